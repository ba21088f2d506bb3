"""What every part of the pool workflow shares: its input and state, the Events it writes about
itself and its nodes, the records of its nodes, and the settings it gives them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from decimal import Decimal
from typing import Generic, TypeVar

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from tgp.capacity import CapacityNode
    from tgp.crds import ConsolidationStatus, PoolNodeStatus
    from tgp.disruption import unlimited_reasons
    from tgp.events import EventSpec
    from tgp.messages import ObjectRef, PoolNode, PoolUpdate
    from tgp.pool_plan import Note, capacity_node, disrupting, live_grants, pod_ref, timeouts_for
    from tgp.types import NodePhase, Stage, StageRecord, TimeoutsUpdate
    from workflows.pool.state import ENDED_REMEMBERED, GRANT_COUNTS_FOR, PoolInput, PoolState

T = TypeVar("T")


class Kept(Generic[T]):
    """What a pass derives from each node's record, kept while the record and what else it reads
    are the same. PoolNode is frozen: a change is a new record (`PoolBase._set`, a report), so a
    pass does not make again, for the hundreds of nodes that did not change, what took most of its
    time at 500 nodes. Not state: made again after a continue-as-new or a replay."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[PoolNode, object, T]] = {}

    def of(self, n: PoolNode, also: object, make: Callable[[], T]) -> T:
        """`make()` for `n`, or what it made for this same record and `also`."""
        kept = self._values.get(n.workflow_id)
        if kept is not None and kept[0] is n and kept[1] == also:
            return kept[2]
        value = make()
        self._values[n.workflow_id] = (n, also, value)
        return value

    def keep_only(self, nodes: Mapping[str, PoolNode]) -> None:
        """Forget the nodes the pool no longer has."""
        self._values = {wid: v for wid, v in self._values.items() if wid in nodes}


class PoolBase:
    """The pool workflow's shared parts; GPUNodePoolWorkflow (workflows.pool.workflow) is made of
    this and the parts for starts, replacement, disruption, settings and status."""

    inp: PoolInput
    state: PoolState
    dirty: bool
    # What passes derive from each node's record (`Kept`): its status line, its capacity.
    node_statuses: Kept[PoolNodeStatus]
    capacities: Kept[CapacityNode]

    @property
    def events(self) -> list[EventSpec]:
        """Events not yet written (in the state: continue-as-new carries them)."""
        return self.state.events

    def _live(self) -> list[PoolNode]:
        return [n for n in self.state.nodes.values() if not n.phase.is_final]

    def _ref(self) -> ObjectRef:
        uid = self.state.update.uid if self.state.update else None
        return ObjectRef(kind="GPUNodePool", name=self.inp.name, namespace=self.inp.namespace, uid=uid)

    def _note(self, *notes: Note) -> None:
        """Write these Events about the pool (or a pod of its demand) with the next pass's."""
        self.events.extend(EventSpec(ref=pod_ref(n.pod) if n.pod else self._ref(), type=n.type, reason=n.reason, message=n.message) for n in notes)

    def _set(self, n: PoolNode, **update: object) -> None:
        self.state.nodes[n.workflow_id] = self.state.nodes[n.workflow_id].model_copy(update=update)

    def _disrupting(self, exclude: str = "") -> int:
        return disrupting(self.state.nodes, self.state.granted, exclude)

    def _forget_grants(self, now: datetime) -> None:
        self.state.granted = live_grants(self.state.granted, self.state.nodes, now, GRANT_COUNTS_FOR)

    def _blocked(self, wid: str, node_name: str, message: str) -> bool:
        """Record why node `wid`'s disruption is blocked; a DisruptionBlocked Event when the
        reason is new for it (not again each pass or ask). Returns whether it was new."""
        if self.state.blocked.get(wid) == message:
            return False
        self.state.blocked[wid] = message
        self._note(Note("Normal", "DisruptionBlocked", f"node {node_name}: {message}"))
        return True

    def _unlimited(self, u: PoolUpdate) -> list[str]:
        """The disruption reasons the pool tells its nodes its budgets cannot refuse, in their
        start and in its settings signal alike (a change of budgets reaches them)."""
        return unlimited_reasons(u.spec.disruption.budgets)

    def _timeouts_for(self, u: PoolUpdate, *, floor: bool, held: bool) -> TimeoutsUpdate:
        return timeouts_for(u.spec, floor=floor, held=held, bind_grace=self.inp.bind_grace, unlimited=self._unlimited(u))

    def _consolidated(self, node_name: str, reason: str, saving: Decimal) -> None:
        """A consolidation was done: add what it saves to savingsMadeHourly and name it."""
        old = self.state.consolidation or ConsolidationStatus()
        self.state.consolidation = old.model_copy(
            update={"savings_made_hourly": old.savings_made_hourly + saving, "last_action": f"node {node_name}: {reason}, saving ${saving}/h"}
        )
        self._note(Note("Normal", "Consolidated", f"node {node_name}: {reason}, saving ${saving}/h"))
        self.dirty = True

    def _node_event(self, n: PoolNode, stages: list[StageRecord] | None = None) -> None:
        """The Event of a node's new phase (and of a drain that timed out)."""
        where = f"{n.gpu_type} on {n.provider} at ${n.hourly_price}/h" if n.provider else ""
        for s in stages or []:
            if s.stage is Stage.DRAIN_TIMED_OUT:  # the pods it names were killed, not evicted
                self._note(Note("Warning", s.stage.value, f"node {n.node_name} drain {s.reason}"))
            elif s.stage is Stage.NODE_DELETED:  # kubectl delete node: its instance is ended for it
                self._note(Note("Warning", s.stage.value, f"node {n.node_name} is drained and terminated: {s.reason}"))
        said = {
            NodePhase.READY: ("Normal", "NodeReady", f"node {n.node_name} is Ready ({where})"),
            NodePhase.FAILED: ("Warning", "LaunchFailed", f"node {n.node_name} could not be launched: {n.reason}"),
            NodePhase.TERMINATION_STUCK: ("Warning", "TerminationStuck", f"node {n.node_name} is still billing: {n.reason}"),
            NodePhase.INTERRUPTED: ("Warning", "NodeInterrupted", f"node {n.node_name} was lost: {n.reason}"),
            NodePhase.TERMINATED: ("Normal", "NodeTerminated", f"node {n.node_name} terminated: {n.reason}"),
            NodePhase.CANCELLED: ("Normal", "NodeTerminated", f"node {n.node_name} terminated: {n.reason}"),
        }.get(n.phase)
        if said is not None:
            self._note(Note(*said))

    def _capacity(self, live: list[PoolNode]) -> list[CapacityNode]:
        """`capacity_node` of each live node, as of the demand."""
        free, at = self.state.free_gpus, self.state.demand_at
        return [self.capacities.of(n, (free.get(n.node_name), at), lambda: capacity_node(n, free, at)) for n in live]

    def _forget_ended(self) -> None:
        """Ended nodes have been reported (status and Events): forget them, remembering their ids
        so late reports about them are known stale."""
        ended = [k for k, n in self.state.nodes.items() if n.phase.is_final]
        if ended:
            self.state.nodes_ended += len(ended)
            self.state.ended = [*self.state.ended, *ended][-ENDED_REMEMBERED:]
            self.state.nodes = {k: n for k, n in self.state.nodes.items() if not n.phase.is_final}
        self.node_statuses.keep_only(self.state.nodes)
        self.capacities.keep_only(self.state.nodes)
