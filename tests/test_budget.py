from decimal import Decimal

from tgp.budget import admit
from tgp.crds import ClassLimits
from tgp.messages import Ledger, Reservation


def r(node: str, price: str | None = None) -> Reservation:
    return Reservation(node_id=node, pool="ml/p", hourly_price=Decimal(price) if price else None)


def test_max_nodes_counts_reservations_but_not_a_resettle() -> None:
    ledger = Ledger(limits=ClassLimits(max_nodes=2), reservations={"a": r("a"), "b": r("b")})
    assert not admit(ledger, r("c")).granted
    assert "maxNodes" in admit(ledger, r("c")).reason
    assert admit(ledger, r("a", "1.0")).granted, "settling the price of a held slot"


def test_max_hourly_cost_uses_known_prices() -> None:
    ledger = Ledger(limits=ClassLimits(max_hourly_cost=Decimal("1.00")), reservations={"a": r("a", "0.60")})
    assert admit(ledger, r("b", "0.40")).granted
    denied = admit(ledger, r("b", "0.41"))
    assert not denied.granted and "$1.01/h" in denied.reason
    assert admit(ledger, r("a", "0.90")).granted, "a node's own old price does not count twice"


def test_no_limits_grants_everything() -> None:
    assert admit(Ledger(), r("x", "99")).granted
