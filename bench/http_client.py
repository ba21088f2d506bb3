"""The CPU of one request through `activities.http.send`, on the wire tgp uses (its requests sent
straight on aiohttp: `activities.http_wire.new_client`) and on httpx's own client and transport
(httpcore over anyio), with 1, 50 and 300 requests in flight (a burst's launches), against a
local server in a process of its own. Prints ms of this process's CPU a request and the ratio
(issue 37).

    PYTHONPATH=. .venv/bin/python bench/http_client.py      (make bench-extra)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import time

import httpx
from pydantic import SecretStr

from activities.http import send
from activities.http_wire import new_client

REQUESTS = 2000
IN_FLIGHT = (1, 50, 300)
BODY = b'{"instances": [{"id": "i-1", "name": "tgp-n-1", "status": "running", "offerId": "o-1"}]}'


def _serve(port: int) -> None:
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=BODY, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=False)


async def _cpu_per_request(client: httpx.AsyncClient, url: str, in_flight: int) -> float:
    gate = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with gate:
            await send(client, "GET", url, system="bench", bearer=SecretStr("k" * 32))

    await asyncio.gather(*(one() for _ in range(200)))  # connections opened, code warm
    started = time.process_time()
    await asyncio.gather(*(one() for _ in range(REQUESTS)))
    return 1000 * (time.process_time() - started) / REQUESTS


async def _measure(url: str) -> None:
    print(f"{'in flight':>9} | {'aiohttp (tgp) ms/request':>24} | {'httpx own ms/request':>20} | ratio")
    for in_flight in IN_FLIGHT:
        async with new_client() as wire, httpx.AsyncClient() as own:
            ours = await _cpu_per_request(wire, url, in_flight)
            theirs = await _cpu_per_request(own, url, in_flight)
        print(f"{in_flight:>9} | {ours:>24.3f} | {theirs:>20.3f} | {theirs / ours:.1f}x")


def main() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    server.start()
    try:
        url = f"http://127.0.0.1:{port}/v1/instances"
        for _ in range(100):  # until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        asyncio.run(_measure(url))
    finally:
        server.terminate()
        server.join()


if __name__ == "__main__":
    main()
