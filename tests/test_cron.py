"""tgp.cron: the schedules of disruption budgets (issue 21 item 1)."""

from dataclasses import replace
from datetime import UTC, date, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.kube_cel import go_regexp
from tgp.cron import MACROS, SCHEDULE_PATTERN, CronError, CronSchedule, schedule_problems

# Tokens a user might write in a field, good and bad: numbers in and out of every range, names,
# steps, the syntax of other crons (L, W, #) and stray characters.
_VALUES = st.one_of(
    st.integers(1, 6).map(str),  # valid in every field
    st.integers(0, 70).map(str),
    st.sampled_from(["00", "007", "mon", "MON", "Fri", "sun", "jan", "Dec", "foo", "L", "W", "5L", "1#2", "", "-1", "٣"]),
)
_ITEMS = st.one_of(
    st.just("*"),
    st.just("?"),
    _VALUES,
    st.builds(lambda a, b: f"{a}-{b}", _VALUES, _VALUES),
    st.builds(lambda a, s: f"{a}/{s}", st.sampled_from(["*", "0", "5", "1-10", "?"]), st.integers(0, 120).map(str)),
)
_FIELD = st.lists(_ITEMS, min_size=1, max_size=3).map(",".join)
_GOOD = st.one_of(st.just("*"), st.integers(1, 6).map(str), st.builds("{}-{}/{}".format, st.integers(1, 3), st.integers(3, 6), st.integers(1, 9)))
_MOSTLY_GOOD = st.one_of(_GOOD, _GOOD, _GOOD, _FIELD)
_SCHEDULES = st.one_of(
    st.lists(_MOSTLY_GOOD, min_size=5, max_size=5).map(" ".join),
    st.lists(_FIELD, min_size=5, max_size=5).map(" ".join),
    st.lists(_FIELD, min_size=4, max_size=6).map(" ".join),
    st.sampled_from([*MACROS, "@DAILY", "@every 1h", "@daily ", " 0 9 * * *", "0 9 * * *\n", "0  9 * * *"]),
)


def _backwards_range(text: str) -> bool:
    try:
        CronSchedule.parse(text)
    except CronError as error:
        return "backwards" in str(error)
    return False


@given(_SCHEDULES)
def test_the_api_server_and_the_parser_refuse_the_same_schedules(text: str) -> None:
    """The CRD's CEL rule (RE2, as the API server runs it) and the bridge's parser agree, but for
    a range written backwards, which only the parser sees."""
    by_schema = go_regexp(SCHEDULE_PATTERN).search(text) is not None
    by_parser = schedule_problems(text) == []
    assert by_schema == by_parser or (by_schema and _backwards_range(text)), text


def _minute_matches(s: CronSchedule, t: datetime) -> bool:
    """An independent reading of robfig/cron's rule, minute by minute."""
    in_month, in_week = t.day in s.days, (t.weekday() + 1) % 7 in s.weekdays
    day = (in_month and in_week) if s.day_and else (in_month or in_week)
    return t.minute in s.minutes and t.hour in s.hours and t.month in s.months and day


_PARSED = st.sampled_from(
    ["0 9 * * mon-fri", "*/15 * * * *", "30 2 1,15 * *", "0 0 1 * mon", "5 4 * * sun", "0 */6 13 * fri", "@hourly", "@daily", "59 23 31 12 *", "0 12 ? * 3"]
).map(CronSchedule.parse)


@settings(max_examples=60)
@given(_PARSED, st.datetimes(datetime(2025, 1, 1), datetime(2027, 12, 31)), st.integers(0, 4 * 24 * 60))
def test_fired_between_agrees_with_a_minute_by_minute_walk(schedule: CronSchedule, start: datetime, minutes: int) -> None:
    start = start.replace(tzinfo=UTC)
    end = start + timedelta(minutes=minutes, seconds=start.second % 7)
    first = start.replace(second=0, microsecond=0) + timedelta(minutes=1)
    walk = any(_minute_matches(schedule, first + timedelta(minutes=i)) for i in range(minutes + 1) if first + timedelta(minutes=i) <= end)
    assert schedule.fired_between(start, end) == walk


def test_robfig_day_rule_and_names() -> None:
    weekdays = CronSchedule.parse("0 9 * * mon-fri")
    assert weekdays.weekdays == {1, 2, 3, 4, 5} and weekdays.day_and
    assert weekdays.matches_day(date(2026, 11, 24)) and not weekdays.matches_day(date(2026, 11, 28))  # a Tuesday, a Saturday
    either = CronSchedule.parse("0 0 1 * mon")  # both day fields given: the 1st or any Monday
    assert not either.day_and and either.matches_day(date(2026, 11, 23)) and either.matches_day(date(2026, 12, 1))
    stepped = CronSchedule.parse("0 0 */2 * mon")  # robfig: */2 is not "any", so either (Debian cron: both)
    assert not stepped.day_and
    assert CronSchedule.parse("0 0 */01 * mon").day_and and CronSchedule.parse("0 0 5,* * mon").day_and
    assert replace(CronSchedule.parse("@weekly"), text="") == replace(CronSchedule.parse("0 0 * * 0"), text="")
    assert CronSchedule.parse("5/20 * * * *").minutes == {5, 25, 45}
    assert CronSchedule.parse("0 9 * JAN-mar *").months == {1, 2, 3}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("61 * * * *", "minute '61' is outside 0-59"),
        ("0 24 * * *", "hour '24' is outside 0-23"),
        ("0 9 * * 7", "day-of-week '7' is outside 0-6"),
        ("0 9 * * mon-fri *", "has 6 fields"),
        ("0 9 * *", "has 4 fields"),
        ("5-1 * * * *", "range written backwards"),
        ("*/0 * * * *", "step"),
        ("0 9 L * *", "day-of-month 'L' is not a number"),
        ("@every 1h", "has 2 fields"),
    ],
)
def test_a_bad_schedule_says_what_to_fix(text: str, says: str) -> None:
    [problem] = schedule_problems(text)
    assert says in problem and "\n" not in problem
