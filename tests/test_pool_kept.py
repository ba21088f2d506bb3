"""What the pool keeps between passes of what it derives from each node's record
(workflows.pool.base.Kept: the status lines, the capacity): after any run of changes, a pass
that kept them answers as a pass that made everything afresh. Pure: the pool workflow's object
outside a workflow, no server."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tgp.messages import PoolNode
from tgp.pool_plan import capacity_node
from tgp.types import NodePhase
from workflows.pool import GPUNodePoolWorkflow
from workflows.pool.state import PoolInput

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
NAMES = [f"n{i}" for i in range(4)]
PHASES = [NodePhase.LAUNCHING, NodePhase.READY, NodePhase.DRAINING, NodePhase.TERMINATED]

# One change to the pool's state: (kind, node index, a value drawn for it).
CHANGES = st.lists(
    st.tuples(
        st.sampled_from(["add", "phase", "replaced_by", "drift", "price", "free", "demand_at", "forget", "pass"]),
        st.integers(0, len(NAMES) - 1),
        st.integers(0, 3),
    ),
    max_size=30,
)


def wid(i: int) -> str:
    return f"gpunode/ml/p/{NAMES[i]}"


def apply(pool: GPUNodePoolWorkflow, kind: str, i: int, v: int) -> None:
    """One change, made as the pool makes it: a new record by `_set`, never one changed in place."""
    state, n = pool.state, pool.state.nodes.get(wid(i))
    if kind == "add" and n is None:
        state.nodes[wid(i)] = PoolNode(workflow_id=wid(i), node_name=NAMES[i], phase=NodePhase.LAUNCHING, created_at=T0 + timedelta(seconds=i), phase_at=T0, gpus=v or None)
    elif kind == "forget":
        pool._forget_ended()
    elif kind == "pass":
        pass  # what follows is asked again of the same records
    elif kind == "free":
        state.free_gpus = {**state.free_gpus, NAMES[i]: v}
    elif kind == "demand_at":
        state.demand_at = T0 + timedelta(minutes=v)
    elif n is not None and kind == "phase":
        pool._set(n, phase=PHASES[v], phase_at=T0 + timedelta(minutes=v))
    elif n is not None and kind == "replaced_by":
        pool._set(n, replaced_by=wid(v % len(NAMES)) if v else None)
    elif n is not None and kind == "drift":
        pool._set(n, drift_hash=f"v1-{v:016x}", drifted=bool(v % 2))
    elif n is not None and kind == "price":
        pool._set(n, hourly_price=Decimal(v) / 4, provider="simulated", gpu_type="RTX4090")


def fresh(pool: GPUNodePoolWorkflow) -> GPUNodePoolWorkflow:
    """A pool object on the same state that has kept nothing (a new run, a replay)."""
    return GPUNodePoolWorkflow(PoolInput(namespace="ml", name="p", state=pool.state))


@given(CHANGES, st.lists(st.sampled_from(["status", "capacity"]), min_size=1, max_size=3))
@example([("add", 0, 0), ("replaced_by", 0, 1), ("add", 1, 0)], ["status"])  # its replacement's name comes later
@example([("add", 0, 1), ("phase", 0, 1), ("free", 0, 0)], ["capacity"])  # the bridge's free GPUs change
@example([("add", 0, 1), ("phase", 0, 1), ("demand_at", 0, 0)], ["capacity"])  # a newer demand
@settings(max_examples=300, deadline=None)
def test_a_pass_that_kept_what_it_derived_answers_as_one_that_made_it_all_again(changes: list[tuple[str, int, int]], asks: list[str]) -> None:
    pool = GPUNodePoolWorkflow(PoolInput(namespace="ml", name="p"))
    for kind, i, v in changes:
        apply(pool, kind, i, v)
        for ask in asks:  # asked after every change, so a kept value is asked again later
            if ask == "status":
                assert pool._status() == fresh(pool)._status()
            else:
                live = pool._live()
                assert pool._capacity(live) == [capacity_node(n, pool.state.free_gpus, pool.state.demand_at) for n in live]


def test_a_node_record_cannot_be_changed_in_place() -> None:
    """What is kept is kept by the record's identity: a record changed in place would keep an
    old status line, so PoolNode refuses it."""
    n = PoolNode(workflow_id=wid(0), node_name=NAMES[0], created_at=T0, phase_at=T0)
    with pytest.raises(ValidationError, match="frozen"):
        n.phase = NodePhase.READY  # type: ignore[misc]
