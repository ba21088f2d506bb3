"""`make bench`'s knobs (environment) and the small helpers every phase shares: progress lines,
percentiles, and CPU used between two readings of each process."""

from __future__ import annotations

import datetime as dt
import os
import time

import structlog

from bench.stack import Usage

# The simulated scheduler and kubelets log each pod they bind and run; the harness prints its own progress.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
QUICK = os.environ.get("BENCH_QUICK", "") not in ("", "0")


def knob(name: str, full: str, quick: str) -> str:
    return os.environ.get(name) or (quick if QUICK else full)


BURSTS = [int(n) for n in knob("BENCH_BURSTS", "100,500", "30").split(",") if n]
# `tgp worker` processes on one task queue in the burst phase (the workers phase tries 1, 2, 4).
BURST_WORKERS = int(knob("BENCH_BURST_WORKERS", "1", "1"))
# A burst small enough not to saturate the machine, after the others: what a pod's overhead is
# when nothing waits for CPU (the batch window, the node's own path, the scheduler). 0: none.
LATENCY_PODS = int(knob("BENCH_LATENCY_PODS", "10", "0"))
HOLD_NODES = int(knob("BENCH_HOLD_NODES", "1000", "100"))
HOLD_SECONDS = float(knob("BENCH_HOLD_SECONDS", "45", "15"))
BOOT = float(knob("BENCH_BOOT_SECONDS", "3", "3"))
IDLE = int(knob("BENCH_IDLE_SECONDS", "5", "5"))
PHASES = set(knob("BENCH_PHASES", "offers,burst,workers,hold,floor", "offers,burst,workers,hold,floor").split(","))
# The workers phase: the same burst of WORKERS_BURST pods once with each number of `tgp worker`
# processes on one task queue (nodes Ready per second for each).
WORKERS = [int(n) for n in knob("BENCH_WORKERS", "1,2,4", "1,2,4").split(",") if n]
WORKERS_BURST = int(knob("BENCH_WORKERS_BURST", "200", "40"))
# Workflows of the smallest life started at once on a dev server of their own (bench/temporal_floor.py).
FLOOR_WORKFLOWS = int(knob("BENCH_FLOOR_WORKFLOWS", "500", "100"))
FLOOR_TIMEOUT = 180.0
# Rounds of the per-node comparison: the largest burst and then the floor; each burst is set
# against the mean of the floor right before it (the previous round's; for the first, one run
# just before the bursts phase's largest burst) and the one right after (figures.floor_around),
# and the targets take each ratio's median round. On a shared host the CPU a fixed amount of
# work costs moves by 15-25% from minute to minute (the floor alone: 36-51 ms within one run),
# so one round's ratio is a draw. Five: with three, the median of one run moved by 0.2x between
# runs of the same tree within an hour.
ROUNDS = int(knob("BENCH_ROUNDS", "5", "1"))
# How long a burst may take until every pod is bound, and the hold's bring-up until every node
# is Ready; past it the phase reports what it has (pods never served, nodes Ready). They keep a
# full run under 15 minutes on 2 cores even where every target is missed by far.
BURST_DEADLINE = {100: 60.0, 500: 120.0}


def burst_deadline(n: int) -> float:
    return BURST_DEADLINE.get(n, 60 + n * 0.5)

HOLD_BRINGUP_DEADLINE = float(knob("BENCH_HOLD_BRINGUP_SECONDS", "180", "60"))
# How long the worker's stacks are sampled after the hold's stretch.
PROFILE_SECONDS = float(knob("BENCH_PROFILE_SECONDS", "10", "5"))
# After the last node is Ready the nodes' last reports, the pool's adoption of the nodes the hold
# started (their settings and labels, signals from the pool) and the twin watches end; the stretch
# at rest starts once the stack is quiet (`settle`): no pool or class history growing and the
# worker under QUIET_WORKER_CPU_PCT of a core, both over QUIET_SECONDS. HOLD_SETTLE bounds the
# wait; a stretch that starts at it is reported as not quiet.
HOLD_SETTLE = float(knob("BENCH_HOLD_SETTLE_SECONDS", "240", "120"))
QUIET_SECONDS = float(knob("BENCH_QUIET_SECONDS", "15", "10"))
QUIET_WORKER_CPU_PCT = float(knob("BENCH_QUIET_WORKER_CPU_PCT", "10", "10"))
# How often the settle reads the entities' history lengths and the worker's CPU.
QUIET_EVERY = 2.5
IDLE_DEADLINE = 75.0
# How long every bound pod has run when the idle reaction deletes them: a job that ran (the
# demo's runs 20 s), not a pod deleted the instant it starts, which its pool never sees bound
# (a node's own end of its bind-grace hold, life-v5, then comes as the pool's settings instead).
RUN_BEFORE_IDLE = float(knob("BENCH_RUN_BEFORE_IDLE_SECONDS", "2", "2"))
# Node workflows whose history lengths the hold reads (spread over all of them).
HISTORY_SAMPLE = 200
# How long the idle nodes' workflows may take to close after their terminate calls.
CLOSE_DEADLINE = 20.0
# A count of workflows by phase on a loaded dev server: the loop around it does not wait longer.
RPC_TIMEOUT = dt.timedelta(seconds=5)
T0 = time.monotonic()


def say(line: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {line}", flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def summary(values: list[float]) -> dict[str, float | None]:
    return {"n": len(values), "p50": pct(values, 50), "p99": pct(values, 99), "max": max(values) if values else None}


def usage_delta(before: dict[str, Usage], after: dict[str, Usage], wall: float) -> dict[str, dict[str, float]]:
    return {
        name: {
            "cpu_s": round(after[name].cpu_s - before[name].cpu_s, 2),
            "cpu_pct_of_core": round(100 * (after[name].cpu_s - before[name].cpu_s) / wall, 1),
            "rss_mb": round(after[name].rss_mb, 1),
            "peak_rss_mb": round(after[name].peak_rss_mb, 1),
        }
        for name in after
    }



def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"

