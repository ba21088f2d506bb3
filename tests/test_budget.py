from decimal import Decimal

from tgp.budget import admit
from tgp.crds import DEFAULT_CLASS_MAX_NODES, ClassLimits, GPUNodeClassSpec
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


def test_a_class_without_limits_stops_at_the_default_cap() -> None:
    """A class that names no limits still bounds spend: a pool typo cannot buy without end."""
    limits = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}]}).limits
    ledger = Ledger(limits=limits, reservations={f"n{i}": r(f"n{i}") for i in range(DEFAULT_CLASS_MAX_NODES)})
    denied = admit(ledger, r("one-more"))
    assert not denied.granted and f"allows {DEFAULT_CLASS_MAX_NODES} nodes" in denied.reason
