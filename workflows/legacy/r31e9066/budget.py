"""The class budget's arithmetic: may this reservation be granted? Pure, no I/O."""

from __future__ import annotations

from decimal import Decimal

from workflows.legacy.r31e9066.messages import Grant, Ledger, Reservation


def admit(ledger: Ledger, r: Reservation) -> Grant:
    """Grant `r` (new, or an existing one with a new price) if the class's `maxNodes` and
    `maxHourlyCost` still hold with it; otherwise say which limit it would break."""
    limits = ledger.limits
    others = [x for k, x in ledger.reservations.items() if k != r.node_id]
    if limits.max_nodes is not None and r.node_id not in ledger.reservations and len(others) >= limits.max_nodes:
        return Grant(granted=False, reason=f"the class allows {limits.max_nodes} nodes and {len(others)} are reserved (limits.maxNodes)")
    if limits.max_hourly_cost is not None and r.hourly_price is not None:
        cost = sum((x.hourly_price or Decimal(0) for x in others), Decimal(0)) + r.hourly_price
        if cost > limits.max_hourly_cost:
            return Grant(
                granted=False,
                reason=f"${r.hourly_price}/h more would make ${cost}/h, over the class's limits.maxHourlyCost of ${limits.max_hourly_cost}/h",
            )
    return Grant(granted=True)
