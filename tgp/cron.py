"""Cron schedules of disruption budgets: the syntax Karpenter's budgets (and Kubernetes CronJobs)
take, in UTC, and the one question a budget asks of it: did it fire within a window? Pure.

Syntax: five fields `minute hour day-of-month month day-of-week`, each a comma list of `*`,
`N` or `N-M`, optionally `/step`; month and weekday names (`jan`, `mon-fri`, any case); `?`
for `*` in the day fields; or one of `@yearly` `@annually` `@monthly` `@weekly` `@daily`
`@midnight` `@hourly`. Day rule of robfig/cron (what Karpenter and CronJobs run): when either
day field is `*` or `?` without a step, both must match, otherwise either may.

Why not a library: cronsim (the well-kept pure one on PyPI) follows Debian cron, not
robfig/cron (its day rule differs for `*/n`, it has no `@daily`, and it accepts `L`, `W`, `#`
and a seconds field that the CRD must refuse), and it searches forward up to 50 years where a
budget only needs "did it fire in (now - duration, now]", a bounded walk over the window's days.
The tests check that walk against a minute-by-minute one, and the parser against the CRD's rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
MAX_SCHEDULE_LENGTH = 100


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()  # names[i] means low + i
    value_pattern: str = ""


def _any_case(word: str) -> str:
    # [jJ][aA][nN], not (?i): RE2 and Python fold some non-ASCII letters differently (K, the Kelvin sign).
    return "".join(f"[{c}{c.upper()}]" for c in word)


_FIELDS = (
    _Field("minute", 0, 59, value_pattern="[0-5]?[0-9]"),
    _Field("hour", 0, 23, value_pattern="[01]?[0-9]|2[0-3]"),
    _Field("day-of-month", 1, 31, value_pattern="0?[1-9]|[12][0-9]|3[01]"),
    _Field("month", 1, 12, MONTHS, value_pattern="0?[1-9]|1[0-2]|" + "|".join(map(_any_case, MONTHS))),
    _Field("day-of-week", 0, 6, WEEKDAYS, value_pattern="0?[0-6]|" + "|".join(map(_any_case, WEEKDAYS))),
)


def _field_pattern(field: _Field) -> str:
    value = f"(?:{field.value_pattern})"
    item = rf"(?:\*|{value}(?:-{value})?)(?:/0*[1-9][0-9]?)?"
    if field.name in ("day-of-month", "day-of-week"):
        item = rf"(?:\?|{item})"
    return rf"{item}(?:,{item})*"


# The schedule syntax as an RE2 pattern (the CRD's CEL rule): it refuses what `parse` refuses,
# except a range written backwards (`5-1`), which only `parse` (the bridge) can see.
SCHEDULE_PATTERN = (
    r"^(?:@(?:yearly|annually|monthly|weekly|daily|midnight|hourly)|"
    + " +".join(_field_pattern(f) for f in _FIELDS)
    + r")$"
)
_SCHEDULE = re.compile(SCHEDULE_PATTERN.removeprefix("^").removesuffix("$"))
SCHEDULE_MESSAGE = (
    "schedule must be a cron expression in UTC: five fields 'minute hour day-of-month month day-of-week' "
    "(each *, N, N-M, a list of them, optionally /step; names like jan or mon-fri allowed), "
    "e.g. '0 9 * * mon-fri', or one of @yearly, @monthly, @weekly, @daily, @hourly"
)


class CronError(ValueError):
    """A schedule tgp cannot read; the message names the field and what to fix."""


@dataclass(frozen=True)
class CronSchedule:
    """A parsed five-field schedule: the allowed values of each field."""

    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    day_and: bool  # a day field is a plain * or ?: both day fields must match

    @classmethod
    def parse(cls, text: str) -> CronSchedule:
        """Read `text`, or raise CronError naming the field that is wrong."""
        if len(text) > MAX_SCHEDULE_LENGTH:
            raise CronError(f"a schedule may be at most {MAX_SCHEDULE_LENGTH} characters")
        parts = MACROS.get(text, text).split()
        if len(parts) != 5:
            raise CronError(f"{text!r} has {len(parts)} fields; {SCHEDULE_MESSAGE}")
        sets = [_parse_field(part, field, text) for part, field in zip(parts, _FIELDS, strict=True)]
        if _SCHEDULE.fullmatch(text) is None:  # what the API server refuses, refused alike
            raise CronError(f"{text!r} is not read the same everywhere (spacing, leading zeros, letters); {SCHEDULE_MESSAGE}")
        day_and = _star_list(parts[2]) or _star_list(parts[4])
        return cls(text, *(frozenset(s) for s in sets), day_and=day_and)

    def matches_day(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        in_month = day.day in self.days
        in_week = (day.isoweekday() % 7) in self.weekdays
        return (in_month and in_week) if self.day_and else (in_month or in_week)

    def fired_between(self, start: datetime, end: datetime) -> bool:
        """Whether a fire time F (a whole UTC minute) lies in (start, end]."""
        start, end = _utc(start), _utc(end)
        if end <= start:
            return False
        hours, minutes = sorted(self.hours), sorted(self.minutes)
        day = start.date()
        while day <= end.date():
            if self.matches_day(day):
                midnight = datetime.combine(day, time(), tzinfo=UTC)
                if start < midnight and midnight + timedelta(days=1) <= end:
                    return True  # the whole day is inside the window, and a day that matches fires
                for hour in hours:
                    for minute in minutes:
                        fire = midnight + timedelta(hours=hour, minutes=minute)
                        if fire > end:
                            break
                        if fire > start:
                            return True
            day += timedelta(days=1)
        return False


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)  # naive = UTC, never local time


def _star_list(part: str) -> bool:
    # robfig/cron marks a field as "any" when one of its list items is * or ? without a step > 1.
    def star(item: str) -> bool:
        body, _, step = item.partition("/")
        return body in ("*", "?") and (not step or int(step) == 1)

    return any(star(item) for item in part.split(","))


def _parse_field(part: str, field: _Field, text: str) -> set[int]:
    out: set[int] = set()
    for item in part.split(","):
        out |= _parse_item(item, field, text)
    return out


def _parse_item(item: str, field: _Field, text: str) -> set[int]:
    def bad(why: str) -> CronError:
        return CronError(f"schedule {text!r}: {field.name} {item!r} {why} (e.g. '0 9 * * mon-fri')")

    body, _, step_text = item.partition("/")
    step = 1
    if step_text:
        if not step_text.isdigit() or not 1 <= int(step_text) <= 99:
            raise bad("has a step that is not a number from 1 to 99")
        step = int(step_text)
    if body in ("*", "?"):
        if body == "?" and field.name not in ("day-of-month", "day-of-week"):
            raise bad("may be ? only in the day fields")
        low, high = field.low, field.high
    else:
        first, dash, last = body.partition("-")
        low = _value(first, field, bad)
        high = _value(last, field, bad) if dash else (field.high if step_text else low)
        if high < low:
            raise bad(f"is a range written backwards ({low} after {high})")
    return set(range(low, high + 1, step))


def _value(text: str, field: _Field, bad: Callable[[str], CronError]) -> int:
    lowered = text.lower()
    if lowered in field.names:
        return field.low + field.names.index(lowered)
    if not text.isdigit() or not text.isascii():
        raise bad(f"is not a number from {field.low} to {field.high}" + (f" or a name like {field.names[0]}" if field.names else ""))
    number = int(text)
    if not field.low <= number <= field.high:
        raise bad(f"is outside {field.low}-{field.high}")
    return number


def schedule_problems(text: str) -> list[str]:
    """What is wrong with `text` as a budget's schedule; empty when it is fine."""
    try:
        CronSchedule.parse(text)
    except CronError as error:
        return [str(error)]
    return []

