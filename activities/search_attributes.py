"""The node workflows' search attributes (the Web UI's columns and filters, the fleet look's and
the sweeper's listing): the node workflow upserts them as its life goes on, and the pool's start
gives a new one its first (`start_attributes`)."""

from __future__ import annotations

from typing import Any

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

from tgp.types import NodePhase, NodeRequest

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
    """A node's attributes as it starts (Pending), as its own first upsert would set them: a
    `life-v4` life that starts with them makes no upsert of its own for the phase. With the
    price its pool reserved for it: a class ledger that counts its running nodes again (a new
    run) holds a Pending node at that price, which a launch at that price does not settle
    again (the Launching upsert sets the offer's)."""
    pairs: list[SearchAttributePair[Any]] = [
        SearchAttributePair(SA_PHASE, NodePhase.PENDING.value),
        SearchAttributePair(SA_POOL, f"{request.namespace}/{request.pool}"),
        SearchAttributePair(SA_NODE_NAME, request.node_name),
        SearchAttributePair(SA_CLASS, request.node_class),
    ]
    if request.reserved_price is not None:
        pairs.append(SearchAttributePair(SA_HOURLY_PRICE, float(request.reserved_price)))
    return TypedSearchAttributes(pairs)
