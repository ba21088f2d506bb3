"""What every stage of the node's activities shares: the worker's adapters (providers, tailnets,
the cluster), looked up by name or by the class's account, the activities' clock, heartbeats."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import structlog
from temporalio import activity

from activities.accounts import ProviderRegistry, TailnetRegistry
from activities.ledger import LedgerBatcher
from activities.node.reports import ReportBatcher
from activities.ports import Cluster, CloudProvider, Tailnet
from activities.termination import settled_at
from tgp.errors import AuthError, ConfigError, PermissionDenied
from tgp.offers import UnavailableOffers
from tgp.types import CredentialsRef, Instance, InstanceRef, TailnetRef

log = structlog.get_logger("tgp.activities")


T = TypeVar("T")

# How often a waiting or verifying activity reads the provider again (`wait_for_join` until the
# instance runs, a terminate's verification, the twin watch). Each read is one API call.
POLL_INTERVAL = timedelta(seconds=5)
# Long calls (a create behind a provider's pacer) heartbeat at least this often.
HEARTBEAT_EVERY = timedelta(seconds=5)


async def _not_the_providers(step: Awaitable[T], system: str) -> T:
    """`step`'s result. Its auth or permission error is not the provider account's (which would
    block that account, tgp.offers.block_for): a ConfigError naming the system that refused,
    which ends the node (no other offer would get past it)."""
    try:
        return await step
    except (AuthError, PermissionDenied) as exc:
        kind = type(exc).__name__
    raise ConfigError(f"{system} refused tgp's credentials ({kind}): fix its credentials or their scopes; no offer was blocked")


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


# What every heartbeat of an activity carries unless told otherwise: set by `launch_instance`
# for its join, so the join's beats carry the launch's memo (what it bought) instead of erasing it.
CARRIED: ContextVar[Callable[[], Sequence[Any]]] = ContextVar("carried_heartbeat_details", default=tuple)


def survivor(instances: Iterable[Instance]) -> Instance:
    """The one instance kept under a name: the lowest id. Every attempt keeps the same one, so two
    overlapping attempts never end each other's."""
    return min(instances, key=lambda i: i.instance_id)


@dataclass
class _Beats:
    """When the activity attempt `attempt` last beat (the event loop's clock): shared by its
    heartbeating blocks, so a block that follows another beats on the same rhythm."""

    attempt: tuple[str, str, int]  # (workflow run, activity id, attempt)
    last: float


# The current attempt's beats, set by its first heartbeating block.
_BEATS: ContextVar[_Beats | None] = ContextVar("heartbeats", default=None)


@contextmanager
def heartbeating(details: Callable[[], Sequence[Any]] | None = None) -> Iterator[None]:
    """Heartbeat in the background while the block runs, a few times per heartbeat timeout,
    each beat carrying `details()` (what a retried attempt of the activity reads back; by
    default what the activity carries, `CARRIED`).

    A beat comes one interval after the attempt's last one (its first: one interval after the
    attempt's first block began), also across blocks: a block that follows another does not
    wait a whole interval more, nor beat at once with nothing to say. No beat at the start: the
    heartbeat timeout runs from the attempt's start, and the SDK sends a beat made within its
    throttle interval of the last (0.8 x the timeout) only at that interval's end, so an empty
    beat at the start would hold back the first that says something (a launch's record of its
    create, `activity.heartbeat` right before it)."""
    details = details or CARRIED.get()
    info = activity.info()
    if info.is_local:
        yield  # a local activity (`check_stage`, `observe_node`) has no heartbeat to send
        return
    timeout = info.heartbeat_timeout
    every = min(HEARTBEAT_EVERY, timeout / 3 if timeout else HEARTBEAT_EVERY).total_seconds()
    loop = asyncio.get_running_loop()
    attempt = (info.workflow_run_id or "", info.activity_id, info.attempt)
    beats = _BEATS.get()
    if beats is None or beats.attempt != attempt:
        beats = _Beats(attempt, loop.time())
        _BEATS.set(beats)

    async def beat() -> None:
        while True:
            await asyncio.sleep(max(0.0, beats.last + every - loop.time()))
            activity.heartbeat(*details())
            beats.last = loop.time()

    task = loop.create_task(beat())
    try:
        yield
    finally:
        task.cancel()


class NodeBase:
    """The adapters and clock NodeActivities holds (set by its `__init__`) and their look-ups:
    what each stage's mixin of NodeActivities (one module per stage) builds on."""

    providers: dict[str, CloudProvider]
    registry: ProviderRegistry
    tailnets: dict[str, Tailnet]
    tailnet_registry: TailnetRegistry
    cluster: Cluster
    reports: ReportBatcher
    ledger: LedgerBatcher
    unavailable: UnavailableOffers
    poll_interval: timedelta
    now: Callable[[], datetime]
    sleep: Callable[[float], Awaitable[object]]

    def _lagging(self, ref: InstanceRef, provider: CloudProvider) -> bool:
        """Whether a 404 for `ref` may still be the provider lagging behind its create."""
        settle = settled_at(ref.created_by, provider, self.now())
        return settle is not None and self.now() < settle

    async def _provider_for(self, name: str, credentials: CredentialsRef | None, account: str | None = None) -> CloudProvider:
        """The adapter billing the class's account (`credentials`, read now), or the worker's own.
        `account`: the key an instance was bought with, which reaches it until it ends."""
        return await self.registry.get(name, credentials, account)

    async def _provider_to_buy(self, name: str, credentials: CredentialsRef | None) -> CloudProvider:
        """`_provider_for` a launch: a class's key is kept for every worker before it buys
        (activities.kept_accounts), so any worker can end what it buys."""
        return await self.registry.for_purchase(name, credentials)

    async def _tailnet_for(self, name: str, ref: TailnetRef | None) -> Tailnet:
        """The class's own tailnet (its Secret, read now), or the worker's."""
        return self._tailnet(name) if ref is None else await self.tailnet_registry.get(name, ref)

    def _tailnet(self, name: str) -> Tailnet:
        try:
            return self.tailnets[name]
        except KeyError:
            raise ConfigError(
                f"tailnet backend {name!r} is not configured on this worker (configured: {', '.join(sorted(self.tailnets)) or 'none'}); "
                "set TS_OAUTH_CLIENT_ID/TS_OAUTH_CLIENT_SECRET for Tailscale or HEADSCALE_URL/HEADSCALE_API_KEY for Headscale"
            ) from None

    async def _warn_class(self, owner: str, reason: str, message: str) -> None:
        """A Warning Event on GPUNodeClass `owner`, for its admin (best effort)."""
        try:
            if owner:
                await self.cluster.record_class_event(owner, type="Warning", reason=reason, message=message)
        except Exception as exc:  # noqa: BLE001 - the launch fails either way; the event is a courtesy
            log.warning("class_event_failed", node_class=owner, error_type=type(exc).__name__)
