"""Demand by fit: which pending pods the pool's nodes already hold, which need new nodes (and
how big), and which fit no offer at all. Pure, no I/O.

A pending pod is *nominated* to one node whose free GPUs can take it: a launching node (its
capacity is the GPU count it was bought for), or a Ready node with free GPUs as the bridge reports
them (allocatable minus the requests of the pods bound to it). Nominations are checked against
the facts on every pass and are *void* as soon as they are false:

* the node is gone (ended, draining, forgotten): the pod gets a node again;
* the node is full: the GPUs the bridge reports free no longer hold the pods nominated to it
  (another pod took them; the scheduler does not know about nominations);
* a launching node holds more nominations than its GPUs can take; one
  whose GPU count the pool does not know keeps its nominations and gets no new ones.

A pod still pending `bind_grace` after its node became Ready, the node not full, does not fit
that node for a reason GPUs do not show (memory, a volume's zone, anti-affinity): it is unfit,
reported, and buys nothing more until it changes or the pool does. (A Ready node whose free GPUs
the bridge does not report, its GPUs not registered, is not full: that node is judged too.) A
node holds the place of the pods bought for it for that grace (its idle timeout does not run
before; see `tgp.lifecycle.judge_observation`), so a node that idled out was Ready for the whole
grace: a nomination to it is judged, not voided (else each idle-out would buy again).

Pods no node holds are packed into new nodes like Karpenter's bin packing: largest request
first, first fit into the nodes opened in this pass; a new node is opened with the GPU count
whose offer is cheapest per GPU, and in the end each node is bought at the cheapest offer that
holds its pods, or split into one node per pod when that is cheaper. What is bought never costs
more than one cheapest fitting node per pod. A pod larger than every offer fits nothing: it is
reported (`NoOfferFits`) and never blocks, sizes or delays the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from decimal import Decimal

from pydantic import BaseModel, ConfigDict

# The scheduler binds a fitting pod within seconds of a node turning Ready and getting its
# labels and taints; the NVIDIA device plugin may take a few minutes more to advertise the
# GPUs, and a busy scheduler queue (its backoff grows to 10 s per pod) adds to that.
POD_BIND_GRACE = timedelta(minutes=3)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Nomination(Frozen):
    """Pod -> the node expected to run it, since when. `bought`: the node was bought (or is
    launching) for this pod; otherwise the pod borrows free GPUs of a node already Ready.
    `ready_at`: when its node turned Ready, as last seen (it outlives the node: see below)."""

    workflow_id: str
    since: datetime
    bought: bool = True
    ready_at: datetime | None = None


class CapacityNode(Frozen):
    """What the accounting needs to know of one live node of the pool."""

    workflow_id: str
    node_name: str
    ready_at: datetime | None = None  # None until it is Ready
    launching: bool = False  # choosing an offer, launching or joining: it will take pods
    free_gpus: int | None = 0  # Ready nodes: free GPUs reported by the bridge; None = not reported
    # Launching nodes: the GPUs it was bought with (at least its offer's count); None = unknown
    # (a node the pool rebuilt from its running workflow): its room is unknown, so the
    # nominations it holds are kept and no new one is made to it.
    gpus: int | None = 1


class OfferSize(Frozen):
    """The cheapest matching offer with exactly `gpu_count` GPUs."""

    gpu_count: int
    hourly_price: Decimal


class NewNode(Frozen):
    """A node to buy: at least `gpus` GPUs (the count of the offer it is planned on: asking for
    that many gets the same offer while it lasts, and guarantees the room), for `pods`."""

    gpus: int
    hourly_price: Decimal | None = None
    pods: list[str] = []


class CapacityPlan(Frozen):
    nominations: dict[str, Nomination]
    newly_unfit: list[str] = []
    new_nodes: list[NewNode] = []
    no_offer_fits: list[str] = []  # asks for more GPUs than any offer has
    borrow_failed: list[str] = []  # did not bind on a node it borrowed from: it needs a node of its own
    voided: list[str] = []  # nominations dropped because their node is full or gone

    @property
    def uncovered(self) -> list[str]:
        """Pods waiting for a new node, in buying order."""
        return [pod for node in self.new_nodes for pod in node.pods]


def cheapest_holding(sizes: Iterable[OfferSize], gpus: int) -> OfferSize | None:
    """The cheapest offer with at least `gpus` GPUs (fewer GPUs on a tie), or None."""
    fitting = [s for s in sizes if s.gpu_count >= gpus]
    return min(fitting, key=lambda s: (s.hourly_price, s.gpu_count)) if fitting else None


def note_ready(nominations: Mapping[str, Nomination], nodes: Iterable[CapacityNode]) -> dict[str, Nomination]:
    """`nominations` with the time each one's node turned Ready, as seen now. The pool calls it
    on every pass, also those that plan nothing (offers unknown, class missing): a node that
    idles out before the next planning pass must have left its Ready time behind, or its
    nomination is voided instead of judged and the pod is bought for again."""
    ready = {n.workflow_id: n.ready_at for n in nodes if n.ready_at is not None and not n.launching}
    return {
        pod: nom.model_copy(update={"ready_at": ready[nom.workflow_id]}) if nom.workflow_id in ready else nom
        for pod, nom in nominations.items()
    }


def no_offer_fits_to_warn(warned: Iterable[str], found: Iterable[str], pending: Iterable[str], *, sizes_known: bool) -> tuple[list[str], list[str]]:
    """The pods to warn about now (`NoOfferFits`, once per pod while it stays unfittable) and
    the pods to remember as warned. `found`: the plan's `no_offer_fits`, judged only when the
    offer sizes are known; while they are not, the pods warned about that still pend stay
    remembered (forgetting them would warn again once the sizes are back)."""
    if not sizes_known:
        return [], sorted(set(warned) & set(pending))
    before = set(warned)
    found = list(dict.fromkeys(found))
    return [pod for pod in found if pod not in before], sorted(found)


def plan_capacity(
    pending: Mapping[str, int],
    nodes: list[CapacityNode],
    nominations: Mapping[str, Nomination],
    unfit: set[str],
    now: datetime,
    bind_grace: timedelta = POD_BIND_GRACE,
    no_borrow: set[str] = frozenset(),  # type: ignore[assignment]
    sizes: list[OfferSize] | None = None,
) -> CapacityPlan:
    """Cover `pending` (pod key -> GPUs) with the pool's nodes, then with new nodes sized from
    `sizes` (the cheapest offer per GPU count; None = unknown, every pod needs a node of its own
    with its own GPU count).

    Order: a pod keeps its nomination while it holds; else it is nominated to a launching node
    with room, then to free GPUs of a Ready node, and only then packed into a new node. A pod
    that did not bind on the node bought for it although it had room is unfit; one that did not
    bind where it borrowed GPUs is not: it gets a node of its own."""
    by_id = {n.workflow_id: n for n in nodes}
    kept: dict[str, Nomination] = {}
    newly_unfit: list[str] = []
    borrow_failed: list[str] = []
    voided: list[str] = []
    # Room left on each node for nominations: launching nodes by their GPUs, Ready nodes by
    # what the bridge reports free (unknown: no new nomination, kept ones are not judged yet).
    left: dict[str, int | None] = {}
    for n in nodes:
        if n.launching:
            left[n.workflow_id] = n.gpus
        elif n.ready_at is not None:
            left[n.workflow_id] = n.free_gpus
    for pod, nom in sorted(nominations.items(), key=lambda item: (item[1].since, item[0])):
        if pod not in pending or pod in unfit:
            continue  # bound, deleted or known unfit
        node = by_id.get(nom.workflow_id)
        room = left.get(nom.workflow_id, 0) if node is not None else 0
        if node is not None and node.ready_at is not None and not node.launching:
            nom = nom.model_copy(update={"ready_at": node.ready_at})
            if room is not None and room < pending[pod]:
                voided.append(pod)  # full: another pod took its place
                continue
            if now - max(nom.since, node.ready_at) >= bind_grace:
                (newly_unfit if nom.bought else borrow_failed).append(pod)
                continue
        elif node is not None and node.launching:
            if room is not None and room < pending[pod]:
                voided.append(pod)
                continue
        else:
            # Gone or on its way out. A node holds its nominated pods' place for the grace, so
            # one that idled out while it held the pod was Ready the whole grace (a full one
            # was voided when seen): judge the pod, as if the node were still there.
            judged = nom.ready_at is not None and now - max(nom.since, nom.ready_at) >= bind_grace
            if judged:
                (newly_unfit if nom.bought else borrow_failed).append(pod)
            else:
                voided.append(pod)
            continue
        kept[pod] = nom
        if room is not None:
            left[nom.workflow_id] = room - pending[pod]
    blocked = unfit | set(newly_unfit)
    may_not_borrow = set(no_borrow) | set(borrow_failed)
    largest = max((s.gpu_count for s in sizes), default=0) if sizes is not None else None
    # First fit in workflow-id order, found in near-linear time (see FirstFit).
    launching_fit = FirstFit([w for w in sorted(left) if by_id[w].launching], left)
    ready_fit = FirstFit([w for w in sorted(left) if by_id[w].ready_at is not None and not by_id[w].launching], left)
    waiting: list[str] = []
    no_offer_fits: list[str] = []
    for pod in sorted(pending, key=lambda p: (-pending[p], p)):  # first fit, largest first
        if pod in kept or pod in blocked:
            continue
        gpus = pending[pod]
        if largest is not None and gpus > largest:
            no_offer_fits.append(pod)
            continue
        launching = launching_fit.first(gpus)
        borrowed = None
        if launching is None and pod not in may_not_borrow:
            borrowed = ready_fit.first(gpus)
        target = launching or borrowed
        if target is None:
            waiting.append(pod)
            continue
        left[target] = (left[target] or 0) - gpus
        kept[pod] = Nomination(workflow_id=target, since=now, bought=borrowed is None)
    return CapacityPlan(
        nominations=kept,
        newly_unfit=newly_unfit,
        new_nodes=pack(waiting, pending, sizes),
        no_offer_fits=no_offer_fits,
        borrow_failed=borrow_failed,
        voided=voided,
    )


class FirstFit:
    """The first of `order` whose room in `left` (None counts as none) holds a request: first
    fit, in near-linear time. Room only shrinks, so a node passed over for a request of g GPUs
    never takes one of g again: one cursor per request size moves only forward (the plan of 4,000 pending pods took seconds when every pod
    scanned every node, inside the pool's workflow task)."""

    def __init__(self, order: list[str], left: Mapping[str, int | None]) -> None:
        self.order, self.left = order, left
        self._cursor: dict[int, int] = {}

    def first(self, gpus: int) -> str | None:
        i = self._cursor.get(gpus, 0)
        while i < len(self.order) and (self.left[self.order[i]] or 0) < gpus:
            i += 1
        self._cursor[gpus] = i
        return self.order[i] if i < len(self.order) else None


def pack(pods: list[str], gpus: Mapping[str, int], sizes: list[OfferSize] | None) -> list[NewNode]:
    """New nodes for `pods` (largest first), each pod on exactly one; pods share a node only
    when that node costs no more than their own nodes would. Without `sizes`, one node each.
    Near-linear: first fit by a cursor per request size (as FirstFit), offers looked up once
    per GPU count."""
    if sizes is None:
        return [NewNode(gpus=gpus[p], pods=[p]) for p in pods]
    holding: dict[int, OfferSize | None] = {}

    def cheapest(n: int) -> OfferSize | None:
        if n not in holding:
            holding[n] = cheapest_holding(sizes, n)
        return holding[n]

    opening: dict[int, int] = {}  # request -> the GPU count cheapest per GPU that holds it
    # Open nodes: capacity (the GPU count cheapest per GPU for the first pod), used, pods.
    capacity: list[int] = []
    used: list[int] = []
    members: list[list[str]] = []
    cursor: dict[int, int] = {}
    for pod in pods:
        need = gpus[pod]
        i = cursor.get(need, 0)
        while i < len(capacity) and used[i] + need > capacity[i]:
            i += 1
        cursor[need] = i
        if i == len(capacity):
            if need not in opening:
                fitting = [s for s in sizes if s.gpu_count >= need]
                opening[need] = min(fitting, key=lambda s: (s.hourly_price / s.gpu_count, s.gpu_count)).gpu_count
            capacity.append(opening[need])
            used.append(0)
            members.append([])
        used[i] += need
        members[i].append(pod)
    nodes: list[NewNode] = []
    for total, group in zip(used, members, strict=True):
        shared = cheapest(total)
        alone = [cheapest(gpus[m]) for m in group]
        assert shared is not None and all(a is not None for a in alone)
        if shared.hourly_price <= sum((a.hourly_price for a in alone if a is not None), start=Decimal(0)):
            nodes.append(NewNode(gpus=shared.gpu_count, hourly_price=shared.hourly_price, pods=group))
        else:
            nodes.extend(NewNode(gpus=a.gpu_count, hourly_price=a.hourly_price, pods=[m]) for m, a in zip(group, alone, strict=True) if a is not None)
    return nodes
