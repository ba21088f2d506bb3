"""The pure rules of disruption (issue 21): why a node may go, what limits it, and whether a
cheaper offer is worth a replacement. No I/O; the node and pool workflows call these.

* **Budgets** (`allowed_disruptions`): Karpenter's. A budget's `nodes` is a count or a
  percentage of the pool's nodes, rounded up; a budget with a schedule is active in
  [each fire, fire + duration); a budget with no `reasons` covers every voluntary reason; of the
  active budgets that cover a reason the most restrictive wins; nodes already disrupting count
  against it. A manual evict, an interruption and a lost node are never limited.
* **do-not-disrupt** (`do_not_disrupt`, `pod_holds_node`, `blocks`): `tgp.io/do-not-disrupt:
  "true"` or Karpenter's `karpenter.sh/do-not-disrupt: "true"` (or a duration, `holds`) on a
  running pod or on a Node stops voluntary reasons; a manual evict, an interruption, a lost node
  and a repair go ahead. A value read otherwise than Karpenter reads it is told to the pod
  (`do_not_disrupt_problem`).
* **terminationGracePeriod** (`termination_deadline`, `pod_delete_at`): the longest a node may
  take to leave once its disruption began, over PDBs and do-not-disrupt.
* **Re-shopping** (`reshop`): replace a node when the best current offer that fits its pods is
  at least `cheaperBy` cheaper and the node has run at least `after`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from tgp.cron import CronSchedule
from tgp.crds import Consolidation, DisruptionBudget, format_duration


class DisruptionReason(StrEnum):
    """Why a node is being taken away. The first five are voluntary: budgets and do-not-disrupt
    limit them, and they are the names a budget's `reasons` lists."""

    EMPTY = "Empty"  # idle past idleTimeout
    EXPIRED = "Expired"  # older than expireAfter
    DRIFTED = "Drifted"  # its class or pool changed what made it
    UNDERUTILIZED = "Underutilized"  # its pods fit on fewer nodes
    CHEAPER = "Cheaper"  # a re-shop: a cheaper offer fits its pods
    REPAIR = "Repair"  # GPUs gone or NotReady too long: budgeted, never held by do-not-disrupt
    EVICTED = "Evicted"  # a manual evict: never limited
    INTERRUPTED = "Interrupted"  # the provider took it: never limited
    LOST = "Lost"  # the Node or the instance is gone: never limited


VOLUNTARY = frozenset(
    {DisruptionReason.EMPTY, DisruptionReason.EXPIRED, DisruptionReason.DRIFTED, DisruptionReason.UNDERUTILIZED, DisruptionReason.CHEAPER}
)
# Reasons a budget limits: the voluntary ones, and a repair (counted by budgets that name no
# reasons, as Karpenter's reason-less budgets cover every method).
BUDGETED = VOLUNTARY | {DisruptionReason.REPAIR}

DO_NOT_DISRUPT_ANNOTATIONS = ("tgp.io/do-not-disrupt", "karpenter.sh/do-not-disrupt")


# --- budgets --------------------------------------------------------------------------------


def budget_nodes(budget: DisruptionBudget, pool_nodes: int) -> int:
    """The most nodes `budget` lets be disrupting at once in a pool of `pool_nodes`: a count, or
    a percentage rounded up (10% of 3 nodes is 1; as Kubernetes rounds a PDB's maxUnavailable)."""
    if budget.nodes.endswith("%"):
        percent = int(budget.nodes[:-1])
        return -(-pool_nodes * percent // 100)
    return int(budget.nodes)


def budget_active(budget: DisruptionBudget, now: datetime) -> bool:
    """A budget without a schedule is always active; with one, from each time the schedule fires
    (UTC) for `duration`: active at the fire time itself, no longer at fire + duration."""
    if budget.schedule is None or budget.duration is None:
        return True
    return CronSchedule.parse(budget.schedule).fired_between(now - budget.duration, now)


def budget_covers(budget: DisruptionBudget, reason: DisruptionReason) -> bool:
    if reason not in BUDGETED:
        return False
    return budget.reasons is None if reason is DisruptionReason.REPAIR else (budget.reasons is None or reason.value in budget.reasons)


class BudgetVerdict(BaseModel):
    """How many more nodes of the pool may start disrupting for a reason now.

    `allowed` None = no budget limits it. When `allowed` is 0, `blocking` is the index of the
    budget that blocks (the first of the most restrictive) and `message` says why, for the
    `DisruptionBlocked` Event and the pool's status."""

    model_config = ConfigDict(frozen=True)
    allowed: int | None
    blocking: int | None = None
    message: str = ""

    def permits(self, count: int = 1) -> bool:
        return self.allowed is None or count <= self.allowed


def allowed_disruptions(
    budgets: Sequence[DisruptionBudget], now: datetime, reason: DisruptionReason, pool_nodes: int, disrupting: int
) -> BudgetVerdict:
    """How many more of a pool's nodes may begin disrupting for `reason` at `now`.

    `pool_nodes` counts the pool's nodes (Karpenter counts initialized ones, so a replacement
    still booting does not widen a percentage); `disrupting` those already being disrupted, which
    every budget counts against itself. The most restrictive active budget that covers `reason`
    wins; a manual evict, an interruption and a lost node are never limited."""
    best: tuple[int, int, int | None] | None = None  # (allowed, budget index, its limit; None = unreadable)
    for index, budget in enumerate(budgets):
        if not budget_covers(budget, reason):
            continue
        try:
            if not budget_active(budget, now):
                continue
            limit: int | None = budget_nodes(budget, pool_nodes)
        except ValueError:
            limit = None  # a budget that cannot be read (admitted under older rules) fails closed, as Karpenter's does
        allowed = 0 if limit is None else max(0, limit - disrupting)
        if best is None or allowed < best[0]:
            best = (allowed, index, limit)
    if best is None:
        return BudgetVerdict(allowed=None)
    allowed, index, limit = best
    if allowed > 0:
        return BudgetVerdict(allowed=allowed)
    budget = budgets[index]
    if limit is None:
        message = f"{reason.value} disruption blocked by budgets[{index}] ({budget.describe()}): it cannot be read, so it blocks"
    else:
        of = f" ({budget.nodes} of {pool_nodes} nodes)" if budget.nodes.endswith("%") else ""
        message = (
            f"{reason.value} disruption blocked by budgets[{index}] ({budget.describe()}): it allows {limit}{of} "
            f"at once and {disrupting} {'is' if disrupting == 1 else 'are'} disrupting"
        )
    return BudgetVerdict(allowed=0, blocking=index, message=message)


def unlimited_reasons(budgets: Sequence[DisruptionBudget]) -> list[str]:
    """The budgeted reasons a pool's node may begin without asking the pool: all of them when no
    budget can ever refuse (none, or each allows 100% of the pool's nodes, whenever it is
    active), none otherwise. All or nothing: the nodes disrupting for one reason count against
    the budgets of every reason, and a drain the pool was not asked about counts only from its
    Draining report. `allowed_disruptions` then permits every ask of a node the pool counts,
    since the nodes disrupting are among the pool's nodes and the asker is not one of them.
    Sorted, for a stable fingerprint."""

    def never_refuses(budget: DisruptionBudget) -> bool:
        try:
            if budget.schedule is not None:
                CronSchedule.parse(budget.schedule)  # unreadable: `allowed_disruptions` fails closed
            return budget.nodes.endswith("%") and int(budget.nodes[:-1]) >= 100
        except ValueError:
            return False  # unreadable: the pool's answer fails closed, so ask it

    return sorted(r.value for r in BUDGETED) if all(never_refuses(b) for b in budgets) else []


# --- do-not-disrupt -------------------------------------------------------------------------


# A Go duration (time.ParseDuration), as Karpenter reads a do-not-disrupt value that is not "true".
_GO_DURATION = re.compile(r"^(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|µs|ms|s|m|h)(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|µs|ms|s|m|h))*$")


def _positive_duration(value: str) -> bool:
    return _GO_DURATION.match(value) is not None and any(c in "123456789" for c in value)


def holds(value: str | None) -> bool:
    """Whether a do-not-disrupt annotation's value holds: "true", or a positive duration
    (Karpenter's grace period, e.g. "4h": tgp holds for as long as the pod runs, more than that,
    and says so: `do_not_disrupt_problem`)."""
    return value == "true" or (value is not None and _positive_duration(value))


def do_not_disrupt(annotations: Mapping[str, str] | None) -> bool:
    """Whether a pod's or a Node's annotations ask that it not be disrupted
    (`tgp.io/do-not-disrupt` or Karpenter's `karpenter.sh/do-not-disrupt`, `holds`)."""
    return any(holds((annotations or {}).get(key)) for key in DO_NOT_DISRUPT_ANNOTATIONS)


def do_not_disrupt_problem(annotations: Mapping[str, str] | None) -> str | None:
    """What a pod is told (a Warning Event) when tgp reads its do-not-disrupt value otherwise
    than Karpenter would, or not at all; None for "true", "false" and no annotation. Never
    silently: a duration holds for as long as the pod runs (Karpenter: for that long from the
    pod's start); any other value does not hold, as in Karpenter, which ignores it too."""
    for key in DO_NOT_DISRUPT_ANNOTATIONS:
        value = (annotations or {}).get(key)
        if value is None or value in ("true", "false"):
            continue
        shown = repr(value[:40])
        if _positive_duration(value):
            return (
                f"{key}: {shown} holds its node for as long as the pod runs, not only {value} from its start as in Karpenter "
                "(tgp does not time the hold); remove the annotation once the pod may be disrupted"
            )
        return f'{key}: {shown} is neither "true" nor a positive duration (e.g. 4h): it does not hold the node, as in Karpenter'
    return None


def pod_holds_node(annotations: Mapping[str, str] | None, phase: str = "Running", deleting: bool = False) -> bool:
    """Whether a pod holds its node against voluntary disruption: it asks not to be disrupted and
    is still active (not Succeeded or Failed, not being deleted), as Karpenter's IsDisruptable
    reads it. A finished Job pod no longer holds its node."""
    return do_not_disrupt(annotations) and phase not in ("Succeeded", "Failed") and not deleting


def blocks(reason: DisruptionReason) -> bool:
    """Whether a do-not-disrupt pod or Node holds back a disruption for `reason`: the voluntary
    ones, not a manual evict, an interruption, a lost node or a repair."""
    return reason in VOLUNTARY


def held_message(reason: DisruptionReason, holders: Sequence[str], grace: timedelta | None = None, total: int | None = None) -> str:
    """What a node held by do-not-disrupt says (a condition, an Event): which pods or the Node
    hold it, for which reason, and what would end the wait. `total`: how many hold it when
    `holders` names only the first of them (default: as many as it names)."""
    count = max(total or 0, len(holders))
    shown = ", ".join(holders[:3]) + (f" and {count - 3} more" if count > 3 else "")
    why = {
        DisruptionReason.EXPIRED: "is past its expireAfter",
        DisruptionReason.EMPTY: "is idle",
        DisruptionReason.DRIFTED: "has drifted",
        DisruptionReason.UNDERUTILIZED: "is underutilized",
        DisruptionReason.CHEAPER: "has a cheaper offer",
    }.get(reason, f"is to be disrupted ({reason.value})")
    until = (
        f"; terminationGracePeriod ({format_duration(grace)}) ends the wait"
        if grace is not None
        else "; it waits until they finish or the annotation is removed (a manual evict does not wait)"
    )
    return f"node {why} but do-not-disrupt holds it: {shown}{until}"


# --- terminationGracePeriod ------------------------------------------------------------------


def termination_deadline(began: datetime, grace: timedelta | None) -> datetime | None:
    """When a node whose disruption began at `began` is terminated whatever holds it (PDBs,
    do-not-disrupt pods): `began + terminationGracePeriod`; None = no such bound."""
    return None if grace is None else began + grace


# The reasons a terminationGracePeriod makes eventual (Karpenter v1): do-not-disrupt holds a node
# for them at most that long. Expiry has its own bound (tgp.lifecycle.longest_life).
EVENTUAL = frozenset({DisruptionReason.DRIFTED})


def eventual_end(reason: str, since: datetime | None, grace: timedelta | None) -> datetime | None:
    """When a node that do-not-disrupt holds against `reason`, asked to go at `since`, goes
    anyway: `since + terminationGracePeriod` for an eventual reason (drift), as in Karpenter v1
    where a drifted node's pods get the grace period and no more; None: held for as long as the
    pods ask (no grace period, another reason, or not known since when)."""
    if grace is None or since is None or reason not in {r.value for r in EVENTUAL}:
        return None
    return since + grace


def pod_delete_at(deadline: datetime, pod_grace: timedelta, began: datetime) -> datetime:
    """When to delete a pod that still blocks the drain so that it gets its whole
    terminationGracePeriodSeconds before the node's deadline (Karpenter: deadline - the pod's
    grace), never before the disruption began."""
    return max(began, deadline - pod_grace)


# --- re-shopping ----------------------------------------------------------------------------


class ReshopVerdict(BaseModel):
    model_config = ConfigDict(frozen=True)
    replace: bool
    saving: Decimal = Decimal(0)  # US$/h the best offer saves over the node's (0 when none is cheaper)
    message: str = ""


def cheaper_by(policy: Consolidation) -> Decimal:
    """The policy's threshold as a fraction: "20%" -> 0.20."""
    return Decimal(policy.cheaper_by.removesuffix("%")) / 100


def reshop(node_price: Decimal, running_for: timedelta, best_price: Decimal | None, policy: Consolidation | None) -> ReshopVerdict:
    """Whether to replace a node (offer at `node_price` US$/h, Ready for `running_for`) with the
    best current offer that fits its pods (`best_price`; None = none fits). Replace when
    consolidation is on, the node has run at least `after`, and the best offer is cheaper by at
    least `cheaperBy` of the node's price."""
    saving = max(Decimal(0), node_price - best_price) if best_price is not None else Decimal(0)
    if policy is None:
        return ReshopVerdict(replace=False, saving=saving, message="consolidation is off")
    if best_price is None:
        return ReshopVerdict(replace=False, message="no current offer fits the node's pods")
    threshold = cheaper_by(policy)
    if node_price <= 0 or saving < node_price * threshold:
        return ReshopVerdict(
            replace=False, saving=saving, message=f"the best offer (${best_price}/h) is not {policy.cheaper_by} cheaper than ${node_price}/h"
        )
    if running_for < policy.after:
        return ReshopVerdict(
            replace=False,
            saving=saving,
            message=f"${saving}/h cheaper, but the node has run {format_duration(running_for)}, less than after ({format_duration(policy.after)})",
        )
    return ReshopVerdict(
        replace=True, saving=saving, message=f"an offer at ${best_price}/h fits its pods, ${saving}/h less than its ${node_price}/h"
    )
