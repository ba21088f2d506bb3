"""Issue 37: a pool's pass writes the Events of one reason on one object as one Event
(`tgp.events.folded`): nothing is lost (the counts add up, every kind of Event is there, in the
order it first came), nothing is merged across objects, types or reasons, and the message stays
within the API's bound, naming as many as fit, in order, and how many more."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from tgp.events import EVENT_MESSAGE_LIMIT, SEPARATOR, EventSpec, folded
from tgp.messages import ObjectRef

refs = st.sampled_from(
    [
        ObjectRef(kind="GPUNodePool", name="burst", namespace="ml", uid="u1"),
        ObjectRef(kind="GPUNodePool", name="burst", namespace="other", uid="u2"),
        ObjectRef(kind="Pod", name="train-0", namespace="ml", uid="p0"),
    ]
)
# Messages as tgp writes them ("; " inside some), from a few characters to past the bound alone.
messages = st.one_of(st.text(alphabet="abc xyz-0123;:", min_size=1, max_size=120), st.text(alphabet="ab ;", min_size=300, max_size=1500))
events = st.builds(
    EventSpec,
    ref=refs,
    type=st.sampled_from(["Normal", "Warning"]),
    reason=st.sampled_from(["NodeLaunched", "NodeReady", "NodeTerminated"]),
    message=messages,
    count=st.integers(min_value=1, max_value=3),
)
MORE = re.compile(rf"{re.escape(SEPARATOR)}and (\d+) more$")


def kind(e: EventSpec) -> tuple[object, ...]:
    return (e.ref.kind, e.ref.namespace, e.ref.name, e.ref.uid, e.type, e.reason)


@given(st.lists(events, max_size=40))
def test_a_writes_events_fold_by_object_and_reason_and_lose_no_occurrence(batch: list[EventSpec]) -> None:
    out = folded(batch)
    assert [kind(e) for e in out] == list(dict.fromkeys(kind(e) for e in batch)), "one Event per kind, in first-come order"
    for e in out:
        group = [b.message for b in batch if kind(b) == kind(e)]
        assert e.count == sum(b.count for b in batch if kind(b) == kind(e))
        if len(group) == 1:
            assert e in batch, "an Event alone is written as it came"
            continue
        assert len(e.message) <= EVENT_MESSAGE_LIMIT
        more = MORE.search(e.message)
        hidden = int(more.group(1)) if more else 0
        shown = len(group) - hidden
        assert shown >= 1, "at least the first message shows"
        listed = e.message[: more.start()] if more else e.message
        if hidden and shown == 1 and len(group[0]) + len(more.group(0)) > EVENT_MESSAGE_LIMIT:
            assert group[0].startswith(listed) and len(e.message) == EVENT_MESSAGE_LIMIT, "a first message too long alone is cut to the bound"
            continue
        assert listed == SEPARATOR.join(group[:shown]), "the messages shown are the first ones, whole, in order"
        if hidden:  # the next one would not have fitted
            rest = f"{SEPARATOR}and {hidden - 1} more" if hidden > 1 else ""
            assert len(SEPARATOR.join(group[: shown + 1]) + rest) > EVENT_MESSAGE_LIMIT


def test_a_bursts_launches_are_one_event_that_names_the_first_and_counts_all() -> None:
    pool = ObjectRef(kind="GPUNodePool", name="burst", namespace="ml", uid="u1")
    batch = [EventSpec(ref=pool, reason="NodeLaunched", message=f"launching node gpu-{i:03d} for pod ml/train-{i}") for i in range(500)]
    batch.insert(3, EventSpec(ref=pool, type="Warning", reason="BudgetExhausted", message="the class's limits.maxNodes is reached"))
    launched, warning = folded(batch)
    assert warning == batch[3]
    assert launched.count == 500 and launched.message.startswith("launching node gpu-000 for pod ml/train-0 | launching node gpu-001")
    named = launched.message.count("launching node")
    assert launched.message.endswith(f" | and {500 - named} more") and len(launched.message) <= EVENT_MESSAGE_LIMIT


def test_two_messages_that_fit_together_are_both_shown() -> None:
    pool = ObjectRef(kind="GPUNodePool", name="burst", namespace="ml")
    a, b = (EventSpec(ref=pool, reason="NodeReady", message=c * 510) for c in "ab")
    (one,) = folded([a, b])
    assert one.message == a.message + SEPARATOR + b.message and one.count == 2
