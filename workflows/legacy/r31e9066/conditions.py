"""Status conditions the Kubernetes way: lastTransitionTime moves only when status changes."""

from __future__ import annotations

from datetime import datetime

from workflows.legacy.r31e9066.crds import Condition


def set_condition(
    current: dict[str, Condition], type: str, status: str, reason: str, message: str, *, generation: int | None, now: datetime
) -> dict[str, Condition]:
    """`current` with condition `type` set; its transition time kept when the status is unchanged."""
    old = current.get(type)
    since = old.last_transition_time if old is not None and old.status == status else now
    new = Condition(type=type, status=status, reason=reason, message=message, last_transition_time=since, observed_generation=generation)  # type: ignore[arg-type]
    return {**current, type: new}


def condition_list(wanted: dict[str, tuple[str, str, str]], generation: int | None, now: datetime, previous: dict[str, Condition] | None = None) -> list[Condition]:
    """Conditions from `type -> (status, reason, message)`, Ready first, then by type."""
    conditions = dict(previous or {})
    for type, (status, reason, message) in wanted.items():
        conditions = set_condition(conditions, type, status, reason, message, generation=generation, now=now)
    return sorted((conditions[t] for t in wanted), key=lambda c: (c.type != "Ready", c.type))
