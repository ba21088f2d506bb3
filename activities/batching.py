"""Updates to one workflow from many activities of this worker process, sent together.

Temporal admits at most 10 updates in flight per workflow (history.maxInFlightUpdates). Node
workflows that each called their class ledger on their own, in a burst of a few hundred, got
RESOURCE_EXHAUSTED, then timed out, and failed; a pool's 100 nodes going idle together each asked
the pool on its own, were refused by the server past the tenth, and waited out growing pauses:
the last terminate call came 20 s after the idle timeout instead of a few. Here one update per
target workflow and kind is in flight from this process; the calls made meanwhile wait for it and
go together as the next one. Each caller gets its own answer; an error reaches every caller of
that update (their activities handle it as they would their own).
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import activity


class UpdateBatcher:
    """Gathers calls per (client, workflow id, kind); `_update` sends one batch as one update."""

    def __init__(self, max_batch: int, timeout: float | None = None, gap: float = 0.0) -> None:
        """`timeout`: the most one update may take, in seconds (None: as long as it takes). Its
        callers hear TimeoutError, and the next batch goes: an update the workflow never
        answers must not hold every later call, nor stay open behind its callers' backs.
        `gap`: after an update, the next one to that workflow goes no sooner than this many
        seconds later, unless a whole batch waits for it; the calls made meanwhile wait and go
        together. A call made when none went for that long goes at once."""
        self.max_batch = max_batch
        self.timeout = timeout
        self.gap = gap
        self._waiting: dict[tuple[int, str, str], list[tuple[Any, asyncio.Future[Any]]]] = {}
        self._sending: set[tuple[int, str, str]] = set()
        self._senders: set[asyncio.Task[None]] = set()  # held, so none is collected mid-send

    async def call(self, workflow_id: str, kind: str, item: Any) -> Any:
        """`item`'s answer, from the update that carries it (with the others made meanwhile)."""
        client = activity.client()
        key = (id(client), workflow_id, kind)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append((item, future))
        if key not in self._sending:
            self._sending.add(key)
            sender = asyncio.get_running_loop().create_task(self._send(key, client))
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        return await future

    async def _update(self, client: Any, workflow_id: str, kind: str, items: list[Any]) -> list[Any]:
        """Send `items` as one update of `kind`; one answer per item, in order."""
        raise NotImplementedError

    async def _send(self, key: tuple[int, str, str], client: Any) -> None:
        _, workflow_id, kind = key
        try:
            while self._waiting.get(key):
                waiting = self._waiting[key]
                batch, self._waiting[key] = waiting[: self.max_batch], waiting[self.max_batch :]
                batch = [(item, f) for item, f in batch if not f.done()]  # callers cancelled meanwhile
                if not batch:
                    continue
                try:
                    async with asyncio.timeout(self.timeout):
                        answers = await self._update(client, workflow_id, kind, [item for item, _ in batch])
                    if len(answers) != len(batch):  # never left waiting for an answer that is not there
                        raise RuntimeError(f"{kind} to {workflow_id}: {len(answers)} answers to {len(batch)} calls")
                except Exception as exc:  # noqa: BLE001 - every caller of this update hears of it
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(exc)
                else:
                    for (_, f), answer in zip(batch, answers, strict=True):
                        if not f.done():
                            f.set_result(answer)
                if self.gap and len(self._waiting.get(key, ())) < self.max_batch:
                    await asyncio.sleep(self.gap)  # the calls made meanwhile gather for the next (a full one goes at once)
        finally:
            self._sending.discard(key)
            for _, f in self._waiting.pop(key, []):  # only when this sender was cancelled (the worker stops)
                if not f.done():
                    f.cancel()
