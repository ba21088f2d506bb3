"""The worker's side of the template sandbox (activities/boot/sandbox.py): every parse, compile
and render of a class's template runs in a fresh child process, here started, bounded in wall
time and queued. The child itself, its bounds and the escaping filters are in sandbox.py, which
the child imports alone.

* **The child.** `run()`/`render()`/`inspect()` start it (`sandbox.main` in the child) with the
  template and its variables on stdin, and read its JSON answer on stdout. Its CPU time and
  memory it bounds itself; the worker kills a child that has not finished after
  `RENDER_WALL_SECONDS` of wall time (RendersBusy: retried later).
* **Slots.** At most `MAX_CONCURRENT_RENDERS` children run at once (their memory together stays
  within the worker's limit). From async code, `bounded(owner, fn, ...)` runs a blocking render
  function on the renders' own thread pool (never the default executor, which DNS resolution
  uses, never the event loop), after waiting in the renders' own queue, where one owner (a
  GPUNodeClass) holds at most `OWNER_SHARE` slots and has at most `MAX_WAITING_PER_OWNER`
  renders waiting: a class whose template is slow or hostile, or that launches in a burst,
  waits behind itself (and is refused past its own cap), not in front of every other class.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import markupsafe

from activities.boot.sandbox import MEMORY_LIMIT_BYTES, RENDER_TIMEOUT_SECONDS, RenderFailed

# Wall time of one child, its start included: a backstop for a machine so loaded that the
# child gets no CPU, which is the machine's fault, not the template's (RendersBusy: retried).
RENDER_WALL_SECONDS = 60.0
# Children at once per worker process; more wait. Bounded by memory, not CPUs: each child may
# use MEMORY_LIMIT_BYTES, and together they stay within half the worker's 1 GiB limit.
MAX_CONCURRENT_RENDERS = 2
# Slots one owner (a GPUNodeClass) may hold at once; its other renders wait in the queue.
OWNER_SHARE = max(1, MAX_CONCURRENT_RENDERS // 2)
# Renders waiting at most, all owners together; past that `bounded` refuses (RendersBusy).
# A bound on the worker's memory (each waiting render holds its template, up to 256 KiB).
MAX_WAITING_RENDERS = 256
# Renders one owner (a GPUNodeClass) may have waiting; past that its next render is refused
# (RendersBusy) while other owners still queue: one class's burst of launches or validations
# once filled the whole queue and made every other class's fail (issue 35). A burst of a
# class's launches beyond it is retried by Temporal, its renders coming in as slots free up.
MAX_WAITING_PER_OWNER = 32
# Environment variables the child keeps: what Python needs, nothing else (never the worker's credentials).
_CHILD_ENVIRONMENT = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "SYSTEMROOT")
_ROOT = str(Path(__file__).resolve().parents[2])
# Jinja's (and MarkupSafe's) installation, the child's only other path.
_PACKAGES = sorted({str(Path(module.__file__).resolve().parents[1]) for module in (jinja2, markupsafe) if module.__file__})
# -I: isolated (no PYTHON* variables, no user site-packages, no cwd on sys.path); -S: no `site`
# (no .pth files to run, 30 ms less per child): its path is the project root and Jinja's only.
# The child imports the sandbox alone (standard library, jinja2, tgp.labels): about 0.1 s of
# CPU a render, half of it Python's own start.
_CHILD_COMMAND = (
    sys.executable,
    "-I",
    "-S",
    "-c",
    f"import sys; sys.path[:0] = {[_ROOT, *_PACKAGES]!r}; from activities.boot.sandbox import main; main()",
)
_SLOTS = threading.BoundedSemaphore(MAX_CONCURRENT_RENDERS)
# What ends a child that used up its CPU: SIGPROF (the timer), SIGXCPU and SIGKILL (RLIMIT_CPU).
_CPU_SIGNALS = frozenset(getattr(signal, name) for name in ("SIGPROF", "SIGXCPU", "SIGKILL") if hasattr(signal, name))

T = TypeVar("T")


class RendersBusy(Exception):
    """The renders' queue is full (MAX_WAITING_RENDERS), or this owner already has
    MAX_WAITING_PER_OWNER renders waiting: try again later."""


def render(source: str, variables: Mapping[str, Any]) -> str:
    """Render `source` (Jinja) with `variables` in a bounded child process. Blocks for up to
    RENDER_TIMEOUT_SECONDS: from async code call it through `bounded`, never on an event loop.
    Raises RenderFailed."""
    return str(run(source, variables=variables)["output"])


def inspect(source: str) -> dict[str, int]:
    """The variables `source` reads without defining them, with the first line naming each,
    found in a bounded child process (see `render`). Raises RenderFailed (a syntax error)."""
    names = run(source, inspect=True)["names"]
    return {str(k): int(v) for k, v in names.items()}


def run(
    source: str, *, variables: Mapping[str, Any] | None = None, inspect: bool = False, known: Iterable[str] | None = None
) -> dict[str, Any]:
    """One request to a bounded child (see `serve`): {"names": ..., "output": ...}, each when
    asked for and done. Blocks for up to RENDER_TIMEOUT_SECONDS. Raises RenderFailed."""
    request = json.dumps(
        {
            "source": source,
            "variables": dict(variables) if variables is not None else None,
            "inspect": inspect,
            "known": sorted(known) if known is not None else None,
        },
        default=str,
    ).encode()
    env = {k: os.environ[k] for k in _CHILD_ENVIRONMENT if k in os.environ}
    with _SLOTS:
        try:
            done = subprocess.run(  # noqa: S603 - our own interpreter and module, no shell
                _CHILD_COMMAND, input=request, capture_output=True, timeout=RENDER_WALL_SECONDS, env=env, check=False
            )
        except subprocess.TimeoutExpired:
            # Not the template's CPU (that ends the child itself): a machine too loaded to run it.
            raise RendersBusy(
                f"the renderer got too little CPU to finish within {RENDER_WALL_SECONDS:g} s (the worker's machine is overloaded)"
            ) from None
    try:
        answer = json.loads(done.stdout) if done.stdout else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        if -done.returncode in _CPU_SIGNALS:
            raise RenderFailed(
                "limit", f"rendering took longer than {RENDER_TIMEOUT_SECONDS:g} s of CPU and was stopped (a loop over too much?)"
            )
        if done.returncode < 0:
            raise RenderFailed(
                "limit",
                f"the renderer was stopped by signal {-done.returncode} (more than {RENDER_TIMEOUT_SECONDS:g} s of CPU "
                f"or {MEMORY_LIMIT_BYTES // 2**20} MiB of memory?)",
            )
        detail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise RenderFailed("error", f"the renderer failed (exit code {done.returncode}): {detail[0][:300]}")
    if "error" in answer:
        error = answer["error"]
        raise RenderFailed(str(error.get("kind", "error")), str(error.get("message", "")), error.get("line"))
    return answer


# --- from async code: the renders' own pool and queue ---------------------------------------

_EXECUTOR = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_RENDERS, thread_name_prefix="tgp-render")


class _Queue:
    """The renders of one event loop: how many run, per owner, and who waits (in order)."""

    def __init__(self) -> None:
        self.running = 0
        self.by_owner: Counter[str] = Counter()
        self.waiting: deque[tuple[str, asyncio.Future[None]]] = deque()

    def grant(self) -> None:
        """Start the first waiters whose owner is under its share, while slots are free."""
        for owner, future in list(self.waiting):
            if self.running >= MAX_CONCURRENT_RENDERS:
                return
            if future.done():
                self.waiting.remove((owner, future))
            elif self.by_owner[owner] < OWNER_SHARE:
                self.waiting.remove((owner, future))
                self.running += 1
                self.by_owner[owner] += 1
                future.set_result(None)

    def release(self, owner: str) -> None:
        self.running -= 1
        self.by_owner[owner] -= 1
        if not self.by_owner[owner]:
            del self.by_owner[owner]
        self.grant()


_QUEUES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue] = weakref.WeakKeyDictionary()


async def bounded(owner: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` (a blocking render, check or inspection) on the renders' own
    threads, once this owner's turn comes (see the module doc); the event loop never waits
    on it. RendersBusy when this owner already has MAX_WAITING_PER_OWNER renders waiting, or
    MAX_WAITING_RENDERS wait in all."""
    loop = asyncio.get_running_loop()
    queue = _QUEUES.setdefault(loop, _Queue())
    own = sum(1 for who, future in queue.waiting if who == owner and not future.done())
    if own >= MAX_WAITING_PER_OWNER:
        raise RendersBusy(f"{own} template renders of {owner} are already waiting")
    if len(queue.waiting) >= MAX_WAITING_RENDERS:
        raise RendersBusy(f"{len(queue.waiting)} template renders are already waiting")
    turn: asyncio.Future[None] = loop.create_future()
    queue.waiting.append((owner, turn))
    queue.grant()
    try:
        await turn
    except asyncio.CancelledError:
        if turn.done() and not turn.cancelled():
            queue.release(owner)  # granted as the wait was cancelled
        else:
            turn.cancel()
            queue.grant()
        raise
    work = _EXECUTOR.submit(functools.partial(fn, *args, **kwargs))

    def done(_: object) -> None:
        # The slot is free when the thread is, not when a cancelled caller stops waiting.
        try:
            loop.call_soon_threadsafe(queue.release, owner)
        except RuntimeError:  # the loop is closed: nothing waits on it any more
            pass

    work.add_done_callback(done)
    return await asyncio.wrap_future(work)
