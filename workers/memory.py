"""The long-running processes' malloc arenas.

glibc gives each thread that allocates its own malloc arena, up to eight per core, and keeps what
is freed in them: the worker's threads (Temporal's Rust core, the event loop, the resolver's)
each grow one, and the process keeps the high-water mark of every one. Two arenas, as
`MALLOC_ARENA_MAX=2` does, gave back ~31 MB of a worker holding 1,000 nodes at rest (make
bench's hold: 400 -> 369 MB) for no measurable CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt's parameter number for the arena limit (glibc's malloc.h).
M_ARENA_MAX = -8
ARENAS = 2


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Limit glibc's malloc arenas for the threads started from now on; call it before any.
    False where it does not apply: not Linux, a libc other than glibc (musl has no arenas), or
    MALLOC_ARENA_MAX set in the environment (glibc read it at start: the operator's choice)."""
    if not sys.platform.startswith("linux") or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, arenas))
