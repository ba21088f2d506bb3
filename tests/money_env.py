"""A node's money path at the activity level, against the provider model on a fake clock: the
simulated cloud (sim.cloud) behind a `ProviderModel` whose clock is a `ManualClock`, the
`simulated` adapter over real HTTP, a Tailscale fake for the keys a launch mints, and
NodeActivities whose `now` is the same clock and whose `sleep` moves it. A consistency window
of minutes costs no wall time. `Temporal` here is only what the workflow's retry policy does:
run the activity again, with the heartbeat details the last attempt left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

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


@dataclass
class MoneyEnv:
    clock: ManualClock
    model: ProviderModel
    cloud: SimulatedCloud
    provider: SimulatedProvider
    activities: NodeActivities
    window: timedelta
    # Every beat of every attempt, and those of the attempt running now with the fake clock's time.
    heartbeats: list[tuple[Any, ...]] = field(default_factory=list)
    beats: list[tuple[float, tuple[Any, ...]]] = field(default_factory=list)

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

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), timezone.utc)

    async def sleep(self, seconds: float) -> None:
        self.clock.advance(seconds)
        await asyncio.sleep(0)

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

    def last_details(self) -> tuple[Any, ...]:
        """The details of the last heartbeat that carried any, as Temporal keeps them when the
        attempt ended by itself (its last beat is flushed with its failure)."""
        return next((d for d in reversed(self.heartbeats) if d), ())

    def details_after_a_kill(self, at: float) -> tuple[Any, ...]:
        """What Temporal keeps when the worker dies at `at`: only the beats the SDK sent. It
        throttles them (THROTTLE, 0.8 x the heartbeat timeout): a beat goes out at once only
        if none went out within the interval; otherwise the latest waits for the interval's
        end, and a worker killed before then takes it with it."""
        sent: tuple[float, tuple[Any, ...]] | None = None
        pending: tuple[Any, ...] | None = None
        for when, details in self.beats:
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

    async def launch(self, node: str, *, attempt: int = 1, details: tuple[Any, ...] = ()) -> LaunchResult:
        return await self.env(attempt=attempt, details=details).run(self.activities.launch_instance, self.launch_input(node))

    async def launch_killed_at_create(self, node: str, *, attempt: int = 1, details: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        """A launch attempt whose worker dies while its create is in flight (after the backend
        took it): the answer never reaches anyone. The details Temporal kept of it (the SDK's
        throttled heartbeats: `details_after_a_kill`)."""
        self.cloud.hold_creates()
        env = self.env(attempt=attempt, details=details)
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

    async def terminate(self, ref: InstanceRef, *, tries: int = 50) -> bool:
        """terminate_instance as CLEANUP_RETRY runs it: again after every failure (the clock
        moves on between tries as Temporal's backoff would)."""
        for _ in range(tries):
            try:
                return await self.env().run(self.activities.terminate_instance, ref)
            except Exception:  # noqa: BLE001 - retried, as Temporal does
                self.clock.advance(30)
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
    async with (
        SimulatedCloud(api_key=api_key, boot_delay=0.0, model=model) as cloud,
        FakeTailscale(clients={client_id: (client_secret, [NODE_TAG])}) as ts,
        SimulatedProvider(cloud.url, api_key=SecretStr(api_key)) as provider,
        TailscaleTailnet(base_url=ts.url, client_id=client_id, client_secret=SecretStr(client_secret)) as tailnet,
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
        env = MoneyEnv(clock=clock, model=model, cloud=cloud, provider=provider, activities=activities, window=window)
        activities.now = env.now
        activities.sleep = env.sleep
        yield env
