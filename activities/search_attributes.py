"""The node workflows' search attributes (the Web UI's columns and filters, the fleet look's and
the sweeper's listing): the node workflow upserts them as its life goes on, and the pool's start
gives a new one its first (`start_attributes`)."""

from __future__ import annotations

from typing import Any

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

from tgp.types import NodePhase, NodeRequest, Offer

SA_POOL = SearchAttributeKey.for_keyword("TgpPool")
SA_PHASE = SearchAttributeKey.for_keyword("TgpPhase")
SA_PROVIDER = SearchAttributeKey.for_keyword("TgpProvider")
SA_GPU_TYPE = SearchAttributeKey.for_keyword("TgpGpuType")
SA_HOURLY_PRICE = SearchAttributeKey.for_float("TgpHourlyPrice")
SA_NODE_NAME = SearchAttributeKey.for_keyword("TgpNodeName")
SA_CLASS = SearchAttributeKey.for_keyword("TgpClass")
SA_INSTANCE_ID = SearchAttributeKey.for_keyword("TgpInstanceId")
SA_READY_SINCE = SearchAttributeKey.for_datetime("TgpReadySince")


def start_attributes(request: NodeRequest) -> TypedSearchAttributes:
    """A node's attributes as it starts, as its own upsert of its first phase would set them
    (the node upserts only what differs: none of these). Pending, with the price its pool
    reserved for it: a class ledger that counts its running nodes again (a new run) holds a
    Pending node at that price, which a launch at that price does not settle again. Launching
    when the start chose the first offer (`request.offer`): the offer's provider, GPU type and
    price, as the Launching upsert sets them."""
    offer = request.offer
    pairs = phase_attributes(request, NodePhase.PENDING if offer is None else NodePhase.LAUNCHING, offer)
    if offer is None and request.reserved_price is not None:
        pairs.append((SA_HOURLY_PRICE, float(request.reserved_price)))
    return TypedSearchAttributes([SearchAttributePair(k, v) for k, v in pairs])


def phase_attributes(request: NodeRequest, phase: NodePhase, offer: Offer | None) -> list[tuple[SearchAttributeKey[Any], Any]]:
    """The attributes (key, value) a node's `phase` sets: the phase, its pool, name and class (the
    class ledger finds its live nodes by it), and Launching its `offer`'s provider, GPU type and
    $/h. The pool's start and the node's own upserts both take them from here."""
    pairs: list[tuple[SearchAttributeKey[Any], Any]] = [
        (SA_PHASE, phase.value),
        (SA_POOL, f"{request.namespace}/{request.pool}"),
        (SA_NODE_NAME, request.node_name),
        (SA_CLASS, request.node_class),
    ]
    if phase is NodePhase.LAUNCHING and offer is not None:
        pairs += [(SA_PROVIDER, offer.provider), (SA_GPU_TYPE, offer.gpu_type), (SA_HOURLY_PRICE, float(offer.hourly_price))]
    return pairs
