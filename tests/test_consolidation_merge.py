"""Several nodes into one (tgp.merge, issue 35 item 9): the plan's merge never costs more than
what it replaces, its pods all fit the new node, it keeps the budgets and minNodes, and it takes
only nodes that may be disrupted and have run `after`."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_consolidation import BUDGETS, node
from tgp.capacity import OfferSize
from tgp.consolidation import ConsolidationNode, plan_consolidation
from tgp.crds import Consolidation, DisruptionBudget
from tgp.disruption import DisruptionReason, allowed_disruptions, cheaper_by
from tgp.merge import merge_in_force, plan_merge, start_merge
from tgp.messages import PoolNode
from tgp.types import NodePhase

NOW = datetime(2026, 11, 24, 10, 0, tzinfo=UTC)
ON = Consolidation(after=timedelta(minutes=30), cheaper_by="10%")
ONE = OfferSize(gpu_count=1, hourly_price=Decimal("0.44"))
FOUR = OfferSize(gpu_count=4, hourly_price=Decimal("1.10"))


@st.composite
def small_nodes(draw: st.DrawFn) -> list[ConsolidationNode]:
    """Pools of mostly small, part-used nodes: the ones a merge is for."""
    nodes = []
    for i in range(draw(st.integers(1, 8))):
        gpus = draw(st.sampled_from([1, 1, 2, 4]))
        used = draw(st.integers(0, gpus))
        nodes.append(
            ConsolidationNode(
                name=f"n{i}",
                gpus=gpus,
                hourly_price=None if draw(st.integers(0, 9)) == 0 else Decimal(draw(st.integers(20, 200))) / 100,
                running_for=draw(st.sampled_from([timedelta(minutes=5), timedelta(hours=1)])),
                pods={f"ns/p{i}-{j}": 1 for j in range(used)},
                do_not_disrupt=draw(st.integers(0, 5)) == 0,
                drifted=draw(st.integers(0, 9)) == 0,
                nominated=draw(st.sampled_from([0, 0, 0, 1])),
            )
        )
    return nodes


SIZES = st.lists(st.builds(OfferSize, gpu_count=st.sampled_from([1, 2, 4, 8]), hourly_price=st.integers(20, 400).map(lambda c: Decimal(c) / 100)), min_size=1, max_size=4)


@settings(max_examples=400)
@given(small_nodes(), SIZES, BUDGETS, st.integers(0, 2), st.integers(0, 4), st.sampled_from(["1%", "20%"]))
def test_a_merge_never_costs_more_fits_every_pod_and_keeps_the_budgets_and_min_nodes(
    nodes: list[ConsolidationNode], offers: list[OfferSize], budgets: list[DisruptionBudget], disrupting: int, min_nodes: int, by: str
) -> None:
    policy = Consolidation(after=timedelta(minutes=30), cheaper_by=by)
    plan = plan_consolidation(nodes, offers, policy, budgets, NOW, disrupting=disrupting, min_nodes=min_nodes)
    merge = plan.merge
    if merge is None:
        return
    by_name = {n.name: n for n in nodes}
    group = [by_name[name] for name in merge.nodes]
    assert len(group) >= 2 and len(set(merge.nodes)) == len(group)
    price = sum((n.hourly_price or Decimal(0) for n in group), start=Decimal(0))
    assert all(n.hourly_price is not None for n in group) and merge.hourly_price == price
    assert merge.replacement_price < price and merge.saving >= price * cheaper_by(policy), "never costs more, and clears cheaperBy"
    assert any(o.gpu_count == merge.replacement_gpus and o.hourly_price == merge.replacement_price for o in offers), "a real offer"
    assert merge.gpus == sum(n.used for n in group) <= merge.replacement_gpus, "every pod of the set fits the new node"
    for n in group:  # only nodes that may be disrupted, past `after`, moved by nothing else
        assert not n.do_not_disrupt and not n.drifted and not n.nominated and n.pods and n.running_for >= policy.after
    others = {a.node for a in plan.actions}
    assert not others & set(merge.nodes), "a node is in one action only"
    for a in plan.actions:
        assert not set(a.moves.values()) & set(merge.nodes), "no pod moves onto a node that is merged away"
    before = sum(1 for a in plan.actions if a.reason is not DisruptionReason.CHEAPER)  # drift and removals are planned first
    verdict = allowed_disruptions(budgets, NOW, DisruptionReason.UNDERUTILIZED, len(nodes), disrupting + before)
    assert verdict.permits(len(group)), "the whole set fits the budgets, with what was planned before it"
    assert len(nodes) - sum(1 for a in plan.actions if a.kind.value == "remove") - len(group) + 1 >= min_nodes, "minNodes kept (the new node counts)"


def test_three_one_gpu_nodes_become_one_four_gpu_node() -> None:
    nodes = [node(f"n{i}", 1, "0.44", {f"ns/p{i}": 1}) for i in range(3)]
    plan = plan_consolidation(nodes, [ONE, FOUR], ON, [], NOW)
    assert plan.merge is not None and plan.merge.nodes == ["n0", "n1", "n2"] and plan.merge.replacement_gpus == 4
    assert plan.merge.saving == Decimal("0.22") == plan.savings and plan.candidates == 3
    assert plan.merge.message.startswith("Consolidating 3 nodes into 1, saving $0.22/h")


def test_no_merge_costs_as_much_as_what_it_replaces() -> None:
    nodes = [node(f"n{i}", 1, "0.44", {f"ns/p{i}": 1}) for i in range(3)]
    dear = OfferSize(gpu_count=4, hourly_price=Decimal("1.32"))
    assert plan_consolidation(nodes, [ONE, dear], ON, [], NOW).merge is None


def test_a_budget_of_two_merges_two_and_a_young_or_held_node_stays_out() -> None:
    nodes = [node(f"n{i}", 1, "0.44", {f"ns/p{i}": 1}) for i in range(4)]
    two = OfferSize(gpu_count=2, hourly_price=Decimal("0.60"))
    plan = plan_consolidation(nodes, [ONE, two, FOUR], ON, [DisruptionBudget(nodes="2")], NOW)
    assert plan.merge is not None and len(plan.merge.nodes) == 2
    young = [*nodes[:3], node("n3", 1, "0.44", {"ns/p3": 1}, age=timedelta(minutes=5))]
    young[0] = node("n0", 1, "0.44", {"ns/p0": 1}, do_not_disrupt=True)
    plan = plan_consolidation(young, [ONE, two], ON, [], NOW)
    assert plan.merge is not None and plan.merge.nodes == ["n1", "n2"]


def test_a_merge_waits_for_all_its_nodes_and_lasts_until_they_have_ended() -> None:
    nodes = {f"w{i}": PoolNode(workflow_id=f"w{i}", node_name=f"n{i}", phase=NodePhase.READY, created_at=NOW, phase_at=NOW) for i in range(3)}
    found = plan_merge([node(f"n{i}", 1, "0.44", {f"ns/p{i}": 1}) for i in range(3)], [FOUR], ON, 3)
    merging = start_merge(found, nodes)
    assert merging is not None and merging.nodes == ["w0", "w1", "w2"] and merging.cap == Decimal("1.10")
    assert merge_in_force(merging, nodes, held=["n1"]) is None, "held before its start: called off"
    started = {**nodes, "w0": nodes["w0"].model_copy(update={"replaced_by": "new"})}
    assert merge_in_force(merging, started, held=["n1"]) == merging, "started: followed through"
    ended = {wid: n.model_copy(update={"phase": NodePhase.TERMINATED}) for wid, n in started.items()}
    assert merge_in_force(merging, ended, held=[]) is None
