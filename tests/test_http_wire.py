"""The wire under tgp's HTTP adapters (activities.http.new_client: httpx's API over aiohttp): what
httpx's own transport did, it still does. A proxy from the environment carries the requests; an
answer the wire cannot parse is a broken answer (`send` retries a read, and a buy is sent once
and is OutcomeUnknown); a connection that drops is never sent again by aiohttp itself
(tests/test_provider_model.py: Vast.ai's PUT that buys).

`send` sends a client's requests straight on its aiohttp wire (`AiohttpWire.exchange`) and any
other client's through httpx: a server sees the same requests from both, and both read the
same answers, within the same bounds."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from aiohttp import web
from pydantic import SecretStr

from activities.http import IN_CALL_ATTEMPTS, OutcomeUnknown, send
from activities.http_wire import AiohttpWire, new_client, wire_of
from tgp.errors import ConfigError, TransientError


@asynccontextmanager
async def raw_server(answer: bytes) -> AsyncIterator[tuple[str, list[str]]]:
    """A server on loopback that reads each request's head, keeps its request line and writes
    `answer` as it is (well formed or not); its URL and the request lines it got."""
    lines: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines.append(head.split(b"\r\n", 1)[0].decode())
            length = next((int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(answer)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", lines
    finally:
        server.close()
        await server.wait_closed()


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}'
MALFORMED = b"HTTP/1.1 2x0 Not A Status\r\nContent-Length: 0\r\n\r\n"


async def no_sleep(_: float) -> None:
    return None


async def test_a_proxy_from_the_environment_carries_the_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    async with raw_server(OK) as (proxy, seen):
        for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy)
        async with new_client(timeout=5) as client:
            response = await send(client, "GET", "http://cloud.example.invalid/v1/instances", system="cloud")
    assert response.status_code == 200
    assert seen == ["GET http://cloud.example.invalid/v1/instances HTTP/1.1"], "the request did not go through the proxy"


async def test_an_answer_the_wire_cannot_parse_is_retried_as_a_read_and_never_resent_as_a_buy() -> None:
    async with raw_server(MALFORMED) as (url, seen), new_client(timeout=5) as client:
        with pytest.raises(OutcomeUnknown) as bought:
            await send(client, "POST", f"{url}/v1/instances?secret=abc", system="cloud", idempotent=False, sleep=no_sleep)
        assert len(seen) == 1, "a buy was sent again"
        assert "RemoteProtocolError" in str(bought.value) and "secret=abc" not in str(bought.value)
        seen.clear()
        with pytest.raises(TransientError):
            await send(client, "GET", f"{url}/v1/instances", system="cloud", sleep=no_sleep)
        assert len(seen) == IN_CALL_ATTEMPTS


async def test_an_answer_with_a_long_header_line_is_read_as_httpxs_own_transport_read_it() -> None:
    """aiohttp's own limit is 8190 bytes a header line; an API's long policy header is read."""
    long = b"Content-Security-Policy: " + b"a" * 12_000 + b"\r\n"
    answer = OK.replace(b"Connection: close\r\n", b"Connection: close\r\n" + long)
    async with raw_server(answer) as (url, _), new_client(timeout=5) as client:
        response = await send(client, "GET", f"{url}/v1/instances", system="cloud", sleep=no_sleep)
    assert response.status_code == 200 and len(response.headers["content-security-policy"]) == 12_000


@asynccontextmanager
async def echo_server() -> AsyncIterator[tuple[str, list[dict[str, object]]]]:
    """A server that records what each request carried (method, path, its raw query, every header
    but those of the connection and the body's transfer, body) and answers with it as JSON;
    under /gzip gzipped, under /bomb a gzipped body that decodes to 2 MB, under /corrupt a body
    that says gzip and is not."""
    seen: list[dict[str, object]] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        transfer = {"host", "content-length", "accept-encoding"}
        record = {
            "method": request.method, "path": request.path, "query": request.query_string,
            "headers": sorted((k.lower(), v) for k, v in request.headers.items() if k.lower() not in transfer), "body": body.decode(),
        }
        seen.append(record)
        if request.path == "/corrupt":
            return web.Response(body=b"not gzip at all", headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})
        if request.path == "/bomb":
            return web.Response(body=gzip.compress(b"x" * 2_000_000), headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})
        payload = json.dumps(record).encode()
        if request.path == "/gzip":
            return web.Response(body=gzip.compress(payload), headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
        return web.Response(body=payload, status=201 if request.method == "POST" else 200, headers={"Content-Type": "application/json", "X-Api": "a"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


REQUESTS: list[tuple[str, str, dict[str, object]]] = [
    ("GET", "/v1/instances", {"params": {"name": "tgp n/ü", "all": True, "page": 3, "tag": ["a", "b"], "none": None}}),
    ("POST", "/v1/instances", {"json": {"name": "tgp-ü", "gpus": [1, 2], "spot": False}}),
    ("POST", "/oauth/token", {"data": {"client_id": "id", "grant_type": "client_credentials", "offline": True, "scope": None}}),
    ("DELETE", "/v1/instances/i-1?force=true", {"headers": {"X-Trace": "t"}}),
    ("GET", "/v1/instances?page=1", {"params": {"page": 2}}),
    ("GET", "/v1/instances?page=1", {"params": {}}),
    ("GET", "/gzip", {"timeout": 5}),
]


async def test_the_wire_and_httpx_send_the_same_requests_and_read_the_same_answers() -> None:
    async with echo_server() as (url, seen), new_client(timeout=5, headers={"User-Agent": "tgp"}) as wire, httpx.AsyncClient(
        transport=AiohttpWire(), timeout=5, headers={"User-Agent": "tgp"}
    ) as through_httpx:
        assert wire_of(wire, url, {}) is not None and wire_of(through_httpx, url, {}) is None
        for method, path, kwargs in REQUESTS:
            answers = []
            for client in (wire, through_httpx):
                answer = await send(client, method, url + path, system="cloud", bearer=SecretStr("k" * 24), **kwargs)  # type: ignore[arg-type]
                headers = sorted((k, v) for k, v in answer.headers.multi_items() if k not in ("date", "server"))
                answers.append((answer.status_code, answer.json(), headers, answer.request.method, answer.request.url.path, answer.request.content))
            assert answers[0] == answers[1], (method, path)
            assert seen[-1] == seen[-2], (method, path)
        assert [r["path"] for r in seen[::2]] == [p.split("?")[0] for _, p, _ in REQUESTS]
        errors = []
        for client in (wire, through_httpx):  # a body its encoding does not decode: a broken answer, retried
            with pytest.raises(TransientError) as broken:
                await send(client, "GET", f"{url}/corrupt", system="cloud", sleep=no_sleep)
            errors.append(str(broken.value))
        assert errors[0] == errors[1] and "ReadError" in errors[0], errors


async def test_a_body_over_the_cap_once_decoded_is_refused_on_both_paths() -> None:
    """A small gzipped answer that decodes past `max_bytes` stops the reading either way."""
    async with echo_server() as (url, _), new_client(timeout=5) as wire, httpx.AsyncClient(transport=AiohttpWire(), timeout=5) as through_httpx:
        for client in (wire, through_httpx):
            with pytest.raises(ConfigError, match="over 1000000 bytes"):
                await send(client, "GET", f"{url}/bomb", system="cloud", max_bytes=1_000_000)
            answer = await send(client, "GET", f"{url}/bomb", system="cloud", max_bytes=3_000_000)
            assert answer.content == b"x" * 2_000_000


async def test_what_the_wire_does_not_take_goes_through_httpx() -> None:
    """A client with any of httpx's client-wide options (auth, params, cookies, hooks, redirects),
    a relative URL, another argument, or params, a form or headers given as pairs: httpx's path."""
    url = "http://cloud.example.invalid/v1"
    async with new_client() as plain:
        assert wire_of(plain, url, {"params": {"a": "1"}, "json": {}, "headers": {}, "timeout": 5}) is not None
        for kwargs in ({"files": {}}, {"params": [("a", "1")]}, {"data": "raw"}, {"headers": [("X-A", "1")]}):
            assert wire_of(plain, url, kwargs) is None, kwargs
        assert wire_of(plain, "/v1", {}) is None
    for options in ({"auth": ("u", "p")}, {"params": {"a": "1"}}, {"cookies": {"c": "1"}}, {"follow_redirects": True}, {"event_hooks": {"request": [print]}}):
        async with new_client(**options) as other:  # type: ignore[arg-type]
            assert wire_of(other, url, {}) is None, options
