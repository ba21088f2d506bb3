"""A class's tailnet credential goes only to its own server, never to an internal address, and
no class reaches tgp's own Secrets (issue 35, item 12).

With `loginServer` and `oauthSecretRef` set, every Headscale API call went to `loginServer`
with `Authorization: Bearer <the Secret's api-key>`; the install keeps the Temporal Cloud API
key in tgp-system under exactly that key name, and loopback, the metadata service and the
Kubernetes API were all accepted. The Secrets live in the Kubernetes emulator (or the cluster
of $TGP_TEST_KUBECONFIG) and are read through the worker's real cluster adapter; the "login
server" is a fake Headscale on loopback that records every request it gets.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import AsyncIterator
from datetime import timedelta

import httpx
import pytest

from activities.accounts import TailnetRegistry
from activities.node_class import NodeClassActivities, ValidateClassInput
from activities.tailnets.servers import ALLOW_INTERNAL_ENV, GuardedTransport, address_problem, same_server
from sim.headscale import FakeHeadscale
from tests.kube_env import KubeApi
from tests.test_credentials import NS, put_secret
from tgp.crds import GPUNodeClassSpec
from tgp.errors import ConfigError
from tgp.secrets import class_reference_problem
from tgp.types import TailnetRef

INTERNAL = [
    "http://127.0.0.1:8080", "http://localhost", "http://169.254.169.254", "http://[fd00:ec2::254]",
    "https://kubernetes.default.svc", "https://kubernetes.default.svc.cluster.local", "http://0x7f000001",
    "http://2130706433", "http://127.1", "http://0177.0.0.1", "http://10.0.0.7", "http://192.168.1.1",
    "http://100.100.100.100", "http://[::1]:443", "http://[::ffff:127.0.0.1]", "http://kubernetes",
    "http://metadata.google.internal", "http://0.0.0.0", "http://headscale.local",
]  # fmt: skip
PUBLIC = ["https://hs.example.com", "https://headscale.example.org:8443/base", "http://93.184.216.34"]


@pytest.fixture
async def attacker() -> AsyncIterator[FakeHeadscale]:
    async with FakeHeadscale(api_keys=[], users=["tgp"]) as hs:
        yield hs


def registry(kube_api: KubeApi, *, allow_internal: bool = False) -> TailnetRegistry:
    env = {"HEADSCALE_USER": "tgp", **({ALLOW_INTERNAL_ENV: "true"} if allow_internal else {})}
    return TailnetRegistry(cluster=kube_api.cluster, env=env)


async def mint(tailnets: TailnetRegistry, ref: TailnetRef) -> object:
    tailnet = await tailnets.get("headscale", ref)
    return await tailnet.mint_auth_key(hostname="gpu-abc", tags=["tag:tgp-node"], expiry=timedelta(hours=1))


async def test_a_class_cannot_send_tgps_own_temporal_key_to_its_login_server(kube_api: KubeApi, attacker: FakeHeadscale) -> None:
    """The exploit of the issue: tgp's own Secret named by a class, its api-key sent to a URL the
    class chose. Refused before the Secret is read; the server hears nothing."""
    temporal_key = "tmprl-" + secrets.token_hex(24)
    await put_secret(kube_api.http, "tgp-temporal-api-key", {"api-key": temporal_key})
    tailnets = registry(kube_api, allow_internal=True)  # even where internal servers are allowed
    try:
        with pytest.raises(ConfigError, match="one of tgp's own") as err:
            await mint(tailnets, TailnetRef(name="tgp-temporal-api-key", login_server=attacker.url))
        assert temporal_key not in str(err.value)
        assert attacker.requests == []
    finally:
        await tailnets.aclose()


async def test_an_api_key_goes_only_to_the_server_its_secret_names(kube_api: KubeApi, attacker: FakeHeadscale) -> None:
    key = "hskey-api-" + secrets.token_hex(16)
    tailnets = registry(kube_api, allow_internal=True)
    try:
        # A Secret that says nothing of its server (any api-key the namespace holds): never sent.
        await put_secret(kube_api.http, "team-hs-unbound", {"api-key": key})
        with pytest.raises(ConfigError, match="no key 'login-server'"):
            await mint(tailnets, TailnetRef(name="team-hs-unbound", login_server=attacker.url))
        # A Secret of another server: not sent to this one.
        await put_secret(kube_api.http, "team-hs-other", {"api-key": key, "login-server": "https://hs.example.com"})
        with pytest.raises(ConfigError, match="holds the API key of 'https://hs.example.com'"):
            await mint(tailnets, TailnetRef(name="team-hs-other", login_server=attacker.url))
        assert attacker.requests == []
        # Its own server: used (internal servers allowed here, the fake listens on loopback).
        attacker.api_keys.add(key)
        await put_secret(kube_api.http, "team-hs", {"api-key": key, "login-server": attacker.url + "/"})
        await mint(tailnets, TailnetRef(name="team-hs", login_server=attacker.url))
        assert attacker.requests, "the class's own server got the call"
    finally:
        await tailnets.aclose()


@pytest.mark.parametrize("url", INTERNAL)
def test_internal_addresses_in_every_form_are_refused(url: str) -> None:
    assert address_problem(url, allow_internal=False) is not None, url
    assert address_problem(url, allow_internal=True) is None


@pytest.mark.parametrize("url", PUBLIC)
def test_public_servers_are_accepted(url: str) -> None:
    assert address_problem(url, allow_internal=False) is None


def test_same_server_ignores_case_default_ports_and_a_trailing_slash() -> None:
    assert same_server("https://HS.example.com:443/", "https://hs.example.com")
    assert not same_server("https://hs.example.com", "http://hs.example.com")
    assert not same_server("https://hs.example.com", "https://hs.example.com.evil.test")
    assert not same_server("https://hs.example.com/a", "https://hs.example.com/b")


async def test_a_bound_key_to_an_internal_server_is_refused_unless_the_operator_allows_it(
    kube_api: KubeApi, attacker: FakeHeadscale
) -> None:
    key = "hskey-api-" + secrets.token_hex(16)
    await put_secret(kube_api.http, "team-hs-local", {"api-key": key, "login-server": attacker.url})
    tailnets = registry(kube_api)
    try:
        with pytest.raises(ConfigError, match=ALLOW_INTERNAL_ENV):
            await mint(tailnets, TailnetRef(name="team-hs-local", login_server=attacker.url))
        assert attacker.requests == []
    finally:
        await tailnets.aclose()


async def test_a_public_name_that_resolves_inside_is_refused_before_the_request(
    monkeypatch: pytest.MonkeyPatch, attacker: FakeHeadscale
) -> None:
    """The URL passes as written; what its name resolves to does not (the resolver answers
    loopback for it here, as a rebinding or a hostile DNS record would)."""
    real = socket.getaddrinfo

    def resolve(host: str, *args: object, **kwargs: object) -> object:
        return real("127.0.0.1", *args, **kwargs) if host == "hs.example.com" else real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    port = attacker.url.rsplit(":", 1)[1]
    async with httpx.AsyncClient(transport=GuardedTransport()) as client:
        with pytest.raises(ConfigError, match="resolves to an internal address"):
            await client.get(f"http://hs.example.com:{port}/api/v1/node")
    assert attacker.requests == []


def test_tgps_own_secrets_are_no_class_reference() -> None:
    for name in ("tgp-temporal-api-key", "tgp-temporal-tls", "tgp-payload-keys", "tgp-operator-secret"):
        assert class_reference_problem(name, "joinSecretRef") is not None
    assert class_reference_problem("team-a-runpod", "joinSecretRef") is None


async def test_the_class_validation_names_each_problem(kube_api: KubeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_INTERNAL_ENV, raising=False)
    await put_secret(kube_api.http, "team-hs-unbound", {"api-key": "hskey-api-" + secrets.token_hex(16)})
    klass = GPUNodeClassSpec.model_validate({
        "providers": [{"name": "simulated", "credentialsRef": {"name": "tgp-operator-secret", "key": "RUNPOD_API_KEY"}}],
        "joinSecretRef": "tgp-payload-keys",
        "tailscaleConfig": {"loginServer": "http://169.254.169.254", "oauthSecretRef": "team-hs-unbound"},
    })  # fmt: skip
    fleet = NodeClassActivities(cluster=kube_api.cluster, providers={}, tailnets=["headscale"])
    found = await fleet.validate_class(ValidateClassInput(name="c", spec=klass, operator_namespace=NS))
    assert any(p.startswith("providers[simulated].credentialsRef: Secret 'tgp-operator-secret' is one of tgp's own") for p in found), found
    assert any(p.startswith("joinSecretRef: Secret 'tgp-payload-keys' is one of tgp's own") for p in found), found
    assert any(p.startswith("tailscaleConfig.oauthSecretRef: Secret") and "no key 'login-server'" in p for p in found), found
    assert any(p.startswith("tailscaleConfig.loginServer: '169.254.169.254' is an internal address") for p in found), found
