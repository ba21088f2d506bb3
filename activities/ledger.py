"""The class ledger's calls (activities.node_class's workflow, GPUNodeClass): reserve, settle
and release a node's place and price in the class budget. Made by the pool's activities
(reserve), the class's (settle, release) and the node's launch and release, which carry the
settle and the release in a `life-v4` life (one activity instead of two): one batcher per worker
process gathers them all."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict
from temporalio import activity
from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from activities.batching import UpdateBatcher
from tgp.messages import Grant, Grants, Releases, Reservation, Reservations

log = structlog.get_logger("tgp.ledger")


class LedgerCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    class_workflow_id: str
    reservation: Reservation


async def ledger_update(class_workflow_id: str, name: str, reservation: Reservation) -> Grant:
    """Call the class ledger's `reserve` / `settle` update; a ledger that is not running or
    refuses answers with a refused Grant (its reason), not an error."""
    try:
        return await activity.client().get_workflow_handle(class_workflow_id).execute_update(name, reservation, result_type=Grant)
    except RPCError as exc:
        if exc.status is RPCStatusCode.NOT_FOUND:
            return Grant(granted=False, reason=f"the class ledger {class_workflow_id} is not running (is the GPUNodeClass applied?)")
        raise
    except WorkflowUpdateFailedError as exc:
        return Grant(granted=False, reason=str(exc.cause or exc))


async def ledger_batch(class_workflow_id: str, name: str, reservations: list[Reservation]) -> list[Grant]:
    """Call the class ledger's `reserve_many` / `settle_many` update: one grant per reservation,
    in order; a ledger that is not running or refuses refuses each (its reason), no error."""
    if not reservations:
        return []
    try:
        answer = await activity.client().get_workflow_handle(class_workflow_id).execute_update(name, Reservations(reservations=reservations), result_type=Grants)
    except RPCError as exc:
        if exc.status is RPCStatusCode.NOT_FOUND:
            why = f"the class ledger {class_workflow_id} is not running (is the GPUNodeClass applied?)"
            return [Grant(granted=False, reason=why)] * len(reservations)
        raise
    except WorkflowUpdateFailedError as exc:
        if "not found" in str(exc.cause or ""):
            # A class run by an older worker that has no batch updates: one call each.
            return [await ledger_update(class_workflow_id, name.removesuffix("_many"), r) for r in reservations]
        return [Grant(granted=False, reason=str(exc.cause or exc))] * len(reservations)
    return answer.grants


# Calls gathered into one ledger update; a bigger backlog goes in the next update.
MAX_LEDGER_BATCH = 500
# The most one batched settle or release may take. A class ledger decides them without waiting,
# so a longer one is a class whose worker is gone or stuck: its callers hear TimeoutError (a
# settle is tried again with its launch, a release by the workflow's own call) and the next
# batch goes, instead of every later call of this worker queueing behind it.
LEDGER_UPDATE_TIMEOUT = timedelta(seconds=30)


class LedgerBatcher(UpdateBatcher):
    """Per worker process: node workflows' ledger calls (settle a price, release a budget) to
    one class go together (activities.batching): `call(class_workflow_id, kind, item)`, kind
    "settle" (item: a Reservation, answer: its Grant) or "release" (item: a node id)."""

    def __init__(self, timeout: timedelta = LEDGER_UPDATE_TIMEOUT) -> None:
        super().__init__(MAX_LEDGER_BATCH, timeout=timeout.total_seconds())

    async def settle(self, call: LedgerCall) -> Grant:
        """The node's price, told to its class ledger (batched); the ledger may refuse."""
        grant: Grant = await self.call(call.class_workflow_id, "settle", call.reservation)
        return grant

    async def release(self, call: LedgerCall) -> None:
        """The node's slot and $/h given back to its class ledger (batched)."""
        await self.call(call.class_workflow_id, "release", call.reservation.node_id)

    async def _update(self, client: Any, class_workflow_id: str, kind: str, items: list[Any]) -> list[Any]:
        handle = client.get_workflow_handle(class_workflow_id)
        try:
            if kind == "settle":
                answer = await handle.execute_update("settle_many", Reservations(reservations=items), result_type=Grants)
                return list(answer.grants)
            await handle.execute_update("release_many", Releases(node_ids=items))
            return [None] * len(items)
        except RPCError as exc:
            if exc.status is not RPCStatusCode.NOT_FOUND:
                raise
            if kind == "release":
                log.info("ledger_gone", class_workflow_id=class_workflow_id)  # nothing left to release
                return [None] * len(items)
            why = f"the class ledger {class_workflow_id} is not running (is the GPUNodeClass applied?)"
            return [Grant(granted=False, reason=why)] * len(items)
        except WorkflowUpdateFailedError as exc:
            if "not found" in str(exc.cause or ""):
                # A class run by an older worker that has no batch updates: one call each.
                return await LedgerBatcher._one_by_one(handle, kind, items)
            if kind == "release":
                raise
            return [Grant(granted=False, reason=str(exc.cause or exc))] * len(items)

    @staticmethod
    async def _one_by_one(handle: Any, kind: str, items: list[Any]) -> list[Any]:
        answers = []
        for item in items:
            if kind == "settle":
                try:
                    answers.append(await handle.execute_update("settle", item, result_type=Grant))
                except WorkflowUpdateFailedError as exc:
                    answers.append(Grant(granted=False, reason=str(exc.cause or exc)))
            else:
                answers.append(await handle.execute_update("release", item))
        return answers
