"""Stopping the bill: terminate a launch attempt's instances until the provider confirms, then
its cleanup (tailnet, Node, the class ledger's place), each step bounded and left to the
workflow when it fails."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field
from temporalio import activity

from activities import metrics
from activities.errors import temporal_errors
from activities.ledger import LedgerCall
from activities.node.base import NodeBase, heartbeating, log
from activities.node.reports import carrying
from activities.termination import end_for_good, settled_at
from tgp.messages import PoolReport
from tgp.types import InstanceRef, TailnetCleanupInput, TailnetCleanupResult

# Upper bound on devices removed for one hostname in one cleanup (guards a runaway loop).
MAX_DEVICES_PER_HOSTNAME = 10
# In a release (`release_attempt`), each step after the terminate (tailnet, Node, class ledger)
# is tried once within this; one that fails or takes longer is left to the workflow,
# which makes it as a call of its own with its retries.
RELEASE_STEP_TIMEOUT = timedelta(seconds=20)


class ReleaseInput(BaseModel):
    """The release of a launch attempt, in one activity: terminate its instance, then remove it
    from the tailnet, delete its Node and (the last attempt of a life) give its place back to
    the class ledger."""

    model_config = ConfigDict(extra="forbid")
    instance: InstanceRef
    tailnet: TailnetCleanupInput
    node_name: str
    ledger: LedgerCall | None = None
    stuck_at: datetime | None = Field(
        None,
        description="An attempt whose terminate fails past this time returns `stuck` (nothing else done) instead of being "
        "retried; the workflow shows TerminationStuck and releases again without it. None: retried until it succeeds.",
    )


class ReleaseResult(BaseModel):
    """What `release_attempt` did: the terminate always (or it fails and is retried), each later
    step only if it says so; the workflow makes the steps not done itself."""

    model_config = ConfigDict(extra="forbid")
    anything_seen: bool
    tailnet_cleaned: bool = False
    node_deleted: bool = False
    released: bool = False
    stuck: bool = Field(False, description="The provider had not confirmed the terminate by `stuck_at`: nothing after it was done.")


class Release(NodeBase):
    """The release's activities: `terminate_instance`, `release_attempt`, `remove_from_tailnet`, `delete_node`."""

    @activity.defn
    async def terminate_instance(self, ref: InstanceRef, report: PoolReport | None = None) -> bool:
        """Stop paying for every instance of a launch attempt: the recorded one, every id ever
        seen under its name, and every live one carrying its name (a twin bought by an
        overlapping or late create bills as much). Works without an instance id (a launch
        cancelled in flight). Done only when a read shows each terminated or gone, and (when
        the attempt's creates are recent) once the provider's consistency window has passed.
        Returns whether anything was seen. `report` (Terminating) goes to the pool meanwhile
        (`carrying`)."""
        async with carrying(report, self.reports):
            return await self._terminate_instance(ref)

    async def _terminate_instance(self, ref: InstanceRef, *, running: bool = False) -> bool:
        """`running`: the caller knows the recorded instance runs (a node just drained): it is
        terminated first, looked up and read a pass later (end_for_good's `first`)."""
        with heartbeating(), temporal_errors(always_retry=True), metrics.counting_failures(metrics.TERMINATION_FAILURES, ref.provider):
            # Its look-ups by name share the account's listings (never older than its own).
            provider = self.registry.sharing_lookups(await self._provider_for(ref.provider, ref.credentials, ref.account))
            seen = await end_for_good(
                provider,
                [*ref.known_ids, ref.instance_id or ""],
                names=[ref.instance_name],
                settle=settled_at(ref.created_by, provider, self.now()),
                now=self.now,
                sleep=self.sleep,
                every=self.poll_interval,
                first=[ref.instance_id or ""] if running else (),
            )
            log.info("instances_terminated", provider=ref.provider, instance_name=ref.instance_name, instance_ids=sorted(seen))
        return bool(seen)

    @activity.defn
    async def release_attempt(self, inp: ReleaseInput, report: PoolReport | None = None) -> ReleaseResult:
        """A launch attempt's release: terminate (as `terminate_instance`, until the provider
        confirms), then the cleanup that follows it (`remove_from_tailnet`, `delete_node`, the
        class ledger's release), each tried once and bounded (RELEASE_STEP_TIMEOUT). A step that
        fails is reported not done, never raised: the terminate is not made again for it, and
        the workflow makes that step as a call of its own. One activity and one workflow task
        for four steps. `report` (Terminating) goes to the pool meanwhile.

        With `inp.stuck_at`, an attempt scheduled at or past that time whose terminate fails
        returns `stuck` instead: the workflow needs no timer of its own beside it."""
        async with carrying(report, self.reports):
            try:
                seen = await self._terminate_instance(inp.instance)
            except Exception:
                # Temporal's clock (the attempt's schedule), as the workflow's that set stuck_at.
                if inp.stuck_at is None or activity.info().current_attempt_scheduled_time < inp.stuck_at:
                    raise  # retried by Temporal (CLEANUP_RETRY)
                log.warning("termination_stuck", provider=inp.instance.provider, instance_name=inp.instance.instance_name)
                return ReleaseResult(anything_seen=True, stuck=True)
            return await self._release_rest(inp, seen)

    async def _release_rest(self, inp: ReleaseInput, seen: bool) -> ReleaseResult:
        """The steps after a confirmed terminate, each tried once (`_step`)."""
        with heartbeating():
            tailnet = await _step("remove_from_tailnet", self.remove_from_tailnet(inp.tailnet))
            node = await _step("delete_node", self.delete_node(inp.node_name))
            released = inp.ledger is not None and await _step("release_reservation", self.ledger.release(inp.ledger))
        return ReleaseResult(anything_seen=seen, tailnet_cleaned=tailnet, node_deleted=node, released=released)

    @activity.defn
    async def remove_from_tailnet(self, inp: TailnetCleanupInput) -> TailnetCleanupResult:
        """Revoke the node's unused keys and delete its tailnet devices. A tailnet this worker has
        no backend for, through which no key of the node was ever minted, has nothing of the
        node to clean: done (retrying would hold a deleted pool, and its budget, for ever)."""
        revoked = deleted = 0
        if inp.tailnet_ref is None and inp.tailnet not in self.tailnets and not inp.key_ids:
            log.warning("tailnet_cleanup_skipped", hostname=inp.hostname, tailnet=inp.tailnet, reason="backend not configured, no key minted")
            return TailnetCleanupResult(keys_revoked=0, devices_deleted=0)
        with temporal_errors(always_retry=True):
            tailnet = await self._tailnet_for(inp.tailnet, inp.tailnet_ref)
            for key_id in inp.key_ids:
                await tailnet.revoke_auth_key(key_id)
            revoked = await tailnet.revoke_keys_for(inp.hostname)
            for _ in range(MAX_DEVICES_PER_HOSTNAME):
                device = await tailnet.find_device(inp.hostname, inp.tags)
                if device is None:
                    break
                await tailnet.delete_device(device.device_id)
                deleted += 1
        return TailnetCleanupResult(keys_revoked=revoked, devices_deleted=deleted)

    @activity.defn
    async def delete_node(self, node_name: str) -> None:
        """Delete the Node object (already gone counts as deleted)."""
        with temporal_errors(always_retry=True):
            await self.cluster.delete_node(node_name)


async def _step(name: str, call: Awaitable[object]) -> bool:
    """One cleanup step of `release_attempt`: whether it was done within RELEASE_STEP_TIMEOUT.
    A failure is logged by its type only (an adapter's message may quote a response body)."""
    try:
        async with asyncio.timeout(RELEASE_STEP_TIMEOUT.total_seconds()):
            await call
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the workflow makes the step again on its own
        log.warning("release_step_left_to_the_workflow", step=name, error=type(exc).__name__)
        return False
    return True
