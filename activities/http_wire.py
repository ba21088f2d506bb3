"""The wire under every HTTP API tgp calls (clouds, Tailscale, Headscale): aiohttp, reached from
httpx's API without httpx's per-request machinery.

httpx stays the API every adapter and test speaks (`httpx.Response`, a test's MockTransport).
Its own transport (httpcore over anyio) cost ~0.9 ms of CPU a request alone and 2-6 ms with
50-300 in flight (its connection pool walks every waiting request on each event), against
~0.45 ms over aiohttp (`AiohttpWire`, bench/http_client.py). Of those 0.45 ms, httpx's client
layer around the wire (its URL and header objects, built and parsed again for the request, the
merge with the client's base, redirects, cookies, auth and hooks, none of which tgp uses) took
two thirds: `AiohttpWire.exchange` sends the same request on the same aiohttp session without
it, ~0.16 ms (issue 37). `activities.http.send` uses it for a client made by `new_client` and
httpx's own path for any other (a test's MockTransport, a proxy from the environment, httpx's
client-wide auth, cookies or redirects) and for arguments it does not take, with the same bounds
and answers (tests/test_http_wire.py).
"""

from __future__ import annotations

import functools
import json as json_module
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlencode

import aiohttp
import httpx
import yarl
from httpx_aiohttp import AiohttpTransport
from httpx_aiohttp.transport import map_aiohttp_exceptions

# The longest header line (and field) an answer may have: what httpx's own transport read.
MAX_HEADER_LINE = 16 * 1024
# Read this much of a body at a time.
CHUNK = 64 * 1024
# Headers of the wire form that do not describe the body as read (decoded, whole).
WIRE_ONLY = frozenset({"content-length", "content-encoding", "transfer-encoding"})
# The request arguments `exchange` takes; a call with any other goes through httpx's own path.
EXCHANGED = frozenset({"params", "json", "data", "headers", "timeout"})


class TooLarge(Exception):
    """An answer's body passed the size cap."""


async def read_capped(chunks: AsyncIterator[bytes], max_bytes: int) -> bytes:
    """A body read whole from `chunks` (decoded), TooLarge once past `max_bytes`: stopped there."""
    read, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge()
        read.append(chunk)
    return b"".join(read)


def unreadable(exc: aiohttp.ClientError, request: httpx.Request | None = None) -> httpx.RemoteProtocolError:
    """An aiohttp error httpx-aiohttp does not map, as the broken answer httpx's own transport
    raised: named by its type only."""
    return httpx.RemoteProtocolError(f"the answer could not be read ({type(exc).__name__})", request=request)


def new_client(*, transport: httpx.AsyncBaseTransport | None = None, **options: Any) -> httpx.AsyncClient:
    """An httpx client that sends over aiohttp (`AiohttpWire`), verifying TLS with
    `default_tls`; `transport` replaces the wire (a test's MockTransport). A proxy from the
    environment (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY, NO_PROXY) is honoured as httpx honours it,
    through httpx's own transport."""
    return _Client(transport=transport, verify=default_tls(), **options)


class _Client(httpx.AsyncClient):
    """httpx's client on `AiohttpWire` where httpx would use its own transport. Given as the
    client's transport instead, it would also turn off the proxies from the environment: httpx
    reads them only for a client made without one. `wire` is the AiohttpWire every request of
    this client goes through (none when a transport was given or a proxy is mounted)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        # The wire takes only what tgp's adapters use: none of httpx's client-wide auth, params,
        # cookies, hooks or redirects (a client given any of them goes through httpx).
        plain = self.auth is None and not self.params and not self.cookies and not any(self.event_hooks.values()) and not self.follow_redirects
        self.wire = self._transport if isinstance(self._transport, AiohttpWire) and not self._mounts and plain else None

    def _init_transport(  # type: ignore[override]
        self, verify: Any = True, cert: Any = None, trust_env: bool = True, http1: bool = True, http2: bool = False,
        limits: httpx.Limits | None = None, transport: httpx.AsyncBaseTransport | None = None,
    ) -> httpx.AsyncBaseTransport:
        if transport is not None:
            return transport
        return AiohttpWire(verify=verify, cert=cert, trust_env=trust_env, **({"limits": limits} if limits is not None else {}))


def wire_of(client: httpx.AsyncClient, url: str, kwargs: Mapping[str, object]) -> AiohttpWire | None:
    """The wire `client` sends this request through when `exchange` can send it: an absolute URL,
    only the arguments it takes, a client of `new_client`'s without a proxy or another transport."""
    wire = getattr(client, "wire", None)
    if wire is None or "://" not in url or not EXCHANGED.issuperset(kwargs):
        return None
    if any(not isinstance(kwargs.get(k) or {}, Mapping) for k in ("params", "data", "headers")):
        return None  # a list of pairs, a raw body: httpx's own reading of them
    return wire  # type: ignore[no-any-return]


class AiohttpWire(AiohttpTransport):
    """httpx-aiohttp's transport, without aiohttp's own retry, and with every aiohttp error an
    httpx one.

    aiohttp sends a GET, PUT or DELETE again, once, when its connection drops before the answer
    (RFC 9112's retry of an idempotent request). `send` is the one retry discipline here, and it
    never sends a buy twice: Vast.ai buys with a PUT (tests/test_provider_model.py's reset after a
    buy). And an answer aiohttp cannot parse (a malformed status line or header, a header line
    over its limit) raises an aiohttp error that httpx-aiohttp does not map: it is an
    httpx.RemoteProtocolError here, as httpx's own transport raised, so that `send` treats it as
    a broken answer (retried, or OutcomeUnknown for a buy), naming only its type."""

    def get_client(self) -> aiohttp.ClientSession:
        session = super().get_client()
        # aiohttp has no public switch; its own test client turns it off the same way.
        session._retry_connection = False
        # aiohttp refuses an answer with a header line over 8190 bytes, httpx's h11 only a head
        # over 16 KiB: the same answers are read as before (an API's long policy headers).
        session._max_line_size = session._max_field_size = MAX_HEADER_LINE
        return session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except aiohttp.ClientError as exc:
            raise unreadable(exc, request) from None

    async def exchange(
        self, method: str, url: str, client_headers: httpx.Headers, default_timeout: httpx.Timeout, max_bytes: int, **kwargs: Any
    ) -> httpx.Response:
        """The request httpx would send for `client.request(method, url, **kwargs)` (`EXCHANGED`
        arguments only), sent on this wire's aiohttp session: the answer with its whole body read
        and decoded, at most `max_bytes` of it (TooLarge past that), and every aiohttp error the
        httpx error `handle_async_request` raises. The body is decoded by aiohttp, which asks
        only for the encodings it can decode."""
        if not isinstance(self.client, aiohttp.ClientSession):
            self.client = self.get_client()
        headers = {k: v for k, v in client_headers.items() if k != "accept-encoding"}
        headers.update((k.lower(), v) for k, v in (kwargs.get("headers") or {}).items())
        body = _body(kwargs, headers)
        try:
            target = yarl.URL(url)
            if kwargs.get("params") is not None:  # as httpx: the params replace the URL's own query
                target = target.with_query(_query(kwargs["params"]))
        except ValueError:
            raise httpx.InvalidURL("the URL is not valid") from None  # as httpx refuses one, without it
        timeout = kwargs["timeout"] if "timeout" in kwargs else default_timeout
        if not isinstance(timeout, httpx.Timeout):
            timeout = httpx.Timeout(timeout)  # seconds, or None for none, as httpx takes them
        try:
            with map_aiohttp_exceptions():
                async with self.client.request(
                    method, target, headers=headers, data=body, allow_redirects=False, timeout=_client_timeout(timeout)
                ) as answer:
                    content = await read_capped(answer.content.iter_chunked(CHUNK), max_bytes)
                    kept = [(k, v) for k, v in answer.raw_headers if k.decode("latin-1").lower() not in WIRE_ONLY]
                    status = answer.status
        except aiohttp.ClientError as exc:
            raise unreadable(exc) from None
        return Answer(status, headers=kept, content=content, sent=(method, str(target), body or b""))


class Answer(httpx.Response):
    """An answer `exchange` read: an httpx.Response whose `request` is made when first read
    (parsing its URL again cost a fifth of a request; only error messages read it)."""

    def __init__(self, status: int, *, headers: list[tuple[bytes, bytes]], content: bytes, sent: tuple[str, str, bytes]) -> None:
        super().__init__(status, headers=headers, content=content)
        self._sent = sent

    @property
    def request(self) -> httpx.Request:
        if self._request is None:
            method, url, body = self._sent
            self._request = httpx.Request(method, url, content=body)
        return self._request

    @request.setter
    def request(self, value: httpx.Request) -> None:
        self._request = value


def _body(kwargs: Mapping[str, Any], headers: dict[str, str]) -> bytes | None:
    """The request's body as httpx encodes `data` (a form, its values as in a query) or else
    `json` (compact UTF-8), with its Content-Type unless the caller set one."""
    if kwargs.get("data"):
        headers.setdefault("content-type", "application/x-www-form-urlencoded")
        return urlencode(_query(kwargs["data"])).encode()
    if kwargs.get("json") is not None:
        headers.setdefault("content-type", "application/json")
        return json_module.dumps(kwargs["json"], ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    return None


def _query(params: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`params` (or a form's fields) as httpx puts them in a URL: True and False as "true" and
    "false", None as "", a list as the name repeated."""
    pairs = []
    for name, value in params.items():
        for one in value if isinstance(value, list | tuple) else [value]:
            pairs.append((name, "true" if one is True else "false" if one is False else "" if one is None else str(one)))
    return pairs


def _client_timeout(timeout: httpx.Timeout) -> aiohttp.ClientTimeout:
    """httpx's timeouts as httpx-aiohttp hands them to aiohttp: connect, read, and the pool's wait."""
    return aiohttp.ClientTimeout(sock_connect=timeout.connect, sock_read=timeout.read, connect=timeout.pool)


@functools.cache
def default_tls() -> ssl.SSLContext:
    """The one verifying TLS context (httpx's default: certifi's CAs) that every client of ours
    shares. Building one loads and parses the whole CA bundle, ~60-120 ms of CPU, which each new
    client paid again: an adapter per class account and per tailnet, a client per metrics
    endpoint. A context is safe to share once configured (nothing here changes it after)."""
    return httpx.create_ssl_context()
