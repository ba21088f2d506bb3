"""Make-before-break replacement (issue 21 items 3 and 4): the pure rule of the pool's step.

A node that must go for a voluntary reason that needs a new node (Drifted: its class or pool
changed what made it; Cheaper: a re-shop) is replaced, one node at a time per pool:

1. **start**: the pool starts a replacement node workflow whose id is derived from the old
   node's id, what it is replaced for (the drift hash, the re-shop's price) and the attempt
   (`replacement_name`). A start that is retried, or a pass replayed after a crash, names the
   same workflow, which Temporal starts once: idempotent by construction. A pool that lost its
   state (a reset) finds the replacement it started among its running nodes by that name and
   adopts it (`adopt`) instead of starting another.
2. **disrupt**: once the replacement is Ready (never before), the old node is told to end
   voluntarily (signal `disrupt`); it asks the budget, drains and terminates. The signal is
   sent again until it was delivered; the node keeps the first.
3. **abandon**: a replacement that ended before Ready (failed launch, evicted) is given up;
   the old node stays (a `ReplacementFailed` Event) and a later attempt has the next id.

`replacement_steps` is all of it, with no I/O: the pool workflow applies the steps it returns;
tests/test_replace.py drives it with Hypothesis over crash and retry points.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from tgp.types import NodePhase

# How many attempt numbers past the recorded one a pool that lost its state looks for among
# its running nodes (a replacement started by an attempt it no longer remembers).
ADOPT_SCAN = 8


def replacement_name(pool: str, old_workflow_id: str, key: str, attempt: int) -> str:
    """The Node (and workflow) name of the replacement of `old_workflow_id` for `key` (the
    drift hash it is made with, or the re-shop's price cap), attempt `attempt`: the same
    inputs always name the same node, so one step never starts two."""
    digest = hashlib.sha256(f"{old_workflow_id}|{key}|{attempt}".encode()).hexdigest()[:5]
    return f"{pool}-r{digest}"


class Slot(BaseModel):
    """What the step reads of one of the pool's nodes."""

    model_config = ConfigDict(frozen=True)
    workflow_id: str
    node_name: str
    phase: NodePhase
    want: str | None = None  # Drifted / Cheaper: it should be replaced; None: it should not
    key: str = ""  # what it is replaced for (drift hash, price cap): part of the replacement's id
    replaced_by: str | None = None  # the workflow id of its replacement in progress
    disrupt_sent: bool = False  # it was told to end (its replacement is Ready)
    attempts: int = 0  # replacements of it that ended before Ready


class StepKind(StrEnum):
    START = "start"
    ADOPT = "adopt"
    DISRUPT = "disrupt"
    ABANDON = "abandon"


class Step(BaseModel):
    model_config = ConfigDict(frozen=True)
    kind: StepKind
    old: str  # the old node's workflow id
    new: str = ""  # the replacement's workflow id (START: its node name)
    reason: str = ""


def in_progress(nodes: Mapping[str, Slot]) -> list[str]:
    """Old nodes (workflow ids) whose replacement is under way: the old one is alive and has a
    replacement recorded."""
    return [wid for wid, n in nodes.items() if n.replaced_by is not None and not n.phase.is_final]


def replacement_steps(nodes: Mapping[str, Slot], *, pool: str, id_prefix: str, may_start: bool) -> list[Step]:
    """The steps of one pass, in order. `id_prefix` + a node name is its workflow id;
    `may_start`: no back-off holds launches and the budget allows one more disruption (the
    caller asks it for the first candidate only)."""
    steps: list[Step] = []
    for wid in sorted(in_progress(nodes)):
        old = nodes[wid]
        assert old.replaced_by is not None
        new = nodes.get(old.replaced_by)
        if new is None or new.phase.is_final:
            steps.append(Step(kind=StepKind.ABANDON, old=wid, new=old.replaced_by, reason=old.want or ""))
        elif new.phase is NodePhase.READY and old.phase is NodePhase.READY and not old.disrupt_sent:
            steps.append(Step(kind=StepKind.DISRUPT, old=wid, new=old.replaced_by, reason=old.want or ""))
    if in_progress(nodes) or not may_start:
        return steps  # one replacement at a time per pool
    candidate = first_candidate(nodes)
    if candidate is None:
        return steps
    old = nodes[candidate]
    for attempt in range(old.attempts, old.attempts + ADOPT_SCAN):
        wid = id_prefix + replacement_name(pool, old.workflow_id, old.key, attempt)
        found = nodes.get(wid)
        if found is not None and not found.phase.is_final:
            return [*steps, Step(kind=StepKind.ADOPT, old=candidate, new=wid, reason=old.want or "")]
    name = replacement_name(pool, old.workflow_id, old.key, old.attempts)
    return [*steps, Step(kind=StepKind.START, old=candidate, new=name, reason=old.want or "")]


def first_candidate(nodes: Mapping[str, Slot]) -> str | None:
    """The node the next replacement is for: Ready, wanting one, none under way (oldest id
    first, so every pass picks the same)."""
    replacing = {n.replaced_by for n in nodes.values() if n.replaced_by}
    for wid in sorted(nodes):
        n = nodes[wid]
        if n.phase is NodePhase.READY and n.want and n.replaced_by is None and wid not in replacing:
            return wid
    return None
