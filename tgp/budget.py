"""The class budget's arithmetic: may this reservation be granted? Pure, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from decimal import Decimal

from tgp.messages import Grant, Ledger, Reservation


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


def hold(ledger: Ledger, r: Reservation, now: datetime) -> Ledger:
    """The ledger with `r` held (a new reservation is stamped `now`; a re-priced one keeps its
    first stamp, which the orphan check reads)."""
    held = ledger.reservations.get(r.node_id)
    r = r.model_copy(update={"reserved_at": held.reserved_at if held and held.reserved_at else now})
    return ledger.model_copy(update={"reservations": {**ledger.reservations, r.node_id: r}})


def admit_many(ledger: Ledger, batch: Iterable[Reservation], now: datetime) -> tuple[Ledger, list[Grant]]:
    """Decide a batch of reservations (a pool's launches of one pass, or the price settlements
    of many nodes) in the order given, each against the ledger with the earlier grants of the
    batch already held: the class grants what fits its budget and says why for the rest (a
    later, cheaper one may still fit after a dearer one was refused). A node that already
    ended and released its budget is refused. Returns the new ledger and one grant per
    reservation, in order."""
    grants = []
    for r in batch:
        if r.node_id in ledger.released:
            grant = Grant(granted=False, reason=f"node {r.node_id} has already ended and released its budget")
        else:
            grant = admit(ledger, r)
        if grant.granted:
            ledger = hold(ledger, r, now)
        grants.append(grant)
    return ledger, grants
