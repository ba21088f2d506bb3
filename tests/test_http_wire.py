"""The wire under tgp's HTTP adapters (activities.http.new_client: httpx's API over aiohttp): what
httpx's own transport did, it still does. A proxy from the environment carries the requests; an
answer the wire cannot parse is a broken answer (`send` retries a read, and a buy is sent once
and is OutcomeUnknown); a connection that drops is never sent again by aiohttp itself
(tests/test_provider_model.py: Vast.ai's PUT that buys)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from activities.http import IN_CALL_ATTEMPTS, OutcomeUnknown, new_client, send
from tgp.errors import TransientError


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
