"""The pool's decisions (tgp.pool_plan, tgp.pool_disruption) as properties over any pool: what a
pass starts, which nodes carry the floor, what the budgets let go, which nodes want a
replacement and which consolidation removes. Pure: no workflow, no clock."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from tgp.capacity import NewNode, OfferSize
from tgp.consolidation import Action, ActionKind
from tgp.crds import DisruptionBudget, GPUNodeClassSpec, GPUNodePoolSpec
from tgp.disruption import budget_nodes
from tgp.drift import drift_hash, drifted
from tgp.messages import NodeStart, PoolNode
from tgp.pool_disruption import Fleet, mark_replacements, past_max_nodes, removals, replacement_slots
from tgp.pool_plan import TUNABLE, UnsettledStart, answer_ask, disrupting, floor_changes, initialized, plan_starts, settings_fingerprint, starts_to_abandon
from tgp.replace import first_candidate
from tgp.types import NodePhase, TimeoutsUpdate

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
PHASES = [NodePhase.PENDING, NodePhase.LAUNCHING, NodePhase.JOINING, NodePhase.READY, NodePhase.DRAINING, NodePhase.TERMINATED]
KLASS = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}]})


def pool_spec(**disruption: object) -> GPUNodePoolSpec:
    return GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}, "disruption": disruption})


# A node record's fields, each strategy built once: built afresh for every node drawn (and the
# drift hash computed each time), drawing the records took two thirds of this file's CPU.
_MINUTES = st.integers(0, 600)
_NODE_FIELDS = {
    "phase": st.sampled_from(PHASES),
    "hourly_price": st.none() | st.integers(10, 300).map(lambda c: Decimal(c) / 100),
    "floor": st.booleans(),
    "replace_reason": st.sampled_from(["", "", "Drifted", "Cheaper"]),
    "removing": st.none() | st.just(Decimal("0.5")),
    "disrupt_sent": st.booleans(),
    "replace_after": st.none() | st.sampled_from([T0 - timedelta(minutes=1), T0 + timedelta(minutes=1)]),
    "drift_hash": st.none() | st.sampled_from(["v1-0000000000000000", "v0-old", drift_hash(KLASS, pool_spec(), "simulated")]),
}


@st.composite
def pool_nodes(draw: st.DrawFn, max_size: int = 8) -> dict[str, PoolNode]:
    """A pool's records of its nodes, in any phase and any replacement state."""
    nodes: dict[str, PoolNode] = {}
    for i in range(draw(st.integers(0, max_size))):
        wid = f"gpunode/ml/p/n{i}"
        nodes[wid] = PoolNode(
            workflow_id=wid,
            node_name=f"n{i}",
            created_at=T0 - timedelta(minutes=draw(_MINUTES)),
            phase_at=T0 - timedelta(minutes=draw(_MINUTES)),
            provider="simulated",
            **{name: draw(field) for name, field in _NODE_FIELDS.items()},
        )
    return nodes


new_nodes_st = st.lists(
    st.builds(NewNode, gpus=st.sampled_from([1, 2, 4]), pods=st.lists(st.sampled_from([f"ml/p{i}" for i in range(20)]), min_size=1, max_size=3, unique=True)),
    max_size=12,
)


@given(new_nodes_st, st.integers(0, 10), st.integers(0, 10), st.integers(0, 6), st.none() | st.integers(0, 12), st.integers(1, 20))
def test_a_pass_never_starts_past_max_nodes_or_its_cap_and_loses_no_pod(
    new: list[NewNode], live: int, floor_live: int, min_nodes: int, max_nodes: int | None, cap: int
) -> None:
    launches = plan_starts(new, live=live, floor_live=floor_live, min_nodes=min_nodes, max_nodes=max_nodes, min_gpus=1, cap=cap)
    assert len(launches.starts) <= cap
    if max_nodes is not None:
        assert live + len(launches.starts) <= max(max_nodes, live)
    # Every pod is either in a start, waiting beyond maxNodes, or beyond the pass's cap.
    started = sum(len(n.pods) for n in launches.starts)
    assert started + launches.waiting <= sum(len(n.pods) for n in new)
    if len(launches.starts) < cap:
        assert started + launches.waiting == sum(len(n.pods) for n in new)
    # minNodes is met when nothing holds it back.
    if max_nodes is None and cap >= len(new) + min_nodes:
        assert live + len(launches.starts) >= min_nodes
    assert launches.floor_missing == max(0, min_nodes - floor_live)


@given(pool_nodes(), st.integers(0, 8))
def test_exactly_min_nodes_of_the_tunable_nodes_carry_the_floor(nodes: dict[str, PoolNode], min_nodes: int) -> None:
    live = [n for n in nodes.values() if not n.phase.is_final]
    changes = floor_changes(live, min_nodes)
    after = [n.model_copy(update={"floor": changes.get(n.workflow_id, n.floor)}) for n in live]
    tunable = [n for n in after if n.phase in TUNABLE]
    assert sum(n.floor for n in tunable) == min(min_nodes, len(tunable))
    assert all(n.phase in TUNABLE for n in live if n.workflow_id in changes), "only nodes whose settings matter change"


@given(pool_nodes(), st.sampled_from(["0", "1", "2", "10%", "50%", "100%"]), st.lists(st.integers(0, 7), max_size=10))
def test_the_budget_lets_no_more_nodes_go_than_it_allows(nodes: dict[str, PoolNode], allowed: str, askers: list[int]) -> None:
    """Asks one after the other, each grant counted for the next: the nodes disrupting never
    exceed the budget because of a grant (they may already, from before)."""
    budgets = [DisruptionBudget.model_validate({"nodes": allowed})]
    limit = budget_nodes(budgets[0], initialized(nodes.values()))
    granted: dict[str, datetime] = {}
    for i in askers:
        wid = f"gpunode/ml/p/n{i}"
        before = disrupting(nodes, granted, exclude=wid)
        asked = answer_ask(budgets, T0, "Empty", wid, nodes, granted)
        if asked.grant:
            assert before < limit, (before, limit)
            granted[wid] = T0
        assert asked.answer.allowed == asked.grant


@given(pool_nodes())
def test_an_unknown_reason_is_let_go_but_never_counted(nodes: dict[str, PoolNode]) -> None:
    asked = answer_ask([DisruptionBudget.model_validate({"nodes": "0"})], T0, "Sideways", "x", nodes, {})
    assert asked.answer.allowed and not asked.grant and "unknown reason" in asked.answer.message


@given(pool_nodes())
def test_no_replacement_is_wanted_for_a_node_consolidation_removes_held_or_backing_off(nodes: dict[str, PoolNode]) -> None:
    held = [n.node_name for i, n in enumerate(nodes.values()) if i % 3 == 0]
    slots = replacement_slots(nodes, held, T0)
    for wid, slot in slots.items():
        n = nodes[wid]
        if slot.want:
            assert n.removing is None
            held_ready = n.phase is NodePhase.READY and n.node_name in held and n.replaced_by is None
            assert not held_ready, "do-not-disrupt holds it: no replacement is bought"
            assert n.replace_after is None or n.replace_after <= T0
    candidate = first_candidate(slots)
    assert candidate is None or nodes[candidate].phase is NodePhase.READY


@given(pool_nodes(), st.integers(0, 10), st.none() | st.integers(0, 10))
def test_a_replacement_past_max_nodes_is_refused_with_why(nodes: dict[str, PoolNode], live: int, max_nodes: int | None) -> None:
    slots = replacement_slots(nodes, [], T0)
    why = past_max_nodes(slots, live, max_nodes)
    if why is not None:
        assert max_nodes is not None and live >= max_nodes and "maxNodes" in why


@given(pool_nodes())
def test_drift_is_marked_exactly_when_the_hash_differs(nodes: dict[str, PoolNode]) -> None:
    spec = pool_spec()
    current = drift_hash(KLASS, spec, "simulated")
    marks = mark_replacements(nodes, KLASS, spec, Fleet(), T0)
    for wid, n in nodes.items():
        after = n.model_copy(update=marks.updates.get(wid, {}))
        if n.phase is not NodePhase.READY:
            assert wid not in marks.updates
            continue
        assert after.drifted == drifted(n.drift_hash, current)
        if n.replaced_by is None:
            assert (after.replace_reason == "Drifted") == after.drifted, "consolidation is off: drift is the only reason"
    drifted_now = sum(1 for wid, n in nodes.items() if n.phase is NodePhase.READY and not n.drifted and marks.updates.get(wid, {}).get("drifted"))
    assert sum(1 for note in marks.notes if note.reason == "NodeDrifted") == drifted_now


@given(pool_nodes(), st.integers(100, 300).map(lambda c: Decimal(c) / 100))
def test_a_cheaper_offer_is_marked_only_with_consolidation_on(nodes: dict[str, PoolNode], offer: Decimal) -> None:
    fleet = Fleet(free_gpus={n.node_name: 0 for n in nodes.values()}, sizes=[OfferSize(gpu_count=1, hourly_price=offer / 10)])
    off = mark_replacements(nodes, KLASS, pool_spec(), fleet, T0)
    assert not any(u.get("replace_reason") == "Cheaper" for u in off.updates.values())
    on = mark_replacements(nodes, KLASS, pool_spec(consolidation={"after": "0s"}), fleet, T0)
    for wid, u in on.updates.items():
        if u.get("replace_reason") == "Cheaper":
            assert nodes[wid].hourly_price is not None and nodes[wid].phase is NodePhase.READY


@given(pool_nodes(), st.lists(st.integers(0, 9), max_size=10))
def test_consolidation_removes_only_ready_nodes_nothing_else_is_moving(nodes: dict[str, PoolNode], picked: list[int]) -> None:
    actions = [Action(kind=ActionKind.REMOVE, node=f"n{i}", reason="Underutilized", hourly_price=Decimal("0.2"), saving=Decimal("0.1"), message="m") for i in picked]
    for n, _ in removals(actions, nodes.values(), T0):
        assert n.phase is NodePhase.READY
        assert n.removing is None and not n.replace_reason and not n.replaced_by and not n.replaces and not n.disrupt_sent
        assert n.replace_after is None or n.replace_after <= T0


@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.lists(st.sampled_from(["ml/x", "ml/y", "ml/z"]), max_size=2, unique=True)), st.lists(st.sampled_from(["ml/x", "ml/y", "ml/z"])), st.integers(0, 4), st.integers(0, 4))
def test_an_unsettled_start_is_given_up_only_once_nothing_needs_it(pods: dict[str, list[str]], demand: list[str], settled: int, min_nodes: int) -> None:
    start = NodeStart(node_name="n", min_gpus=1)
    unsettled = {wid: UnsettledStart(start=start, pods=p) for wid, p in pods.items()}
    abandoned = starts_to_abandon(unsettled, demand, settled, min_nodes)
    for wid, p in pods.items():
        needed = bool(set(p) & set(demand)) if p else settled < min_nodes
        assert (wid in abandoned) == (not needed)


durations = st.none() | st.integers(0, 86400).map(lambda s: timedelta(seconds=s))


@given(durations, durations, durations, durations, durations, st.none() | st.lists(st.sampled_from(["Empty", "Drifted"]), max_size=2))
def test_the_settings_a_node_was_sent_read_back_as_sent(
    idle: timedelta | None, drain: timedelta | None, expire: timedelta | None, hold: timedelta | None, grace: timedelta | None, unlimited: list[str] | None
) -> None:
    """The pool keeps what it sent each node as its fingerprint and reads it back (a node that
    ended its hold itself): nothing is lost on the way."""
    sent = TimeoutsUpdate(idle=idle, drain=drain or timedelta(minutes=5), expire_after=expire, hold=hold, termination_grace=grace, unlimited_reasons=unlimited)
    assert TimeoutsUpdate.model_validate_json(settings_fingerprint(sent)) == sent
