"""The long-running processes' malloc arenas, and the heap they give back.

glibc gives each thread that allocates its own malloc arena, up to eight per core, and keeps what
is freed in them: the worker's threads (Temporal's Rust core, the event loop, the resolver's)
each grow one, and the process keeps the high-water mark of every one. Two arenas, as
`MALLOC_ARENA_MAX=2` does, gave back ~31 MB of a worker holding 1,000 nodes at rest (make
bench's hold: 400 -> 369 MB) for no measurable CPU.

What glibc frees inside its heap it keeps: only a free stretch at the very top goes back to the
system by itself. A worker's bring-up of many nodes churns through its workflow cache (runs
evicted, replayed, their histories decoded) and leaves the heap with free pages between live
objects; at rest it keeps them. `malloc_trim(0)` hands those pages back (madvise): the worker
and the bridge call it every TRIM_EVERY (`TGP_HEAP_TRIM_SECONDS`, 0 turns it off), off the event
loop. In make bench's hold of 1,000 nodes at rest, one trim took the worker from 340 to 309 MB;
a minute at rest (the class's and the fleet's looks) then grew it again by ~18 MB, hence a trim
every 10 s: a ~300 MB heap trims in about a millisecond.

Python's cyclic collector, too, is settled once a process has started (`settle_gc`): what
start-up made (the modules, the models' schemas, the SDK's objects, ~120,000 objects) is never
garbage, yet every full collection walked all of it. In a burst of 500 nodes on 2 cores the
worker spent about an eighth of its CPU collecting (2.4 s, 1.3 s of it in full collections;
issue 37); with start-up frozen, 1.5 s (0.6 s). The thresholds stay CPython's: collecting the
youngest generation every 10,000 allocations instead of 700 cut that to 0.7 s, but a worker
holding 1,000 nodes at rest then kept 380 MB instead of 210 MB.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import sys
from collections.abc import Coroutine, Mapping
from functools import cache
from typing import Any

from tgp.errors import ConfigError

# mallopt's parameter number for the arena limit (glibc's malloc.h).
M_ARENA_MAX = -8
ARENAS = 2

TRIM_EVERY_ENV = "TGP_HEAP_TRIM_SECONDS"
TRIM_EVERY = 10.0  # seconds; a trim of a ~300 MB heap takes about a millisecond, on a thread


@cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, or None (not Linux; musl and others have neither arenas nor malloc_trim)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process runs on (no ldconfig lookup)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Limit glibc's malloc arenas for the threads started from now on; call it before any.
    False where it does not apply: not Linux, a libc other than glibc (musl has no arenas), or
    MALLOC_ARENA_MAX set in the environment (glibc read it at start: the operator's choice)."""
    libc = _glibc()
    if libc is None or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, arenas))


def settle_gc() -> None:
    """Once a long-lived process has started: collect what start-up left, and freeze the rest out
    of the collector's view (gc.freeze: never walked again). A cycle made later through a frozen
    object is never collected either: bounded by what start-up made."""
    gc.collect()
    gc.freeze()


def trim_heap() -> bool:
    """Give the free pages inside the heap back to the system; False where glibc is not there."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def trim_every(env: Mapping[str, str] = os.environ) -> float:
    """Seconds between trims: TGP_HEAP_TRIM_SECONDS, else TRIM_EVERY; 0 turns trimming off."""
    raw = env.get(TRIM_EVERY_ENV, "").strip()
    if not raw:
        return TRIM_EVERY
    try:
        every = float(raw)
    except ValueError:
        every = -1.0
    if not (every == 0 or 1 <= every < float("inf")):  # also NaN; under a second is a busy loop
        raise ConfigError(f"{TRIM_EVERY_ENV}={raw!r} must be 0 (no trimming) or a number of seconds from 1 on")
    return every


async def with_heap_trimmed(main: Coroutine[Any, Any, None], every: float) -> None:
    """Run a long-lived command, trimming the heap every `every` seconds meanwhile (0: never)."""
    if every == 0 or _glibc() is None:
        await main
        return

    async def trim() -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await asyncio.to_thread(trim_heap)  # ctypes lets go of the GIL: the loop goes on
            except Exception as exc:  # noqa: BLE001 - a lost trim costs memory, never the command
                print(f"tgp: heap trimming stopped: {exc!r}", file=sys.stderr)
                return

    trimmer = asyncio.create_task(trim())
    try:
        await main
    finally:
        trimmer.cancel()
