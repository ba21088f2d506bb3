"""What a class's look at its running node workflows changes in its ledger (the class workflow's
reality check, once a resync): pure, so the workflow only carries it out."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from tgp.messages import Ledger, NodeSighting, Reservation


def sighted(ledger: Ledger, unknown: Iterable[NodeSighting], gone: set[str], *, now: datetime, grace: timedelta) -> tuple[list[Reservation], list[str]]:
    """The reservations to hold for running nodes the ledger does not count (a new run of the
    ledger after a crash or reset), and the node ids whose reservations may be stale: their
    workflows are not running and they were reserved at least `grace` ago (a younger node may
    not be started yet). The caller releases those whose workflows turn out closed."""
    holds = [
        Reservation(node_id=s.workflow_id, pool="/".join(s.workflow_id.split("/")[1:3]), hourly_price=s.hourly_price)
        for s in unknown
        if s.workflow_id not in ledger.reservations and s.workflow_id not in ledger.released
    ]
    stale = [wid for wid, r in ledger.reservations.items() if wid in gone and (r.reserved_at is None or now - r.reserved_at >= grace)]
    return holds, stale
