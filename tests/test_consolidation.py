"""Consolidation planning (tgp.consolidation): remove underutilized nodes, re-shop to cheaper
offers, replace drifted nodes; within budgets, never a do-not-disrupt node, never a pod left
without GPUs."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from tgp.capacity import OfferSize
from tgp.crds import Consolidation, DisruptionBudget
from tgp.consolidation import ActionKind, Cause, ConsolidationNode, ConsolidationPlan, describe_plan, plan_consolidation
from tgp.disruption import DisruptionReason, allowed_disruptions

NOW = datetime(2026, 11, 24, 10, 0, tzinfo=UTC)
ON = Consolidation()  # cheaperBy 20%, after 30m, WhenEmptyOrUnderutilized
HOUR = timedelta(hours=1)


def node(name: str, gpus: int, price: str, pods: dict[str, int] | None = None, *, age: timedelta = HOUR, **kw: object) -> ConsolidationNode:
    return ConsolidationNode(name=name, gpus=gpus, hourly_price=Decimal(price), running_for=age, pods=pods or {}, **kw)  # type: ignore[arg-type]


# Each strategy built once (Hypothesis builds, validates and labels every strategy object it is
# given: built per node drawn, they were most of this file's CPU).
_GPUS = st.sampled_from([1, 2, 4, 8])
_SIZES = {gpus: st.lists(st.integers(1, gpus), max_size=3) for gpus in (1, 2, 4, 8)}
_TENTH, _CENTS = st.integers(0, 9), st.integers(1, 400)
_AGES = st.sampled_from([timedelta(minutes=5), timedelta(minutes=30), timedelta(hours=3)])


@st.composite
def pools(draw: st.DrawFn) -> list[ConsolidationNode]:
    count = draw(st.integers(1, 7))
    nodes = []
    for i in range(count):
        gpus = draw(_GPUS)
        sizes = draw(_SIZES[gpus])
        pods: dict[str, int] = {}
        for j, size in enumerate(sizes):
            if sum(pods.values()) + size <= gpus:
                pods[f"ns/p{i}-{j}"] = size
        nodes.append(
            ConsolidationNode(
                name=f"n{i}",
                gpus=gpus,
                hourly_price=None if draw(_TENTH) == 0 else Decimal(draw(_CENTS)) / 100,
                running_for=draw(_AGES),
                pods=pods,
                do_not_disrupt=draw(st.booleans()) and draw(st.booleans()),
                drifted=draw(_TENTH) == 0,
            )
        )
    return nodes


OFFERS = st.one_of(
    st.just(None),
    st.lists(st.builds(OfferSize, gpu_count=st.sampled_from([1, 2, 4, 8]), hourly_price=st.integers(5, 300).map(lambda c: Decimal(c) / 100)), min_size=1, max_size=4),
)
POLICIES = st.one_of(
    st.none(),
    st.builds(
        Consolidation,
        cheaper_by=st.sampled_from(["1%", "10%", "20%", "50%"]),
        after=st.sampled_from([timedelta(0), timedelta(minutes=30), timedelta(hours=2)]),
        policy=st.sampled_from(["WhenEmpty", "WhenEmptyOrUnderutilized"]),
    ),
)
BUDGETS = st.lists(st.builds(DisruptionBudget, nodes=st.one_of(st.integers(0, 4).map(str), st.sampled_from(["10%", "50%", "100%"]))), max_size=2)


def _plan(nodes: list[ConsolidationNode], offers: list[OfferSize] | None, policy: Consolidation | None, budgets: list[DisruptionBudget], disrupting: int = 0, min_nodes: int = 0) -> ConsolidationPlan:
    return plan_consolidation(nodes, offers, policy, budgets, NOW, disrupting=disrupting, min_nodes=min_nodes)


@settings(max_examples=300)
@given(pools(), OFFERS, POLICIES, BUDGETS, st.integers(0, 2), st.integers(0, 3))
def test_every_pod_of_a_removed_node_has_gpus_on_a_node_that_stays(
    nodes: list[ConsolidationNode], offers: list[OfferSize] | None, policy: Consolidation | None, budgets: list[DisruptionBudget], disrupting: int, min_nodes: int
) -> None:
    plan = _plan(nodes, offers, policy, budgets, disrupting, min_nodes)
    by_name = {n.name: n for n in nodes}
    removed = {a.node for a in plan.actions if a.kind is ActionKind.REMOVE}
    leaving = removed | {a.node for a in plan.actions if a.reason is DisruptionReason.DRIFTED} | {n.name for n in nodes if n.drifted}
    taken: dict[str, int] = {}
    for a in plan.actions:
        if a.kind is not ActionKind.REMOVE:
            continue
        assert set(a.moves) == set(by_name[a.node].pods), "every pod of a removed node is placed"
        for pod, target in a.moves.items():
            assert target not in leaving, f"{pod} moved to {target}, which leaves too"
            taken[target] = taken.get(target, 0) + by_name[a.node].pods[pod]
    for target, gpus in taken.items():
        assert gpus <= by_name[target].free, f"{target} got {gpus} GPUs of pods but had {by_name[target].free} free"
    assert len(nodes) - len(removed) >= min(min_nodes, len(nodes)) or not removed, "removals keep minNodes"


@settings(max_examples=300)
@given(pools(), OFFERS, POLICIES, BUDGETS, st.integers(0, 2))
def test_no_held_node_is_touched_and_the_budgets_are_kept(
    nodes: list[ConsolidationNode], offers: list[OfferSize] | None, policy: Consolidation | None, budgets: list[DisruptionBudget], disrupting: int
) -> None:
    plan = _plan(nodes, offers, policy, budgets, disrupting)
    held = {n.name for n in nodes if n.do_not_disrupt}
    assert not held & {a.node for a in plan.actions}, "a do-not-disrupt node is never touched"
    assert len({a.node for a in plan.actions}) == len(plan.actions), "one action per node"
    assert len({b.node for b in plan.blocked}) == len(plan.blocked) and not {b.node for b in plan.blocked} & {a.node for a in plan.actions}
    for i, a in enumerate(plan.actions):  # each action fits the budgets with the ones before it disrupting
        assert allowed_disruptions(budgets, NOW, a.reason, len(nodes), disrupting + i).permits()
    for b in budgets:
        if b.nodes.isdigit():
            assert plan.candidates <= max(0, int(b.nodes) - disrupting)
    if policy is None:
        assert all(a.reason is DisruptionReason.DRIFTED for a in plan.actions), "consolidation off: drift only"


@settings(max_examples=300)
@given(pools(), OFFERS, POLICIES, BUDGETS)
def test_savings_are_the_price_differences_and_re_shops_clear_the_threshold(
    nodes: list[ConsolidationNode], offers: list[OfferSize] | None, policy: Consolidation | None, budgets: list[DisruptionBudget]
) -> None:
    plan = _plan(nodes, offers, policy, budgets)
    by_name = {n.name: n for n in nodes}
    expected = Decimal(0)
    for a in plan.actions:
        price = by_name[a.node].hourly_price or Decimal(0)
        assert a.hourly_price == price
        if a.reason is DisruptionReason.DRIFTED:
            assert a.saving == 0
        elif a.kind is ActionKind.REMOVE:
            assert a.saving == price > 0
        else:
            assert a.replacement_price is not None and a.saving == price - a.replacement_price
            assert policy is not None and a.saving >= price * Decimal(policy.cheaper_by.removesuffix("%")) / 100, "within the threshold: no re-shop"
            assert a.saving > 0 and by_name[a.node].running_for >= policy.after
            assert a.replacement_gpus is not None and a.replacement_gpus >= by_name[a.node].used
        if a.reason is not DisruptionReason.DRIFTED:
            expected += a.saving
    assert plan.savings == expected
    if plan.merge is not None:
        expected += plan.merge.saving
    if policy is not None and policy.policy == "WhenEmpty":
        assert not any(a.kind is ActionKind.REMOVE for a in plan.actions) and plan.merge is None


@settings(max_examples=200)
@given(pools(), OFFERS, POLICIES, BUDGETS, st.randoms(use_true_random=False))
def test_the_plan_does_not_depend_on_the_order_nodes_are_given_in(
    nodes: list[ConsolidationNode], offers: list[OfferSize] | None, policy: Consolidation | None, budgets: list[DisruptionBudget], rnd: object
) -> None:
    shuffled = list(nodes)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert _plan(shuffled, offers, policy, budgets) == _plan(nodes, offers, policy, budgets)


# --- examples -------------------------------------------------------------------------------


def test_two_half_empty_nodes_become_one() -> None:
    nodes = [node("a", 2, "1.00", {"ns/x": 1}), node("b", 2, "1.20", {"ns/y": 1})]
    plan = _plan(nodes, [OfferSize(gpu_count=2, hourly_price=Decimal("1.00"))], ON, [])
    assert [(a.node, a.kind, a.reason, a.saving, a.moves) for a in plan.actions] == [
        ("b", ActionKind.REMOVE, DisruptionReason.UNDERUTILIZED, Decimal("1.20"), {"ns/y": "a"})
    ], "the dearer of two equally used nodes goes, and the one that took its pod stays"
    assert plan.savings == Decimal("1.20")
    assert describe_plan(plan)[0].startswith("remove   b")


def test_a_node_whose_pods_do_not_fit_elsewhere_stays() -> None:
    plan = _plan([node("a", 2, "1.00", {"ns/x": 2}), node("b", 2, "1.00", {"ns/y": 1})], None, ON, [])
    assert not plan.actions
    assert {(b.node, b.cause) for b in plan.blocked} == {("a", Cause.NO_PRICE), ("b", Cause.NO_PRICE)}, "not underutilized; offers unknown"


def test_a_cheaper_offer_replaces_the_node_and_one_within_the_threshold_does_not() -> None:
    n = node("a", 1, "1.00", {"ns/x": 1})
    cheaper = _plan([n], [OfferSize(gpu_count=1, hourly_price=Decimal("0.70"))], ON, [])
    assert [(a.kind, a.reason, a.saving, a.replacement_price) for a in cheaper.actions] == [
        (ActionKind.REPLACE, DisruptionReason.CHEAPER, Decimal("0.30"), Decimal("0.70"))
    ]
    close = _plan([n], [OfferSize(gpu_count=1, hourly_price=Decimal("0.85"))], ON, [])
    assert not close.actions and [(b.cause, b.saving) for b in close.blocked] == [(Cause.THRESHOLD, Decimal("0.15"))]
    young = _plan([node("a", 1, "1.00", {"ns/x": 1}, age=timedelta(minutes=10))], [OfferSize(gpu_count=1, hourly_price=Decimal("0.70"))], ON, [])
    assert not young.actions and [b.cause for b in young.blocked] == [Cause.AFTER]
    off = _plan([n], [OfferSize(gpu_count=1, hourly_price=Decimal("0.70"))], None, [])
    assert not off.actions and [b.cause for b in off.blocked] == [Cause.OFF]


def test_what_holds_each_candidate_back_is_named() -> None:
    nodes = [
        node("a", 4, "2.00", {"ns/x": 1}, do_not_disrupt=True, holders=["ns/x"]),
        node("b", 4, "2.00", {"ns/y": 1}),
        node("c", 4, "2.00", {"ns/z": 1}),
        node("d", 4, "2.00", {"ns/w": 1}, drifted=True),
    ]
    plan = _plan(nodes, None, ON, [DisruptionBudget(nodes="1")])
    assert [(a.node, a.reason) for a in plan.actions] == [("d", DisruptionReason.DRIFTED)], "drift first; then the budget of one is spent"
    causes = {(b.node, b.reason, b.cause) for b in plan.blocked}
    assert ("a", DisruptionReason.UNDERUTILIZED, Cause.DO_NOT_DISRUPT) in causes
    assert ("b", DisruptionReason.UNDERUTILIZED, Cause.BUDGET) in causes
    message = next(b.message for b in plan.blocked if b.cause is Cause.BUDGET)
    assert "budgets[0] (nodes: 1)" in message


def test_min_nodes_is_kept() -> None:
    nodes = [node("a", 2, "1.00", {"ns/x": 1}), node("b", 2, "1.00", {"ns/y": 1})]
    plan = _plan(nodes, None, ON, [], min_nodes=2)
    assert not plan.actions and any(b.cause is Cause.MIN_NODES for b in plan.blocked)


def test_a_look_leaves_out_leaving_nodes_and_counts_nominated_pending_pods_as_the_nodes_pods() -> None:
    """`look_at`: a node on its way out (told to end, being replaced) is no place for another
    node's pods and no candidate; the pending pods nominated to a node's free GPUs take them
    and move with it, so the plan removes no node onto GPUs that are not there to be had."""
    from tgp.consolidation import PoolMember, look_at

    hour = timedelta(hours=1)
    members = [
        PoolMember(name="a", workflow_id="w/a", hourly_price=Decimal("0.95"), running_for=hour),
        PoolMember(name="b", workflow_id="w/b", hourly_price=Decimal("0.95"), running_for=hour),
        PoolMember(name="old", workflow_id="w/old", hourly_price=Decimal("0.95"), running_for=hour, leaving=True),
    ]
    free, bound = {"a": 1, "b": 1, "old": 2}, {"a": [1], "b": [1]}
    policy = Consolidation.model_validate({"after": "1m"})
    budgets = [DisruptionBudget.model_validate({"nodes": "100%"})]

    def removed(nodes: list[ConsolidationNode]) -> list[str]:
        plan = plan_consolidation(nodes, None, policy, budgets, NOW, pool_nodes=len(nodes), disrupting=0, min_nodes=0)
        return sorted(a.node for a in plan.actions if a.kind is ActionKind.REMOVE)

    nodes = look_at(members, free, bound, [], {"w/a": {"ml/pending": 1}})
    assert [n.name for n in nodes] == ["a", "b"], "the leaving node is no place for pods"
    a = next(n for n in nodes if n.name == "a")
    assert a.nominated == 1 and a.free == 0
    assert removed(nodes) == [], "b's pod has no room on a (a pending pod takes it), and a keeps its pending pod"

    # A node whose only pod is on its way (nominated, not bound) is no candidate either: its pod
    # would bind and be evicted, and nothing be bought for it meanwhile.
    # (a: one GPU, a pending pod nominated to it; b: two GPUs, one pod, one free.)
    waiting = look_at(members, {"a": 1, "b": 1}, {"b": [1]}, [], {"w/a": {"ml/pending": 1}})
    assert removed(waiting) == []

    # Without the nomination, b's pod fits on a: b goes (the rules take away only what is taken).
    assert removed(look_at(members, free, bound, [], {})) in (["a"], ["b"])


# --- destinations respect `after` (issue 35 item 9) -------------------------------------------


@settings(max_examples=300)
@given(pools(), OFFERS, POLICIES, BUDGETS)
def test_no_pod_moves_onto_a_node_inside_its_own_after_window(
    nodes: list[ConsolidationNode], offers: list[OfferSize] | None, policy: Consolidation | None, budgets: list[DisruptionBudget]
) -> None:
    """Karpenter's consolidateAfter: a node that is itself too young to be consolidated is no
    destination either (its pods have not settled; it may be the next to go)."""
    plan = _plan(nodes, offers, policy, budgets)
    by_name = {n.name: n for n in nodes}
    for a in plan.actions:
        for pod, target in a.moves.items():
            assert policy is not None and by_name[target].running_for >= policy.after, f"{pod} moved onto {target}, inside its after window"


def test_a_young_node_with_room_takes_no_pods() -> None:
    old = node("old", 1, "1.00", {"ns/a": 1}, age=3 * HOUR)
    young = node("young", 2, "1.00", {}, age=timedelta(minutes=5))
    plan = _plan([old, young], None, ON, [])
    assert not [a for a in plan.actions if a.kind is ActionKind.REMOVE], plan.actions
    plan = _plan([old, young.model_copy(update={"running_for": HOUR})], None, ON, [])
    assert [(a.node, a.moves) for a in plan.actions if a.kind is ActionKind.REMOVE] == [("old", {"ns/a": "young"})]
