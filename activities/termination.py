"""Ending instances for good: a terminate is done only when a read shows the instance
terminated or gone, and a name is settled only once its consistency window has passed.

Real clouds answer a terminate with 200 and sometimes do nothing (or act minutes later), list
and describe lag behind a create (describe-by-id answers 404 for an instance that is running),
and a create can complete after its caller gave up (reference/providers.md, issue 17). So:

* every instance is terminated, then read; one still running is terminated again;
* a 404 counts as gone only after the window: before, it may be a lagging read of a running
  instance;
* names are looked up until the window has passed, since a late create lands under them.

Shared by the node's release (activities.node) and the sweeper (activities.sweeper).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timedelta

import structlog

from activities.ports import CloudProvider
from activities import metrics
from tgp.errors import TerminationStuck, TransientError
from tgp.types import InstanceState

log = structlog.get_logger("tgp.termination")

# How long one call keeps terminating and reading before it hands the rest to Temporal's retry:
# clouds that honour a terminate show it within seconds; one that lies is retried meanwhile.
VERIFY_FOR = timedelta(seconds=90)
# Between two reads of instances being terminated.
VERIFY_EVERY = timedelta(seconds=5)

Now = Callable[[], datetime]
Sleep = Callable[[float], Awaitable[object]]


def consistency_window(provider: CloudProvider) -> timedelta:
    """How long the provider's lists and reads may lag behind a create (0: no lag modelled)."""
    return getattr(provider, "consistency_window", timedelta(0))


def settled_at(created_by: datetime | None, provider: CloudProvider, now: datetime) -> datetime | None:
    """When names created up to `created_by` stop changing: the provider's consistency window
    after it (None: no create time known, or a provider without lag: nothing to wait for).
    Never more than one window from `now`: `created_by` is the workflow's clock, which a test
    server may have skipped ahead of this one."""
    window = consistency_window(provider)
    if created_by is None or not window:
        return None
    return min(created_by, now) + window


async def end_for_good(
    provider: CloudProvider,
    ids: Iterable[str],
    *,
    names: Iterable[str] = (),
    keep: str | None = None,
    settle: datetime | None,
    now: Now,
    sleep: Sleep,
    heartbeat: Callable[[], object] = lambda: None,
    budget: timedelta = VERIFY_FOR,
    every: timedelta = VERIFY_EVERY,
    first: Iterable[str] = (),
) -> set[str]:
    """Terminate every instance in `ids` and every live one carrying one of `names`, except
    `keep`, and read each until it shows terminated or gone; a 404 counts as gone, and names
    stop being looked up, only once `settle` has passed. Returns every id seen (`keep`
    included if it was seen). The ids in `first` (of `ids`) are terminated before anything is
    looked up or read, and the first pass comes `every` later: the bill of the instance a
    caller knows stops at its first call, not after a listing and a read, and a read at once
    would show what the cloud has not applied yet.

    Raises TerminationStuck when an instance still runs after `budget` of terminating and
    reading, and TransientError when only the window is left to wait out: Temporal's retry
    goes on from there."""
    wanted = set(ids) - {""}
    seen = set(wanted)
    confirmed: set[str] = set()
    deadline = now() + budget
    fresh = sorted((set(first) & wanted) - {keep})
    for instance_id in fresh:
        await _terminate(provider, instance_id)
    if fresh:
        await sleep(every.total_seconds())
    names = list(names)
    # An instance found by name that was not known: a late create. Its reads lag behind its own
    # create, not the caller's: its 404 counts as gone only a window after it was first listed.
    window, listed_at = consistency_window(provider), dict[str, datetime]()
    while True:
        heartbeat()
        for name in names:
            for found in await provider.find_all_by_name(name):
                if found.instance_id not in seen:
                    listed_at[found.instance_id] = now()
                seen.add(found.instance_id)
        settled = settle is None or now() >= settle
        running: list[str] = []
        for instance_id in sorted(seen - confirmed - {keep}):
            inst = await provider.describe(instance_id)
            gone = inst is None and settled and (instance_id not in listed_at or now() >= listed_at[instance_id] + window)
            if gone or (inst is not None and inst.state is InstanceState.TERMINATED):
                confirmed.add(instance_id)
                log.info("instance_terminated", provider=provider.name, instance_id=instance_id, verified="gone" if inst is None else "terminated")
                continue
            # Running, or a 404 that may be a lagging read: (again) terminate, then read again.
            await _terminate(provider, instance_id)
            if inst is not None:
                running.append(instance_id)
        unconfirmed = seen - confirmed - {keep}
        if not unconfirmed and settled:
            return seen
        if now() >= deadline:
            if running:
                raise TerminationStuck(
                    f"{provider.name} answered the terminate of {', '.join(running)} but still shows it running after "
                    f"{int(budget.total_seconds())}s; terminating again"
                )
            left = (settle - now()).total_seconds() if settle is not None else 0.0
            raise TransientError(
                f"{provider.name}: waiting out the consistency window ({max(0, int(left))}s left) before "
                f"{', '.join(sorted(unconfirmed)) or 'the names'} can be counted as gone",
                retry_after=min(max(left, 1.0), 30.0),
            )
        await sleep(every.total_seconds())


async def _terminate(provider: CloudProvider, instance_id: str) -> None:
    await provider.terminate(instance_id)
    metrics.TERMINATIONS.labels(provider.name).inc()
    log.info("instance_terminate_sent", provider=provider.name, instance_id=instance_id)
