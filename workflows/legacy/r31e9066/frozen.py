"""Which runs are 31e9066's, and their frozen instances (handover.py says what happens then).

The current pool, class and node workflows call `frozen_pool`/`frozen_class`/`frozen_node` once,
in `@workflow.init`. A run whose input 31e9066 wrote (told by its shape) gets a `FrozenRun`, and
the current workflow hands it its run, signals, updates and queries."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tgp.messages import ClassInput as CurrentClassInput
from tgp.node import NodeWorkflowInput as CurrentNodeInput
from workflows.legacy.r31e9066 import messages, node, node_class, pool, types

# A field every later release writes into the input and 31e9066 did not (checked against the
# recorded histories of 31e9066, d9d0b88 and e9a7c55 in tests/test_legacy_31e9066.py). The
# pydantic converter writes every field, so a payload without it was written by 31e9066.
POOL_MARK = "resync_interval"  # PoolInput.resync_interval, since d9d0b88
CLASS_MARK = "resync_interval"  # ClassInput.resync_interval, since d9d0b88
NODE_MARK = "demand_since"  # NodeWorkflowInput.request.demand_since, since d9d0b88


class FrozenRun:
    """A 31e9066 workflow instance behind today's workflow class. Signals and updates arrive in
    today's types and are read into 31e9066's (which ignore fields added since); the latest of
    each is also kept as it came, for the handover (`latest`)."""

    def __init__(self, wf: Any, inp: Any, arg_types: dict[str, type], current_input: type) -> None:
        self.wf = wf
        self.inp = inp
        self.arg_types = arg_types
        wf.latest = {}  # what the handover reads (handover.py)
        wf.current_input = current_input

    async def run(self) -> Any:
        return await self.wf.run(self.inp)

    def handle(self, name: str, arg: Any = None) -> Any:
        """A signal or update by name. One 31e9066 did not have (a node's update_timeouts) is only
        kept, for the handover: today's run takes it."""
        self.wf.latest[name] = arg
        handler = getattr(self.wf, name, None)
        if handler is None or name not in self.arg_types:
            return None
        data = arg.model_dump(mode="json") if isinstance(arg, BaseModel) else arg
        return handler(self.arg_types[name].model_validate(data) if issubclass(self.arg_types[name], BaseModel) else data)

    def query(self, name: str) -> Any:
        return getattr(self.wf, name)()


def written_by_31e9066(inp: BaseModel, mark: str) -> bool:
    return mark not in inp.model_fields_set


def _frozen_input(inp: BaseModel, model: type[BaseModel]) -> Any:
    # Only the fields the payload held: today's defaults for fields added since are not 31e9066's.
    return model.model_validate(inp.model_dump(mode="json", exclude_unset=True))


def frozen_pool(inp: Any) -> FrozenRun | None:
    if not written_by_31e9066(inp, POOL_MARK):
        return None
    frozen = _frozen_input(inp, pool.PoolInput)
    arg_types = {"update": messages.PoolUpdate, "demand": messages.Demand, "node_phase": messages.NodeReport}
    return FrozenRun(pool.GPUNodePoolWorkflow(frozen), frozen, arg_types, type(inp))


def frozen_class(inp: CurrentClassInput) -> FrozenRun | None:
    if not written_by_31e9066(inp, CLASS_MARK):
        return None
    frozen = _frozen_input(inp, messages.ClassInput)
    arg_types: dict[str, type] = {
        "reserve": messages.Reservation,
        "settle": messages.Reservation,
        "release": str,
        "update_class": messages.ClassUpdate,
    }
    return FrozenRun(node_class.GPUNodeClassWorkflow(frozen), frozen, arg_types, type(inp))


def frozen_node(inp: CurrentNodeInput) -> FrozenRun | None:
    if not written_by_31e9066(inp.request, NODE_MARK):
        return None
    frozen = _frozen_input(inp, node.NodeWorkflowInput)
    return FrozenRun(node.GPUNodeWorkflow(frozen), frozen, {"evict": types.EvictRequest}, type(inp))
