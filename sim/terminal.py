"""The terminal's foreground for `tgp demo` and `tgp dev`, so that a clean Ctrl-C under make is clean.

Ctrl-C sends SIGINT to the terminal's foreground process group. Under `make demo` that group
holds make as well as the demo: the demo stops cleanly and exits 0, but make, interrupted
itself, prints `make: *** [Makefile:..: demo] Interrupt` and exits 2. So the demo takes a process
group of its own and makes it the terminal's foreground while it runs: Ctrl-C then reaches the
demo and the processes it started, never make, which sees a command that exited 0. The terminal
goes back to the previous group at the end. Ctrl-Z is ignored meanwhile: a stopped demo in a group
the shell does not know of would hold the terminal with no `fg` to resume it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def terminal_foreground() -> Iterator[None]:
    """Hold the terminal's foreground in a process group of this process's own while inside.

    Does nothing where there is no terminal, where this process is not in the foreground
    (started in the background, `&`) or where it already leads its group (started by a shell
    with job control, which made it the foreground itself)."""
    fd = _terminal_fd()
    if fd is None or os.getpgrp() == os.getpid():
        yield
        return
    previous = os.getpgrp()
    os.setpgid(0, 0)
    _set_foreground(fd, os.getpid())
    stop = signal.signal(signal.SIGTSTP, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTSTP, stop)
        _set_foreground(fd, previous)


def _terminal_fd() -> int | None:
    """stdin's descriptor when it is a terminal whose foreground is this process's group."""
    try:
        fd = sys.stdin.fileno()
        return fd if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp() else None
    except (AttributeError, OSError, ValueError):  # no stdin, or one that is not a file
        return None


def _set_foreground(fd: int, group: int) -> None:
    """Make `group` the terminal's foreground. A process outside the foreground that does so
    is sent SIGTTOU (which would stop it), so SIGTTOU is ignored for the call."""
    ttou = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, group)
    except OSError:  # the previous group is gone (make killed): the shell takes the terminal back
        pass
    finally:
        signal.signal(signal.SIGTTOU, ttou)
