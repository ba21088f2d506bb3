"""Status conditions the Kubernetes way: lastTransitionTime moves only when status changes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from tgp.crds import Condition

# A condition's message is read by people and carried in the entity's state: what it quotes of
# a spec (lists of GPU types, regions) is named up to MAX_QUOTED items, and a message is cut at
# MAX_MESSAGE_LENGTH whatever it quotes (Kubernetes allows 32768; a status must stay small).
MAX_QUOTED = 10
MAX_MESSAGE_LENGTH = 1024


def quoted(items: Sequence[object], limit: int = MAX_QUOTED) -> str:
    """`a, b, c … and N more`: the first `limit` of `items`, then how many were left out."""
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f" … and {len(items) - limit} more" if len(items) > limit else "")


def bounded(message: str, limit: int = MAX_MESSAGE_LENGTH) -> str:
    """`message`, cut to `limit` characters with how many were left out."""
    if len(message) <= limit:
        return message
    tail = f" … and {len(message) - limit} more characters"
    return message[: limit - len(tail)] + tail


def set_condition(
    current: dict[str, Condition], type: str, status: str, reason: str, message: str, *, generation: int | None, now: datetime
) -> dict[str, Condition]:
    """`current` with condition `type` set; its transition time kept when the status is unchanged."""
    old = current.get(type)
    since = old.last_transition_time if old is not None and old.status == status else now
    new = Condition(type=type, status=status, reason=reason, message=bounded(message), last_transition_time=since, observed_generation=generation)  # type: ignore[arg-type]
    return {**current, type: new}


def condition_list(wanted: dict[str, tuple[str, str, str]], generation: int | None, now: datetime, previous: dict[str, Condition] | None = None) -> list[Condition]:
    """Conditions from `type -> (status, reason, message)`, Ready first, then by type."""
    conditions = dict(previous or {})
    for type, (status, reason, message) in wanted.items():
        conditions = set_condition(conditions, type, status, reason, message, generation=generation, now=now)
    return sorted((conditions[t] for t in wanted), key=lambda c: (c.type != "Ready", c.type))
