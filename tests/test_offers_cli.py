"""`tgp offers` across the real adapters, each against its local fake."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from decimal import Decimal

import pytest

from workers.offers_args import add_arguments
from workers.offers_cli import list_offers, run_offers
from sim.lambdalabs import FakeLambda
from sim.runpod import FakeRunPod
from sim.vastai import FakeAsk, FakeVast

ASKS = [
    FakeAsk(id=101, gpu_name="RTX 4090", geolocation="Helsinki, FI", dph_base=Decimal("0.31"), min_bid=Decimal("0.18")),
    FakeAsk(id=102, gpu_name="A100 SXM4 80GB", geolocation="Texas, US", dph_base=Decimal("1.10")),
]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
async def fakes():
    async with FakeRunPod(api_key="rp") as rp, FakeLambda(api_key="lam") as lam, FakeVast(api_key="va", asks=ASKS) as va:
        env = {
            "RUNPOD_API_KEY": "rp",
            "TGP_RUNPOD_API_URL": rp.url,
            "LAMBDA_LABS_API_KEY": "lam",
            "TGP_LAMBDALABS_API_URL": lam.url,
            "VAST_API_KEY": "va",
            "TGP_VASTAI_API_URL": va.url,
        }
        yield env


async def test_offers_from_every_provider_cheapest_first(fakes: dict[str, str]) -> None:
    offers, errors = await list_offers(parse("--spot"), fakes)
    assert errors == {}
    assert {o.provider for o in offers} == {"runpod", "lambdalabs", "vastai"}
    prices = [o.hourly_price for o in offers]
    assert prices == sorted(prices)


async def test_filters_apply_and_gpu_names_are_normalised(fakes: dict[str, str]) -> None:
    offers, _ = await list_offers(parse("--gpu", "RTX 4090", "--max-price", "0.60"), fakes)
    assert offers and all(o.gpu_type == "RTX4090" and o.hourly_price <= 0.60 and not o.spot for o in offers)
    only, _ = await list_offers(parse("--provider", "vastai"), fakes)
    assert {o.provider for o in only} == {"vastai"}


async def test_a_provider_with_a_bad_key_is_reported_and_the_rest_still_listed(fakes: dict[str, str]) -> None:
    offers, errors = await list_offers(parse(), {**fakes, "LAMBDA_LABS_API_KEY": "wrong"})
    assert list(errors) == ["lambdalabs"] and "AuthError" in errors["lambdalabs"]
    assert "wrong" not in errors["lambdalabs"], "the key is not echoed"
    assert offers and "lambdalabs" not in {o.provider for o in offers}


async def test_json_output(fakes: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in fakes.items():
        monkeypatch.setenv(k, v)
    assert await run_offers(parse("--json", "--limit", "3")) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and {"provider", "gpu_type", "hourly_price", "region"} <= set(rows[0])


async def test_keys_from_a_kubernetes_secret(fakes: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import base64

    import httpx

    from activities.http_wire import default_tls

    from sim.kube import KubeEmulator

    async with KubeEmulator() as kube:
        data = {"VAST_API_KEY": base64.b64encode(fakes["VAST_API_KEY"].encode()).decode()}
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys", "namespace": "tgp-system"}, "data": data}
        async with httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
            (await http.post("/api/v1/namespaces/tgp-system/secrets", json=secret)).raise_for_status()
        for k, v in fakes.items():
            if k.startswith("TGP_"):
                monkeypatch.setenv(k, v)  # where the fakes are: options stay in the environment
            else:
                monkeypatch.setenv(k, "not-the-key")  # keys in the environment are ignored with --secret
        monkeypatch.setenv("TGP_KUBE_URL", kube.url)
        assert await run_offers(parse("--secret", "tgp-system/keys", "--json")) == 0
        assert {r["provider"] for r in json.loads(capsys.readouterr().out)} == {"vastai"}
        with pytest.raises(Exception, match="Secret tgp-system/missing does not exist"):
            await run_offers(parse("--secret", "tgp-system/missing"))


def test_the_command_line_builds_every_parser_without_the_heavy_imports() -> None:
    """`tgp --help`, `tgp status` and every other command build the whole parser (the
    simulated world's commands included, through their entry point) before they run: that
    imports neither a cloud adapter, the Kubernetes client nor the simulated world, which each
    command imports only when it runs (~1.4 s of CPU at every start before)."""
    probe = (
        "import sys; from workers.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('kubernetes', 'activities.clouds.registry', 'activities.kube.cluster', 'sim.demo', 'sim.world', 'crd_bridge.bridge') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
