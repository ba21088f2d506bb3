"""Several nodes into one (issue 35 item 9; Karpenter's multi-node consolidation): when the pods
of N under-used nodes of a pool fit one new node that costs less than the N together, buy that
node, and once it is Ready drain and terminate the N. Pure, no I/O.

`plan_merge` finds the set (tgp.consolidation calls it after its removals). `Merging` is the
pool's record of the one merge under way, carried out make-before-break by the pool's
replacement step (tgp.replace): the first node of the set leads (the new node is its
replacement), the others follow it (each is told to end, as the lead is, once the new node is
Ready; none is touched before). One merge at a time per pool, as one replacement at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from tgp.capacity import OfferSize, cheapest_holding
from tgp.crds import Consolidation, ConsolidationStatus
from tgp.disruption import DisruptionReason, cheaper_by
from tgp.messages import PoolNode
from tgp.types import NodePhase


class Candidate(Protocol):
    """What a merge reads of a node (tgp.consolidation.ConsolidationNode)."""

    @property
    def name(self) -> str: ...
    @property
    def used(self) -> int: ...
    @property
    def hourly_price(self) -> Decimal | None: ...

# Karpenter's multi-node consolidation looks at 100 candidates at most: it bounds the search
# (each set size tried costs one pass over the offers) whatever the pool's size.
MAX_MERGE = 100


class Merge(BaseModel):
    """A set of nodes whose pods fit one cheaper new node."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    nodes: list[str] = Field(description="The Node names, in the order chosen.")
    gpus: int = Field(description="The GPUs their pods request together: the new node has at least these.")
    hourly_price: Decimal = Field(description="What the nodes cost together, US$/h.")
    replacement_gpus: int
    replacement_price: Decimal = Field(description="The new node's offer, US$/h: the most it may cost.")

    @property
    def saving(self) -> Decimal:
        return self.hourly_price - self.replacement_price

    @property
    def message(self) -> str:
        return f"Consolidating {len(self.nodes)} nodes into 1, saving ${self.saving}/h: {', '.join(self.nodes)} (${self.hourly_price}/h) into a {self.replacement_gpus}-GPU node (${self.replacement_price}/h)"


def plan_merge(candidates: Sequence[Candidate], offers: Sequence[OfferSize], policy: Consolidation, most: int, min_gpus: int = 1) -> Merge | None:
    """The largest set of two or more of `candidates` (in their order, at most `most`) whose pods
    fit one offer (of at least `min_gpus` GPUs) cheaper than the set's nodes together by the
    pool's cheaperBy; None when there is none. Candidates need known prices; a pod's GPUs sit on
    one node, so the pods fit a node with as many GPUs as they request together."""
    chosen = [n for n in candidates if n.hourly_price is not None][: min(most, MAX_MERGE)]
    for size in range(len(chosen), 1, -1):
        group = chosen[:size]
        gpus = sum(n.used for n in group)
        total = sum((n.hourly_price or Decimal(0) for n in group), start=Decimal(0))
        best = cheapest_holding(offers, max(gpus, min_gpus))
        if best is None or total - best.hourly_price <= 0 or total - best.hourly_price < total * cheaper_by(policy):
            continue
        return Merge(nodes=[n.name for n in group], gpus=gpus, hourly_price=total, replacement_gpus=best.gpu_count, replacement_price=best.hourly_price)
    return None


class Merging(BaseModel):
    """The pool's record of the merge under way (carried across continue-as-new)."""

    model_config = ConfigDict(frozen=True)
    nodes: list[str] = Field(description="The workflow ids of the nodes merged, the lead first.")
    gpus: int = Field(description="The fewest GPUs the new node may have.")
    cap: Decimal = Field(description="The most the new node may cost, US$/h.")
    saving: Decimal
    message: str

    @property
    def lead(self) -> str:
        return self.nodes[0]

    @property
    def key(self) -> str:
        """What the lead is replaced for: part of the new node's id (tgp.replace.replacement_name)."""
        return "merge " + hashlib.sha256("|".join(self.nodes).encode()).hexdigest()[:8]


def start_merge(merge: Merge | None, nodes: Mapping[str, PoolNode]) -> Merging | None:
    """The pool's record of `merge` (found by a look) to carry out, or None when one of its nodes
    is no longer a Ready node that nothing else moves (the next look plans again)."""
    if merge is None:
        return None
    by_name = {n.node_name: n for n in nodes.values()}
    members = [by_name.get(name) for name in merge.nodes]
    if any(n is None or n.phase is not NodePhase.READY or n.replaced_by or n.replaces or n.removing is not None or n.disrupt_sent for n in members):
        return None
    return Merging(nodes=[n.workflow_id for n in members if n], gpus=merge.gpus, cap=merge.replacement_price, saving=merge.saving, message=merge.message)


def merge_in_force(merging: Merging | None, nodes: Mapping[str, PoolNode], held: Sequence[str]) -> Merging | None:
    """`merging` while it still has something to do: until every node of it has ended once the
    new node is started; before that, only while all of them are Ready and none drifted, is held
    by do-not-disrupt (`held`: Node names) or is told to go another way (a removal, a
    replacement of its own)."""
    if merging is None:
        return None
    members = [nodes.get(wid) for wid in merging.nodes]
    lead = members[0]
    if lead is not None and lead.replaced_by is not None:
        return merging if any(n is not None and not n.phase.is_final for n in members) else None
    if any(n is None or n.phase is not NodePhase.READY or n.drifted or n.removing is not None or n.replaced_by or n.node_name in held for n in members):
        return None
    return merging


def wants_merge(wid: str, n: PoolNode, merging: Merging | None) -> tuple[str | None, str] | None:
    """What the replacement step reads of node `wid` in a merge not yet started: the lead wants
    its replacement (Underutilized, for the merge's key), the others wait for it (nothing).
    None when `wid` is in no such merge."""
    if merging is None or wid not in merging.nodes or n.replaced_by is not None:
        return None
    return (DisruptionReason.UNDERUTILIZED.value, merging.key) if wid == merging.lead else (None, "")


def replacement_size(old: PoolNode, size: int | None, cap: Decimal | None, merging: Merging | None) -> tuple[int, Decimal | None]:
    """The fewest GPUs and the highest price of `old`'s replacement: a merge's new node holds the
    pods of all its nodes for at most its offer's price; else `old`'s size (`size`, as the bridge
    reports it) and `cap` (the re-shop's)."""
    if merging is not None and old.workflow_id == merging.lead:
        return merging.gpus, merging.cap
    return size or old.gpus or 1, cap


def followers(merging: Merging | None, lead: str, new: str) -> dict[str, dict[str, object]]:
    """The records of the other nodes of the merge `lead` leads, once its new node `new` is
    started: they are replaced by it too, and told to end when it is Ready."""
    if merging is None or lead != merging.lead:
        return {}
    return {wid: {"replaced_by": new, "disrupt_sent": False, "replace_reason": DisruptionReason.UNDERUTILIZED.value} for wid in merging.nodes[1:]}


def saving_made(old: PoolNode, reason: str, new: PoolNode | None, merging: Merging | None) -> tuple[str, Decimal] | None:
    """What telling `old` to end (its replacement `new` is Ready) saves, and what to name: a
    re-shop the price difference, a merge (counted once, at its lead) what it found; None else."""
    if merging is not None and old.workflow_id in merging.nodes:
        return (f"{len(merging.nodes)} nodes into {new.node_name if new else 'one'}", merging.saving) if old.workflow_id == merging.lead else None
    if reason == DisruptionReason.CHEAPER.value and old.hourly_price is not None and new is not None and new.hourly_price is not None:
        return old.node_name, old.hourly_price - new.hourly_price
    return None


def with_merging(status: ConsolidationStatus | None, merging: Merging | None) -> ConsolidationStatus | None:
    """The pool's status.consolidation, saying which merge is under way."""
    if status is None and merging is None:
        return None
    return (status or ConsolidationStatus()).model_copy(update={"consolidating": merging.message if merging else ""})
