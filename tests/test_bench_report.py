"""docs/benchmarks.md is written from the JSON `make bench` records (bench/report.py): the page
renders from the recorded baseline, with and without a baseline column, so a change to either
side cannot leave `make bench` failing at its last step."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import cpu_budget, floor, render, targets, unsaturated, why

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def test_the_page_renders_every_target_of_the_recorded_baseline() -> None:
    baseline = json.loads((RESULTS / "baseline.json").read_text())
    keys = [row[0] for row in targets(baseline)]
    assert {"burst2", "burst5", "idle", "life", "listings", "ranking"} <= set(keys)
    page = render(baseline)
    assert "## Targets" in page and baseline["machine"]["commit"] in page


def test_a_run_renders_beside_the_baseline() -> None:
    baseline = json.loads((RESULTS / "baseline.json").read_text())
    quick = json.loads((RESULTS / "baseline-quick.json").read_text())
    page = render(quick, baseline)
    assert f"before: `{baseline['machine']['commit']}`" in page
    assert "Workers per fleet" in page  # the quick run's hold was at rest


def test_a_bursts_cpu_is_set_against_what_its_target_allows() -> None:
    """A burst of 100 whose 99 first pods must be bound within 2 s + a 3 s boot has 5 s of the
    machine's cores for them: 5 s x 2 cores / 99 pods, and 5 s / 99 pods in the worker."""
    burst = {"served": 100, "boot_s": 3.0, "wall_s": 10.0, "usage": {"worker": {"cpu_s": 10.1}, "temporal": {"cpu_s": 5.05}}}
    line = cpu_budget(100, burst, 2.0, cores=2)
    assert line is not None
    assert "151 ms of CPU per pod (worker 101, temporal 50)" in line
    assert "at most 101 ms of CPU per pod across the processes on 2 cores" in line
    assert "at most 51 ms in the worker" in line
    assert "1.5× and 2.0× over" in line
    assert "76% busy" in line
    assert cpu_budget(100, {**burst, "served": 0}, 2.0, cores=2) is None


def test_the_unsaturated_burst_is_shown_when_a_burst_target_is_missed() -> None:
    """The small burst after the big ones says what a pod's overhead is when nothing waits for
    CPU: the batch's idle window first, then the node's own path."""
    run = json.loads((RESULTS / "baseline.json").read_text())
    stages = {"start_to_launching": {"n": 10, "p50": 0.26, "p99": 0.41}, "ready_to_pod_bound": {"n": 10, "p50": 0.22, "p99": 0.34}}
    run["latency"] = {
        "pods": 10, "served": 10, "boot_s": 3.0, "overhead_s": {"p50": 2.36, "p99": 2.51},
        "pending_to_node_workflow_start_s": {"p99": 1.28}, "usage": {"worker": {"cpu_pct_of_core": 15.4}, "temporal": {"cpu_pct_of_core": 19.6}},
        "launch_instance": {"stages_s": stages},
    }  # fmt: skip
    line = unsaturated(run)
    assert line is not None and "a burst of 10" in line and "p99 2.51 s" in line and "once no pod has come for 1 s" in line
    assert "Ready → its pod bound (the simulated scheduler) 0.22 s / 0.34 s" in line
    assert any(p == line for p in why(run)), "the baseline misses its burst targets: the paragraph belongs on its page"
    assert unsaturated({**run, "latency": {"error": "boom"}}) is None


def test_the_floor_is_set_against_what_each_burst_allows() -> None:
    """A one-step life of 23 ms and 8 ms per further step: a launch then a join is 31 ms a pod.
    With the rest of the stack's 40 ms a pod (bridge and simulated world; the worker's and the
    dev server's own are what the floor replaces), a burst of 100 (101 ms allowed) is within
    it; with 90 ms, a burst of 500 (32 ms allowed) is 3.7x over."""

    def usage(n: int, rest_ms: int) -> dict[str, dict[str, float]]:
        """The worker's and the dev server's CPU (not counted), the bridge's 10 ms a pod, the world's the rest."""
        return {"worker": {"cpu_s": 99.0}, "temporal": {"cpu_s": 99.0}, "bridge": {"cpu_s": 0.01 * n}, "sim": {"cpu_s": (rest_ms - 10) / 1000 * n}}

    run = {
        "machine": {"nproc": 2}, "knobs": {"boot_s": 3.0},
        "bursts": {"100": {"usage": usage(100, 40)}, "500": {"usage": usage(500, 90)}},
        "temporal_floor": {"n": 500, "one_step_ms": 23.0, "one_step_server_ms": 18.0, "one_step_worker_ms": 5.0, "three_steps_ms": 39.0, "per_step_ms": 8.0},
    }  # fmt: skip
    line = floor(run)
    assert line is not None and "31 ms per pod" in line
    assert "burst 100: 31 + 40 = 71 ms against 101 ms allowed (within it: not ruled out by the floor)" in line
    assert "burst 500: 31 + 90 = 121 ms against 32 ms allowed (3.7× over: out of reach)" in line
    del run["bursts"]
    assert "burst 500: the floor 31 ms against 32 ms allowed" in (floor(run) or "")
    assert floor({"temporal_floor": {"error": "boom"}}) is None
