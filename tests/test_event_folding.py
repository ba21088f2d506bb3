"""Issue 37: a pool's pass writes the Events of one reason on one object as one Event
(`activities.entity.folded`): nothing is lost (the counts add up, every kind of Event is there,
in the order it first came), nothing is merged across objects, types or reasons, and the message
stays within the API's bound, naming as many as fit and how many more."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from activities.entity import EventSpec, folded
from activities.kube.cluster import EVENT_MESSAGE_LIMIT
from tgp.messages import ObjectRef

refs = st.sampled_from(
    [
        ObjectRef(kind="GPUNodePool", name="burst", namespace="ml", uid="u1"),
        ObjectRef(kind="GPUNodePool", name="burst", namespace="other", uid="u2"),
        ObjectRef(kind="Pod", name="train-0", namespace="ml", uid="p0"),
    ]
)
events = st.builds(
    EventSpec,
    ref=refs,
    type=st.sampled_from(["Normal", "Warning"]),
    reason=st.sampled_from(["NodeLaunched", "NodeReady", "NodeTerminated"]),
    message=st.text(alphabet="abc xyz-0123", min_size=1, max_size=400),
    count=st.integers(min_value=1, max_value=3),
)


def kind(e: EventSpec) -> tuple[object, ...]:
    return (e.ref.kind, e.ref.namespace, e.ref.name, e.ref.uid, e.type, e.reason)


@given(st.lists(events, max_size=60))
def test_a_writes_events_fold_by_object_and_reason_and_lose_no_occurrence(batch: list[EventSpec]) -> None:
    out = folded(batch)
    assert [kind(e) for e in out] == list(dict.fromkeys(kind(e) for e in batch)), "one Event per kind, in first-come order"
    for e in out:
        group = [b for b in batch if kind(b) == kind(e)]
        assert e.count == sum(b.count for b in group)
        assert len(e.message) <= EVENT_MESSAGE_LIMIT
        if len(group) == 1:
            assert e == group[0], "an Event alone is written as it came"
            continue
        shown = e.message.split("; ")
        if shown[-1].startswith("and ") and shown[-1].endswith(" more"):
            hidden = int(shown[-1].removeprefix("and ").removesuffix(" more"))
            shown = shown[:-1]
        else:
            hidden = 0
        assert hidden < len(group), "at least the first message is shown"
        assert "; ".join(shown) == "; ".join(b.message for b in group[: len(group) - hidden])[: len("; ".join(shown))]


def test_a_bursts_launches_are_one_event_that_names_the_first_and_counts_all() -> None:
    pool = ObjectRef(kind="GPUNodePool", name="burst", namespace="ml", uid="u1")
    batch = [EventSpec(ref=pool, reason="NodeLaunched", message=f"launching node gpu-{i:03d} for pod ml/train-{i}") for i in range(500)]
    batch.insert(3, EventSpec(ref=pool, type="Warning", reason="BudgetExhausted", message="the class's limits.maxNodes is reached"))
    launched, warning = folded(batch)
    assert warning == batch[3]
    assert launched.count == 500 and launched.message.startswith("launching node gpu-000 for pod ml/train-0; launching node gpu-001")
    assert launched.message.endswith(" more") and len(launched.message) <= EVENT_MESSAGE_LIMIT
    named = launched.message.count("launching node")
    assert launched.message.endswith(f"; and {500 - named} more")
