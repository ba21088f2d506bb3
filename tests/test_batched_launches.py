"""Issue 20, batched launches: the pure rules behind one class ledger call per pass.

* `tgp.budget.admit_many`: the class's grant for a batch never goes over its budget, decides in
  the order given (the same batch gets the same answer), and a refusal always says why.
* `tgp.pools.request_for`: a batch sends one request and per node only what differs; the node's
  request built from those is the one `node_request` gives for it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from tgp.budget import admit, admit_many
from tgp.crds import ClassLimits, GPUNodeClassSpec, GPUNodePoolSpec
from tgp.messages import Ledger, NodeStart, Reservation
from tgp.pools import node_request, request_for

NOW = datetime(2026, 11, 24, 9, 0, tzinfo=timezone.utc)

prices = st.one_of(st.none(), st.decimals(min_value=Decimal("0.10"), max_value=Decimal("3.00"), places=2))
limits = st.builds(
    ClassLimits,
    max_nodes=st.integers(min_value=1, max_value=12),
    max_hourly_cost=st.one_of(st.none(), st.decimals(min_value=Decimal("0.50"), max_value=Decimal("10.00"), places=2)),
)


@st.composite
def ledgers_and_batches(draw: st.DrawFn) -> tuple[Ledger, list[Reservation]]:
    lim = draw(limits)
    held = draw(st.integers(min_value=0, max_value=lim.max_nodes))
    reservations = {f"n{i}": Reservation(node_id=f"n{i}", pool="ml/a", hourly_price=draw(prices), reserved_at=NOW) for i in range(held)}
    ledger = Ledger(limits=lim, reservations=reservations, released=draw(st.lists(st.sampled_from(["r0", "r1", "n0"]), unique=True, max_size=2)))
    # New nodes, ended ones (released) and re-pricings of held ones, in any order.
    ids = st.one_of(st.integers(0, 30).map(lambda i: f"new{i}"), st.sampled_from(["r0", "r1"]), st.integers(0, max(held - 1, 0)).map(lambda i: f"n{i}"))
    batch = draw(st.lists(st.builds(Reservation, node_id=ids, pool=st.sampled_from(["ml/a", "ml/b"]), hourly_price=prices), max_size=25))
    return ledger, batch


def within_budget(ledger: Ledger) -> bool:
    lim = ledger.limits
    nodes_ok = lim.max_nodes is None or len(ledger.reservations) <= lim.max_nodes
    cost_ok = lim.max_hourly_cost is None or ledger.hourly_cost <= lim.max_hourly_cost
    return nodes_ok and cost_ok


@given(ledgers_and_batches())
def test_a_batch_never_takes_the_class_over_its_budget_and_every_refusal_says_why(case: tuple[Ledger, list[Reservation]]) -> None:
    ledger, batch = case
    was_within = within_budget(ledger)
    after, grants = admit_many(ledger, batch, NOW)
    assert len(grants) == len(batch)
    for r, g in zip(batch, grants, strict=True):
        assert g.granted or g.reason, f"{r.node_id} refused without a reason"
        if g.granted:
            assert r.node_id in after.reservations and r.node_id not in ledger.released
        elif r.node_id not in ledger.reservations:
            assert r.node_id not in after.reservations or any(x.node_id == r.node_id and y.granted for x, y in zip(batch, grants, strict=True))
    if was_within:
        assert within_budget(after), "the grants of one batch broke maxNodes or maxHourlyCost"
    # Held reservations are never dropped by a batch, and keep their first stamp.
    for node_id, r in ledger.reservations.items():
        assert after.reservations[node_id].reserved_at == r.reserved_at


@given(ledgers_and_batches())
def test_a_batch_is_decided_in_its_order_as_the_same_calls_one_at_a_time(case: tuple[Ledger, list[Reservation]]) -> None:
    """The same answer as `reserve` called once per node in the batch's order: deterministic,
    and a batch grants no more (nor less) than the calls it replaces."""
    ledger, batch = case
    one_by_one, expected = ledger, []
    for r in batch:
        g = admit(one_by_one, r) if r.node_id not in one_by_one.released else None
        if g is not None and g.granted:
            one_by_one = admit_many(one_by_one, [r], NOW)[0]
        expected.append(bool(g and g.granted))
    after, grants = admit_many(ledger, batch, NOW)
    assert [g.granted for g in grants] == expected
    assert after == one_by_one
    assert admit_many(ledger, batch, NOW) == (after, grants)


POOL = GPUNodePoolSpec.model_validate(
    {"nodeClassRef": {"name": "sim"}, "disruption": {"idleTimeout": "5m", "drainTimeout": "10s"}, "template": {"metadata": {"labels": {"team": "ml"}}}}
)
KLASS = GPUNodeClassSpec.model_validate(
    {"providers": [{"name": "simulated"}], "tailscaleConfig": {"tags": ["tag:tgp-node"]}, "instanceRequirements": {"minGpuCount": 1}}
)


@settings(max_examples=50)
@given(
    floor=st.booleans(),
    min_gpus=st.integers(min_value=0, max_value=8),
    bind_grace=st.one_of(st.none(), st.integers(min_value=0, max_value=600).map(lambda s: timedelta(seconds=s))),
    demand_since=st.one_of(st.none(), st.just(NOW)),
    watch=st.one_of(st.none(), st.just(timedelta(seconds=1))),
)
def test_a_node_of_a_batch_gets_the_request_node_request_gives_it(
    floor: bool, min_gpus: int, bind_grace: timedelta | None, demand_since: datetime | None, watch: timedelta | None
) -> None:
    common = {"namespace": "ml", "pool_name": "rtx", "class_name": "sim", "pool": POOL, "klass": KLASS, "watch_interval": watch}
    template = node_request(node_name="", **common)
    start = NodeStart(node_name="rtx-abcde", floor=floor, min_gpus=min_gpus, bind_grace=bind_grace, demand_since=demand_since)
    expected = node_request(node_name="rtx-abcde", floor=floor, min_gpus=min_gpus, bind_grace=bind_grace, **common)
    if demand_since is not None:
        expected = expected.model_copy(update={"demand_since": demand_since})
    assert request_for(template, start) == expected
