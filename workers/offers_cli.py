"""`tgp offers`: live offers across the enabled providers, cheapest first."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping

from activities.clouds.registry import API_KEY_ENV, providers_from_env
from activities.kube.cluster import KubernetesCluster
from tgp.errors import ConfigError
from tgp.normalize import normalize_gpu, normalize_region
from tgp.offers import rank_offers
from tgp.types import Offer, OfferRequirements


async def _secret_env(ref: str) -> dict[str, str]:
    namespace, _, name = ref.partition("/")
    if not name:
        raise ConfigError(f"--secret {ref!r}: expected NAMESPACE/NAME")
    kube_url = os.environ.get("TGP_KUBE_URL")
    async with KubernetesCluster.from_url(kube_url) if kube_url else KubernetesCluster.from_kubeconfig(os.environ.get("KUBECONFIG")) as cluster:
        data = await cluster.read_secret(namespace, name)
    if data is None:
        raise ConfigError(f"Secret {ref} does not exist")
    return {k: v.decode() for k, v in data.items()}


async def list_offers(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[list[Offer], dict[str, str]]:
    """Ranked offers and, per provider, the error that kept its offers out."""
    providers = providers_from_env(env, only=args.provider or None)
    if not providers:
        wanted = args.provider or list(API_KEY_ENV)
        raise ConfigError(f"no credentials for {', '.join(wanted)}: set {', '.join(API_KEY_ENV[p] for p in wanted if p in API_KEY_ENV)} or use --secret")
    try:
        results = await asyncio.gather(*(p.list_offers() for p in providers.values()), return_exceptions=True)
    finally:
        await asyncio.gather(*(p.aclose() for p in providers.values()), return_exceptions=True)  # type: ignore[attr-defined]
    offers: list[Offer] = []
    errors: dict[str, str] = {}
    for name, result in zip(providers, results, strict=True):
        if isinstance(result, BaseException):
            errors[name] = f"{type(result).__name__}: {result}"
        else:
            offers.extend(result)
    req = OfferRequirements(
        gpu_types=[normalize_gpu(g) for g in args.gpu],
        regions=[normalize_region(r) for r in args.region],
        min_gpu_count=args.min_gpus,
        max_hourly_price=args.max_price,
        allow_spot=args.spot,
    )
    return rank_offers(offers, req), errors


def render_table(offers: list[Offer]) -> str:
    header = ("PROVIDER", "GPU", "COUNT", "REGION", "$/H", "SPOT", "OFFER")
    rows = [header] + [(o.provider, o.gpu_type, str(o.gpu_count), o.region, f"{o.hourly_price:.3f}", "yes" if o.spot else "", o.offer_id) for o in offers]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


async def run_offers(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    if args.secret:
        # Keys from the Secret only; options (base URLs, SSH key name) still from the environment.
        env = {k: v for k, v in env.items() if k not in API_KEY_ENV.values()} | await _secret_env(args.secret)
    offers, errors = await list_offers(args, env)
    for name, error in errors.items():
        print(f"tgp offers: {name}: {error}", file=sys.stderr)
    shown = offers[: args.limit]
    if args.json:
        print(json.dumps([o.model_dump(mode="json") for o in shown], indent=2))
    else:
        print(render_table(shown) if shown else "no offers match")
    return 1 if errors and not offers else 0
