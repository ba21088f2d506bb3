"""Every provider and tailnet call has a total deadline and a response-size cap (issue 35).

httpx's timeouts bound each read, not the whole answer: a response that dripped a byte at a
time was still being read after 100 s, and a 100 MB body raised the worker's memory by ~424 MB.
Now each attempt, from sending to the last byte, has `deadline` seconds (activities.http), and
at most `max_response_bytes` of a body are read; the error names the limit and quotes nothing
of the body. Each adapter talks, over real HTTP on loopback, to a local server that answers
every request by dripping or by sending 100 MB. The whole call (attempts, waits, turns at the
rate limit) has `call_deadline` seconds (CALL_DEADLINE).
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from aiohttp import web
from pydantic import SecretStr

import activities.http
from activities.clouds.lambdalabs import LambdaProvider
from activities.clouds.paperspace import PaperspaceProvider
from activities.clouds.runpod import RunPodProvider
from activities.clouds.simulated import SimulatedProvider
from activities.clouds.vastai import VastProvider
from activities.http import MAX_RESPONSE_BYTES, OutcomeUnknown, send
from activities.tailnets.headscale import HeadscaleTailnet
from activities.tailnets.tailscale import TailscaleTailnet
from tgp.errors import ConfigError, TgpError, TransientError
from tgp.types import BootPayload, Offer

ADAPTERS = ("runpod", "lambdalabs", "paperspace", "vastai", "simulated", "tailscale", "headscale")
# What the oversized body repeats: it must not reach an error.
MARKER = b'{"message": "BODYTEXT-do-not-quote", "items": [' + b"1," * 4000 + b"1]}\n"
HUGE = 100 * 1024 * 1024
DEADLINE = 0.5


class Server:
    """Answers every request by dripping a byte every 50 ms for ever ("drip") or with a 100 MB
    JSON-looking body ("oversize"); counts the bytes it managed to send."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sent = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            if self.mode == "drip":
                await response.write(b"{")
                while True:
                    await asyncio.sleep(0.05)
                    await response.write(b" ")
                    self.sent += 1
            while self.sent < HUGE:
                await response.write(MARKER)
                self.sent += len(MARKER)
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        return response

    async def __aenter__(self) -> Server:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


async def no_sleep(seconds: float) -> None:
    return None


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(activities.http, "backoff", lambda attempt, base=0.5: 0.0)


def adapter(name: str, url: str) -> Any:
    key = SecretStr(f"{name}-key-0123456789abcdef")
    if name == "runpod":
        return RunPodProvider(key, base_url=url, sleep=no_sleep)
    if name == "lambdalabs":
        return LambdaProvider(key, ssh_key_name="tgp", base_url=url, request_interval=0, launch_interval=0, sleep=no_sleep)
    if name == "paperspace":
        return PaperspaceProvider(key, base_url=url, template_id="t123", sleep=no_sleep)
    if name == "vastai":
        return VastProvider(key, base_url=url, sleep=no_sleep, min_intervals={}, spot=False)
    if name == "simulated":
        return SimulatedProvider(url, api_key=key)
    if name == "tailscale":
        return TailscaleTailnet(client_id="kClient0CNTRL", client_secret=key, base_url=url, sleep=no_sleep)
    return HeadscaleTailnet(api_key=key, base_url=url, user="tgp", sleep=no_sleep)


def listing(name: str, target: Any) -> Callable[[], Awaitable[object]]:
    if name in ("tailscale", "headscale"):
        return lambda: target.list_devices(["tag:tgp-node"])
    return lambda: target.list_offers()


async def call(target: Any, op: Callable[[], Awaitable[object]]) -> TgpError:
    try:
        await op()
    except TgpError as exc:
        return exc
    finally:
        await target.aclose()
    raise AssertionError("no error")


@pytest.mark.parametrize("name", ADAPTERS)
async def test_an_answer_that_drips_ends_at_the_deadline(name: str) -> None:
    async with Server("drip") as server:
        target = adapter(name, server.url)
        target.deadline = DEADLINE
        started = time.monotonic()
        error = await call(target, listing(name, target))
        took = time.monotonic() - started
    assert isinstance(error, TransientError), repr(error)
    assert f"no complete answer within {DEADLINE:g} s" in str(error)
    # Three in-call attempts at most, each ended by its deadline.
    assert took < 3 * DEADLINE + 2, took


@pytest.mark.parametrize("name", ADAPTERS)
async def test_an_oversized_answer_stops_being_read_at_the_cap(name: str) -> None:
    async with Server("oversize") as server:
        target = adapter(name, server.url)
        tracemalloc.start()
        try:
            error = await call(target, listing(name, target))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        await asyncio.sleep(0.1)
        sent = server.sent
    assert isinstance(error, ConfigError), repr(error)
    assert f"over {MAX_RESPONSE_BYTES} bytes" in str(error) and "stopped reading" in str(error)
    assert "BODYTEXT" not in str(error) and "items" not in str(error)
    assert peak < 4 * MAX_RESPONSE_BYTES, f"peak {peak / 2**20:.0f} MiB"
    assert sent < HUGE / 2, f"the server sent {sent / 2**20:.0f} MiB: reading did not stop"


async def test_a_create_whose_answer_drips_or_overflows_may_have_bought() -> None:
    """A launch is never retried blind: past the deadline or the cap, its outcome is unknown."""
    offer = Offer(provider="simulated", offer_id="o1", gpu_type="RTX4090", region="r", hourly_price=Decimal("0.5"))
    boot = BootPayload(kind="env", content="TS_AUTHKEY=x\n", hostname="gpu-abc")
    for mode in ("drip", "oversize"):
        async with Server(mode) as server:
            target = SimulatedProvider(server.url, api_key=SecretStr("sim-key-0123456789"))
            target.deadline = DEADLINE
            error = await call(target, lambda: target.launch(offer, name="gpu-abc", boot=boot))
        assert isinstance(error, OutcomeUnknown), (mode, repr(error))
        assert "look it up by name" in str(error), str(error)


async def test_the_bounds_hold_for_a_minting_call_too() -> None:
    async with Server("drip") as server:
        target = HeadscaleTailnet(api_key=SecretStr("hskey-api-0123456789abcdef"), base_url=server.url, user=None, sleep=no_sleep)
        target.deadline = DEADLINE
        error = await call(target, lambda: target.mint_auth_key(hostname="gpu-abc", tags=["tag:tgp-node"], expiry=timedelta(hours=1)))
    assert f"no complete answer within {DEADLINE:g} s" in str(error), str(error)



# --- one deadline for the whole call (issue 35, load and size L4) ------------------------------
# Each attempt had its deadline, but a call of three attempts, their waits and its turns at the
# rate limiter took over three minutes: past the activity's own start-to-close timeout, which
# ended it saying nothing. Now the whole call has `call_deadline` seconds.


class HeldPace:
    """A rate limiter whose turn never comes (a queue behind a stuck burst)."""

    def __init__(self) -> None:
        self.entered = 0

    async def __aenter__(self) -> None:
        self.entered += 1
        await asyncio.Event().wait()

    async def __aexit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("name", ["runpod", "headscale"])
async def test_a_call_whose_every_attempt_drips_ends_at_the_calls_deadline(name: str) -> None:
    async with Server("drip") as server:
        target = adapter(name, server.url)
        target.deadline, target.call_deadline = DEADLINE, 1.2 * DEADLINE
        started = time.monotonic()
        error = await call(target, listing(name, target))
        took = time.monotonic() - started
    assert isinstance(error, TransientError), repr(error)
    assert f"no answer within {1.2 * DEADLINE:g} s, the whole call's deadline" in str(error), str(error)
    assert took < 1.2 * DEADLINE + 0.5, took


async def test_a_turn_at_the_rate_limit_counts_against_the_calls_deadline() -> None:
    answered: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        answered.append(request)
        return httpx.Response(200, json={})

    pace = HeldPace()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        for idempotent in (True, False):
            with pytest.raises(TransientError, match="the whole call's deadline .*; nothing was sent") as raised:
                # wait_for: without the call's deadline the held turn would wait for ever.
                await asyncio.wait_for(
                    send(client, "POST", "http://x.test/v1/pods", system="RunPod", pace=pace, idempotent=idempotent, call_deadline=0.2), 5
                )
            # A create still waiting for its turn bought nothing: not OutcomeUnknown.
            assert type(raised.value) is TransientError
    assert pace.entered == 2 and answered == []


async def test_a_create_past_the_calls_deadline_may_have_bought() -> None:
    async with Server("drip") as server:
        target = SimulatedProvider(server.url, api_key=SecretStr("sim-key-0123456789"))
        target.call_deadline = 0.3
        offer = Offer(provider="simulated", offer_id="o1", gpu_type="RTX4090", region="r", hourly_price=Decimal("0.5"))
        boot = BootPayload(kind="env", content="TS_AUTHKEY=x\n", hostname="gpu-abc")
        error = await call(target, lambda: target.launch(offer, name="gpu-abc", boot=boot))
    assert isinstance(error, OutcomeUnknown) and "the whole call's deadline" in str(error), repr(error)


async def test_a_wait_that_would_pass_the_calls_deadline_is_not_begun() -> None:
    """A 503 asking for 3 s, in a call with 1 s left: the call ends now with the answer's error
    (its Retry-After handed to Temporal), rather than sleeping into its deadline."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={"Retry-After": "3"}, json={"message": "busy"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(TransientError) as raised:
            await send(client, "GET", "http://x.test/v1/pods", system="RunPod", sleep=sleep, call_deadline=1.0)
    assert "answered 503" in str(raised.value) and raised.value.retry_after == 3.0, str(raised.value)
    assert slept == []
