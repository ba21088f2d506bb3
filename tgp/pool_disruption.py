"""The pool's voluntary disruption choices, pure (issue 34 item 6): which Ready nodes drifted or
are worth a re-shop, which may have a replacement started (make-before-break: tgp.replace takes
the steps), and which underutilized nodes consolidation tells to go. No I/O: the pool workflow
(workflows/pool/) applies the answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from decimal import Decimal

from pydantic import BaseModel, ConfigDict

from tgp.capacity import Nomination, OfferSize
from tgp.consolidation import Action, ActionKind, PoolMember
from tgp.crds import Consolidation, GPUNodeClassSpec, GPUNodePoolSpec
from tgp.disruption import DisruptionReason, allowed_disruptions, cheaper_by, reshop
from tgp.drift import NodeFacts, drift_hash, drifted, requirements_digest, unmet_requirements
from tgp.merge import Merging, wants_merge
from tgp.messages import PoolNode
from tgp.pool_plan import Note
from tgp.replace import Slot, first_candidate, in_progress
from tgp.types import LABEL_GPU_TYPE, LABEL_REGION, NodePhase


def node_size(n: PoolNode, free_gpus: Mapping[str, int], bound_gpus: Mapping[str, Sequence[int]]) -> int | None:
    """The GPUs `n` has, as the bridge reports its Node (free + bound to its pods), at least what
    it was bought for; None while the bridge has not reported it (a node adopted after the pool
    lost its state knows no size: sized by its request, an 8-GPU node would be re-shopped to a
    1-GPU offer)."""
    if n.node_name not in free_gpus:
        return None
    return max(free_gpus[n.node_name] + sum(bound_gpus.get(n.node_name, [])), n.gpus or 1)


def best_price(size: int | None, sizes: Iterable[OfferSize] | None) -> Decimal | None:
    """The cheapest current offer with at least `size` GPUs: a node of that size's pods fit on
    it. None when there is none, or the size or the offers are not known."""
    if sizes is None or size is None:
        return None
    return min((s.hourly_price for s in sizes if s.gpu_count >= size), default=None)


class Marks(BaseModel):
    """What a look at the Ready nodes found: changes to the pool's records, and Events."""

    model_config = ConfigDict(frozen=True)
    updates: dict[str, dict[str, object]] = {}
    notes: list[Note] = []


class Fleet(BaseModel):
    """What the replacement choices read besides the nodes: the bridge's view and the offers."""

    model_config = ConfigDict(frozen=True)
    free_gpus: dict[str, int] = {}
    bound_gpus: dict[str, list[int]] = {}
    held_nodes: list[str] = []
    sizes: list[OfferSize] | None = None

    def size(self, n: PoolNode) -> int | None:
        """`node_size` of `n` as the bridge reports it."""
        return node_size(n, self.free_gpus, self.bound_gpus)

    def best(self, n: PoolNode) -> Decimal | None:
        """`best_price` for `n`'s size."""
        return best_price(self.size(n), self.sizes)


def replacing(n: PoolNode, nodes: Mapping[str, PoolNode]) -> bool:
    """`n` replaces a node that is still alive."""
    old = nodes.get(n.replaces) if n.replaces else None
    return old is not None and not old.phase.is_final


def being_replaced(n: PoolNode, nodes: Mapping[str, PoolNode]) -> bool:
    """`n` has a replacement under way that is still alive."""
    new = nodes.get(n.replaced_by) if n.replaced_by else None
    return new is not None and not new.phase.is_final and not n.phase.is_final


def cheaper_since(n: PoolNode, nodes: Mapping[str, PoolNode], policy: Consolidation | None, best: Decimal | None, now: datetime) -> datetime | None:
    """Since when an offer cheaper by the pool's cheaperBy fits `n` (None: none does, or
    consolidation is off, or `n` is itself a replacement whose old node lives)."""
    if policy is None or n.hourly_price is None or n.hourly_price <= 0 or (n.replaces is not None and replacing(n, nodes)):
        return None
    if best is None or n.hourly_price - best < n.hourly_price * cheaper_by(policy):
        return None
    return n.cheaper_since or now


def node_facts(n: PoolNode, fleet: Fleet) -> NodeFacts:
    """What drift compares of `n`: the labels its offer gave it, its GPUs (as the bridge reports
    its Node, else what it was bought with) and whether it is spot."""
    labels = {k: v for k, v in ((LABEL_GPU_TYPE, n.gpu_type), (LABEL_REGION, n.region)) if v is not None}
    return NodeFacts(labels=labels, gpus=fleet.size(n) or n.gpus, spot=n.spot)


def drift_of(n: PoolNode, klass: GPUNodeClassSpec, spec: GPUNodePoolSpec, current: str, fleet: Fleet) -> tuple[str, str] | None:
    """Why `n` has drifted, and what it is replaced for (its replacement's key); None when it
    has not: the hash of what cannot be compared differs, or it no longer meets the
    requirements (tgp.drift)."""
    if drifted(n.drift_hash, current):
        return f"its class or pool changed what made it (hash {n.drift_hash}, now {current})", current
    unmet = unmet_requirements(node_facts(n, fleet), klass, spec)
    if unmet:
        return f"it no longer meets its pool's and class's requirements: {'; '.join(unmet)}", f"{current}+{requirements_digest(klass, spec)}"
    return None


def mark_replacements(
    nodes: Mapping[str, PoolNode], klass: GPUNodeClassSpec, spec: GPUNodePoolSpec, fleet: Fleet, now: datetime
) -> Marks:
    """Which Ready nodes should be replaced, and why: Drifted (`drift_of`: a NodeDrifted Event,
    once), else Cheaper (consolidation on, an offer that fits them cheaper by cheaperBy for
    `after`)."""
    updates: dict[str, dict[str, object]] = {}
    notes: list[Note] = []
    hashes: dict[str | None, str] = {}
    policy = spec.disruption.consolidation_policy
    for wid in sorted(nodes):
        n = nodes[wid]
        if n.phase is not NodePhase.READY:
            continue
        update: dict[str, object] = {}
        if n.provider not in hashes:  # once a provider a pass (~30 us each)
            hashes[n.provider] = drift_hash(klass, spec, n.provider)
        current = hashes[n.provider]
        drift = drift_of(n, klass, spec, current, fleet)
        is_drifted = drift is not None
        update["drifted"] = is_drifted
        if drift is not None and not n.drifted:
            notes.append(
                Note("Normal", "NodeDrifted", f"node {n.node_name} has drifted: {drift[0]}; it is replaced make-before-break within the disruption budget")
            )
        reason, key = "", ""
        if drift is not None:
            reason, key = DisruptionReason.DRIFTED.value, drift[1]
        else:
            since = cheaper_since(n, nodes, policy, fleet.best(n), now)
            update["cheaper_since"] = since
            if since is not None and policy is not None and n.hourly_price is not None:
                verdict = reshop(n.hourly_price, now - since, fleet.best(n), policy)
                if verdict.replace:
                    cap = (n.hourly_price * (1 - cheaper_by(policy))).quantize(Decimal("0.0001"))
                    reason, key = DisruptionReason.CHEAPER.value, f"under {cap}"
                    if n.replace_reason != reason:
                        notes.append(Note("Normal", "CheaperOfferFound", f"node {n.node_name}: {verdict.message}; it is replaced make-before-break"))
        if n.replaced_by is None:
            update.update({"replace_reason": reason, "replace_key": key})
        update = {k: v for k, v in update.items() if getattr(n, k) != v}
        if update:
            updates[wid] = update
    return Marks(updates=updates, notes=notes)


def held_from_replacement(n: PoolNode, held_nodes: Iterable[str]) -> bool:
    """A Ready node that wants a replacement not yet bought, which a do-not-disrupt pod or the
    Node's annotation holds (the bridge's demand): no replacement is bought while it lasts."""
    return bool(n.replace_reason) and n.replaced_by is None and n.phase is NodePhase.READY and n.node_name in held_nodes


def replacement_slots(nodes: Mapping[str, PoolNode], held_nodes: Iterable[str], now: datetime, merging: Merging | None = None) -> dict[str, Slot]:
    """The pool's nodes as tgp.replace reads them. A node consolidation told to go wants no
    replacement, nor one do-not-disrupt holds, nor one whose last replacement failed lately. The
    lead of a merge not yet started wants the merge's new node; the others of it, nothing yet."""
    held = set(held_nodes)

    def want(n: PoolNode) -> tuple[str | None, str]:
        if n.removing is not None or (n.replace_after is not None and now < n.replace_after) or held_from_replacement(n, held):
            return None, n.replace_key
        return wants_merge(n.workflow_id, n, merging) or (n.replace_reason or None, n.replace_key)

    def slot(wid: str, n: PoolNode) -> Slot:
        wanted, key = want(n)
        return Slot(
            workflow_id=wid, node_name=n.node_name, phase=n.phase, want=wanted, key=key, replaced_by=n.replaced_by, disrupt_sent=n.disrupt_sent, attempts=n.replace_attempts
        )

    return {wid: slot(wid, n) for wid, n in nodes.items()}


def next_candidate(slots: Mapping[str, Slot]) -> str | None:
    """The node a replacement may start for this pass: none while one is under way."""
    return None if in_progress(slots) else first_candidate(slots)


def past_max_nodes(slots: Mapping[str, Slot], live: int, max_nodes: int | None) -> str | None:
    """Why the next replacement may not start under spec.maxNodes (the old node bills beside it
    until it is Ready), or None when it fits or there is none."""
    candidate = next_candidate(slots)
    if candidate is None or max_nodes is None or live < max_nodes:
        return None
    return (
        f"{slots[candidate].want}: its replacement would be node {live + 1} of spec.maxNodes {max_nodes} "
        "(make-before-break buys it before the old node goes); raise maxNodes by one to let it through"
    )


def may_replace(
    slots: Mapping[str, Slot], live: int, spec: GPUNodePoolSpec, now: datetime, disrupting: tuple[int, int], merging: Merging | None
) -> tuple[str | None, str]:
    """The node the next replacement is for, and why it may not start now ('' when it may):
    under spec.maxNodes beside every live node (the old node bills until its replacement is
    Ready), and within the budgets (it counts as disrupting from its start; a merge's lead
    counts its whole set). `disrupting`: the pool's initialized nodes and those disrupting."""
    candidate = next_candidate(slots)
    if candidate is None:
        return None, ""
    too_many = past_max_nodes(slots, live, spec.max_nodes)
    if too_many is not None:
        return candidate, too_many
    reason = DisruptionReason(slots[candidate].want or DisruptionReason.DRIFTED.value)
    verdict = allowed_disruptions(spec.disruption.budgets, now, reason, *disrupting)
    return candidate, "" if verdict.permits(len(merging.nodes) if merging and candidate == merging.lead else 1) else verdict.message


def called_off(old: PoolNode, now: datetime, wait: timedelta) -> dict[str, object]:
    """The record of a node whose re-shop (or removal) do-not-disrupt called off: no replacement
    under way, not re-shopped again for `wait`; the evicted replacement's name is spent."""
    return {
        "replaced_by": None,
        "disrupt_sent": False,
        "held": "",
        "cheaper_since": None,
        "replace_reason": "",
        "replace_key": "",
        "replace_after": now + wait,
        "removing": None,
        "replace_attempts": old.replace_attempts + (1 if old.replaced_by else 0),
    }


def replacement_cap(old: PoolNode, offer: Decimal | None) -> Decimal | None:
    """The most a replacement of `old` may cost per hour: `offer`, else the re-shop's cap its
    key names (`under <price>`), else none."""
    if offer is not None:
        return offer
    return Decimal(old.replace_key.removeprefix("under ")) if old.replace_key.startswith("under ") else None


# --- consolidation ----------------------------------------------------------------------------


def leaving(n: PoolNode) -> bool:
    """A Ready node on its way out: told to end by consolidation, or being replaced."""
    return n.removing is not None or n.disrupt_sent or n.replaced_by is not None


def consolidation_view(
    live: Iterable[PoolNode], nominations: Mapping[str, Nomination], demand: Iterable[str], pod_gpus: Mapping[str, int], now: datetime
) -> tuple[list[PoolMember], dict[str, dict[str, int]]]:
    """The Ready nodes a consolidation look plans over, and per node the pending pods nominated
    to its free GPUs (they will bind there) with their GPUs."""
    pending = set(demand)
    nominated: dict[str, dict[str, int]] = {}
    for pod, nom in sorted(nominations.items()):
        if not nom.bought and pod in pending:
            nominated.setdefault(nom.workflow_id, {})[pod] = pod_gpus.get(pod, 1)
    members = [
        PoolMember(name=n.node_name, workflow_id=n.workflow_id, hourly_price=n.hourly_price, running_for=now - n.phase_at, leaving=leaving(n))
        for n in live
        if n.phase is NodePhase.READY
    ]
    return members, nominated


def removals(actions: Iterable[Action], nodes: Iterable[PoolNode], now: datetime) -> list[tuple[PoolNode, Action]]:
    """The plan's removals to carry out now: Ready nodes not already told to go, not drifted or
    cheaper (the replacement step's), not replacing or replaced, nor called off lately."""
    by_name = {n.node_name: n for n in nodes}
    chosen = []
    for action in actions:
        n = by_name.get(action.node)
        if action.kind is not ActionKind.REMOVE or n is None or n.phase is not NodePhase.READY:
            continue
        if n.removing is not None or n.replace_reason or n.replaced_by or n.replaces or n.disrupt_sent:
            continue
        if n.replace_after is not None and now < n.replace_after:
            continue
        chosen.append((n, action))
    return chosen
