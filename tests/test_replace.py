"""The make-before-break replacement step (tgp.replace) over crash and retry points.

A model of the world the pool acts on: node workflows that start once per id (Temporal's
REJECT_DUPLICATE + USE_EXISTING), come up or fail, end when told to; reports that reach the pool
late; steps whose effect happened but whose result the pool never recorded (a retried activity
or signal); and a pool that loses its whole state (a reset: it adopts its running nodes by
name). Whatever Hypothesis interleaves, the promises hold:

* never two live replacements for one old node;
* an old node is told to end (and so drained) only after its replacement was Ready;
* with the world quiet, every drifted node is eventually replaced and gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tgp.replace import Slot, StepKind, replacement_name, replacement_steps
from tgp.types import NodePhase

POOL = "p"
PREFIX = "gpunode/ml/p/"
KEY = "v1-new"


@dataclass
class Node:
    phase: NodePhase
    replaces: str | None = None  # the old node's id (a replacement), as its name says
    was_ready: bool = False
    told: list[str] = field(default_factory=list)  # replacements named in the `disrupt` signals it got


class ReplacementSteps(RuleBasedStateMachine):
    @initialize(olds=st.integers(1, 3))
    def start(self, olds: int) -> None:
        self.world: dict[str, Node] = {}
        self.slots: dict[str, Slot] = {}
        for i in range(olds):
            wid = f"{PREFIX}old{i}"
            self.world[wid] = Node(NodePhase.READY, was_ready=True)
            self.slots[wid] = Slot(workflow_id=wid, node_name=f"old{i}", phase=NodePhase.READY, want="Drifted", key=KEY)
        self.olds = sorted(self.world)

    # --- the pool's pass, with results it may not record -----------------------------------------

    @rule(lose=st.lists(st.booleans(), max_size=4))
    def pass_(self, lose: list[bool]) -> None:
        steps = replacement_steps(self.slots, pool=POOL, id_prefix=PREFIX, may_start=True)
        for i, step in enumerate(steps):
            lost = i < len(lose) and lose[i]  # done in the world, not recorded by the pool
            old = self.slots[step.old]
            if step.kind is StepKind.START:
                wid = PREFIX + step.new
                if wid not in self.world:  # started once per id; a retry finds it
                    self.world[wid] = Node(NodePhase.PENDING, replaces=step.old)
                if not lost:
                    self.slots[step.old] = old.model_copy(update={"replaced_by": wid, "disrupt_sent": False})
                    self.slots.setdefault(wid, Slot(workflow_id=wid, node_name=step.new, phase=NodePhase.PENDING))
            elif step.kind is StepKind.ADOPT:
                self.slots[step.old] = old.model_copy(update={"replaced_by": step.new, "disrupt_sent": False})
            elif step.kind is StepKind.DISRUPT:
                target = self.world[step.old]
                target.told.append(step.new)
                assert self.world[step.new].was_ready, f"{step.old} told to end before its replacement {step.new} was Ready"
                if not lost:
                    self.slots[step.old] = old.model_copy(update={"disrupt_sent": True})
            else:  # ABANDON
                self.slots[step.old] = old.model_copy(update={"replaced_by": None, "disrupt_sent": False, "attempts": old.attempts + 1})

    @rule()
    def reset(self) -> None:
        """The pool loses its state and adopts its running node workflows (visibility): no
        record of who replaces whom, attempts forgotten."""
        self.slots = {
            wid: Slot(
                workflow_id=wid,
                node_name=wid.removeprefix(PREFIX),
                phase=n.phase,
                want="Drifted" if n.replaces is None else None,
                key=KEY if n.replaces is None else "",
            )
            for wid, n in self.world.items()
            if not n.phase.is_final
        }

    # --- the world -------------------------------------------------------------------------------

    def _pending(self) -> list[str]:
        return sorted(w for w, n in self.world.items() if n.replaces is not None and n.phase is NodePhase.PENDING)

    @precondition(lambda self: self._pending())
    @rule(data=st.data(), ok=st.booleans())
    def replacement_comes_up(self, data: st.DataObject, ok: bool) -> None:
        wid = data.draw(st.sampled_from(self._pending()))
        self.world[wid].phase = NodePhase.READY if ok else NodePhase.FAILED
        self.world[wid].was_ready |= ok

    @precondition(lambda self: any(n.told and not n.phase.is_final for n in self.world.values()))
    @rule(data=st.data())
    def old_node_ends(self, data: st.DataObject) -> None:
        """A node told to end drains and terminates (its budget and holders allowed)."""
        wid = data.draw(st.sampled_from(sorted(w for w, n in self.world.items() if n.told and not n.phase.is_final)))
        self.world[wid].phase = NodePhase.TERMINATED

    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        """A node's report reaches the pool (reports lag the world; they arrive in order)."""
        wid = data.draw(st.sampled_from(sorted(self.slots)))
        self.slots[wid] = self.slots[wid].model_copy(update={"phase": self.world[wid].phase})

    # --- the promises ----------------------------------------------------------------------------

    @invariant()
    def never_two_live_replacements(self) -> None:
        for old in self.olds:
            live = [w for w, n in self.world.items() if n.replaces == old and not n.phase.is_final]
            assert len(live) <= 1, f"{old} has two live replacements: {live}"

    @invariant()
    def told_only_by_ready_replacements(self) -> None:
        for wid, n in self.world.items():
            for new in n.told:
                assert self.world[new].replaces == wid and self.world[new].was_ready

    def teardown(self) -> None:
        """Quiet: the pool passes, reports arrive and replacements come up until done. Every
        old node ends, replaced by exactly one live node."""
        for _ in range(60):
            for wid in self._pending():
                self.world[wid].phase = NodePhase.READY
                self.world[wid].was_ready = True
            for wid in list(self.slots):
                self.slots[wid] = self.slots[wid].model_copy(update={"phase": self.world[wid].phase})
            self.pass_([])
            for n in self.world.values():
                if n.told and not n.phase.is_final:
                    n.phase = NodePhase.TERMINATED
            if all(self.world[o].phase.is_final for o in self.olds):
                break
        for old in self.olds:
            assert self.world[old].phase is NodePhase.TERMINATED, f"{old} was never replaced"
            assert len([n for n in self.world.values() if n.replaces == old and not n.phase.is_final]) == 1


ReplacementSteps.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_replacement_steps = ReplacementSteps.TestCase


def test_the_replacement_name_is_the_same_for_the_same_step_and_new_per_attempt() -> None:
    a = replacement_name(POOL, "gpunode/ml/p/old0", KEY, 0)
    assert a == replacement_name(POOL, "gpunode/ml/p/old0", KEY, 0)
    assert a != replacement_name(POOL, "gpunode/ml/p/old0", KEY, 1)
    assert a != replacement_name(POOL, "gpunode/ml/p/old1", KEY, 0)
    assert a != replacement_name(POOL, "gpunode/ml/p/old0", "v1-other", 0)
    assert a.startswith("p-r") and len(a) == len("p-r") + 5
