"""The pool's decisions, pure (issue 34 item 6): what to start for the demand, which nodes carry
the floor, what the budgets answer, what the pool's conditions say. No I/O: the pool workflow
(workflows/pool/) applies the answers and talks to the world through activities.

Replacement and consolidation choices are in `tgp.pool_disruption`; demand by fit itself (which
pods the nodes hold, which new nodes the rest need) is `tgp.capacity`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from tgp.capacity import CapacityNode, NewNode
from tgp.conditions import quoted
from tgp.crds import DisruptionBudget, GPUNodePoolSpec
from tgp.disruption import DisruptionReason, allowed_disruptions
from tgp.messages import DisruptionAnswer, NodeStart, ObjectRef, OfferCheck, PoolNode
from tgp.pools import node_timeouts
from tgp.types import NodePhase, OfferRequirements, TemplateUpdate, TimeoutsUpdate

LAUNCHING = frozenset({NodePhase.PENDING, NodePhase.LAUNCHING, NodePhase.JOINING})
# Nodes whose settings still matter (later phases are on their way out).
TUNABLE = LAUNCHING | {NodePhase.READY}
# Pods named in a message (the rest are counted).
MAX_PODS_NAMED = 5
# After a node fails to come up, wait before launching again; doubles per failure.
LAUNCH_BACKOFF = timedelta(seconds=30)
MAX_LAUNCH_BACKOFF = timedelta(minutes=15)

# A condition as the pool wants it: (status, reason, message).
Wanted = tuple[str, str, str]


class Note(NamedTuple):
    """An Event the pool is to write about itself, or (`pod`, a pod key) about one of its pending
    pods, where `kubectl describe pod` shows it."""

    type: str
    reason: str
    message: str
    pod: str = ""


def pod_ref(pod: str) -> ObjectRef:
    """A pending pod (key namespace/name) as an Event's object; its uid is read when written."""
    namespace, name = pod.split("/", 1)
    return ObjectRef(kind="Pod", name=name, namespace=namespace)


class ClassRefusal(BaseModel):
    """The class ledger refused this pool's launches: why, and what would make it ask again."""

    model_config = ConfigDict(extra="forbid")
    reason: str
    until: datetime
    generation: int | None = None
    node_class: str = Field("", description="The class spec as it was (JSON): a changed class is asked again at once.")
    nodes_ended: int = 0

    def holds(self, now: datetime, generation: int | None, node_class: str, nodes_ended: int) -> bool:
        """Nothing that could change the class's answer happened (the pool's generation, the
        class spec, a node of the pool ending) and its back-off has not passed."""
        return now < self.until and self.generation == generation and self.node_class == node_class and self.nodes_ended == nodes_ended

    def asks_again(self) -> str:
        """When the pool asks the class again, for its condition's message."""
        return f"asking the class again when a node of the pool ends, the pool or class changes, or at {self.until:%H:%M:%S}"


class UnsettledStart(BaseModel):
    """A node start that may or may not have happened: started again, with the same name, until
    it is known to have (or its pods are gone, or the class refuses it)."""

    model_config = ConfigDict(extra="forbid")
    start: NodeStart
    pods: list[str] = []
    error: str = ""


# --- starts -------------------------------------------------------------------------------------


class Launches(BaseModel):
    """What a pass starts: `starts` (the first `floor_missing` of them carry the floor), and the
    pods that wait beyond spec.maxNodes (`waiting`, 0 when none)."""

    model_config = ConfigDict(frozen=True)
    starts: list[NewNode] = []
    floor_missing: int = 0
    waiting: int = 0


def plan_starts(
    new_nodes: Sequence[NewNode], *, live: int, floor_live: int, min_nodes: int, max_nodes: int | None, min_gpus: int, cap: int
) -> Launches:
    """The nodes to start for `new_nodes` (tgp.capacity's plan) and minNodes: minNodes counts
    `live` nodes (nodes bought for pods count toward it, the rest start empty with the class's
    `min_gpus`); spec.maxNodes bounds the live nodes, `cap` one pass's starts."""
    wanted = list(new_nodes)
    wanted += [NewNode(gpus=min_gpus)] * max(0, min_nodes - live - len(wanted))
    room = len(wanted) if max_nodes is None else max(0, max_nodes - live)
    waiting = sum(len(n.pods) for n in wanted[room:])
    return Launches(starts=wanted[: min(room, cap)], floor_missing=max(0, min_nodes - floor_live), waiting=waiting)


def capacity_node(n: PoolNode, free_gpus: Mapping[str, int], demand_at: datetime | None) -> CapacityNode:
    """What demand by fit knows of live node `n`, as of the demand (its pending pods and the free
    GPUs of the Ready nodes are one snapshot of the bridge's). A node on its way out since the
    demand was observed has unknown room: its nominations stay, none is added, and nothing is
    bought for them until a demand observed after it began to leave still lists them (else a
    bridge slow to report buys a node per drained pod). A node Ready since then, which the
    demand's free GPUs do not list yet, had no pod bound as of the demand (none binds before the
    joining taint goes): all its GPUs were free (else every pod the scheduler swapped onto
    another's node meanwhile bought a node again, the room it left behind unknown)."""
    leaving = n.phase not in LAUNCHING and n.phase is not NodePhase.READY
    if leaving and (demand_at is None or demand_at <= n.phase_at):
        return CapacityNode(workflow_id=n.workflow_id, node_name=n.node_name, launching=True, gpus=None)
    ready = n.phase is NodePhase.READY
    free = free_gpus.get(n.node_name)  # not reported by the bridge: unknown
    if ready and free is None and demand_at is not None and demand_at <= n.phase_at:
        free = n.gpus
    return CapacityNode(
        workflow_id=n.workflow_id,
        node_name=n.node_name,
        ready_at=n.phase_at if ready else None,
        launching=n.phase in LAUNCHING,
        free_gpus=free,
        gpus=n.gpus,  # unknown: no new nominations, none voided
    )


def starts_to_abandon(unsettled: Mapping[str, UnsettledStart], demand: Iterable[str], settled: int, min_nodes: int) -> dict[str, str]:
    """Unsettled starts not to start again, with why: all its pods left the demand, or (a
    minNodes start) minNodes is met by the `settled` live nodes."""
    pending = set(demand)
    return {
        wid: "its pods are gone" if us.pods else "minNodes is met"
        for wid, us in sorted(unsettled.items())
        if (us.pods and not pending.intersection(us.pods)) or (not us.pods and settled >= min_nodes)
    }


def launch_backoff(failures: int) -> timedelta:
    """How long launches wait after the `failures`-th launch failure in a row."""
    return min(LAUNCH_BACKOFF * 2 ** (failures - 1), MAX_LAUNCH_BACKOFF)


def launched_why(pods: Sequence[str], gpus: int) -> str:
    """Why a node was launched, for its NodeLaunched Event."""
    if not pods:
        return f"with {gpus} GPU(s) to keep minNodes"
    if len(pods) == 1:
        return f"with {gpus} GPU(s) for pod {pods[0]}"
    more = " and more" if len(pods) > MAX_PODS_NAMED else ""
    return f"with {gpus} GPU(s) for {len(pods)} pods ({', '.join(pods[:MAX_PODS_NAMED])}{more})"


# --- the floor ----------------------------------------------------------------------------------


def floor_changes(live: Sequence[PoolNode], min_nodes: int) -> dict[str, bool]:
    """Which live nodes take or drop the floor so that exactly `min_nodes` of the tunable ones
    carry it (as many as there are). Lowering minNodes releases the dearest floor nodes (they
    idle out like the rest); raising it adopts live nodes first, Ready ones before others."""
    floor = [n for n in live if n.floor and n.phase in TUNABLE]
    if len(floor) > min_nodes:
        drop = sorted(floor, key=lambda n: (-(n.hourly_price or 0), n.created_at, n.workflow_id))[: len(floor) - min_nodes]
        return {n.workflow_id: False for n in drop}
    spare = [n for n in live if not n.floor and n.phase in TUNABLE]
    take = sorted(spare, key=lambda n: (n.phase is not NodePhase.READY, n.created_at, n.workflow_id))[: min_nodes - len(floor)]
    return {n.workflow_id: True for n in take}


# --- budgets ------------------------------------------------------------------------------------


def initialized(nodes: Iterable[PoolNode]) -> int:
    """The pool's nodes a budget's percentage counts: Ready or draining."""
    return sum(1 for n in nodes if n.phase in (NodePhase.READY, NodePhase.DRAINING))


def disrupting(nodes: Mapping[str, PoolNode], granted: Iterable[str], exclude: str = "") -> int:
    """The pool's nodes being disrupted: draining, let go by a budget and not yet draining, or
    Ready with a replacement under way (make-before-break counts from the replacement's start)."""
    draining = {wid for wid, n in nodes.items() if n.phase is NodePhase.DRAINING}
    let_go = {wid for wid in granted if (n := nodes.get(wid)) is not None and n.phase is NodePhase.READY}
    replacing = {wid for wid, n in nodes.items() if n.replaced_by is not None and n.phase is NodePhase.READY}
    return len((draining | let_go | replacing) - {exclude})


def live_grants(granted: Mapping[str, datetime], nodes: Mapping[str, PoolNode], now: datetime, counts_for: timedelta) -> dict[str, datetime]:
    """The grants that still count: until their node reports anything but Ready, at most
    `counts_for` (a node let go whose drain was called off is Ready again and asks anew)."""
    return {
        wid: at
        for wid, at in granted.items()
        if (n := nodes.get(wid)) is not None and n.phase is NodePhase.READY and now - at <= counts_for
    }


class Asked(NamedTuple):
    """The budgets' answer to a node's ask; `grant`: it counts as disrupting from now."""

    answer: DisruptionAnswer
    grant: bool


def answer_ask(
    budgets: Sequence[DisruptionBudget], now: datetime, reason: str, asker: str, nodes: Mapping[str, PoolNode], granted: Iterable[str]
) -> Asked:
    """May node `asker` begin a voluntary disruption for `reason` now: the most restrictive of
    the active budgets that cover it, over the pool's nodes disrupting (the asker left out). A
    reason tgp does not know is not limited."""
    try:
        why = DisruptionReason(reason)
    except ValueError:
        return Asked(DisruptionAnswer(allowed=True, message=f"unknown reason {reason!r}: not limited"), grant=False)
    verdict = allowed_disruptions(budgets, now, why, initialized(nodes.values()), disrupting(nodes, granted, exclude=asker))
    if verdict.permits():
        return Asked(DisruptionAnswer(allowed=True), grant=True)
    return Asked(DisruptionAnswer(allowed=False, message=verdict.message), grant=False)


# --- settings sent to the nodes ------------------------------------------------------------------


def timeouts_for(spec: GPUNodePoolSpec, *, floor: bool, held: bool, bind_grace: timedelta, unlimited: Sequence[str]) -> TimeoutsUpdate:
    """A node's disruption settings: the pool's, whether it holds nominated pods' place (bind
    grace) or not (it idles out as usual once its pods left), its terminationGracePeriod, and
    the reasons no budget of the pool can refuse (sent only when there are some)."""
    wanted = node_timeouts(spec, floor=floor).model_copy(update={"hold": bind_grace if held else timedelta(0)})
    grace = spec.disruption.termination_grace_period
    if grace is not None:
        wanted = wanted.model_copy(update={"termination_grace": grace})
    if unlimited:
        wanted = wanted.model_copy(update={"unlimited_reasons": list(unlimited)})
    return wanted


def settings_fingerprint(timeouts: TimeoutsUpdate) -> str:
    """The settings as sent to a node (JSON it reads back), compared on each pass: a change
    sends them again. The optional parts are left out when unset: most pools have none."""
    optional = {"hold", "termination_grace", "unlimited_reasons"}
    return timeouts.model_dump_json(exclude={k for k in optional if getattr(timeouts, k) is None} or None)


def template_of(spec: GPUNodePoolSpec) -> TemplateUpdate:
    """The labels and taints the pool's template puts on its Nodes."""
    return TemplateUpdate(labels=dict(spec.template.metadata.labels), taints=list(spec.template.spec.taints))


def template_fingerprint(template: TemplateUpdate) -> str:
    """A short hash of the labels and taints a node was sent: the pool keeps one per node, and
    64 labels and 32 taints as JSON per node would swell its state at a few hundred nodes."""
    return hashlib.sha256(template.model_dump_json().encode()).hexdigest()[:16]


def hold_ended(n: PoolNode, bound_gpus: Mapping[str, Sequence[int]]) -> PoolNode | None:
    """`n` as the pool records it once the node ended its bind-grace hold itself, or None when
    it has not. A node started with `hold_ends_when_busy` ends the hold at the first pod the
    bridge shows bound on it (the bridge lists bound pods only on Ready Nodes): its settings as
    sent then have no hold, and the pool sends nothing when its pods' nominations end."""
    if not (n.hold_ends_when_busy and bound_gpus.get(n.node_name)):
        return None
    sent = TimeoutsUpdate.model_validate_json(n.timeouts_sent) if n.timeouts_sent else None
    dropped = settings_fingerprint(sent.model_copy(update={"hold": timedelta(0)})) if sent is not None and sent.hold else n.timeouts_sent
    return n.model_copy(update={"hold_ends_when_busy": False, "timeouts_sent": dropped})


# --- conditions ---------------------------------------------------------------------------------


def named(pods: Sequence[str]) -> str:
    """Pods by name, the first MAX_PODS_NAMED of them."""
    return ", ".join(pods[:MAX_PODS_NAMED]) + (f" and {len(pods) - MAX_PODS_NAMED} more" if len(pods) > MAX_PODS_NAMED else "")


def offers_available(oc: OfferCheck, req: OfferRequirements) -> Wanted:
    """The OffersAvailable condition from the pool's last offer check."""
    unreachable = "".join(f"; offers of {name} could not be listed" for name in sorted(oc.failed))
    if oc.matching:
        return ("True", "OffersFound", f"{oc.matching} matching offers from ${oc.cheapest}/h{unreachable}")
    if oc.cheapest_any_price is not None and req.max_hourly_price is not None:
        return (
            "False",
            "PriceTooLow",
            f"spec.maxHourlyPrice ${req.max_hourly_price}/h is below every matching offer; the cheapest is "
            f"${oc.cheapest_any_price}/h ({oc.cheapest_description}): raise maxHourlyPrice or relax the requirements",
        )
    lists = {"GPU types": req.gpu_types, "regions": req.regions, "providers": req.providers}
    wants = "; ".join(f"{what} [{quoted(values)}]" for what, values in lists.items() if values)
    wants += f"{'; ' if wants else ''}{req.min_gpu_count}+ GPUs{', spot allowed' if req.allow_spot else ''}"
    return ("False", "NoMatchingOffers", f"no offer matches {wants}: check the GPU types, regions and providers of the pool and class{unreachable}")


_UNFIT = (
    "stayed pending on the Ready node bought for it, which had room for its GPUs: it asks for something the pool's nodes do not "
    "have (memory, CPU, a volume's zone, anti-affinity...); no more nodes are bought for it until it changes or the pool does"
)


def unfit_notes(pods: Sequence[str]) -> list[Note]:
    """The PodDoesNotFit Warnings, on the pool and on each pod (once: an unfit pod stays so)."""
    return [note for pod in pods for note in (Note("Warning", "PodDoesNotFit", f"pod {pod} {_UNFIT}"), Note("Warning", "PodDoesNotFit", _UNFIT, pod))]


def no_offer_fits_notes(pods: Sequence[str], pod_gpus: Mapping[str, int], largest: int) -> list[Note]:
    """The NoOfferFits Warnings, on the pool and on each pod (once per pod while it stays unfittable)."""
    notes = []
    for pod in pods:
        why = f"asks for {pod_gpus.get(pod, 1)} nvidia.com/gpu; the largest offer matching the pool has {largest}: no node is bought for it"
        notes += [Note("Warning", "NoOfferFits", f"pod {pod} {why} (the pool's other pods are served)"), Note("Warning", "NoOfferFits", why, pod)]
    return notes


def pods_fit(unfit: Sequence[str], too_big: Sequence[str], unsold: Mapping[str, int] | None = None) -> Wanted:
    """The PodsFit condition: pods that did not fit the nodes bought for them, or any offer, or
    that ask for GPU resources tgp does not sell (`unsold`: resource -> pods, from the bridge)."""
    if unfit:
        return ("False", "PodDoesNotFit", f"{named(unfit)} stayed pending on nodes bought for them; see the pods' Events for what does not fit")
    if too_big:
        return ("False", "NoOfferFits", f"{named(too_big)} ask(s) for more GPUs than any offer of the pool has; see the pods' Events")
    if unsold:
        asked = quoted([f"{resource} ({count} pod(s))" for resource, count in unsold.items()])
        return ("False", "GPUResourceNotSold", f"pending pods ask for GPU resources tgp does not sell: {asked}; tgp buys nodes with nvidia.com/gpu only (see the pods' Events)")
    return ("True", "AllPodsFit", "")


def pods_tracked(untracked: int, limit: int) -> Wanted:
    """The PodsTracked condition: pending pods beyond the `limit` the pool plans for at a time."""
    if untracked:
        return ("False", "TooManyPending", f"{untracked} pending pod(s) wait beyond the {limit} the pool plans for at a time (oldest first): planned as those bind or go")
    return ("True", "AllPodsTracked", "")


def max_nodes_reached(waiting: int, live: Sequence[PoolNode], max_nodes: int | None) -> Wanted:
    """The BudgetAvailable condition of a pool whose `waiting` pending pods its spec.maxNodes
    keeps from a node: counting every live node, the ones starting too (the pass that started
    one says so)."""
    starting = sum(1 for n in live if n.phase in (NodePhase.PENDING, NodePhase.LAUNCHING, NodePhase.JOINING))
    has = f"{len(live)} node(s)" + (f" ({starting} starting)" if starting else "")
    message = f"{waiting} pending pod(s) wait for a node: the pool has {has} and its spec.maxNodes is {max_nodes}; raise maxNodes, or they run when a node frees up"
    return ("False", "MaxNodesReached", message)


def instances_released(live: Iterable[PoolNode]) -> Wanted:
    """The InstancesReleased condition: nodes still billing while tgp retries termination."""
    stuck = [n for n in live if n.phase is NodePhase.TERMINATION_STUCK]
    if not stuck:
        return ("True", "Released", "")
    detail = "; ".join(f"{n.node_name}: {n.reason}" for n in stuck)
    return ("False", "TerminationStuck", f"{len(stuck)} node(s) still billing while tgp retries termination: {detail}")


def ready(wanted: Mapping[str, Wanted], *, ok: bool, ready_nodes: int, live: int, failures: int, backoff_until: datetime | None, now: datetime, at_max_nodes: bool) -> Wanted:
    """The Ready condition: the first failing condition, else how many nodes are Ready (and
    whether launches back off or the pool is at its spec.maxNodes, which keeps it Ready)."""
    if not ok:
        return ("False", "NotReady", next(f"{t}: {m}" for t, (s, _, m) in wanted.items() if s != "True"))
    backing_off = backoff_until is not None and now < backoff_until
    message = f"{ready_nodes}/{live} nodes ready"
    if backing_off:
        message += f"; {failures} launch failure(s), next launch after {backoff_until:%H:%M:%S}"
    if at_max_nodes:
        message += "; at spec.maxNodes (see BudgetAvailable)"
    return ("True", "Ready" if not backing_off else "LaunchBackoff", message)
