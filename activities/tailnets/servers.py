"""Where a class's tailnet credential may be sent (issue 35, item 12).

A GPUNodeClass names a Headscale server (`tailscaleConfig.loginServer`) and a Secret
(`oauthSecretRef`) whose `api-key` goes, as a bearer token, with every Headscale API call. Both
are the class author's choice, so without a rule a class could send any Secret's `api-key`
(tgp's own Temporal Cloud key sits under that name) to any URL: loopback, the cloud metadata
service, the Kubernetes API. Two rules close that:

* **A credential is usable only with its own server.** The Secret says which server its key
  belongs to, in key `login-server`, and the class's loginServer must be that server
  (`bound_server_problem`). Whoever writes the Secret decides where its key may go; a Secret
  without `login-server` (any of tgp's own) is never sent anywhere.
* **Internal addresses are refused** unless the operator allows them on the worker
  (`TGP_TAILNET_ALLOW_INTERNAL=true`, for a Headscale inside the cluster): loopback, private,
  link-local (the metadata service, `169.254.169.254`, `fd00:ec2::254`), carrier-grade NAT and
  every other non-global address, in any numeric form (`0x7f000001`, `2130706433`, `127.1`),
  and names that resolve inside the cluster or the host (`localhost`, `*.svc`,
  `*.cluster.local`, `*.internal`, `*.local`, a name without a dot). `address_problem` checks
  the URL as written (the class's validation); `GuardedTransport` checks what the name
  resolves to before each request (a public name may point inside). A name that resolves to
  another address between that check and the connection (DNS rebinding) still gets through,
  which the worker's egress NetworkPolicy (deploy/kustomize/components/worker-egress) stops.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Mapping
from urllib.parse import urlsplit

import httpx

from activities.http_wire import default_tls
from tgp.errors import ConfigError

__all__ = [
    "ALLOW_INTERNAL_ENV",
    "LOGIN_SERVER_KEY",
    "GuardedTransport",
    "address_problem",
    "allows_internal",
    "bound_server_problem",
    "same_server",
]

# The worker setting that lets classes use Headscale servers on internal addresses.
ALLOW_INTERNAL_ENV = "TGP_TAILNET_ALLOW_INTERNAL"
# The key of a class's Headscale Secret that names the server its api-key belongs to.
LOGIN_SERVER_KEY = "login-server"
# Names that resolve inside the cluster or the host, whatever DNS says.
_INTERNAL_SUFFIXES = (".svc", ".cluster.local", ".internal", ".local", ".localhost", ".localdomain", ".home.arpa")
_INTERNAL_NAMES = frozenset({"localhost", "localhost.localdomain"})
_NUMERIC = re.compile(r"[0-9a-fA-FxX.]+")


def allows_internal(env: Mapping[str, str]) -> bool:
    """Whether the operator lets classes use login servers on internal addresses."""
    return env.get(ALLOW_INTERNAL_ENV, "").strip().lower() in ("1", "true", "yes")


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an IP address, in any form a resolver takes for one (`127.1`, `0x7f000001`,
    `2130706433`, `0177.0.0.1`, `[::1]`), or None for a name."""
    text = host.strip("[]").rstrip(".")
    try:
        return ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        pass
    if _NUMERIC.fullmatch(text) and any(c.isdigit() for c in text):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def _internal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not address.is_global or address.is_multicast


def address_problem(url: str, *, allow_internal: bool) -> str | None:
    """What is wrong with `url`'s host as a place to send a class's tailnet credential, or
    None. Checks the URL as written; `GuardedTransport` checks what a name resolves to."""
    if allow_internal:
        return None
    try:
        host = (urlsplit(url).hostname or "").lower()
    except ValueError:
        return f"{url[:80]!r} has no host tgp can read"
    address = _address(host)
    internal = (
        _internal(address)
        if address is not None
        else host in _INTERNAL_NAMES or host.rstrip(".").endswith(_INTERNAL_SUFFIXES) or "." not in host.rstrip(".")
    )
    if not internal:
        return None
    return (
        f"{host!r} is an internal address (loopback, private, link-local, or a name that resolves inside the cluster), "
        f"where the worker does not send a class's tailnet credential; use the Headscale server's public name, or let "
        f"classes use internal servers with {ALLOW_INTERNAL_ENV}=true on the worker"
    )


def _normal(url: str) -> tuple[str, str, int | None, str] | None:
    try:
        parts = urlsplit(url.strip())
        port = parts.port or {"https": 443, "http": 80}.get(parts.scheme.lower())
    except ValueError:
        return None
    return parts.scheme.lower(), (parts.hostname or "").rstrip(".").lower(), port, parts.path.rstrip("/")


def same_server(a: str, b: str) -> bool:
    """Whether two login server URLs name the same server (scheme, host, port and path; letter
    case of scheme and host, a default port and a trailing slash aside)."""
    left, right = _normal(a), _normal(b)
    return left is not None and left == right


def bound_server_problem(data: Mapping[str, bytes], login_server: str, where: str) -> str | None:
    """Whether the Secret `data` (at `where`) allows its api-key to be sent to `login_server`:
    its `login-server` key must name that server. None when it does."""
    raw = data.get(LOGIN_SERVER_KEY)
    if raw is None:
        return (
            f"{where} has no key {LOGIN_SERVER_KEY!r}: a Headscale API key is sent only to the server its Secret names; "
            f"add key {LOGIN_SERVER_KEY!r} with the Headscale server's URL (the class's loginServer)"
        )
    try:
        named = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        named = ""
    if not same_server(named, login_server):
        shown = named[:80] if _normal(named) is not None else "not a URL"
        return (
            f"{where} holds the API key of {shown!r} (its key {LOGIN_SERVER_KEY!r}), not of the class's loginServer "
            f"{login_server[:80]!r}: reference the Secret of that server, or fix one of the two"
        )
    return None


class GuardedTransport(httpx.AsyncBaseTransport):
    """A transport that, before each request, resolves its host and refuses it (ConfigError)
    when any address it resolves to is internal (see the module docstring); `inner` sends."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._inner = inner or httpx.AsyncHTTPTransport(verify=default_tls())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        problem = address_problem(str(request.url), allow_internal=False)
        if problem is None and _address(host) is None:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, request.url.port or 443, type=socket.SOCK_STREAM)
            except OSError:
                infos = []  # the connection fails on its own, with the transport's error
            for info in infos:
                address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
                if _internal(address):
                    problem = (
                        f"{host!r} resolves to an internal address, where the worker does not send a class's tailnet "
                        f"credential; use a name that resolves to the Headscale server's public address, or let classes "
                        f"use internal servers with {ALLOW_INTERNAL_ENV}=true on the worker"
                    )
                    break
        if problem is not None:
            raise ConfigError(f"Headscale API: {request.method} {request.url.path} was not sent: {problem}")
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()
