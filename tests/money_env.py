"""A node's money path at the activity level, against the provider model on a fake clock: the
simulated cloud (sim.cloud) behind a `ProviderModel` whose clock is a `ManualClock`, the
`simulated` adapter over real HTTP, a Tailscale fake for the keys a launch mints, and
NodeActivities whose `now` is the same clock and whose `sleep` moves it. A consistency window
of minutes costs no wall time. `Temporal` here is only what the workflow's retry policy does:
run the activity again, with the heartbeat details the last attempt left.

An attempt runs in a `Worker` the test may kill at any of its steps (`MoneyEnv.attempt`): a
request about to leave (to the cloud or the tailnet), a request answered, a wait, the attempt's
return. Temporal then keeps only the heartbeats the SDK really sent (`details_after_a_kill`).
Every create that reaches the cloud is checked against the look-ups by name its own attempt made
(`MoneyEnv.unlooked_creates`).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import httpx
from pydantic import SecretStr
from temporalio.testing import ActivityEnvironment

from activities.clouds.simulated import SimulatedProvider
from activities.node import NodeActivities
from activities.tailnets.tailscale import TailscaleTailnet
from sim.cloud import SimulatedCloud
from sim.provider_model import ManualClock, ProviderModel
from sim.tailscale import FakeTailscale
from tgp.types import InstanceRef, LaunchInput, LaunchResult, Offer, instance_name

NODE_TAG = "tag:tgp-node"
# The SDK's heartbeat throttle for the launch's 30 s heartbeat timeout (0.8 x), in fake seconds.
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
THROTTLE = 0.8 * HEARTBEAT_TIMEOUT.total_seconds()
OFFER = Offer(provider="simulated", offer_id="rtx4090-us-east", gpu_type="RTX4090", region="us-east", hourly_price=Decimal("0.44"))
# A step label (`Worker.step`) that kills the worker once the cloud has taken its create and
# answered it (whatever the answer): bought, and nobody hears of it.
CREATE_ANSWERED = "<- POST /v1/instances"


class Killed(Exception):
    """The attempt's worker died (`MoneyEnv.attempt`): Temporal retries it after its heartbeat
    timeout, with `details`, what the SDK had sent of its heartbeats."""

    def __init__(self, step: str, details: tuple[Any, ...]) -> None:
        super().__init__(f"worker killed at {step}")
        self.step, self.details = step, details


class Worker:
    """The process an activity attempt runs in, killed at its step number `kill_at` (or the first
    step so labelled; None: it lives). Steps are what the attempt does outside itself: each
    request to the cloud or the tailnet as it leaves (`-> GET /v1/instances`) and as its answer
    or failure arrives (`<- ...`), each wait (`sleep`), and its return. A dead worker does
    nothing more: every later step of its tasks (a listing it started, a shielded revoke) ends
    there. Also what its look-ups by name showed (`looks`: fake time, the names covered, None
    for every name)."""

    def __init__(self, kill_at: int | str | None) -> None:
        self.kill_at = kill_at
        self.steps: list[str] = []
        self.looks: list[tuple[float, str | None]] = []
        self.died = asyncio.Event()
        self.death: tuple[str, float, int] | None = None  # the step, the fake time, beats made before
        self._grave: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._clock: Callable[[], float] = lambda: 0.0
        self._beats: Callable[[], int] = lambda: 0

    async def step(self, what: str) -> None:
        if self.death is not None or self.dies_at(what):
            await self._grave  # dead: nothing of this worker goes further

    def dies_at(self, what: str) -> bool:
        """Take step `what`: whether the worker dies there."""
        self.steps.append(what)
        if self.kill_at == len(self.steps) - 1 or self.kill_at == what:
            self.kill_at = None
            self.death = (what, self._clock(), self._beats())
            self.died.set()
        return self.death is not None

    def bury(self) -> None:
        """End every task of the dead worker where it stands."""
        self._grave.cancel()


WORKER: contextvars.ContextVar[Worker | None] = contextvars.ContextVar("money_env_worker", default=None)


class WorkerTransport(httpx.AsyncBaseTransport):
    """HTTP as the attempt's worker sends it: a step before a request leaves and one when its
    answer arrives, so a kill lands before the cloud saw a request or after it acted on it. Tells
    `env` of creates sent and look-ups answered."""

    def __init__(self, env: Callable[[], MoneyEnv | None]) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._env = env

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        worker, env = WORKER.get(), self._env()
        what = f"{request.method} {request.url.path}"
        if worker is not None:
            await worker.step(f"-> {what}")
        if env is not None and request.method == "POST" and request.url.path == "/v1/instances":
            env.create_sent(json.loads(request.content).get("name", ""), worker)
        try:
            response = await self._inner.handle_async_request(request)
            await response.aread()
        except Exception:
            if worker is not None:
                await worker.step(f"<- {what}")
            raise
        if worker is not None and env is not None and request.method == "GET" and request.url.path == "/v1/instances":
            worker.looks.append((env.clock(), request.url.params.get("name")))
        if worker is not None:
            await worker.step(f"<- {what}")
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass
class MoneyEnv:
    clock: ManualClock
    model: ProviderModel
    cloud: SimulatedCloud
    provider: SimulatedProvider
    activities: NodeActivities
    window: timedelta
    tailscale: FakeTailscale | None = None  # the tailnet the launches mint their keys at
    # Every beat of every attempt, and those of the attempt running now with the fake clock's time.
    heartbeats: list[tuple[Any, ...]] = field(default_factory=list)
    beats: list[tuple[float, tuple[Any, ...]]] = field(default_factory=list)
    # Creates that reached the cloud (fake time, name), and those sent while an earlier create
    # of the name might still land and no look-up of the sender's had covered its settle time.
    creates: list[tuple[float, str]] = field(default_factory=list)
    unlooked_creates: list[str] = field(default_factory=list)

    def reset(self, *, list_lag: float = 0.0, describe_lag: float = 0.0, late_create_after: float = 70.0) -> None:
        """The next run on the same servers: a new clock and provider model, no instances (the
        ids go on counting, so no id is seen twice)."""
        self.clock = ManualClock()
        self.model = ProviderModel(
            clock=self.clock, list_lag=list_lag, describe_lag=describe_lag, late_create_after=late_create_after, late_terminate_after=20.0
        )
        self.cloud.release_creates()
        self.cloud.model = self.model
        self.cloud.instances.clear()
        self.cloud.max_live_per_name.clear()
        self.cloud.create_requests = 0
        self.heartbeats.clear()
        self.creates.clear()
        self.unlooked_creates.clear()

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), timezone.utc)

    async def sleep(self, seconds: float) -> None:
        worker = WORKER.get()
        if worker is not None:
            await worker.step(f"sleep {seconds:g}")
        self.clock.advance(seconds)
        await asyncio.sleep(0)

    @property
    def settle(self) -> timedelta:
        """How long, by the rule the docs state, a create whose fate nobody knows may take to
        show: max(30 s, the provider's consistency window)."""
        return max(timedelta(seconds=30), self.window)

    def create_sent(self, name: str, worker: Worker | None) -> None:
        """A create of `name` leaves now: every earlier create of the name (by another attempt:
        an attempt sends one) must have been settled by a look-up of this attempt's, one made
        the settle time after it or later."""
        now = self.clock()
        for sent, earlier in self.creates:
            if earlier != name:
                continue
            due = sent + self.settle.total_seconds()
            if worker is None or not any(due <= at <= now and covers in (None, name) for at, covers in worker.looks):
                self.unlooked_creates.append(f"{name} created at {now:g} while its create of {sent:g} was unsettled (looked at {[at for at, _ in worker.looks] if worker else []})")
        self.creates.append((now, name))

    def launch_input(self, node: str, attempt: int = 1) -> LaunchInput:
        return LaunchInput(node_name=node, attempt=attempt, offer=OFFER, tailnet_tags=[NODE_TAG])

    def env(self, *, attempt: int = 1, details: tuple[Any, ...] = ()) -> ActivityEnvironment:
        """An activity attempt as Temporal starts it: its number and the last attempt's details."""
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, attempt=attempt, heartbeat_details=list(details), heartbeat_timeout=HEARTBEAT_TIMEOUT)
        self.beats = []

        def beat(*details: Any) -> None:
            self.heartbeats.append(details)
            self.beats.append((self.clock(), details))

        env.on_heartbeat = beat
        return env

    def beat_now(self, details: tuple[Any, ...]) -> None:
        """A beat of the attempt in `env` now, carrying `details`: what a launch that waited a
        heartbeat interval before its create sent first (its later beats are the SDK's to hold)."""
        self.heartbeats.append(tuple(details))
        self.beats.append((self.clock(), tuple(details)))

    def attempt_details(self, before: tuple[Any, ...]) -> tuple[Any, ...]:
        """What Temporal keeps of an attempt that ended by itself (its last beat is flushed with
        its end): its last beat with details, else the details it was started with."""
        return next((d for _, d in reversed(self.beats) if d), before)

    def last_details(self) -> tuple[Any, ...]:
        """The details of the last heartbeat that carried any, as Temporal keeps them when the
        attempt ended by itself (its last beat is flushed with its failure)."""
        return next((d for d in reversed(self.heartbeats) if d), ())

    def details_after_a_kill(self, at: float, made: int | None = None) -> tuple[Any, ...]:
        """What Temporal keeps when the worker dies at `at`, having made `made` beats (None: all
        made by then): only the beats the SDK sent. It throttles them (THROTTLE, 0.8 x the
        heartbeat timeout; tgp sets no throttle of its own, so the Worker's default, the timeout's
        0.8 capped at 60 s): a beat goes out at once only if none went out within the interval;
        otherwise the latest waits for the interval's end, and a worker killed before then takes
        it with it."""
        sent: tuple[float, tuple[Any, ...]] | None = None
        pending: tuple[Any, ...] | None = None
        for when, details in self.beats[:made]:
            if when > at:
                break
            if sent is not None and pending is not None and sent[0] + THROTTLE <= when:
                sent, pending = (sent[0] + THROTTLE, pending), None  # the interval's end sent the latest
            if sent is None or sent[0] + THROTTLE <= when:
                sent = (when, details)
            else:
                pending = details
        if sent is not None and pending is not None and sent[0] + THROTTLE <= at:
            sent = (sent[0] + THROTTLE, pending)
        return next((d for d in [sent[1] if sent else ()] if d), ())

    async def attempt(
        self, run: Callable[[ActivityEnvironment], Awaitable[Any]], *, attempt: int = 1, details: tuple[Any, ...] = (), kill_at: int | str | None = None,
        beat_first: bool = False,
    ) -> Any:
        """One activity attempt (`run` in the environment given), its worker killed at step
        `kill_at` (`Worker`; its return is its last step): its result or error, or `Killed`
        with what Temporal kept of its heartbeats (those the SDK had sent; none: `details`).
        `beat_first`: the attempt beat (what it carries, `details`) before its first step, as a
        launch does that waited a heartbeat interval (a pacer's turn, a slow mint) before its
        create: the SDK then holds the beat that records the create (`details_after_a_kill`)."""
        worker = Worker(kill_at)
        env = self.env(attempt=attempt, details=details)
        if beat_first:
            self.beat_now(details)
        worker._clock, worker._beats = self.clock, lambda: len(self.beats)
        token = WORKER.set(worker)
        try:
            task = asyncio.ensure_future(run(env))
        finally:
            WORKER.reset(token)
        died = asyncio.ensure_future(worker.died.wait())
        await asyncio.wait([task, died], return_when=asyncio.FIRST_COMPLETED)
        if task.done() and worker.death is None:
            worker.dies_at("return")  # killed before Temporal heard of its end?
        died.cancel()
        if worker.death is None:
            return task.result()
        step, at, made = worker.death
        kept = self.details_after_a_kill(at, made)
        env.cancel()
        worker.bury()
        try:
            await task
        except BaseException:  # noqa: BLE001 - the dead worker's attempt ends however it ends
            pass
        for _ in range(5):  # its other tasks (a listing, a shielded revoke) end at their next step
            await asyncio.sleep(0)
        raise Killed(step, kept or details)

    async def launch(
        self, node: str, *, attempt: int = 1, details: tuple[Any, ...] = (), kill_at: int | str | None = None, node_attempt: int = 1, beat_first: bool = False,
    ) -> LaunchResult:
        inp = self.launch_input(node, node_attempt)
        return await self.attempt(
            lambda env: env.run(self.activities.launch_instance, inp), attempt=attempt, details=details, kill_at=kill_at, beat_first=beat_first
        )

    async def launch_killed_at_create(self, node: str, *, attempt: int = 1, details: tuple[Any, ...] = (), beat_first: bool = False) -> tuple[Any, ...]:
        """A launch attempt whose worker dies while its create is in flight (after the backend
        took it): the answer never reaches anyone. The details Temporal kept of it (the SDK's
        throttled heartbeats: `details_after_a_kill`). `beat_first`: as `attempt`'s."""
        self.cloud.hold_creates()
        env = self.env(attempt=attempt, details=details)
        if beat_first:
            self.beat_now(details)
        task = asyncio.ensure_future(env.run(self.activities.launch_instance, self.launch_input(node)))
        arrived = asyncio.ensure_future(self.cloud.create_arrived.wait())
        await asyncio.wait([task, arrived], return_when=asyncio.FIRST_COMPLETED)
        arrived.cancel()
        kept = self.details_after_a_kill(self.clock())
        env.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - the dead worker's attempt ends however it ends
            pass
        self.cloud.release_creates()
        return kept or details

    async def terminate(self, ref: InstanceRef, *, tries: int = 50, kill_at: int | str | None = None) -> bool:
        """terminate_instance as CLEANUP_RETRY runs it: again after every failure (the clock
        moves on between tries as Temporal's backoff would), its first try's worker killed at
        step `kill_at` (retried once the heartbeat timeout has passed)."""
        for _ in range(tries):
            try:
                return await self.attempt(lambda env: env.run(self.activities.terminate_instance, ref), kill_at=kill_at)
            except Killed:
                self.clock.advance(HEARTBEAT_TIMEOUT.total_seconds())
            except Exception:  # noqa: BLE001 - retried, as Temporal does
                self.clock.advance(30)
            kill_at = None
        raise AssertionError(f"terminate_instance did not succeed in {tries} tries")

    def billing(self, node: str, attempt: int = 1) -> list[str]:
        """Ids really billing under the attempt's name: the model's truth, not an API answer."""
        return sorted(r.id for r in self.model.billing_named(instance_name(node, attempt)))


@asynccontextmanager
async def money_env(
    *, list_lag: float = 0.0, describe_lag: float = 0.0, late_create_after: float = 70.0, window: timedelta = timedelta(minutes=3)
) -> AsyncIterator[MoneyEnv]:
    clock = ManualClock()
    model = ProviderModel(clock=clock, list_lag=list_lag, describe_lag=describe_lag, late_create_after=late_create_after, late_terminate_after=20.0)
    api_key = "sim-" + secrets.token_hex(8)
    client_id = "k" + secrets.token_hex(6) + "CNTRL"
    client_secret = f"tskey-client-{client_id}-{secrets.token_hex(16)}"
    made: list[MoneyEnv] = []
    transport = WorkerTransport(lambda: made[0] if made else None)
    async with (
        SimulatedCloud(api_key=api_key, boot_delay=0.0, model=model) as cloud,
        FakeTailscale(clients={client_id: (client_secret, [NODE_TAG])}) as ts,
        httpx.AsyncClient(transport=transport, headers={"User-Agent": "tgp"}) as client,
        SimulatedProvider(cloud.url, api_key=SecretStr(api_key), client=client) as provider,
        TailscaleTailnet(base_url=ts.url, client_id=client_id, client_secret=SecretStr(client_secret), transport=WorkerTransport(lambda: None)) as tailnet,
    ):
        # Set as attributes, not constructor arguments, so the same test runs against code that
        # predates them (and fails there for the reason it names).
        provider.consistency_window = window
        activities = NodeActivities(
            providers={"simulated": provider},
            tailnets={"tailscale": tailnet},
            cluster=None,  # type: ignore[arg-type]  # the money path never reads the cluster
            poll_interval=timedelta(seconds=15),  # fake seconds: fewer looks over a window cost less wall time
            create_settle=timedelta(0),
        )
        env = MoneyEnv(clock=clock, model=model, cloud=cloud, provider=provider, activities=activities, window=window, tailscale=ts)
        made.append(env)
        activities.now = env.now
        activities.sleep = env.sleep
        yield env
