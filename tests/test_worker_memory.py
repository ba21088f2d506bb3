"""The worker and the bridge limit glibc's malloc arenas before their first thread
(workers.memory): threads that allocate then share two arenas instead of one each. Counted in a
fresh interpreter with glibc's own `malloc_stats` (one "Arena N:" block per arena).

And they give the heap's free pages back while they run (`malloc_trim`, every
TGP_HEAP_TRIM_SECONDS): measured as the resident size of a fresh `tgp worker` whose work frees
most of what it allocated between blocks it keeps (glibc returns nothing of that by itself)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tgp.errors import ConfigError
from workers.memory import ARENAS, TRIM_EVERY, TRIM_EVERY_ENV, limit_malloc_arenas, trim_every

THREADS = 8
ROOT = Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent(
    f"""
    import ctypes, sys, threading
    from workers.memory import limit_malloc_arenas

    def allocate_in_threads():
        kept, ready, done = [], threading.Barrier({THREADS} + 1), threading.Event()

        def allocate():
            kept.append([bytearray(64 * 1024) for _ in range(16)])  # past pymalloc: glibc's malloc
            ready.wait()
            done.wait()

        threads = [threading.Thread(target=allocate) for _ in range({THREADS})]
        for t in threads:
            t.start()
        ready.wait()  # every thread holds its memory at once
        ctypes.CDLL("libc.so.6").malloc_stats()
        done.set()
        for t in threads:
            t.join()

    if sys.argv[1] == "limited":
        assert limit_malloc_arenas()
    if sys.argv[1] == "tgp worker":  # the command's own start, its work replaced by the threads
        import workers.cli

        async def work(args):
            allocate_in_threads()

        workers.cli.run_worker = work
        sys.exit(workers.cli.main(["worker"]))
    allocate_in_threads()
    """
)


def arenas(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env["PYTHONPATH"] = os.getcwd()
    run = subprocess.run([sys.executable, "-c", PROGRAM, mode], env=env, capture_output=True, text=True, timeout=60, check=True)
    return sum(1 for line in run.stderr.splitlines() if line.startswith("Arena "))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's arenas")
def test_threads_that_allocate_share_two_arenas_once_limited() -> None:
    unlimited, limited, worker = arenas("unlimited"), arenas("limited"), arenas("tgp worker")
    assert unlimited > ARENAS, f"{THREADS} threads allocating made only {unlimited} arenas without the limit: the test shows nothing"
    assert limited <= ARENAS, f"{limited} arenas with the limit"
    assert worker <= ARENAS, f"{worker} arenas in `tgp worker`: it did not limit them before its threads"


def test_an_operators_malloc_arena_max_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False


FRAGMENTING_WORKER = textwrap.dedent(
    """
    import asyncio, sys, time
    import workers.cli

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    async def work(args):
        kept, freed = [], []
        for i in range(40_000):  # 2 KB blocks: past pymalloc, in glibc's heap
            (kept if i % 10 == 0 else freed).append(bytearray(2048))
        del freed  # ~70 MB free between the blocks kept: glibc keeps it
        before, deadline = rss_mb(), time.monotonic() + float(sys.argv[1])
        while time.monotonic() < deadline and rss_mb() > before - 40:
            await asyncio.sleep(0.05)
        print(round(before), round(rss_mb()))

    workers.cli.run_worker = work
    sys.exit(workers.cli.main(["worker"]))
    """
)


def resident_before_and_after(trim_seconds: str, wait: float) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env.update(PYTHONPATH=str(ROOT), **{TRIM_EVERY_ENV: trim_seconds})
    run = subprocess.run([sys.executable, "-c", FRAGMENTING_WORKER, str(wait)], env=env, capture_output=True, text=True, timeout=120, check=True)
    before, after = run.stdout.split()
    return int(before), int(after)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_tgp_worker_gives_the_heaps_free_pages_back() -> None:
    before, after = resident_before_and_after("1", wait=60)  # returns as soon as it dropped
    assert after < before - 40, f"`tgp worker` kept {before} -> {after} MB with trims every second"
    # The control: without trims the same work keeps its pages (what the line above tells apart).
    before, after = resident_before_and_after("0", wait=1)
    assert after > before - 40, f"{before} -> {after} MB without trims: the test shows nothing"


def test_the_trim_interval_is_read_and_a_bad_one_says_what_to_fix() -> None:
    assert trim_every({}) == TRIM_EVERY
    assert trim_every({TRIM_EVERY_ENV: " 0 "}) == 0
    assert trim_every({TRIM_EVERY_ENV: "2.5"}) == 2.5
    for bad in ("soon", "-1", "nan", "inf", "0.5"):  # under a second: a busy loop
        with pytest.raises(ConfigError, match=f"{TRIM_EVERY_ENV}=.*number of seconds"):
            trim_every({TRIM_EVERY_ENV: bad})


def test_a_settled_collector_no_longer_walks_what_start_up_made() -> None:
    """After `settle_gc` (the worker and the bridge, once started), what start-up made is frozen
    out of the collector's view: a full collection walks only what came after (in a fresh
    interpreter)."""
    program = textwrap.dedent(
        """
        import gc, json
        import workers.main, activities.node, workflows.node  # a worker's start-up: its modules and models
        gc.collect()
        before = len(gc.get_objects())  # what a full collection walks
        from workers.memory import settle_gc
        settle_gc()
        print(json.dumps({"frozen": gc.get_freeze_count(), "before": before, "after": len(gc.get_objects())}))
        """
    )
    run = subprocess.run([sys.executable, "-c", program], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(run.stdout)
    assert seen["frozen"] > 50_000 and seen["after"] < seen["before"] - 50_000, seen
