"""How tgp connects to a Kubernetes API: the client configuration from a URL or a kubeconfig
(or the pod's service account), read once and without per-request environment look-ups, the
client classes loaded up front, and a plain authenticated httpx client for the few callers that
speak raw HTTP to the API."""

from __future__ import annotations

import contextlib
import functools
import os
import ssl
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config

from activities.http_wire import default_tls
from activities.kube.api_errors import MESSAGE_LIMIT
from tgp.errors import ConfigError

Configure = Callable[[], Awaitable[k8s.Configuration]]


def load_client_classes() -> None:
    """Load kubernetes.aio's client classes now. It loads them on first use (~1 s of CPU, several
    on a loaded machine): inside a running worker or bridge that first call would stall every
    heartbeat, query and workflow task meanwhile. Processes call this as they start; short
    commands that never talk to Kubernetes do not pay for it. (Its CoreV1Api, 1.3 s more, is
    never loaded: activities/kube/core_calls.py makes the few core/v1 calls tgp needs.)"""
    for name in ("ApiClient", "CustomObjectsApi"):
        getattr(k8s, name)


def environment_read_once(configuration: k8s.Configuration) -> k8s.Configuration:
    """`configuration` with the proxy the environment names for its host (HTTPS_PROXY,
    HTTP_PROXY, NO_PROXY) read now, once, and aiohttp's `trust_env` off.

    kubernetes.aio opens its session with trust_env=True, so aiohttp looked up ~/.netrc on every
    request (in the default executor) and the proxy variables on every one too: 3% of the
    worker's CPU in a burst. Credentials for the API server come from the kubeconfig or the
    service account, never from a netrc, so dropping netrc changes nothing; the proxy variables
    keep their effect, read at start-up (a worker's environment does not change while it runs).
    An explicit proxy (the kubeconfig's proxy-url) wins, as before."""
    if not configuration.proxy:
        host = urllib.parse.urlsplit(configuration.host or "").hostname or ""
        proxies = urllib.request.getproxies()
        scheme = "https" if (configuration.host or "").startswith("https") else "http"
        proxy = proxies.get(scheme)
        if proxy and host and not urllib.request.proxy_bypass(host):
            configuration.proxy = proxy
    configuration.client_session_kwargs = {**(getattr(configuration, "client_session_kwargs", None) or {}), "trust_env": False}
    return configuration


@functools.cache
def _one_ca() -> str:
    """One CA certificate (the first of the process's shared TLS context), for a TLS context
    that is never used."""
    return ssl.DER_cert_to_PEM_cert(default_tls().get_ca_certs(binary_form=True)[0])


def url_configuration(url: str, token: str | None) -> Configure:
    """The configuration of the API server at `url`, unauthenticated unless a bearer `token` is given."""

    async def configure() -> k8s.Configuration:
        configuration = k8s.Configuration(host=url.rstrip("/"))
        if urllib.parse.urlsplit(url).scheme == "http":
            # Plain HTTP (the emulator, `kubectl proxy`) never uses the client's TLS context,
            # which kubernetes.aio builds anyway: from the system's whole CA store (50 ms of
            # CPU for every client) unless given a CA. One CA costs a millisecond.
            configuration.ca_cert_data = _one_ca()
        if token:
            configuration.api_key = {"BearerToken": f"Bearer {token}"}
        return configuration

    return configure


def kubeconfig_configuration(path: str | None, context: str | None) -> Configure:
    """The configuration from the kubeconfig at `path`; with no path the pod's service account
    when running in a cluster, else `$KUBECONFIG` or `~/.kube/config`. Read when called: an
    unusable file raises ConfigError."""

    async def configure() -> k8s.Configuration:
        configuration = k8s.Configuration()
        in_cluster = path is None and "KUBERNETES_SERVICE_HOST" in os.environ
        source = "the in-cluster service account" if in_cluster else f"kubeconfig {path or '(default)'}"
        try:
            if in_cluster:
                k8s_config.load_incluster_config(client_configuration=configuration)
            else:
                await k8s_config.load_kube_config(
                    config_file=path, context=context, client_configuration=configuration, persist_config=False
                )
        except (k8s_config.ConfigException, OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot load Kubernetes credentials from {source}: {type(exc).__name__}: "
                f"{str(exc)[:MESSAGE_LIMIT]}"
            ) from None
        return configuration

    return configure


@contextlib.asynccontextmanager
async def authenticated_http(kubeconfig: str, *, timeout: float = 10.0) -> AsyncIterator[httpx.AsyncClient]:
    """A plain httpx client with the kubeconfig's server, CA, client certificate and token,
    for the few callers that speak raw HTTP to the API (the simulated kubelet, tests)."""
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration, persist_config=False)
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, keyfile=configuration.key_file)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    token = await configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
    headers = {"Authorization": token} if token else {}
    async with httpx.AsyncClient(base_url=configuration.host, verify=context, timeout=timeout, headers=headers) as client:
        yield client
