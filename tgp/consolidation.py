"""Consolidation (issue 21 item 4): which of a pool's nodes to remove or replace now, what each
saves, and what holds the others back. Pure, no I/O: the pool's look records the savings it
finds (status.consolidation) and `tgp plan` prints the whole plan; a replacement or removal
itself is carried out make-before-break by the node's disruption path.

Four kinds of action, in this order (Karpenter's: drift before consolidation):

* **Drifted**: a node whose class or pool changed what made it (`tgp.drift`) is replaced. It
  saves nothing by itself (saving 0); budgets and do-not-disrupt limit it, `after` does not.
* **Underutilized** (policy WhenEmptyOrUnderutilized): a node is removed when every pod on it
  has a place on the free GPUs of a Ready node that stays. GPUs are whole-node (a pod's GPUs all
  sit on one node, no sharing), so fit is integer bin packing: largest pod first, first fit over
  the staying nodes in name order. Nodes with the fewest GPUs in use go first (least to move), the
  dearer first among equals. A node that takes pods of a removed node stays (so no pod moves
  twice), and the pool keeps minNodes. An empty node is left to its idleTimeout (reason Empty).
  Saves the node's whole price.
* **Several into one** (policy WhenEmptyOrUnderutilized; Karpenter's multi-node consolidation):
  of the nodes that stay and took no pods, the largest set (fewest GPUs in use first) whose pods
  fit one new node cheaper than the set by `cheaperBy` is merged into it (`tgp.merge`): bought
  first, the set drained once it is Ready. Each node must have run `after`; the set counts
  against the budgets as a whole, and the new node toward minNodes. Saves the set's price less
  the new node's.
* **Cheaper** (re-shopping, either policy): a node is replaced by the cheapest current offer
  that holds its pods' GPUs (at least the class's minimum) when that is `cheaperBy` cheaper and
  the node has run `after` (`tgp.disruption.reshop`). Saves the price difference.

Every action is a voluntary disruption: a node held by do-not-disrupt is never touched, and the
actions taken at once never exceed what the pool's budgets allow (each action counts against
the next, as a disrupting node does). Candidates that are held back are reported with why
(`Blocked.cause`), for `tgp plan`.

Only GPUs are modelled: a pod's other requests (memory, CPU, volumes, affinity) are not, as the
pool does not see them. A moved pod that does not bind on its new node stays pending and the pool
buys for it again, which is why a node must have run `after` before it is removed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from tgp.capacity import OfferSize, cheapest_holding
from tgp.crds import Consolidation, DisruptionBudget, format_duration
from tgp.disruption import DisruptionReason, allowed_disruptions, cheaper_by, reshop
from tgp.merge import Merge, plan_merge


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ConsolidationNode(Frozen):
    """What consolidation needs to know of one Ready node of the pool."""

    name: str = Field(description="The Node name.")
    gpus: int = Field(description="Its allocatable GPUs.")
    hourly_price: Decimal | None = Field(None, description="What its offer costs, US$/h; None = unknown (not consolidated).")
    running_for: timedelta = Field(timedelta(0), description="How long it has been Ready.")
    pods: dict[str, int] = Field({}, description="The pods that need a place if it goes (namespace/name -> GPUs they request).")
    do_not_disrupt: bool = Field(False, description="The Node or one of its pods asks not to be disrupted.")
    holders: list[str] = Field([], description="What holds it (the Node or pods), for messages.")
    drifted: bool = False
    nominated: int = Field(0, description="GPUs of pending pods the pool has nominated to it (they bind there): taken, and it stays.")

    @property
    def used(self) -> int:
        return sum(self.pods.values())

    @property
    def free(self) -> int:
        return max(0, self.gpus - self.used - self.nominated)


class ActionKind(StrEnum):
    REMOVE = "remove"  # drain and terminate: its pods fit on the nodes that stay
    REPLACE = "replace"  # buy a replacement, Ready, then drain and terminate it


class Action(Frozen):
    node: str
    kind: ActionKind
    reason: DisruptionReason
    hourly_price: Decimal = Field(description="The node's price, US$/h.")
    replacement_price: Decimal | None = Field(None, description="The replacement's offer, US$/h (replace only).")
    replacement_gpus: int | None = None
    saving: Decimal = Field(Decimal(0), description="US$/h it saves: the node's price, less its replacement's.")
    moves: dict[str, str] = Field({}, description="remove: each of its pods -> the node whose free GPUs take it.")
    message: str = ""


class Cause(StrEnum):
    """Why a candidate is held back."""

    OFF = "off"  # consolidation is off, or the policy does not remove nodes that run pods
    BUDGET = "budget"  # a disruption budget allows no more now
    DO_NOT_DISRUPT = "do-not-disrupt"
    AFTER = "after"  # the node has not run `after` yet
    THRESHOLD = "threshold"  # no offer is cheaperBy cheaper
    MIN_NODES = "min-nodes"  # removing it would leave fewer than minNodes
    NO_PRICE = "no-price"  # its price or the offers are unknown


class Blocked(Frozen):
    node: str
    reason: DisruptionReason
    cause: Cause
    saving: Decimal = Decimal(0)
    message: str


class ConsolidationPlan(Frozen):
    actions: list[Action] = []
    merge: Merge | None = None  # several nodes into one (tgp.merge)
    blocked: list[Blocked] = []

    @property
    def savings(self) -> Decimal:
        """US$/h the actions and the merge save together."""
        return sum((a.saving for a in self.actions), start=self.merge.saving if self.merge else Decimal(0))

    @property
    def candidates(self) -> int:
        """The nodes the plan disrupts."""
        return len(self.actions) + (len(self.merge.nodes) if self.merge else 0)


class PoolMember(Frozen):
    """One Ready node as the pool records it, for `look_at`."""

    name: str
    workflow_id: str
    hourly_price: Decimal | None = None
    running_for: timedelta = timedelta(0)
    leaving: bool = False  # told to end (consolidation) or being replaced


def look_at(
    members: Sequence[PoolMember],
    free_gpus: Mapping[str, int],
    bound_gpus: Mapping[str, Sequence[int]],
    held: Sequence[str],
    nominated: Mapping[str, Mapping[str, int]],
) -> list[ConsolidationNode]:
    """The nodes a consolidation look plans over, from what the bridge reports (each node's free
    GPUs, the GPU requests of its bound pods, the nodes do-not-disrupt holds) and the pool's
    nominations (`nominated`: node workflow id -> pending pods that will bind to its free GPUs,
    with their GPUs). A node the bridge has not reported GPUs for is left out, and so is a
    leaving node (no place for another node's pods, no candidate); the GPUs of the pending pods
    nominated to a node are taken and keep it (as Karpenter keeps a node with pods nominated to
    it: they are on their way there)."""
    nodes = []
    for m in members:
        if m.name not in free_gpus or m.leaving:
            continue
        bound = list(bound_gpus.get(m.name, []))
        nodes.append(
            ConsolidationNode(
                name=m.name,
                gpus=free_gpus[m.name] + sum(bound),
                hourly_price=m.hourly_price,
                running_for=m.running_for,
                pods={f"{m.name}#{i}": gpus for i, gpus in enumerate(bound)},
                do_not_disrupt=m.name in held,
                nominated=sum(nominated.get(m.workflow_id, {}).values()),
            )
        )
    return nodes


def plan_consolidation(
    nodes: Sequence[ConsolidationNode],
    offers: Sequence[OfferSize] | None,
    policy: Consolidation | None,
    budgets: Sequence[DisruptionBudget],
    now: datetime,
    *,
    pool_nodes: int | None = None,
    disrupting: int = 0,
    min_nodes: int = 0,
    min_gpus: int = 1,
) -> ConsolidationPlan:
    """What to disrupt now among the pool's Ready `nodes`, given the cheapest current offer per
    GPU count (`offers`; None = unknown), the pool's consolidation `policy` (None = off) and its
    `budgets` at `now`. `pool_nodes`: the pool's nodes a percentage budget is of (default: the
    Ready nodes given); `disrupting`: its nodes being disrupted already; `min_nodes`: the pool's
    minNodes, which removals keep; `min_gpus`: the fewest GPUs a replacement may have.

    The same input in any order gives the same plan (nodes are taken by name)."""
    planning = _Planning(
        nodes=sorted(nodes, key=lambda n: n.name),
        offers=offers,
        policy=policy,
        budgets=budgets,
        now=now,
        pool=len(nodes) if pool_nodes is None else pool_nodes,
        disrupting=disrupting,
        min_nodes=min_nodes,
        min_gpus=min_gpus,
    )
    _replace_drifted(planning)
    _remove_underutilized(planning)
    _merge_several(planning)
    _reshop(planning)
    return _plan_of(planning)


@dataclass
class _Planning:
    """What the steps of `plan_consolidation` share: its input (nodes by name) and what the
    steps before decided. Each action, and the merge, counts against the budgets of the next."""

    nodes: list[ConsolidationNode]
    offers: Sequence[OfferSize] | None
    policy: Consolidation | None
    budgets: Sequence[DisruptionBudget]
    now: datetime
    pool: int  # the nodes a percentage budget is of
    disrupting: int
    min_nodes: int
    min_gpus: int
    actions: list[Action] = field(default_factory=list)
    blocked: list[Blocked] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)  # drifted: going away either way, neither a target nor a candidate
    removed: set[str] = field(default_factory=set)
    receivers: set[str] = field(default_factory=set)  # took pods of a removed node: they stay
    merge: Merge | None = None

    @property
    def merged(self) -> list[str]:
        return self.merge.nodes if self.merge else []

    @property
    def removes_underutilized(self) -> bool:
        """WhenEmpty only re-shops nodes that run pods."""
        return self.policy is not None and self.policy.policy == "WhenEmptyOrUnderutilized"

    def budget_refusal(self, reason: DisruptionReason) -> str:
        """Why the budgets allow no more disruption for `reason` now; "" when they do."""
        verdict = allowed_disruptions(self.budgets, self.now, reason, self.pool, self.disrupting + len(self.actions) + len(self.merged))
        return "" if verdict.permits() else verdict.message

    def held(self, node: ConsolidationNode, reason: DisruptionReason, saving: Decimal = Decimal(0)) -> bool:
        """Whether do-not-disrupt holds `node` (recorded as blocked if it does)."""
        if not node.do_not_disrupt:
            return False
        shown = ", ".join(node.holders[:3]) or "the Node"
        self.blocked.append(Blocked(node=node.name, reason=reason, cause=Cause.DO_NOT_DISRUPT, saving=saving, message=f"do-not-disrupt holds it: {shown}"))
        return True


def _replace_drifted(s: _Planning) -> None:
    """1. Drift: replaced like for like."""
    for node in s.nodes:
        if not node.drifted:
            continue
        s.touched.add(node.name)
        if s.held(node, DisruptionReason.DRIFTED):
            continue
        if why := s.budget_refusal(DisruptionReason.DRIFTED):
            s.blocked.append(Blocked(node=node.name, reason=DisruptionReason.DRIFTED, cause=Cause.BUDGET, message=why))
            continue
        s.actions.append(
            Action(
                node=node.name,
                kind=ActionKind.REPLACE,
                reason=DisruptionReason.DRIFTED,
                hourly_price=node.hourly_price or Decimal(0),
                message="its class or pool changed what made it: replaced by a new node, Ready before it drains",
            )
        )


def _remove_underutilized(s: _Planning) -> None:
    """2. Underutilized: remove nodes whose pods fit on the free GPUs of the nodes that stay.
    A node still inside its own `after` window takes no pods (Karpenter's consolidateAfter: a
    node that changed lately is not a destination either): they would move onto a node that
    may itself go, or whose pods have not settled."""
    if s.policy is None or not s.removes_underutilized:
        return
    free = {n.name: n.free for n in s.nodes if n.name not in s.touched and n.running_for >= s.policy.after}
    candidates = sorted((n for n in s.nodes if n.name not in s.touched and n.pods and not n.nominated), key=lambda n: (n.used, -(n.hourly_price or 0), n.name))
    for node in candidates:
        if node.name in s.receivers:
            continue  # took pods of a removed node: it stays, so no pod moves twice
        if node.hourly_price is None:
            continue  # reported by the re-shop, as it cannot price it either
        moves = _place(node, free, s.removed | {node.name})
        if moves is None:
            continue  # its pods fit nowhere else: not underutilized
        if s.held(node, DisruptionReason.UNDERUTILIZED, node.hourly_price):
            continue
        if hold := _removal_hold(s, s.policy, node, node.hourly_price):
            s.blocked.append(hold)
            continue
        for pod, target in moves.items():
            free[target] -= node.pods[pod]
            s.receivers.add(target)
        s.removed.add(node.name)
        free.pop(node.name, None)
        targets = sorted(set(moves.values()))
        s.actions.append(
            Action(
                node=node.name,
                kind=ActionKind.REMOVE,
                reason=DisruptionReason.UNDERUTILIZED,
                hourly_price=node.hourly_price,
                saving=node.hourly_price,
                moves=moves,
                message=f"its {len(node.pods)} pod(s) fit on the free GPUs of {', '.join(targets)}: removing it saves ${node.hourly_price}/h",
            )
        )


def _removal_hold(s: _Planning, policy: Consolidation, node: ConsolidationNode, saving: Decimal) -> Blocked | None:
    """What holds back removing `node`, whose pods fit elsewhere: its `after`, minNodes, a budget."""
    reason = DisruptionReason.UNDERUTILIZED
    if node.running_for < policy.after:
        return Blocked(
            node=node.name,
            reason=reason,
            cause=Cause.AFTER,
            saving=saving,
            message=f"its pods fit on other nodes, but it has run {format_duration(node.running_for)}, less than after ({format_duration(policy.after)})",
        )
    if len(s.nodes) - len(s.removed) - 1 < s.min_nodes:  # a drifted node is replaced: it still counts
        return Blocked(node=node.name, reason=reason, cause=Cause.MIN_NODES, saving=saving, message=f"the pool keeps minNodes ({s.min_nodes})")
    if why := s.budget_refusal(reason):
        return Blocked(node=node.name, reason=reason, cause=Cause.BUDGET, saving=saving, message=why)
    return None


def _merge_several(s: _Planning) -> None:
    """3. Several into one: the pods of nodes that stay (and took none) fit one cheaper new node."""
    if s.policy is None or not s.removes_underutilized or s.offers is None:
        return
    verdict = allowed_disruptions(s.budgets, s.now, DisruptionReason.UNDERUTILIZED, s.pool, s.disrupting + len(s.actions))
    most = len(s.nodes) - len(s.removed) + 1 - s.min_nodes  # the new node counts toward minNodes
    decided = s.touched | s.removed | s.receivers  # going, or took pods: not merged
    movable = [n for n in s.nodes if n.name not in decided and n.pods and not n.nominated and not n.do_not_disrupt and n.running_for >= s.policy.after]
    movable.sort(key=lambda n: (n.used, -(n.hourly_price or 0), n.name))
    s.merge = plan_merge(movable, s.offers, s.policy, most if verdict.allowed is None else min(most, verdict.allowed), s.min_gpus)


def _reshop(s: _Planning) -> None:
    """4. Cheaper: re-shop the nodes that stay and took no pods (and that nothing above holds)."""
    held_already = {b.node for b in s.blocked if b.cause is Cause.DO_NOT_DISRUPT}
    for node in s.nodes:
        if node.name in s.touched or node.name in s.removed or node.name in s.receivers or node.name in held_already or node.nominated or node.name in s.merged:
            continue
        _reshop_node(s, node)


def _reshop_node(s: _Planning, node: ConsolidationNode) -> None:
    """Replace `node` by the cheapest offer that holds its pods, or record what holds it back."""
    reason = DisruptionReason.CHEAPER
    best = cheapest_holding(s.offers, max(node.used, s.min_gpus)) if s.offers is not None else None
    if node.hourly_price is None or s.offers is None:
        if s.policy is not None:
            s.blocked.append(Blocked(node=node.name, reason=reason, cause=Cause.NO_PRICE, message="its price or the current offers are unknown"))
        return
    verdict = reshop(node.hourly_price, node.running_for, best.hourly_price if best else None, s.policy)
    if s.policy is None:
        if verdict.saving > 0:
            s.blocked.append(Blocked(node=node.name, reason=reason, cause=Cause.OFF, saving=verdict.saving, message="consolidation is off (spec.disruption.consolidation)"))
        return
    if best is None or verdict.saving <= 0:
        return  # nothing cheaper: not a candidate
    if not verdict.replace:
        cheap_enough = verdict.saving >= node.hourly_price * cheaper_by(s.policy)
        cause = Cause.AFTER if cheap_enough else Cause.THRESHOLD
        s.blocked.append(Blocked(node=node.name, reason=reason, cause=cause, saving=verdict.saving, message=verdict.message))
        return
    if s.held(node, reason, verdict.saving):
        return
    if why := s.budget_refusal(reason):
        s.blocked.append(Blocked(node=node.name, reason=reason, cause=Cause.BUDGET, saving=verdict.saving, message=why))
        return
    s.actions.append(
        Action(
            node=node.name,
            kind=ActionKind.REPLACE,
            reason=reason,
            hourly_price=node.hourly_price,
            replacement_price=best.hourly_price,
            replacement_gpus=best.gpu_count,
            saving=verdict.saving,
            message=f"{verdict.message}: replaced by a {best.gpu_count}-GPU node, Ready before it drains",
        )
    )


def _plan_of(s: _Planning) -> ConsolidationPlan:
    """The plan: the actions, the merge, and one line per node held back (the first thing that
    holds it; none for a node an action or the merge takes)."""
    acted = {a.node for a in s.actions} | set(s.merged)
    first: dict[str, Blocked] = {}
    for b in s.blocked:
        if b.node not in acted:
            first.setdefault(b.node, b)
    return ConsolidationPlan(actions=s.actions, merge=s.merge, blocked=list(first.values()))


def _place(node: ConsolidationNode, free: Mapping[str, int], leaving: set[str]) -> dict[str, str] | None:
    """Where each pod of `node` goes on the free GPUs of the nodes not `leaving` (largest pod
    first, first fit by name), or None when one does not fit."""
    room = {name: gpus for name, gpus in sorted(free.items()) if name not in leaving}
    moves: dict[str, str] = {}
    for pod, gpus in sorted(node.pods.items(), key=lambda item: (-item[1], item[0])):
        target = next((name for name, left in room.items() if left >= gpus), None)
        if target is None:
            return None
        room[target] -= gpus
        moves[pod] = target
    return moves


def describe_plan(plan: ConsolidationPlan) -> list[str]:
    """The plan in lines, for `tgp plan` and Events: each action and what it saves, then each
    candidate held back and why."""
    lines = [f"merge    {', '.join(plan.merge.nodes):<24} {DisruptionReason.UNDERUTILIZED.value:<14} saves ${plan.merge.saving}/h  {plan.merge.message}"] if plan.merge else []
    for a in plan.actions:
        lines.append(f"{a.kind.value:<8} {a.node:<24} {a.reason.value:<14} saves ${a.saving}/h  {a.message}")
    for b in plan.blocked:
        lines.append(f"held     {b.node:<24} {b.reason.value:<14} saves ${b.saving}/h  [{b.cause.value}] {b.message}")
    return lines
