"""How a real cloud's control plane behaves under load, shared by the simulated cloud
(sim.cloud) and the four provider fakes (sim.runpod, sim.lambdalabs, sim.paperspace,
sim.vastai): the fakes speak each API's wire format, this model decides *what happens*.

Real clouds are eventually consistent and their gateways answer independently of their
backends (reference/providers.md, section 5). Tests choose the behaviour:

* **lag** (`list_lag`, `describe_lag`): a new instance is missing from lists, and describe-by-id
  answers 404, for that many seconds after it was bought;
* **create outcomes** (`next_creates`): a create is bought and answered (`OK`); or the connection
  drops before any answer and the backend buys `late_create_after` seconds later (`LATE`, a
  create slower than any client waits); or it is bought, then answered 429 (`THROTTLED_AFTER_BUY`),
  503 (`FAILED_AFTER_BUY`), a connection reset (`RESET_AFTER_BUY`), or nothing until the client
  gives up (`TIMEOUT_AFTER_BUY`);
* **terminate outcomes** (`next_terminates`): a terminate answers success and ends the instance
  (`OK`), does nothing (`LIE`), or ends it `late_terminate_after` seconds later (`LATE`);
* **vanishing**: the provider takes an instance away by itself (`SimulatedCloud.preempt`; the
  fake tells the model through `ended`).

The model's **truth** (`billing`, `billing_named`) is what really bills, whatever the API
answered: the property tests judge tgp by it. Time is `clock` (seconds); a test passes a
`ManualClock` and moves it with `advance`, so a 90 s lag costs no wall time. Late creates and
late terminates happen when the clock passes their time: every request a fake serves first
calls `settle`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

from aiohttp import web

__all__ = ["CreateOutcome", "ManualClock", "ProviderModel", "Record", "TerminateOutcome", "drop_connection"]

T = TypeVar("T")


class CreateOutcome(StrEnum):
    OK = "ok"
    LATE = "late"
    THROTTLED_AFTER_BUY = "429-after-buy"
    FAILED_AFTER_BUY = "5xx-after-buy"
    RESET_AFTER_BUY = "reset-after-buy"
    TIMEOUT_AFTER_BUY = "timeout-after-buy"


class TerminateOutcome(StrEnum):
    OK = "ok"
    LIE = "lie"
    LATE = "late"


class ManualClock:
    """A clock that moves only when told: `clock()` is now, `advance(s)` moves it."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


@dataclass
class Record:
    """One instance as the backend knows it (not as any API answer shows it)."""

    id: str
    name: str
    created_at: float
    ended_at: float | None = None

    @property
    def billing(self) -> bool:
        return self.ended_at is None


@dataclass
class _Later:
    due: float
    action: Callable[[], object]
    done: bool = field(default=False)


class ProviderModel:
    """One cloud's behaviour and truth (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        list_lag: float = 0.0,
        describe_lag: float = 0.0,
        late_create_after: float = 70.0,
        late_terminate_after: float = 30.0,
    ) -> None:
        self.clock = clock
        self.list_lag = list_lag
        self.describe_lag = describe_lag
        self.late_create_after = late_create_after
        self.late_terminate_after = late_terminate_after
        self.records: dict[str, Record] = {}
        self.create_outcomes: deque[CreateOutcome] = deque()
        self.terminate_outcomes: deque[TerminateOutcome] = deque()
        self.creates_by_outcome: dict[CreateOutcome, int] = {o: 0 for o in CreateOutcome}
        self._later: list[_Later] = []
        # Answers held back (TIMEOUT_AFTER_BUY) wait on this until the server stops.
        self.held = asyncio.Event()

    # --- what a test chooses -------------------------------------------------------------

    def next_creates(self, *outcomes: CreateOutcome | str) -> None:
        """The next creates end as `outcomes`, in order; after them, `OK`."""
        self.create_outcomes.extend(CreateOutcome(o) for o in outcomes)

    def next_terminates(self, *outcomes: TerminateOutcome | str) -> None:
        """The next terminates end as `outcomes`, in order; after them, `OK`."""
        self.terminate_outcomes.extend(TerminateOutcome(o) for o in outcomes)

    def reset(self) -> None:
        """Behave consistently again: no lag, no queued outcomes (what already happened, and
        late actions under way, stay: they are the truth)."""
        self.list_lag = self.describe_lag = 0.0
        self.create_outcomes.clear()
        self.terminate_outcomes.clear()

    # --- truth ---------------------------------------------------------------------------

    def billing(self) -> list[Record]:
        """Every instance that really bills now, whatever the API says."""
        self.settle()
        return [r for r in self.records.values() if r.billing]

    def billing_named(self, name: str) -> list[Record]:
        return [r for r in self.billing() if r.name == name]

    def pending(self) -> int:
        """Late creates and terminates not yet happened."""
        return sum(1 for job in self._later if not job.done)

    # --- what a fake calls ----------------------------------------------------------------

    def settle(self) -> None:
        """Carry out every late create and terminate whose time has come."""
        now = self.clock()
        for job in sorted(self._later, key=lambda j: j.due):
            if not job.done and job.due <= now:
                job.done = True
                job.action()
        self._later = [j for j in self._later if not j.done]

    def create(self, buy: Callable[[], T]) -> tuple[CreateOutcome, T | None]:
        """Decide the next create: `buy` (which makes the instance and calls `bought`) runs
        now, or for `LATE` when the clock passes `late_create_after` from now (then None)."""
        self.settle()
        outcome = self.create_outcomes.popleft() if self.create_outcomes else CreateOutcome.OK
        self.creates_by_outcome[outcome] += 1
        if outcome is CreateOutcome.LATE:
            self._later.append(_Later(self.clock() + self.late_create_after, buy))
            return outcome, None
        return outcome, buy()

    def bought(self, instance_id: str, name: str) -> None:
        """The backend made an instance (the fake calls this from its `buy`)."""
        self.records[instance_id] = Record(instance_id, name, self.clock())

    def ended(self, instance_id: str) -> None:
        """The instance stopped billing (terminated, preempted, vanished)."""
        record = self.records.get(instance_id)
        if record is not None and record.ended_at is None:
            record.ended_at = self.clock()

    def listed(self, instance_id: str) -> bool:
        """Whether lists show the instance yet (instances the model never saw: yes)."""
        return self._visible(instance_id, self.list_lag)

    def describable(self, instance_id: str) -> bool:
        """Whether describe-by-id finds the instance yet (else it answers 404)."""
        return self._visible(instance_id, self.describe_lag)

    def _visible(self, instance_id: str, lag: float) -> bool:
        self.settle()
        record = self.records.get(instance_id)
        return record is None or self.clock() - record.created_at >= lag

    def terminate(self, instance_id: str, end: Callable[[], object]) -> TerminateOutcome:
        """Decide a terminate the API will answer as done: `end` (the fake's own, which ends
        the instance and calls `ended`) runs now, never (`LIE`), or later (`LATE`)."""
        self.settle()
        outcome = self.terminate_outcomes.popleft() if self.terminate_outcomes else TerminateOutcome.OK
        if outcome is TerminateOutcome.OK:
            end()
        elif outcome is TerminateOutcome.LATE:
            self._later.append(_Later(self.clock() + self.late_terminate_after, end))
        return outcome

    async def answer_create(
        self, request: web.Request, outcome: CreateOutcome, error: Callable[[int], web.StreamResponse]
    ) -> web.StreamResponse | None:
        """The answer a fake gives for a create that did not go `OK` (None for `OK`: the fake
        answers as usual). `error(status)` words an error in the fake's own shape."""
        if outcome is CreateOutcome.OK:
            return None
        if outcome is CreateOutcome.THROTTLED_AFTER_BUY:
            return error(429)
        if outcome is CreateOutcome.FAILED_AFTER_BUY:
            return error(503)
        if outcome is CreateOutcome.TIMEOUT_AFTER_BUY:
            await self.held.wait()  # the client gives up first; the server stopping ends it
        return drop_connection(request)


def drop_connection(request: web.Request) -> web.StreamResponse:
    """Close the connection without an answer: the client sees a reset (a transport error)."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=499)
