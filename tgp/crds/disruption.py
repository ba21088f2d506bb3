"""A pool's disruption settings (issue 21): when idle or expired nodes go, how long a drain
waits, the budgets that bound how many nodes are disrupted at once, and consolidation."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from tgp.cron import MAX_SCHEDULE_LENGTH, SCHEDULE_MESSAGE, SCHEDULE_PATTERN, schedule_problems
from tgp.crds.common import (
    DURATION_PATTERN,
    MAX_DRAIN_TIMEOUT,
    MAX_SCALAR_LENGTH,
    MIN_EXPIRE_AFTER,
    MIN_IDLE_TIMEOUT,
    Duration,
    Spec,
    _admission_bounds,
    _at_least,
    format_duration,
    parse_duration,
)


# Karpenter's reasons (Empty, Drifted, Underutilized) plus tgp's: Expired waits for the budget
# here (as in Karpenter before v1), Cheaper is a re-shop to a cheaper offer.
BUDGET_REASONS = ("Empty", "Expired", "Drifted", "Underutilized", "Cheaper")
BudgetReason = Literal["Empty", "Expired", "Drifted", "Underutilized", "Cheaper"]
MAX_BUDGETS = 50
# A budget's window is at most a year: a budget active for longer needs no schedule, and the
# check walks the window's days. Checked by the model (the bridge), as a pattern cannot bound it.
MAX_BUDGET_DURATION = timedelta(days=366)
BUDGET_NODES_PATTERN = r"^((100|[0-9]{1,2})%|[0-9]{1,4})$"
BUDGET_NODES_MESSAGE = (
    "nodes must be a count of nodes from 0 to 9999 (e.g. 2; 0 blocks) or a percentage of the pool's nodes from 0% "
    "to 100%, rounded up (e.g. 10%)"
)
BUDGET_WINDOW_RULE = "has(self.schedule) == has(self.duration)"
BUDGET_WINDOW_MESSAGE = (
    "schedule and duration go together: give both (the budget is active for duration from each time the schedule "
    "fires) or neither (always active)"
)
CHEAPER_BY_PATTERN = r"^[1-9][0-9]?%$"
CHEAPER_BY_MESSAGE = "cheaperBy must be a percentage from 1% to 99% (e.g. 20%): how much cheaper the best offer must be"


def _cel_matches(pattern: str, message: str) -> dict[str, str]:
    quoted = pattern.replace("\\", "\\\\").replace("'", "\\'")
    return {"rule": f"self.matches('{quoted}')", "message": message}


def _check_pattern(value: str, pattern: str, message: str) -> str:
    if re.fullmatch(pattern.removeprefix("^").removesuffix("$"), value) is None:
        raise ValueError(f"{value[:40]!r}: {message}")
    return value


def _check_schedule(value: str | None) -> str | None:
    if value is not None and (problems := schedule_problems(value)):
        raise ValueError(problems[0])
    return value


BudgetNodes = Annotated[
    str,
    BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v),
    AfterValidator(lambda v: _check_pattern(v, BUDGET_NODES_PATTERN, BUDGET_NODES_MESSAGE)),
    WithJsonSchema(
        {"type": "string", "maxLength": 5, "x-kubernetes-validations": [_cel_matches(BUDGET_NODES_PATTERN, BUDGET_NODES_MESSAGE)]}
    ),
]
# Optional strings and durations written without `nullable`: a null the API server drops, so a
# CEL `has()` sees an absent field, never a present null.
Schedule = Annotated[
    str | None,
    AfterValidator(_check_schedule),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": MAX_SCHEDULE_LENGTH,
            "x-kubernetes-validations": [_cel_matches(SCHEDULE_PATTERN, SCHEDULE_MESSAGE)],
        }
    ),
]
OptionalDuration = Annotated[Duration | None, WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN, "maxLength": MAX_SCALAR_LENGTH})]
# Karpenter writes "Never" where a duration may be switched off (expireAfter, consolidateAfter):
# its manifests apply unchanged. "Never" is kept as written, so the spec reads back the same.
NEVER = "Never"
NEVER_OR_DURATION_PATTERN = f"^({DURATION_PATTERN[1:-1]}|{NEVER})$"


def _never_or_duration(value: Any) -> Any:
    return value if value == NEVER else parse_duration(value)


NeverOrDuration = Annotated[
    timedelta | Literal["Never"] | None,
    BeforeValidator(_never_or_duration),
    PlainSerializer(lambda v: v if v is None or v == NEVER else format_duration(v), return_type=str | None),
    WithJsonSchema({"type": "string", "pattern": NEVER_OR_DURATION_PATTERN, "maxLength": MAX_SCALAR_LENGTH}),
]


class DisruptionBudget(Spec):
    """How many of the pool's nodes tgp may disrupt at once, when, and for which reasons."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{"rule": BUDGET_WINDOW_RULE, "message": BUDGET_WINDOW_MESSAGE}]})

    nodes: BudgetNodes = Field(
        "10%",
        description="How many of the pool's nodes may be disrupting at once: a count (\"2\"; \"0\" blocks every disruption "
        "this budget covers) or a percentage of the pool's nodes (\"10%\", rounded up: 10% of 3 nodes is 1). Nodes "
        "already disrupting count against it.",
    )
    schedule: Schedule = Field(
        None,
        description="When the budget becomes active: a cron expression in UTC (\"0 9 * * mon-fri\"; minute hour "
        "day-of-month month day-of-week) or @yearly, @monthly, @weekly, @daily, @hourly. Needs duration. Unset = always active.",
    )
    duration: OptionalDuration = Field(
        None,
        description=f"How long the budget stays active each time its schedule fires, e.g. 8h; at most {format_duration(MAX_BUDGET_DURATION)} "
        "(the bridge refuses more). Needs schedule.",
    )
    reasons: list[BudgetReason] | None = Field(
        None,
        min_length=1,
        max_length=len(BUDGET_REASONS),
        description="The disruptions this budget limits: Empty (idle), Expired, Drifted, Underutilized, Cheaper (a re-shop "
        "to a cheaper offer). Unset = all of them. A manual evict, an interruption and a lost node are never limited.",
    )

    @model_validator(mode="after")
    def _window_needs_both(self) -> DisruptionBudget:
        if (self.schedule is None) != (self.duration is None):
            raise ValueError(BUDGET_WINDOW_MESSAGE)
        if self.duration is not None and self.duration > MAX_BUDGET_DURATION:
            raise ValueError(
                f"duration {format_duration(self.duration)} is longer than {format_duration(MAX_BUDGET_DURATION)}: "
                "a budget active for longer needs no schedule"
            )
        return self

    def describe(self) -> str:
        """The budget as a user wrote it, for messages and Events: `nodes: 0, schedule '0 9 * * mon-fri' for 8h, reasons Drifted`."""
        parts = [f"nodes: {self.nodes}"]
        if self.schedule is not None and self.duration is not None:
            parts.append(f"schedule '{self.schedule}' for {format_duration(self.duration)}")
        if self.reasons is not None:
            parts.append(f"reasons {', '.join(self.reasons)}")
        return ", ".join(parts)


class Consolidation(Spec):
    """Re-shopping: replace a node by a cheaper current offer that fits its pods."""

    cheaper_by: Annotated[
        str,
        AfterValidator(lambda v: _check_pattern(v, CHEAPER_BY_PATTERN, CHEAPER_BY_MESSAGE)),
        WithJsonSchema({"type": "string", "maxLength": 4, "x-kubernetes-validations": [_cel_matches(CHEAPER_BY_PATTERN, CHEAPER_BY_MESSAGE)]}),
    ] = Field(
        "20%",
        description="Replace a node when the best current offer that fits its pods costs at least this much less per hour "
        "than the node's own offer, as a percentage of the node's price (\"20%\": $1.00/h is replaced by $0.80/h or less).",
    )
    after: Duration = Field(
        timedelta(minutes=30),
        description="Re-shop a node only once the cheaper offer has lasted this long (so never a node that has run for less), "
        "e.g. 30m: a replacement costs a boot and a drain, and a price that dips for minutes is not worth one. The replacement "
        "is bought and Ready before the node drains (make-before-break), within the disruption budgets; a node a "
        "do-not-disrupt pod or Node holds is never re-shopped.",
    )
    policy: Literal["WhenEmpty", "WhenEmptyOrUnderutilized"] = Field(
        "WhenEmptyOrUnderutilized",
        description="Karpenter's consolidationPolicy. WhenEmptyOrUnderutilized: also remove a node whose pods fit on the "
        "free GPUs of the pool's other Ready nodes (GPUs are whole-node: a pod's GPUs all sit on one node), once it has "
        "run `after`. WhenEmpty: never remove a node that runs pods (empty nodes go by idleTimeout); re-shopping "
        "(cheaperBy) works with either.",
    )


class Disruption(Spec):
    idle_timeout: Duration = Field(
        timedelta(minutes=10),
        description=f"Drain and terminate a node with no workload pods for this long, e.g. 10m; at least {format_duration(MIN_IDLE_TIMEOUT)} (the bridge refuses less).",
    )
    expire_after: NeverOrDuration = Field(
        None,
        description=f"Replace nodes older than this, e.g. 720h; at least {format_duration(MIN_EXPIRE_AFTER)} (the bridge refuses less); "
        "unset or Never (Karpenter's spelling) = never.",
    )
    consolidate_after: NeverOrDuration = Field(
        None,
        description="Karpenter's consolidateAfter, so its manifests apply unchanged. Never: tgp never disrupts a node of this "
        "pool for being empty or underutilized, nor re-shops it (consolidation and idleTimeout are off). A duration: how long "
        f"a node must be empty before it goes, in place of idleTimeout (at least {format_duration(MIN_IDLE_TIMEOUT)}, the bridge "
        "refuses less); underutilized nodes and re-shops keep consolidation.after. Unset: idleTimeout and consolidation as given.",
    )
    drain_timeout: Duration = Field(
        timedelta(minutes=10),
        description=f"Give up waiting for evictions after this and terminate anyway, e.g. 10m; at most {format_duration(MAX_DRAIN_TIMEOUT)} (the bridge refuses more).",
    )

    @field_validator("idle_timeout")
    @classmethod
    def _idle_timeout_bound(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        bounds = _admission_bounds(info)
        if bounds is not None:
            _at_least(value, bounds.min_idle_timeout, "nodes would be terminated before pods reach them, then bought again")
        return value

    @field_validator("expire_after")
    @classmethod
    def _expire_after_bound(cls, value: timedelta | str | None, info: ValidationInfo) -> timedelta | str | None:
        bounds = _admission_bounds(info)
        if bounds is not None and isinstance(value, timedelta):
            _at_least(value, bounds.min_expire_after, "nodes would be replaced about as fast as they boot")
        return value

    @field_validator("consolidate_after")
    @classmethod
    def _consolidate_after_bound(cls, value: timedelta | str | None, info: ValidationInfo) -> timedelta | str | None:
        bounds = _admission_bounds(info)
        if bounds is not None and isinstance(value, timedelta):
            why = "it is how long a node must be empty before it goes, and nodes would be terminated before pods reach them, then bought again"
            _at_least(value, bounds.min_idle_timeout, why)
        return value

    @property
    def expiry(self) -> timedelta | None:
        """How old a node may get (None: never, for unset and Never alike)."""
        return self.expire_after if isinstance(self.expire_after, timedelta) else None

    @property
    def consolidates(self) -> bool:
        """False under `consolidateAfter: Never`: no node goes for being empty or underutilized, none is re-shopped."""
        return self.consolidate_after != NEVER

    @property
    def idle(self) -> timedelta | None:
        """How long a node may be empty before it goes: consolidateAfter when a duration, else
        idleTimeout; None under consolidateAfter: Never."""
        if not self.consolidates:
            return None
        return self.consolidate_after if isinstance(self.consolidate_after, timedelta) else self.idle_timeout

    @property
    def consolidation_policy(self) -> Consolidation | None:
        """The consolidation in force: spec.disruption.consolidation, None when off or under consolidateAfter: Never."""
        return self.consolidation if self.consolidates else None

    @field_validator("drain_timeout")
    @classmethod
    def _drain_timeout_bound(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        bounds = _admission_bounds(info)
        if bounds is not None and value > bounds.max_drain_timeout:
            raise ValueError(f"{format_duration(value)} is above the maximum of {format_duration(bounds.max_drain_timeout)}")
        return value

    budgets: list[DisruptionBudget] = Field(
        [DisruptionBudget()],
        max_length=MAX_BUDGETS,
        description="Disruption budgets (Karpenter's): how many nodes tgp may disrupt at once for voluntary reasons "
        "(Empty, Expired, Drifted, Underutilized, Cheaper). When several are active the most restrictive wins. "
        f"Unset = one budget of nodes: 10%; an empty list = no limit. At most {MAX_BUDGETS}.",
    )
    consolidation: Consolidation | None = Field(
        None,
        description="Re-shopping to cheaper offers (cheaperBy, after); unset = off. \"consolidation: {}\" turns it on "
        "with cheaperBy 20% and after 30m.",
    )
    termination_grace_period: OptionalDuration = Field(
        None,
        description="Karpenter's terminationGracePeriod: the longest a node's drain may take once it began, e.g. 24h. "
        "At it the instance is terminated anyway, overriding PodDisruptionBudgets and do-not-disrupt pods; a pod the drain "
        "cannot evict is deleted at the deadline minus its own terminationGracePeriodSeconds, so it gets its grace first. "
        "drainTimeout bounds the drain too, and the shorter wins. With expireAfter it bounds a node's life: do-not-disrupt "
        "holds an expired node at most this long past its expiry, drain included (expireAfter + terminationGracePeriod, as in "
        "Karpenter v1). It makes drift eventual: do-not-disrupt holds a drifted node whose replacement is Ready at most this long. "
        "It does not bound how long do-not-disrupt holds an idle node (a manual evict does not wait).",
    )
