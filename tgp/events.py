"""Kubernetes Events as an entity workflow asks for them, and a pass's Events folded by kind."""

from __future__ import annotations

from pydantic import Field

from tgp.messages import Msg, ObjectRef

# The longest Event message tgp writes; past it, cut.
EVENT_MESSAGE_LIMIT = 1024
# Between the messages of one folded Event (some messages hold "; " of their own).
SEPARATOR = " | "


class EventSpec(Msg):
    """An Event to write about `ref`, standing for `count` occurrences (`folded`)."""

    ref: ObjectRef
    type: str = "Normal"
    reason: str
    message: str
    count: int = Field(1, ge=1, description="How many occurrences this one Event stands for (`folded`).")


def folded(events: list[EventSpec]) -> list[EventSpec]:
    """The Events of one write with the same object, type and reason as one Event each, in the
    order they first came: its `count` says how many, its message lists theirs as far as
    EVENT_MESSAGE_LIMIT allows ("... | and 27 more"). A burst's pass launches hundreds of nodes:
    one NodeLaunched per node buried the pool's other Events in `kubectl describe` and cost a
    request each. An Event alone is as it came."""
    groups: dict[tuple[object, ...], list[EventSpec]] = {}
    for e in events:
        groups.setdefault((e.ref.kind, e.ref.namespace, e.ref.name, e.ref.uid, e.type, e.reason), []).append(e)
    return [group[0] if len(group) == 1 else _one_for(group) for group in groups.values()]


def _and_more(n: int) -> str:
    """What a folded message ends with for `n` messages not shown ("" for none)."""
    return f"{SEPARATOR}and {n} more" if n else ""


def _one_for(group: list[EventSpec]) -> EventSpec:
    """The group's messages in order, as many as fit with "and N more" for the rest; a first
    message too long alone is cut so that the count of the rest still shows."""
    shown: list[str] = []
    length = 0  # of SEPARATOR.join(shown)
    hidden = 0
    for i, e in enumerate(group):
        after = len(group) - i - 1
        more = _and_more(after)
        grown = length + (len(SEPARATOR) if shown else 0) + len(e.message)
        if grown + len(more) <= EVENT_MESSAGE_LIMIT:
            shown.append(e.message)
            length = grown
            continue
        if shown:
            hidden = len(group) - i  # the last one shown left room for this count
        else:
            shown.append(e.message[: EVENT_MESSAGE_LIMIT - len(more)])
            hidden = after
        break
    message = SEPARATOR.join(shown) + _and_more(hidden)
    return group[0].model_copy(update={"message": message, "count": sum(e.count for e in group)})
