"""`make bench`: issue 37's and the kept targets of issue 20, each a ratio or figure measured on
the real stack in one run, written to bench/results/latest.json (or BENCH_OUT) and
docs/benchmarks.md (bench/report.py).

    make bench                                           # the full run (about 13-15 minutes on 2 cores)
    make bench BENCH_QUICK=1                             # a 2-3 minute run for development
    bench/device.sh                                      # the figures on a many-core machine, JSON to $OUT

Phases, each on a fresh stack (bench/stack.py: a Temporal dev server, `tgp worker` and `tgp
bridge`, and the simulated world spread over four processes, bench/world.py), each process's CPU
read from /proc over the phase (the page names the busiest and every saturated process: near one
core for Python, for the dev server near what it used in the floor):

* burst N (N = 100 and 500): N pending 1-GPU pods at once through the bridge; per pod, tgp's
  overhead (pod bound - pod created - the simulated boot); per node brought up, each process's
  CPU (bench/burst.py);
* idle reaction (on the first burst's nodes): every pod deleted; per node, its first terminate
  call - the deletion of its pod - the pool's idle timeout; then the history events and Temporal
  Cloud actions of those short lives (bench/actions.py);
* workers: the same burst (BENCH_WORKERS_BURST pods) with each of BENCH_WORKERS worker processes
  on one task queue: nodes Ready per second (first pod created -> last node Ready);
* latency: one burst of BENCH_LATENCY_PODS, too small to saturate anything;
* hold: 1,000 node workflows at rest (bench/hold.py);
* offers: ranking 10,000 offers, offer listings per node started;
* floor (right before and right after the largest burst): the least one workflow per node
  costs, nothing of tgp in it: lives of one and of two activities on a dev server of their own
  (bench/temporal_floor.py);
* rounds: the largest burst and the floor again, BENCH_ROUNDS in all (5; 1 in a quick run): each
  burst against the mean of the floors on either side of it (bench/figures.py floor_around), the
  per-node targets take each ratio's median round (median_round).

Knobs (environment; bench/knobs.py): BENCH_QUICK=1, BENCH_BURSTS ("100,500"), BENCH_BURST_WORKERS
(worker processes in the burst phase, 1), BENCH_WORKERS
("1,2,4"), BENCH_WORKERS_BURST, BENCH_PHASES ("offers,burst,workers,hold,floor"), BENCH_HOLD_*,
BENCH_QUIET_*, BENCH_BOOT_SECONDS, BENCH_IDLE_SECONDS, BENCH_FLOOR_WORKFLOWS, BENCH_LATENCY_PODS,
BENCH_IDLE_BUDGET, BENCH_ROUNDS, BENCH_SKIP_IDLE=1, BENCH_IDLE_PROFILE (seconds of the worker's stacks sampled from
the idle phase's deletions), BENCH_BURST_PROFILE, BENCH_OUT (the JSON), BENCH_DOC (the page; "-" for none),
BENCH_DEVICE_JSON (many-core runs' JSON, comma-separated, for the page's 8-core section; by default
every bench/results/device-*.json from 8+ cores);
TGP_WORKFLOW_CACHE reaches the workers.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import offer_cache, offer_selection
from bench.burst import burst
from bench.hold import hold
from bench.knobs import BOOT, BURST_WORKERS, BURSTS, FLOOR_TIMEOUT, FLOOR_WORKFLOWS, HOLD_NODES, HOLD_SECONDS, IDLE, LATENCY_PODS, PHASES, QUICK, ROUNDS, WORKERS, WORKERS_BURST, say
from bench.report import device_figures, render
from bench.stack import ROOT
from workers.main import workflow_cache


async def floor(n: int) -> dict[str, Any]:
    """bench/temporal_floor.py in a process of its own, so its CPU is its worker's and client's
    alone (not what this process's earlier phases left running)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.temporal_floor", str(n), "--json", cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), FLOOR_TIMEOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.temporal_floor exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    return {"nproc": os.cpu_count(), "cpu_model": model, "python": platform.python_version(), "commit": commit + ("+dirty" if dirty else "")}


async def phase(work: Any, name: str) -> dict[str, Any]:
    """A phase's figures, or its error: a phase that breaks is reported, the others still run."""
    try:
        return await work  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001
        say(f"{name} failed: {exc!r}")
        return {"error": repr(exc)[-500:]}  # the end: where a traceback says what broke


async def measure(results: dict[str, Any]) -> None:
    """Every phase in PHASES, into `results`."""
    if "offers" in PHASES:
        say("offers: ranking 10,000 offers")
        results["offer_selection"] = offer_selection.measure(10_000)
        results["offer_cache"] = await offer_cache.run(100)
    if "burst" in PHASES:
        idle = os.environ.get("BENCH_SKIP_IDLE") != "1"
        results["bursts"] = {}
        # Round 1 of the per-node comparison is the largest burst whose pods were all served: the
        # workers phase's 1-worker run where it is larger (a quick run's), else this phase's last.
        round_one_here = not ("workers" in PHASES and 1 in WORKERS and WORKERS_BURST > max(BURSTS))
        for i, n in enumerate(BURSTS):
            if n == max(BURSTS) and "floor" in PHASES and round_one_here:  # right before it: round 1's floor before
                say(f"floor: {FLOOR_WORKFLOWS} lives of one and of two activities at once, before burst {n}")
                results["temporal_floor_before"] = {**await phase(floor(FLOOR_WORKFLOWS), "floor before"), "before_burst": n}
            results["bursts"][str(n)] = await phase(burst(n, idle=idle and i == 0, workers=BURST_WORKERS), f"burst {n}")
    if "floor" in PHASES:  # right after the largest burst: the first round of the per-node comparison
        say(f"floor: {FLOOR_WORKFLOWS} lives of one and of two activities at once, on a dev server of their own")
        results["temporal_floor"] = await phase(floor(FLOOR_WORKFLOWS), "floor")
    if "burst" in PHASES and "floor" in PHASES and ROUNDS > 1:
        results["rounds"] = [await another_round(i) for i in range(2, ROUNDS + 1)]
    if "workers" in PHASES:
        # The same burst once with each number of workers on the one task queue.
        results["workers"] = {str(w): await phase(burst(WORKERS_BURST, idle=False, workers=w, name=f"workers{w}"), f"workers {w}") for w in WORKERS}
    if "burst" in PHASES and LATENCY_PODS:
        results["latency"] = await phase(burst(LATENCY_PODS, idle=False, name="latency"), "latency")
    if "hold" in PHASES:
        results["hold"] = await phase(hold(HOLD_NODES), "hold")


async def another_round(i: int) -> dict[str, Any]:
    """Round `i` of the per-node comparison (knobs.ROUNDS): the largest burst again, then the floor."""
    n = max(BURSTS)
    b = await phase(burst(n, idle=False, workers=BURST_WORKERS, name=f"round{i}-burst{n}"), f"round {i}: burst {n}")
    say(f"round {i}: the floor")
    fl = await phase(floor(FLOOR_WORKFLOWS), f"round {i}: floor")
    kept = ("pods", "instances_bought", "usage", "wall_s", "served", "never_served", "machine_busy_pct", "error")
    return {"burst": {k: b[k] for k in kept if k in b}, "floor": fl}


async def main() -> int:
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_at_start": list(os.getloadavg()),
        "quick": QUICK,
        "knobs": {"workflow_cache": workflow_cache(), "bursts": BURSTS, "burst_workers": BURST_WORKERS, "workers": WORKERS, "workers_burst": WORKERS_BURST,
                  "hold_nodes": HOLD_NODES, "hold_seconds": HOLD_SECONDS, "boot_s": BOOT, "idle_timeout_s": IDLE, "rounds": ROUNDS},
    }  # fmt: skip
    wall0 = time.monotonic()
    say(f"make bench ({'quick' if QUICK else 'full'}): {results['machine']}, load {results['load_at_start']}")
    await measure(results)
    results["load_at_end"] = list(os.getloadavg())
    results["bench_wall_s"] = round(time.monotonic() - wall0, 1)
    out = Path(os.environ.get("BENCH_OUT") or ROOT / "bench" / "results" / ("quick.json" if QUICK else "latest.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    say(f"wrote {out}")
    doc = os.environ.get("BENCH_DOC", "" if QUICK else str(ROOT / "docs" / "benchmarks.md"))
    page = render(results, device_figures())
    if doc and doc != "-":
        Path(doc).write_text(page)
        say(f"wrote {doc}")
    # The targets with their ratios, and the saturated process of each phase, on the terminal too.
    for section in ("## Targets", "## Which process was saturated"):
        print(section + page.split(section, 1)[-1].split("\n## ", 1)[0])
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
