"""The pure rules of disruption (issue 21): budgets, do-not-disrupt, re-shopping."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tgp.crds import BUDGET_REASONS, Consolidation, Disruption, DisruptionBudget, GPUNodePoolSpec
from tgp.disruption import (
    BUDGETED,
    VOLUNTARY,
    DisruptionReason,
    allowed_disruptions,
    blocks,
    budget_active,
    budget_nodes,
    do_not_disrupt,
    held_message,
    pod_delete_at,
    pod_holds_node,
    reshop,
    termination_deadline,
    unlimited_reasons,
)

NOW = datetime(2026, 11, 24, 10, 0, tzinfo=UTC)  # a Tuesday
ALWAYS = st.builds(
    DisruptionBudget,
    nodes=st.one_of(st.integers(0, 30).map(str), st.integers(0, 100).map("{}%".format)),
    reasons=st.one_of(st.none(), st.lists(st.sampled_from(BUDGET_REASONS), min_size=1, max_size=3, unique=True)),
)
REASONS = st.sampled_from(list(DisruptionReason))
POOLS = st.integers(0, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n)))  # (nodes, disrupting)


def _covers(budget: DisruptionBudget, reason: DisruptionReason) -> bool:
    if reason not in BUDGETED:
        return False
    return budget.reasons is None or (reason is not DisruptionReason.REPAIR and reason.value in budget.reasons)


# --- budgets ----------------------------------------------------------------------------------


@given(st.integers(0, 10_000), st.integers(0, 100))
def test_a_percentage_is_rounded_up(nodes: int, percent: int) -> None:
    allowed = budget_nodes(DisruptionBudget(nodes=f"{percent}%"), nodes)
    assert allowed * 100 >= nodes * percent > (allowed - 1) * 100  # the least whole count not below the share
    assert allowed >= 1 or nodes * percent == 0  # 5% of 10 nodes still lets one go, as Karpenter and PDBs do


def test_percentage_examples() -> None:
    assert [budget_nodes(DisruptionBudget(nodes="10%"), n) for n in (0, 1, 3, 10, 11, 25)] == [0, 1, 1, 1, 2, 3]
    assert budget_nodes(DisruptionBudget(nodes="100%"), 7) == 7 and budget_nodes(DisruptionBudget(nodes="0%"), 7) == 0
    assert budget_nodes(DisruptionBudget(nodes="3"), 1) == 3


@given(st.lists(ALWAYS, max_size=5), REASONS, POOLS)
def test_the_most_restrictive_active_budget_wins(budgets: list[DisruptionBudget], reason: DisruptionReason, pool: tuple[int, int]) -> None:
    nodes, disrupting = pool
    verdict = allowed_disruptions(budgets, NOW, reason, nodes, disrupting)
    room = [max(0, budget_nodes(b, nodes) - disrupting) for b in budgets if _covers(b, reason)]
    if not room:
        assert verdict.allowed is None and verdict.permits(10_000)  # nothing limits it
        return
    assert verdict.allowed == min(room)
    assert all(verdict.allowed <= r for r in room) and verdict.permits(verdict.allowed) and not verdict.permits(verdict.allowed + 1)
    if verdict.allowed == 0:
        blocking = budgets[verdict.blocking]  # type: ignore[index]
        assert _covers(blocking, reason) and budget_nodes(blocking, nodes) <= disrupting
        assert f"budgets[{verdict.blocking}]" in verdict.message and blocking.nodes in verdict.message
    else:
        assert verdict.blocking is None and verdict.message == ""


@given(st.lists(ALWAYS, max_size=4), ALWAYS, REASONS, POOLS)
def test_another_budget_never_allows_more(budgets: list[DisruptionBudget], extra: DisruptionBudget, reason: DisruptionReason, pool: tuple[int, int]) -> None:
    before = allowed_disruptions(budgets, NOW, reason, *pool).allowed
    after = allowed_disruptions([*budgets, extra], NOW, reason, *pool).allowed
    assert after is not None or before is None
    assert before is None or after is None or after <= before


@settings(max_examples=50)
@given(st.lists(ALWAYS, max_size=4), st.sampled_from([DisruptionReason.EVICTED, DisruptionReason.INTERRUPTED, DisruptionReason.LOST]), POOLS)
def test_a_manual_evict_an_interruption_and_a_loss_are_never_limited(budgets: list[DisruptionBudget], reason: DisruptionReason, pool: tuple[int, int]) -> None:
    zero = DisruptionBudget(nodes="0")
    assert allowed_disruptions([*budgets, zero], NOW, reason, *pool).allowed is None


def test_reasons_scope_a_budget_and_repair_counts_only_against_reasonless_ones() -> None:
    drift_freeze = DisruptionBudget(nodes="0", reasons=["Drifted"])
    assert allowed_disruptions([drift_freeze], NOW, DisruptionReason.DRIFTED, 10, 0).allowed == 0
    assert allowed_disruptions([drift_freeze], NOW, DisruptionReason.EMPTY, 10, 0).allowed is None
    assert allowed_disruptions([drift_freeze], NOW, DisruptionReason.REPAIR, 10, 0).allowed is None
    assert allowed_disruptions([DisruptionBudget(nodes="1")], NOW, DisruptionReason.REPAIR, 10, 1).allowed == 0


def test_the_default_is_one_budget_of_ten_percent_and_an_empty_list_is_no_limit() -> None:
    spec = GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}})  # a pool written before budgets
    assert spec.disruption.budgets == [DisruptionBudget(nodes="10%")] == Disruption().budgets
    assert allowed_disruptions(spec.disruption.budgets, NOW, DisruptionReason.EMPTY, 25, 1).allowed == 2
    assert allowed_disruptions([], NOW, DisruptionReason.EMPTY, 25, 25).allowed is None


def _yearly(fire: datetime) -> str:
    return f"{fire.minute} {fire.hour} {fire.day} {fire.month} *"


@given(
    st.datetimes(datetime(2025, 1, 1), datetime(2027, 12, 31)).map(lambda t: t.replace(second=0, microsecond=0, tzinfo=UTC)),
    st.integers(1, 30 * 24 * 60).map(lambda m: timedelta(minutes=m)),
    st.integers(-200 * 24 * 3600, 200 * 24 * 3600).map(lambda s: timedelta(seconds=s)),
    st.integers(1, 200),
)
def test_a_zero_budget_blocks_within_its_window_and_not_outside(fire: datetime, duration: timedelta, offset: timedelta, nodes: int) -> None:
    """A budget with a schedule is active in [fire, fire + duration): a zero budget there blocks;
    before the fire or from fire + duration on, the always-active 10% lets disruption proceed."""
    assume(not (fire.month == 2 and fire.day == 29))
    window = DisruptionBudget(nodes="0", schedule=_yearly(fire), duration=duration)
    budgets = [DisruptionBudget(nodes="10%"), window]
    now = fire + offset
    verdict = allowed_disruptions(budgets, now, DisruptionReason.DRIFTED, nodes, 0)
    inside = timedelta(0) <= offset < duration
    assert budget_active(window, now) is inside
    if inside:
        assert verdict.allowed == 0 and verdict.blocking == 1 and "schedule" in verdict.message
    else:
        assert verdict.allowed is not None and verdict.allowed >= 1


def test_a_naive_time_is_utc_and_a_year_long_window_is_quick() -> None:
    window = DisruptionBudget(nodes="0", schedule="0 0 29 2 *", duration="8784h")  # Feb 29: 2028, 2032
    assert not budget_active(window, datetime(2027, 1, 1, tzinfo=UTC)) and budget_active(window, datetime(2028, 3, 1, tzinfo=UTC))
    assert budget_active(window, datetime(2029, 2, 28, tzinfo=UTC)) and not budget_active(window, datetime(2029, 3, 1, tzinfo=UTC))
    daily = DisruptionBudget(nodes="0", schedule="0 9 * * *", duration="1h")
    assert budget_active(daily, datetime(2026, 11, 24, 9, 30)) and not budget_active(daily, datetime(2026, 11, 24, 10, 30))


def test_a_budget_that_cannot_be_read_fails_closed() -> None:
    """As Karpenter's: a schedule or count no longer readable (admitted under older rules and
    carried in history) blocks rather than lets every node go."""
    unreadable = DisruptionBudget.model_construct(nodes="10%", schedule="0 9 * * 7", duration=timedelta(hours=1), reasons=None)
    verdict = allowed_disruptions([DisruptionBudget(nodes="50%"), unreadable], NOW, DisruptionReason.DRIFTED, 10, 0)
    assert verdict.allowed == 0 and verdict.blocking == 1
    garbled = DisruptionBudget.model_construct(nodes="lots", schedule=None, duration=None, reasons=None)
    assert allowed_disruptions([garbled], NOW, DisruptionReason.EMPTY, 10, 0).allowed == 0


WINDOWED = st.builds(
    DisruptionBudget,
    nodes=st.one_of(st.integers(0, 30).map(str), st.integers(0, 100).map("{}%".format)),
    schedule=st.sampled_from(["0 9 * * mon-fri", "@daily", "30 * * * *"]),
    duration=st.integers(1, 23).map(lambda h: timedelta(hours=h)),
    reasons=st.one_of(st.none(), st.lists(st.sampled_from(BUDGET_REASONS), min_size=1, max_size=3, unique=True)),
)


@given(
    st.lists(st.one_of(ALWAYS, WINDOWED), max_size=4),
    st.sampled_from(sorted(BUDGETED)),
    st.datetimes(datetime(2026, 1, 1), datetime(2027, 12, 31)).map(lambda t: t.replace(tzinfo=UTC)),
    st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))),
)
def test_a_reason_no_budget_can_refuse_is_never_refused(
    budgets: list[DisruptionBudget], reason: DisruptionReason, now: datetime, pool: tuple[int, int]
) -> None:
    """A node of a pool whose budgets cannot refuse its reason begins its drain without asking
    (life-v5): the pool's answer would have been yes, whatever the time, the pool's size and the
    nodes already disrupting (which never include the asker, one of the pool's nodes)."""
    nodes, disrupting = pool
    if reason.value in unlimited_reasons(budgets):
        assert allowed_disruptions(budgets, now, reason, nodes, disrupting).permits()


@given(st.lists(ALWAYS, max_size=4))
def test_budgets_that_can_refuse_anything_are_asked_for_everything(budgets: list[DisruptionBudget]) -> None:
    """The converse, for budgets always active: all or nothing. Budgets left with no unlimited
    reason can refuse some reason in some pool's state (a large pool with all but the asker
    disrupting); the nodes disrupting for one reason count against every budget, so none is
    left unasked then."""
    refused = [r for r in BUDGETED if not allowed_disruptions(budgets, NOW, r, 1000, 999).permits()]
    assert unlimited_reasons(budgets) == ([] if refused else sorted(r.value for r in BUDGETED))


def test_unlimited_reasons_examples() -> None:
    everything = sorted(r.value for r in BUDGETED)
    assert unlimited_reasons([]) == everything  # no budget: nothing limits
    assert unlimited_reasons(Disruption().budgets) == []  # the default 10% limits every reason
    assert unlimited_reasons([DisruptionBudget(nodes="100%")]) == everything
    assert unlimited_reasons([DisruptionBudget(nodes="100%", reasons=["Empty"])]) == everything
    # An idle drain left unasked would be uncounted by the Drifted budget of 1 until its report.
    assert unlimited_reasons([DisruptionBudget(nodes="100%"), DisruptionBudget(nodes="1", reasons=["Drifted"])]) == []
    windowed = [DisruptionBudget(nodes="0", schedule="0 9 * * mon-fri", duration="8h", reasons=["Empty"])]
    assert unlimited_reasons(windowed) == []
    garbled = DisruptionBudget.model_construct(nodes="lots%", schedule=None, duration=None, reasons=None)
    assert unlimited_reasons([garbled]) == []  # unreadable: ask the pool, whose answer fails closed
    unparsable = DisruptionBudget.model_construct(nodes="100%", schedule="0 9 * * 7", duration=timedelta(hours=1), reasons=None)
    assert unlimited_reasons([unparsable]) == []  # allowed_disruptions fails closed on it: ask


def test_business_hours_freeze_example() -> None:
    """The issue's example: no voluntary disruption on weekdays 09:00-17:00 UTC."""
    budgets = [DisruptionBudget(nodes="0", schedule="0 9 * * mon-fri", duration="8h"), DisruptionBudget(nodes="20%")]

    def allowed(at: datetime) -> int | None:
        return allowed_disruptions(budgets, at, DisruptionReason.EXPIRED, 10, 0).allowed

    tuesday = datetime(2026, 11, 24, tzinfo=UTC)
    assert allowed(tuesday.replace(hour=9)) == 0  # the fire itself opens the window
    assert allowed(tuesday.replace(hour=16, minute=59, second=59)) == 0
    assert allowed(tuesday.replace(hour=17)) == 2  # fire + duration: closed
    assert allowed(tuesday.replace(hour=8, minute=59)) == 2
    assert allowed(datetime(2026, 11, 28, 12, tzinfo=UTC)) == 2  # Saturday
    blocked = allowed_disruptions(budgets, tuesday.replace(hour=10), DisruptionReason.EXPIRED, 10, 0)
    assert blocked.message.startswith("Expired disruption blocked by budgets[0] (nodes: 0, schedule '0 9 * * mon-fri' for 8h)")


@pytest.mark.parametrize(
    ("budget", "says"),
    [
        ({"nodes": "101%"}, "percentage of the pool's nodes from 0% to 100%"),
        ({"nodes": "-1"}, "a count of nodes from 0"),
        ({"nodes": "0", "duration": "8h"}, "schedule and duration go together"),
        ({"nodes": "0", "schedule": "0 9 * * *"}, "schedule and duration go together"),
        ({"nodes": "0", "schedule": "0 9 * * 8", "duration": "8h"}, "day-of-week '8' is outside 0-6"),
        ({"nodes": "0", "reasons": []}, "at least 1 item"),
        ({"nodes": "0", "schedule": "@daily", "duration": "8785h"}, "longer than 8784h"),
        ({"nodes": "0", "reasons": ["Evicted"]}, "'Empty', 'Expired', 'Drifted', 'Underutilized' or 'Cheaper'"),
    ],
)
def test_a_bad_budget_is_refused_saying_what_to_fix(budget: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match="budgets") as refused:
        GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}, "disruption": {"budgets": [budget]}})
    assert says in str(refused.value)


# --- do-not-disrupt ---------------------------------------------------------------------------

_KEYS = st.sampled_from(["tgp.io/do-not-disrupt", "karpenter.sh/do-not-disrupt", "tgp.io/other", "do-not-disrupt", "example.com/do-not-disrupt"])
_VALUES = st.sampled_from(["true", "True", "false", "", "1", "yes", " true"])


@given(st.dictionaries(_KEYS, _VALUES, max_size=4), REASONS)
def test_do_not_disrupt_is_either_annotation_set_to_true(annotations: dict[str, str], reason: DisruptionReason) -> None:
    expected = annotations.get("tgp.io/do-not-disrupt") == "true" or annotations.get("karpenter.sh/do-not-disrupt") == "true"
    assert do_not_disrupt(annotations) is expected
    held = do_not_disrupt(annotations) and blocks(reason)
    assert held is (expected and reason in VOLUNTARY)


@given(st.dictionaries(_KEYS, _VALUES, max_size=3), st.sampled_from(["Pending", "Running", "Succeeded", "Failed", "Unknown"]), st.booleans())
def test_only_an_active_pod_holds_its_node(annotations: dict[str, str], phase: str, deleting: bool) -> None:
    """Karpenter's IsDisruptable: a finished or terminating pod no longer holds its node."""
    active = phase not in ("Succeeded", "Failed") and not deleting
    assert pod_holds_node(annotations, phase, deleting) is (do_not_disrupt(annotations) and active)


def test_do_not_disrupt_holds_voluntary_reasons_only() -> None:
    assert do_not_disrupt({"karpenter.sh/do-not-disrupt": "true"}) and not do_not_disrupt(None)
    assert {r for r in DisruptionReason if blocks(r)} == {
        DisruptionReason.EMPTY, DisruptionReason.EXPIRED, DisruptionReason.DRIFTED, DisruptionReason.UNDERUTILIZED, DisruptionReason.CHEAPER
    }
    for reason in (DisruptionReason.EVICTED, DisruptionReason.INTERRUPTED, DisruptionReason.LOST, DisruptionReason.REPAIR):
        assert not blocks(reason)


def test_do_not_disrupt_on_a_pod_and_on_a_node() -> None:
    """The issue's examples: either annotation, on a running pod or on the Node, holds expiry; a
    finished pod does not; a manual evict goes ahead."""
    annotated = {"tgp.io/do-not-disrupt": "true"}
    assert pod_holds_node(annotated, "Running") and blocks(DisruptionReason.EXPIRED)
    assert not pod_holds_node(annotated, "Succeeded") and not pod_holds_node({"tgp.io/do-not-disrupt": "false"})
    node = {"karpenter.sh/do-not-disrupt": "true", "node.alpha.kubernetes.io/ttl": "0"}
    assert do_not_disrupt(node) and not blocks(DisruptionReason.EVICTED)


def test_a_node_past_expiry_says_what_holds_it() -> None:
    message = held_message(DisruptionReason.EXPIRED, ["ml/train-0", "ml/train-1", "ml/a", "ml/b"])
    assert message.startswith("node is past its expireAfter but do-not-disrupt holds it: ml/train-0, ml/train-1, ml/a and 1 more")
    assert "manual evict does not wait" in message
    assert "terminationGracePeriod (24h) ends the wait" in held_message(DisruptionReason.EXPIRED, ["node"], timedelta(hours=24))


# --- terminationGracePeriod -------------------------------------------------------------------


@given(
    st.datetimes(datetime(2026, 1, 1), datetime(2027, 1, 1)).map(lambda t: t.replace(tzinfo=UTC)),
    st.integers(0, 48 * 3600).map(lambda s: timedelta(seconds=s)),
    st.integers(0, 3 * 3600).map(lambda s: timedelta(seconds=s)),
)
def test_a_pod_is_deleted_in_time_for_its_own_grace(began: datetime, grace: timedelta, pod_grace: timedelta) -> None:
    deadline = termination_deadline(began, grace)
    assert deadline == began + grace and termination_deadline(began, None) is None
    delete_at = pod_delete_at(deadline, pod_grace, began)
    assert began <= delete_at <= deadline
    assert delete_at + pod_grace <= deadline or delete_at == began  # its whole grace fits, unless the window is shorter


@given(
    st.integers(0, 3600),  # terminationGracePeriod, s
    st.integers(0, 600),  # the pod's terminationGracePeriodSeconds
    st.floats(0, 4000, allow_nan=False),  # when the drain looks, s after it began
)
def test_the_drain_deletes_a_stuck_pod_not_before_its_time_and_never_past_the_deadline(grace: int, pod_grace: int, now: float) -> None:
    """The drain's use of pod_delete_at (activities.drain._delete_now): a pod is deleted only
    from the deadline minus its grace, with its own grace or what is left to the deadline,
    whichever is less (so it is gone by the deadline), and always once the deadline is there."""
    from activities.drain import _delete_now
    from tgp.types import PodSummary

    pod = PodSummary(namespace="ml", name="db", grace_period=timedelta(seconds=pod_grace))
    began = 1000.0
    deadline = began + grace
    given_grace = _delete_now(pod, began, deadline, began + now)
    if given_grace is None:
        assert began + now < max(began, deadline - pod_grace)
        return
    assert began + now >= deadline - pod_grace
    assert given_grace <= timedelta(seconds=pod_grace) and began + now + given_grace.total_seconds() <= deadline + 1e-6 or given_grace == timedelta(0)


# --- re-shopping ------------------------------------------------------------------------------

CENTS = st.integers(1, 5000).map(lambda c: Decimal(c) / 100)
POLICIES = st.builds(Consolidation, cheaper_by=st.integers(1, 99).map("{}%".format), after=st.integers(0, 180).map(lambda m: timedelta(minutes=m)))


@given(CENTS, CENTS, st.integers(0, 600).map(lambda m: timedelta(minutes=m)), POLICIES)
def test_reshop_replaces_exactly_when_beyond_threshold_and_after(node: Decimal, best: Decimal, running: timedelta, policy: Consolidation) -> None:
    verdict = reshop(node, running, best, policy)
    percent = Decimal(policy.cheaper_by.removesuffix("%"))
    beyond_threshold = (node - best) * 100 >= node * percent
    if not beyond_threshold or running < policy.after:
        assert not verdict.replace  # never within the threshold or before `after`
    else:
        assert verdict.replace  # always beyond both
    assert verdict.saving == max(Decimal(0), node - best)


@given(CENTS, st.one_of(st.none(), CENTS), st.integers(0, 600).map(lambda m: timedelta(minutes=m)))
def test_reshop_is_off_by_default_and_needs_an_offer(node: Decimal, best: Decimal | None, running: timedelta) -> None:
    assert GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}}).disruption.consolidation is None
    assert not reshop(node, running, best, None).replace
    assert not reshop(node, running, None, Consolidation()).replace


def test_reshop_when_the_market_drops_and_not_within_the_threshold() -> None:
    policy = Consolidation.model_validate({"cheaperBy": "20%", "after": "30m"})
    hour = timedelta(hours=1)
    dropped = reshop(Decimal("1.00"), hour, Decimal("0.79"), policy)
    assert dropped.replace and dropped.saving == Decimal("0.21") and "$0.21/h less" in dropped.message
    assert reshop(Decimal("1.00"), hour, Decimal("0.80"), policy).replace  # exactly 20%: "at least"
    within = reshop(Decimal("1.00"), hour, Decimal("0.81"), policy)
    assert not within.replace and within.saving == Decimal("0.19") and "not 20% cheaper" in within.message
    early = reshop(Decimal("1.00"), timedelta(minutes=29), Decimal("0.50"), policy)
    assert not early.replace and "less than after (30m)" in early.message
    with pytest.raises(ValidationError, match="from 1% to 99%"):
        Consolidation.model_validate({"cheaperBy": "0%"})
