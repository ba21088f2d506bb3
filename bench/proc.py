"""`python -m bench.proc worker|bridge [tgp flags]`: the `tgp worker` and `tgp bridge` processes
that `make bench` measures (bench/run.py).

This is `workers.cli.main` itself, configured from the environment exactly as the real
commands are, with tgp's own intervals and timeouts. One bound only is lowered, so the idle
reaction does not wait out production's 30 s minimum: the bridge accepts a pool idle timeout
down to 1 s (the reaction is measured as terminate call minus pod deletion minus the pool's
idle timeout, so the timeout's length does not enter the figure).

With BENCH_PROFILE=<file> the process samples its Python stacks between SIGUSR1 and SIGUSR2
(a stand-in for py-spy, which is not available) and writes the busiest functions to the file.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from types import FrameType

# py-spy is not available here: with BENCH_PROFILE=<file>, a thread samples every Python
# thread's stack (SAMPLE_EVERY) between SIGUSR1 and SIGUSR2 and writes the busiest functions to
# the file at SIGUSR2. A sample whose innermost frame is one of IDLE is a thread waiting.
SAMPLE_EVERY = 0.02
IDLE = frozenset({"select", "poll", "wait", "get", "sleep", "_worker", "accept", "recv", "read", "epoll", "acquire"})
PROFILE_ENV = "BENCH_PROFILE"
OURS = ("activities/", "workflows/", "tgp/", "workers/", "crd_bridge/", "sim/")
TOP = 25


def _configure() -> None:
    from crd_bridge.bridge import Bridge
    from tgp.crds import DisruptionBounds

    Bridge.__init__.__kwdefaults__.update(disruption_bounds=DisruptionBounds(min_idle_timeout=timedelta(seconds=1)))


def _where(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        path = os.path.relpath(path)
    return f"{path}:{code.co_name}"


def _sample_on_signals(out: Path) -> None:
    sampling = threading.Event()  # set while on; the sampler sleeps on it while off (no wakeups)
    self_time: Counter[str] = Counter()
    total: Counter[str] = Counter()
    # The innermost frame with the first of tgp's own frames that called it: who pays for it.
    paths: Counter[str] = Counter()
    counts = {"busy": 0, "idle": 0}
    started = [0.0]

    def start(*_: object) -> None:
        self_time.clear()
        total.clear()
        paths.clear()
        counts.update(busy=0, idle=0)
        started[0] = time.monotonic()
        sampling.set()

    def stop(*_: object) -> None:
        sampling.clear()
        busy = max(1, counts["busy"])
        out.write_text(json.dumps({
            "seconds": round(time.monotonic() - started[0], 1),
            "sample_every_s": SAMPLE_EVERY,
            "busy_samples": counts["busy"],
            "idle_samples": counts["idle"],
            "self": [(k, round(100 * v / busy, 1)) for k, v in self_time.most_common(TOP)],
            "inclusive": [(k, round(100 * v / busy, 1)) for k, v in total.most_common(TOP * 2)],
            "innermost_from_tgp": [(k, round(100 * v / busy, 1)) for k, v in paths.most_common(TOP)],
        }, indent=1))  # fmt: skip

    def loop() -> None:
        me = threading.get_ident()
        while True:
            sampling.wait()
            time.sleep(SAMPLE_EVERY)
            if not sampling.is_set():
                continue
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                if frame.f_code.co_name in IDLE:
                    counts["idle"] += 1
                    continue
                counts["busy"] += 1
                self_time[_where(frame)] += 1
                seen = set()
                ours = ""
                f: FrameType | None = frame
                while f is not None:
                    where = _where(f)
                    if where not in seen:
                        seen.add(where)
                        total[where] += 1
                    if not ours and where.startswith(OURS) and f is not frame:
                        ours = where
                    f = f.f_back
                paths[f"{_where(frame)} <- {ours or '?'}"] += 1

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    threading.Thread(target=loop, name="bench-sampler", daemon=True).start()


if __name__ == "__main__":
    _configure()
    if os.environ.get(PROFILE_ENV):
        _sample_on_signals(Path(os.environ[PROFILE_ENV]))
    from workers.cli import main

    sys.exit(main(sys.argv[1:]))
