"""Runs of release 31e9066, finished in that release's own code, then handed to today's.

A run 31e9066 started (frozen.py) replays its history through the frozen code command for
command; at its first step that is not a replay it continues as new with today's input
(`pool_input`, `class_input`, `node_input`):

* a pool or class, at the top of its loop (before and after its wait), so no command of the old
  code runs after the upgrade except those of a pass already under way;
* a node, in its watch loop only: a node still coming up, draining or cleaning up finishes that
  in the old code (minutes), with the activities of the same names today's worker runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from temporalio import workflow

from tgp.messages import ClassInput as CurrentClassInput
from tgp.node import NodeState as CurrentNodeState
from tgp.node import NodeWorkflowInput as CurrentNodeInput
from tgp.types import NodeRequest as CurrentNodeRequest

# --- the handover: 31e9066's state as today's input ------------------------------------------


def hand_over(wf: Any, convert: Callable[[Any], Any]) -> None:
    """Past the replay: continue as new into today's code. Called by the frozen code only where
    31e9066 itself could have continued as new (no handler awaits in these workflows)."""
    if not workflow.unsafe.is_replaying():
        workflow.continue_as_new(convert(wf))


async def hand_over_node(wf: Any) -> None:
    """`hand_over` for a node, which waits for its phase reports under way, as 31e9066's own
    continue-as-new did."""
    if not workflow.unsafe.is_replaying():
        await workflow.wait_condition(workflow.all_handlers_finished)
        await asyncio.gather(*wf._reports)
        workflow.continue_as_new(node_input(wf))


def pool_input(wf: Any) -> Any:
    """Today's PoolInput for a 31e9066 pool: its state (a subset of today's), the Events not
    written yet, and the latest pool update and demand as the bridge sent them (the bridge does
    not send an unchanged demand again)."""
    PoolInput = wf.current_input  # today's workflows.pool.PoolInput (that module imports this one)
    PoolState = PoolInput.model_fields["state"].annotation

    state = PoolState.model_validate(wf.state.model_dump(mode="json"))
    changes: dict[str, Any] = {"events": [*state.events, *(e.model_dump(mode="json") for e in wf.events)]}
    update, demand = wf.latest.get("update"), wf.latest.get("demand")
    if update is not None:
        changes["update"] = update
    if demand is not None:
        changes |= {
            "pending_since": {pod: demand.observed_at for pod in demand.pods},
            "pod_gpus": dict(demand.pod_gpus),
            "free_gpus": dict(demand.free_gpus),
        }
    state = PoolState.model_validate(state.model_dump() | changes)
    return PoolInput(namespace=wf.inp.namespace, name=wf.inp.name, watch_interval=wf.inp.watch_interval, state=state)


def class_input(wf: Any) -> CurrentClassInput:
    """Today's ClassInput for a 31e9066 class: the class as last seen, with the ledger (today's
    code validates it again before it grants)."""
    inp = CurrentClassInput.model_validate(wf.inp.model_copy(update={"ledger": wf.ledger}).model_dump(mode="json"))
    update = wf.latest.get("update_class")
    if update is not None:  # as the bridge sent it, fields added since included
        inp = inp.model_copy(update={"spec": update.spec, "generation": update.generation, "uid": update.uid or inp.uid})
    return inp


def node_input(wf: Any) -> CurrentNodeInput:
    """Today's NodeWorkflowInput for a 31e9066 node in its watch loop: the same request and state
    (today's NodeState has the same fields)."""
    request = CurrentNodeRequest.model_validate(wf.req.model_dump(mode="json"))
    timeouts = wf.latest.get("update_timeouts")  # a pool's new settings 31e9066 could not take
    if timeouts is not None:
        update = {"idle": timeouts.idle, "drain": timeouts.drain, "expire_after": timeouts.expire_after}
        request = request.model_copy(update={"timeouts": request.timeouts.model_copy(update=update)})
    state = CurrentNodeState.model_validate(wf.state.model_dump(mode="json"))
    return CurrentNodeInput(request=request, state=state)
