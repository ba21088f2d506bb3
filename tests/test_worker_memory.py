"""The worker and the bridge limit glibc's malloc arenas before their first thread
(workers.memory): threads that allocate then share two arenas instead of one each. Counted in a
fresh interpreter with glibc's own `malloc_stats` (one "Arena N:" block per arena)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from workers.memory import ARENAS, limit_malloc_arenas

THREADS = 8

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
