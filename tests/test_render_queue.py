"""One class's renders cannot starve every other class (issue 35, item 14).

The renders' queue (activities/boot/renders.py) had one waiting cap for all classes: a class
with MAX_WAITING_RENDERS renders waiting (a burst of launches, validations retried) made every
other class's launches and validations fail with RendersBusy. Now each class has at most
MAX_WAITING_PER_OWNER renders waiting; past that only its own are refused. The renders here are
real blocking calls on the renders' own threads, held by a gate.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from activities.boot.renders import MAX_CONCURRENT_RENDERS, MAX_WAITING_PER_OWNER, MAX_WAITING_RENDERS, RendersBusy, bounded


async def test_a_class_with_its_renders_waiting_leaves_room_for_every_other_class() -> None:
    gate = threading.Event()
    tasks: list[asyncio.Future[object]] = []
    try:
        # Every slot held, so whatever comes next waits.
        tasks += [asyncio.ensure_future(bounded(f"holder-{i}", gate.wait, 60)) for i in range(MAX_CONCURRENT_RENDERS)]
        await asyncio.sleep(0.05)
        # The busy class queues as many as the whole queue takes, and more.
        refused = 0
        for _ in range(MAX_WAITING_RENDERS + 8):
            task = asyncio.ensure_future(bounded("busy-class", gate.wait, 60))
            await asyncio.sleep(0)
            if task.done() and isinstance(task.exception(), RendersBusy):
                refused += 1
                assert "busy-class" in str(task.exception())
            else:
                tasks.append(task)
        assert refused == MAX_WAITING_RENDERS + 8 - MAX_WAITING_PER_OWNER, refused
        # Another class still gets in line, and its render runs once a slot frees.
        others = [asyncio.ensure_future(bounded(f"quiet-class-{i}", lambda: "rendered")) for i in range(3)]
        await asyncio.sleep(0)
        assert not any(t.done() for t in others), [t.exception() for t in others if t.done()]
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(*others), timeout=30) == ["rendered"] * 3
    finally:
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_whole_queue_still_has_its_bound() -> None:
    """Many classes together still meet MAX_WAITING_RENDERS (the worker's memory bound)."""
    gate = threading.Event()
    tasks: list[asyncio.Future[object]] = []
    try:
        tasks += [asyncio.ensure_future(bounded(f"holder-{i}", gate.wait, 60)) for i in range(MAX_CONCURRENT_RENDERS)]
        await asyncio.sleep(0.05)
        owners = MAX_WAITING_RENDERS // MAX_WAITING_PER_OWNER
        for n in range(owners * MAX_WAITING_PER_OWNER):
            tasks.append(asyncio.ensure_future(bounded(f"class-{n % owners}", gate.wait, 60)))
        await asyncio.sleep(0)
        with pytest.raises(RendersBusy, match=f"{MAX_WAITING_RENDERS} template renders are already waiting"):
            await bounded("one-more-class", gate.wait, 60)
    finally:
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
