"""The arithmetic of `make bench`'s page (bench/report.py), pure: each target's ratio from the
figures one run recorded (bench/run.py's JSON), so the page holds on any machine."""

from __future__ import annotations

import math
from typing import Any

# A process is saturated when it used this share of what it can use over a phase: one core for
# tgp's processes and the simulated world's (Python: the GIL); for the dev server (Go) what it
# used in the run's floor (`server_ceiling_pct`: 2.4 cores on 16; it sat near one core only
# while the simulated world did, before the scheduler had a process of its own).
SATURATED_PCT = 85.0
# The machine is saturated when all processes together used this share of all its cores.
MACHINE_SATURATED = 0.9
# tgp's own processes in a phase's usage (the rest is Temporal and the simulated world).
TGP = ("worker", "bridge")
# Targets (issue 37), each a ratio measured in one run.
SUM_VS_FLOOR = 1.5  # worker + bridge + server CPU per node, at most this x the two-step floor
WORKER_VS_FLOOR = 2.0  # worker CPU per node, at most this x the floor's worker share
LIFE_EVENTS = 40  # history events of one short life, at most
SCALING_2_VS_1 = 1.7  # nodes Ready per second, 2 workers against 1, at least
P99_VS_FLOOR_WALL = 2.0  # burst 500 overhead p99, at most this x the floor's wall for 500 two-step lives (8+ cores)
# The scale model's assumptions (bench/report.py prints them): Temporal commits a workflow's
# events in one transaction per state transition (a task's completion with its commands, an
# activity's result, a signal), about two events each; a history shard serialises its
# transactions, and at ~5 ms a write on a SQL store one shard commits ~200 a second.
EVENTS_PER_TRANSITION = 2.0
TRANSITIONS_PER_SHARD_S = 200.0


def worker_cpu(usage: dict[str, Any]) -> float:
    """CPU seconds of every `tgp worker` process (worker, or worker1..n)."""
    return sum(u["cpu_s"] for name, u in usage.items() if name.startswith("worker"))


def per_node(burst: dict[str, Any]) -> dict[str, float] | None:
    """CPU milliseconds per node brought up in a burst: worker(s), bridge, Temporal server, their sum."""
    nodes, usage = burst.get("instances_bought"), burst.get("usage")
    if not nodes or not usage:
        return None
    worker = 1000 * worker_cpu(usage) / nodes
    bridge = 1000 * usage["bridge"]["cpu_s"] / nodes
    server = 1000 * usage["temporal"]["cpu_s"] / nodes
    return {"worker": worker, "bridge": bridge, "temporal": server, "sum": worker + bridge + server}


def floor_ratios(cost: dict[str, float], floor: dict[str, Any]) -> dict[str, float]:
    """Each per-node figure against the two-step floor of the same run: the sum against the
    floor's total, the worker against its worker share, the server against its server share."""
    return {
        "sum": cost["sum"] / floor["two_steps_ms"],
        "worker": cost["worker"] / floor["two_steps_worker_ms"],
        "temporal": cost["temporal"] / floor["two_steps_server_ms"],
    }


# The floor's figures a round is judged on (bench/temporal_floor.py's JSON).
FLOOR_FIGURES = ("two_steps_ms", "two_steps_worker_ms", "two_steps_server_ms")


def measured_floor(floor: dict[str, Any] | None) -> bool:
    return floor is not None and "error" not in floor and all(k in floor for k in FLOOR_FIGURES)


def floor_around(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """The floor a burst is judged against: `after` (measured right after the burst), its
    figures the mean of it and `before` (measured right before the burst) where both were
    measured. On a shared host the CPU one piece of work costs drifts from minute to minute;
    the mean of the floors on either side of a burst cancels a drift over the round instead of
    charging it to one side of the ratio. `around` keeps both sums."""
    if not measured_floor(before) or not measured_floor(after):
        return after
    assert before is not None  # (measured_floor)
    mean = {k: round((before[k] + after[k]) / 2, 2) for k in FLOOR_FIGURES}
    return {**after, **mean, "around": [before["two_steps_ms"], after["two_steps_ms"]]}


def rounds(first: dict[str, Any] | None, floor: dict[str, Any], more: list[dict[str, Any]], before: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each round of the per-node comparison, numbered from 1: a burst's per-node CPU
    (`per_node`) against the floors measured right before and right after it (`floor_around`),
    with their ratios (`floor_ratios`); or, for a round left out, why ("left_out"). The first
    round is the run's own burst (`first`) between the floor `before` it and `floor`; `more`
    are the later rounds (bench/run.py), each {"burst", "floor"} (the floor after it; the one
    before is the previous round's), and each must be the first round's burst again (as many
    pods) with every pod served, as `first` was. A round whose floor after it broke is left out."""
    pods = (first or {}).get("pods")
    out: list[dict[str, Any]] = []
    pairs = [(first, floor), *((m.get("burst"), m.get("floor") or {}) for m in more)]
    floors = [before, *(fl for _, fl in pairs)]
    for i, (burst, fl) in enumerate(pairs, 1):
        cost = per_node(burst) if burst and "error" not in burst else None
        why = ("its burst broke" if burst and "error" in burst else "no burst measured" if cost is None else
               "its floor broke" if "error" in fl else "no floor measured" if "two_steps_ms" not in fl else
               f"its burst left {burst.get('never_served')} pods unserved" if i > 1 and burst.get("never_served", 0) != 0 else
               # (a run recorded before rounds kept their size: each was the largest burst again)
               f"its burst was of {burst.get('pods')} pods, not {pods}" if i > 1 and burst.get("pods", pods) != pods else None)  # fmt: skip
        if why is not None or cost is None or burst is None:
            out.append({"round": i, "left_out": why or "not measured"})
        else:
            around = floor_around(floors[i - 1], fl)
            out.append({"round": i, "cost": cost, "floor": around, "ratio": floor_ratios(cost, around), "wall_s": burst.get("wall_s")})
    return out


def median_round(measured: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round whose `key` ratio ("sum" or "worker") is the median of the rounds measured (of
    an even number, the higher of the middle two: never the better one by default): a round
    that was measured, with its own figures."""
    ordered = sorted((m for m in measured if "left_out" not in m), key=lambda m: m["ratio"][key])
    return ordered[len(ordered) // 2]


def saturation(usage: dict[str, Any], cores: int, machine_busy_pct: float | None = None, server_ceiling: float = 100.0) -> dict[str, Any]:
    """The busiest process of a phase, the processes that were saturated (at SATURATED_PCT of
    what each can use: one core for a Python process, `server_ceiling` for the dev server), and
    whether the machine was: by `machine_busy_pct` (every process on it, /proc/stat) where
    recorded, else the stack's own."""
    name, u = max(usage.items(), key=lambda kv: kv[1]["cpu_pct_of_core"])
    machine = machine_busy_pct if machine_busy_pct is not None else sum(v["cpu_pct_of_core"] for v in usage.values()) / cores
    full = [k for k, v in usage.items() if v["cpu_pct_of_core"] >= SATURATED_PCT / 100 * (server_ceiling if k == "temporal" else 100.0)]
    return {
        "busiest": name,
        "pct": u["cpu_pct_of_core"],
        "saturated": sorted(full, key=lambda k: -usage[k]["cpu_pct_of_core"]),
        "machine_pct": machine,
        "machine_saturated": machine >= MACHINE_SATURATED * 100,
    }


def server_ceiling_pct(floor: dict[str, Any] | None) -> float:
    """The most of a core the Temporal dev server was seen to use in this run: in the floor's
    two-step lives (it is Go, and its one SQLite store serialises only the writes: 2.4 cores on
    16), else one core. At least one core."""
    if not floor or not floor.get("two_steps_wall_s") or not floor.get("n"):
        return 100.0
    return max(100.0, 100 * floor["n"] * floor["two_steps_server_ms"] / 1000 / floor["two_steps_wall_s"])


def ready_rates(workers: dict[str, Any]) -> tuple[dict[int, float | None], bool]:
    """Each run's nodes Ready per second while they come Ready (between the 10th and the 90th
    percentile of their Ready times: the workers' throughput, without the batch window and the
    boot that every run waits alike), or, unless every run has that, over the whole burst (first
    pod created -> last Ready); and whether they are the former."""
    during = _rates(workers, "nodes_ready_per_s_steady")
    steady = bool(during) and all(during.values())
    return (during if steady else _rates(workers, "nodes_ready_per_s")), steady


def _rates(workers: dict[str, Any], key: str) -> dict[int, float | None]:
    """`key` of each run of a workers phase that did not break, by its number of workers."""
    return {int(n): w.get(key) for n, w in workers.items() if "error" not in w}


def scaling(workers: dict[str, Any], cores: int, floor: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Nodes Ready per second by number of workers (`ready_rates`), 2 against 1, and whether the
    2-worker run had a Temporal server (against `server_ceiling_pct`) or a machine that was not
    saturated, which the target needs."""
    rates, steady = ready_rates(workers)
    if not rates.get(1) or not rates.get(2):
        return None
    two, ceiling = workers["2"], server_ceiling_pct(floor)
    sat = saturation(two["usage"], cores, two.get("machine_busy_pct"), ceiling)
    one = saturation(workers["1"]["usage"], cores, workers["1"].get("machine_busy_pct"), ceiling)
    span_rates = _rates(workers, "nodes_ready_per_s")
    return {
        "rates": rates,
        "ratio": rates[2] / rates[1],
        "steady": steady,
        # Over the whole burst, shown beside: the batch window and the boot are in every run's span.
        "span_ratio": span_rates[2] / span_rates[1] if span_rates.get(1) and span_rates.get(2) else None,
        # A run cut off by its deadline measured the nodes that made it, not the burst.
        "all_served": all(workers[n].get("never_served", 0) == 0 for n in ("1", "2")),
        "server_pct": two["usage"]["temporal"]["cpu_pct_of_core"],
        "server_ceiling_pct": ceiling,
        "server_saturated": "temporal" in sat["saturated"],
        "machine_saturated": sat["machine_saturated"],
        "machine_pct": sat["machine_pct"],
        # What the machine had left beyond the 1-worker run: at the same CPU a node, nodes Ready
        # per second can grow at most this much however many workers run (busy 78%: 1.28x).
        "headroom": 100.0 / one["machine_pct"] if one["machine_pct"] > 0 else math.inf,
    }


def scale_model(nodes: int, seconds: float, events: float, actions: float, upserts: float) -> dict[str, float]:
    """What bringing `nodes` up in `seconds` asks of a Temporal cluster, from one life's history
    events, actions and search-attribute upserts (visibility writes: its start, each upsert, its close)."""
    transitions = events / EVENTS_PER_TRANSITION
    rate = nodes * transitions / seconds
    return {
        "actions_per_s": nodes * actions / seconds,
        "history_writes_per_life": transitions,
        "history_writes_per_s": rate,
        "visibility_writes_per_s": nodes * (2 + upserts) / seconds,
        "shards_at_least": max(1, math.ceil(rate / TRANSITIONS_PER_SHARD_S)),
    }
