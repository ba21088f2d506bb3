"""What the entity workflows (pool, class) share: they live as long as their custom resource,
so an activity error never ends them. It becomes a condition or a Warning Event, and the next
pass tries again (the Temporal samples' entity pattern)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Generic, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from activities.entity import EntityActivities, StatusWrite
    from tgp.messages import NodeSighting, RunningNodesQuery
    from workflows.retries import BEST_EFFORT_RETRY

T = TypeVar("T")

# An activity's start-to-close timeout unless the caller gives one; also how long a pass waits
# before retrying an activity whose worker died. Read at each call (not bound as a default
# argument), so every wrapper below honours a deployment's (or the fault matrix's) setting.
BEST_EFFORT_TIMEOUT = timedelta(seconds=60)
# The longest timeout any entity activity may be given (None: as each caller asks, e.g. a
# pass's batch of starts, 3 minutes). The fault matrix sets its short one, so a worker killed
# under a pool's activity costs it seconds there, as in every other call.
ENTITY_TIMEOUT_CAP: timedelta | None = None


def _capped(timeout: timedelta) -> timedelta:
    return min(timeout, ENTITY_TIMEOUT_CAP) if ENTITY_TIMEOUT_CAP is not None else timeout


class Outcome(Generic[T]):
    """The result of a best-effort activity: `value`, or `error` saying what went wrong."""

    def __init__(self, value: T | None = None, error: str | None = None) -> None:
        self.value = value
        self.error = error

    @property
    def ok(self) -> bool:
        return self.error is None


async def best_effort(activity: Callable[..., Any], arg: Any, *, summary: str, timeout: timedelta | None = None) -> Outcome[Any]:
    """Run an activity (start-to-close `timeout`, else BEST_EFFORT_TIMEOUT); an error
    (non-retryable, or retries spent) is returned, not raised."""
    try:
        value = await workflow.execute_activity_method(
            activity, arg, start_to_close_timeout=_capped(timeout or BEST_EFFORT_TIMEOUT), retry_policy=BEST_EFFORT_RETRY, summary=summary
        )
    except ActivityError as exc:
        message = describe(exc)
        workflow.logger.warning("%s failed: %s", summary, message)
        return Outcome(error=f"{summary} failed: {message}")
    return Outcome(value=value)


class Sighted:
    """A look at the running node workflows: those the caller did not know, and the ids of
    those it knew that are not running (`gone`)."""

    def __init__(self, unknown: list[NodeSighting], gone: set[str]) -> None:
        self.unknown, self.gone = unknown, gone


async def running_nodes_changed(query: str, prefix: str, live: Iterable[str]) -> Outcome[Sighted | None]:
    """Look at the running node workflows of `query`, sending the ids the caller counts as
    `live` (each starting with `prefix`, sent without it) and recording only what differs. Not
    ok: the look failed (the caller looks again later); None: the server has no visibility."""
    known = sorted(wid.removeprefix(prefix) for wid in live)
    changed = await best_effort(
        EntityActivities.running_nodes_changed,
        RunningNodesQuery(query=query, prefix=prefix, known=known),
        summary="list running nodes (changes)",
    )
    if not changed.ok:
        return Outcome(error=changed.error)
    if not changed.value.listed:
        return Outcome(value=None)
    return Outcome(value=Sighted(changed.value.unknown, {prefix + name for name in changed.value.missing}))


async def write_status_once(write: StatusWrite, *, fingerprint: str, written: str, summary: str, timeout: timedelta | None = None) -> str:
    """Write a custom resource's status unless `fingerprint` is what was written last. Returns
    the fingerprint now written: unchanged after a failed write, so the next pass tries again."""
    if fingerprint == written:
        return written
    result = await best_effort(EntityActivities.write_status, write, summary=summary, timeout=timeout)
    return fingerprint if result.ok else written


def describe(exc: ActivityError) -> str:
    cause = exc.cause
    if isinstance(cause, ApplicationError):
        return f"{cause.type}: {cause.message}" if cause.type else cause.message
    if isinstance(cause, TimeoutError):
        return f"activity timed out ({cause.type.name if cause.type else 'timeout'})"
    return str(cause or exc)
