"""The arithmetic of `make bench`'s page (bench/figures.py, bench/actions.py, bench/report.py):
each target's ratio, the saturated process, the actions rule, and the page rendered from a run
recorded as JSON. Pure and fast: no stack is started."""

from __future__ import annotations

import pytest

from bench import figures as fig
from bench.actions import actions
from bench.report import render, targets


def usage(**cpu: float) -> dict[str, dict[str, float]]:
    """A phase's usage over 10 s of wall: each process's CPU seconds."""
    return {k: {"cpu_s": v, "cpu_pct_of_core": 10 * v, "rss_mb": 100.0, "peak_rss_mb": 100.0} for k, v in cpu.items()}


FLOOR = {"n": 500, "two_steps_ms": 40.0, "two_steps_worker_ms": 10.0, "two_steps_server_ms": 30.0, "two_steps_wall_s": 8.0}


def test_cpu_per_node_sums_every_worker_and_is_set_against_the_two_step_floor() -> None:
    """100 nodes; two workers of 3 s and 1 s, a bridge of 0.5 s, a server of 4.5 s: 40 + 5 + 45 = 90 ms a node."""
    burst = {"instances_bought": 100, "usage": usage(worker1=3.0, worker2=1.0, bridge=0.5, temporal=4.5, **{"sim kube": 9.0})}
    cost = fig.per_node(burst)
    assert cost == pytest.approx({"worker": 40.0, "bridge": 5.0, "temporal": 45.0, "sum": 90.0})
    assert fig.floor_ratios(cost, FLOOR) == pytest.approx({"sum": 2.25, "worker": 4.0, "temporal": 1.5})
    assert fig.per_node({"instances_bought": 0, "usage": burst["usage"]}) is None


def test_the_busiest_process_is_named_and_saturated_near_one_core() -> None:
    s = fig.saturation(usage(worker=9.0, temporal=4.0), cores=2)
    assert (s["busiest"], s["pct"], s["saturated"], s["machine_saturated"]) == ("worker", 90.0, ["worker"], False)
    s = fig.saturation(usage(worker=8.0, temporal=8.0, bridge=2.5), cores=2)
    assert (s["saturated"], s["machine_saturated"]) == ([], True)  # 185% of 2 cores


def test_the_dev_server_is_saturated_near_what_it_used_in_the_floor_and_a_python_process_near_one_core() -> None:
    """On 16 cores: the server busiest at 150% of a core, not saturated against its 240%; the
    worker at 90%, saturated, though not the busiest."""
    s = fig.saturation(usage(temporal=15.0, worker=9.0), cores=16, server_ceiling=240.0)
    assert (s["busiest"], s["saturated"]) == ("temporal", ["worker"])
    assert fig.saturation(usage(temporal=21.0, worker=9.0), cores=16, server_ceiling=240.0)["saturated"] == ["temporal", "worker"]


def test_two_workers_against_one_is_judged_only_with_a_server_that_was_not_saturated() -> None:
    runs = {"1": {"nodes_ready_per_s": 4.0, "usage": usage(worker=9.0, temporal=3.0)},
            "2": {"nodes_ready_per_s": 6.0, "usage": usage(worker1=5.0, worker2=5.0, temporal=4.0)}}  # fmt: skip
    s = fig.scaling(runs, cores=8)
    assert s is not None and s["ratio"] == pytest.approx(1.5) and not s["server_saturated"]
    runs["2"]["usage"]["temporal"]["cpu_pct_of_core"] = 95.0
    s = fig.scaling(runs, cores=8)
    assert s is not None and s["server_saturated"]
    assert fig.scaling({"1": runs["1"]}, cores=8) is None


def test_the_server_is_judged_against_what_it_used_in_the_floor() -> None:
    """The dev server is Go: 150% of a core is not saturated where the floor saw it use 240%
    (500 lives x 43.2 ms in 9 s), and is where no floor ran (one core)."""
    runs = {"1": {"nodes_ready_per_s": 4.0, "usage": usage(worker=9.0, temporal=3.0)},
            "2": {"nodes_ready_per_s": 6.0, "usage": usage(worker1=5.0, worker2=5.0, temporal=15.0)}}  # fmt: skip
    floor = {"n": 500, "two_steps_server_ms": 43.2, "two_steps_wall_s": 9.0}
    assert fig.server_ceiling_pct(floor) == pytest.approx(240.0)
    s = fig.scaling(runs, cores=16, floor=floor)
    assert s is not None and not s["server_saturated"]
    assert fig.scaling(runs, cores=16)["server_saturated"]  # type: ignore[index]
    assert fig.server_ceiling_pct({"n": 10, "two_steps_server_ms": 40.0, "two_steps_wall_s": 8.0}) == 100.0  # at least one core


def test_workers_are_compared_by_their_rate_while_nodes_come_ready_where_every_run_has_it() -> None:
    """The whole burst's rate carries the batch window and the boot, which no worker shortens."""
    runs = {"1": {"nodes_ready_per_s": 10.0, "nodes_ready_per_s_steady": 12.0, "usage": usage(worker=9.0, temporal=3.0)},
            "2": {"nodes_ready_per_s": 14.0, "nodes_ready_per_s_steady": 24.0, "usage": usage(worker1=5.0, worker2=5.0, temporal=4.0)}}  # fmt: skip
    s = fig.scaling(runs, cores=8)
    assert s is not None and s["steady"] and s["ratio"] == pytest.approx(2.0)
    del runs["1"]["nodes_ready_per_s_steady"]  # one run without it: both by the whole burst, never mixed
    s = fig.scaling(runs, cores=8)
    assert s is not None and not s["steady"] and s["ratio"] == pytest.approx(1.4)


def test_actions_follow_temporal_clouds_rule() -> None:
    """Start 1; two activities, one on its third attempt (2 retries); a timer; two upserts; a
    signal in and one out; local activities in two workflow tasks (three markers) and a patch
    marker, which is no action: 1 + 2 + 2 + 1 + 2 + 2 + 2 = 12."""
    history = [
        ("WORKFLOW_EXECUTION_STARTED", ""), ("WORKFLOW_TASK_SCHEDULED", ""), ("WORKFLOW_TASK_STARTED", ""), ("WORKFLOW_TASK_COMPLETED", ""),
        ("MARKER_RECORDED", "core_patch"), ("MARKER_RECORDED", "core_local_activity"), ("MARKER_RECORDED", "core_local_activity"),
        ("UPSERT_WORKFLOW_SEARCH_ATTRIBUTES", ""), ("ACTIVITY_TASK_SCHEDULED", ""), ("ACTIVITY_TASK_STARTED", 3), ("ACTIVITY_TASK_COMPLETED", ""),
        ("WORKFLOW_TASK_COMPLETED", ""), ("ACTIVITY_TASK_SCHEDULED", ""), ("ACTIVITY_TASK_STARTED", 1), ("TIMER_STARTED", ""),
        ("WORKFLOW_EXECUTION_SIGNALED", ""), ("WORKFLOW_TASK_COMPLETED", ""), ("MARKER_RECORDED", "core_local_activity"),
        ("SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED", ""), ("UPSERT_WORKFLOW_SEARCH_ATTRIBUTES", ""), ("WORKFLOW_EXECUTION_COMPLETED", ""),
    ]  # fmt: skip
    counted = actions(history)
    assert counted["activity"] == 2 and counted["activity retry"] == 2
    assert counted["local activities (per workflow task)"] == 2
    assert sum(counted.values()) == 12


def test_the_scale_model_counts_writes_from_events_and_shards_from_the_write_rate() -> None:
    m = fig.scale_model(500, 10.0, events=40.0, actions=20.0, upserts=4.0)
    assert m["actions_per_s"] == 1000
    assert m["history_writes_per_s"] == 500 * 40 / fig.EVENTS_PER_TRANSITION / 10
    assert m["visibility_writes_per_s"] == 500 * 6 / 10
    assert m["shards_at_least"] == 5  # 1,000 writes a second at 200 a shard


def run(nproc: int = 2, life_events: float = 38.0) -> dict:
    burst = {"pods": 500, "instances_bought": 500, "served": 500, "never_served": 0, "wall_s": 20.0, "overhead_s": {"p99": 12.0},
             "offer_listings_per_node": 0.01, "usage": usage(worker=25.0, bridge=2.5, temporal=30.0, **{"sim kube": 8.0})}  # fmt: skip
    burst["idle"] = {"nodes": 500, "never_terminated": 0, "reaction_s": {"p99": 1.2}, "wall_s": 9.0, "usage": usage(worker=1.0, temporal=1.0),
                     "short_life": {"workflows": 500, "history_events": {"p50": life_events}, "life_s": {"p50": 20.0},
                                    "actions": {"sampled": 10, "p50": 18, "by_kind": {"workflow started": 1, "search attribute upsert": 4}}}}  # fmt: skip
    w = {n: {"pods": 200, "nodes_ready_per_s": rate, "usage": usage(worker=5.0, temporal=5.0), "overhead_s": {"p99": 5.0}} for n, rate in (("1", 10.0), ("2", 18.0), ("4", 30.0))}
    return {"date": "2026-11-29 00:00 UTC", "machine": {"nproc": nproc, "cpu_model": "X", "python": "3.12", "commit": "abc1234"},
            "load_at_start": [1.0, 1.0, 1.0], "bursts": {"500": burst}, "workers": w, "temporal_floor": FLOOR}  # fmt: skip


def test_the_page_shows_each_target_with_its_ratio_and_verdict() -> None:
    # 500 nodes: worker 50 ms, bridge 5, server 60: 115 ms against 40 (2.88x); worker 50 against 10 (5x).
    cost = next(r for r in targets(run()) if r[0].startswith("worker + bridge"))
    assert "2.88×" in cost[2] and cost[3] is False
    worker = next(r for r in targets(run()) if r[0].startswith("worker CPU per node"))
    assert "5.00×" in worker[2] and worker[3] is False
    life = next(r for r in targets(run()) if r[0].startswith("history events"))
    assert life[3] is True and next(r for r in targets(run(life_events=41)) if r[0].startswith("history events"))[3] is False
    scaling = next(r for r in targets(run()) if r[0].startswith("nodes Ready per second"))
    assert "1.80×" in scaling[2] and scaling[3] is True
    p99 = next(r for r in targets(run()) if r[0].startswith("burst 500"))
    assert "1.50×" in p99[2] and p99[3] is None  # judged on 8+ cores only
    assert next(r for r in targets(run(nproc=16)) if r[0].startswith("burst 500"))[3] is True


def test_the_page_says_how_to_run_the_8_core_figures_or_shows_them() -> None:
    page = render(run())
    assert "## Targets" in page and "abc1234" in page and "bench/device.sh" in page
    assert "| burst 500 | 20 s | temporal | 300.0% | **temporal, worker**" in page  # saturated: the server past 85% of its 188% in the floor
    device = {**run(nproc=16), "file": "bench/results/device-16core.json"}
    page = render(run(), [device])
    assert "### `bench/results/device-16core.json`\n\n16 × X" in page


def test_each_many_core_run_is_shown_with_the_targets_it_measured_against_its_own_floor() -> None:
    """Two runs on two machines: a ratio never takes one run's burst and the other's floor."""
    bursts = {**run(nproc=16), "file": "a.json"}
    del bursts["workers"]
    workers = {**run(nproc=16), "file": "b.json", "bursts": {}, "temporal_floor": {**FLOOR, "two_steps_wall_s": 4.0}}
    section = render(run(), [bursts, workers]).split("## On 8 or more cores", 1)[1]
    a, b = section.split("### `b.json`")
    assert "1.50×" in a and "nodes Ready per second, 2 workers" not in a  # 12 s against its own 8 s
    assert "burst 500" not in b.split("Saturated process")[0] and "1.80×" in b  # not measured there: not shown
    # Each is of the same commit as the page here; one of an older commit says whose code it measured.
    assert "not this page's" not in section
    older = {**bursts, "machine": {**bursts["machine"], "commit": "0ld0ld0"}}
    assert "Its code is commit `0ld0ld0`'s, not this page's (`abc1234`)" in render(run(), [older])


def test_a_machine_busy_with_other_work_is_saturated_though_the_stack_is_not() -> None:
    """On a shared machine the others' load takes the stack's cores: /proc/stat's share decides."""
    quiet = usage(worker=2.0, temporal=2.0)
    assert not fig.saturation(quiet, cores=2)["machine_saturated"]
    assert fig.saturation(quiet, cores=2, machine_busy_pct=97.0)["machine_saturated"]
    runs = {"1": {"nodes_ready_per_s": 4.0, "usage": quiet}, "2": {"nodes_ready_per_s": 5.0, "usage": quiet, "machine_busy_pct": 97.0}}
    s = fig.scaling(runs, cores=2)
    assert s is not None and s["machine_saturated"] and not s["server_saturated"]


def test_workers_per_fleet_keep_each_worker_under_half_a_core_at_rest() -> None:
    """30% of a core for 1,000 nodes: 10,000 nodes are 300%, six workers at 50% each."""
    from bench.report import fleet_section

    r = {"knobs": {"workflow_cache": 300}, "hold": {"nodes": 1000, "usage": {"worker": {"cpu_pct_of_core": 30.0, "rss_mb": 280.0}}}}
    line = fleet_section(r)[0]
    assert "1,000 nodes → 1 worker(s), 5,000 nodes → 3 worker(s), 10,000 nodes → 6 worker(s)" in line


def test_per_node_figures_come_from_a_burst_whose_every_pod_was_served() -> None:
    """A burst cut off by its deadline spent CPU on nodes not yet up: the 1-worker run that
    served all its pods is taken instead, though it bought more or fewer nodes."""
    from bench.report import largest_burst

    r = run()
    r["bursts"]["500"].update(instances_bought=185, never_served=315)
    r["workers"]["1"].update(instances_bought=150, never_served=0)
    assert largest_burst(r) == ("200, 1 worker", r["workers"]["1"])
    r["workers"]["1"]["never_served"] = 3
    assert largest_burst(r) == ("500", r["bursts"]["500"])  # none whole: the biggest that bought any


def test_the_rate_while_nodes_come_ready_counts_the_nodes_between_its_percentiles() -> None:
    from bench.history import STEADY_AT_LEAST, steady_window

    assert steady_window([float(i) for i in range(STEADY_AT_LEAST - 1)]) is None  # too few for percentiles
    w = steady_window([float(i) for i in reversed(range(101))])  # one a second, 0..100, in any order
    assert w == {"nodes": 80, "s": 80.0}


def test_workers_are_not_judged_where_a_run_left_pods_unserved() -> None:
    """A 2-worker run cut off by its deadline measured the nodes that made it, not the burst."""
    r = run()
    r["workers"]["2"]["never_served"] = 100
    row = next(x for x in targets(r) if x[0].startswith("nodes Ready per second"))
    assert row[3] is None and "unserved" in row[2]


def test_a_many_core_run_keeps_its_failed_rows_and_an_unreadable_file_is_said(tmp_path, monkeypatch) -> None:
    from bench.report import device_figures

    device = {**run(nproc=16), "file": "d.json"}
    device["bursts"]["500"]["idle"]["reaction_s"]["p99"] = None  # "not measured; never terminated 0": a failure
    section = render(run(), [device]).split("## On 8 or more cores", 1)[1]
    assert "| idle reaction" in section and "**not met**" in section.split("| idle reaction", 1)[1].split("\n", 1)[0]
    (tmp_path / "cut.json").write_text('{"machine": {"nproc": 16')
    monkeypatch.setenv("BENCH_DEVICE_JSON", str(tmp_path / "cut.json"))
    devices = device_figures()
    assert "could not be read (JSONDecodeError)" in render(run(), devices)


def test_the_per_node_targets_take_each_ratios_median_round_and_the_page_shows_every_round() -> None:
    """Rounds, each a burst against the mean of the floor right after it and the previous
    round's floor: the sum's ratios 2.88x (the run's own round), 1.45x, 0.80x (48 ms against the
    mean of 40 and 80); the worker's 5.00x, 1.50x, 2.40x. Each target takes its own median
    round, with that round's figures. A round whose floor broke, whose burst left pods unserved
    or was another size is left out and said so; of an even number the higher middle counts."""
    r = run()
    again = lambda worker, server, floor, **burst: {"burst": {"pods": 500, "never_served": 0, "instances_bought": 500, "wall_s": 30.0,  # noqa: E731
                                                              "usage": usage(worker=worker, bridge=0.0, temporal=server), **burst}, "floor": floor}  # fmt: skip
    r["rounds"] = [
        again(7.5, 21.5, FLOOR),  # 15 + 43 = 58 ms: 1.45x; the worker 15 against 10: 1.50x
        again(12.0, 12.0, {**FLOOR, "two_steps_ms": 80.0, "two_steps_worker_ms": 10.0}),  # 48 ms against (40 + 80) / 2: 0.80x; 24 against 10: 2.40x
        again(1.0, 1.0, {"error": "the floor broke"}),
        again(1.0, 1.0, FLOOR, never_served=3),
        again(1.0, 1.0, FLOOR, pods=200),
    ]
    cost = next(x for x in targets(r) if x[0].startswith("worker + bridge"))
    assert cost[2].startswith("**1.45×** (the median of 3 rounds: 2.88×, 1.45×, 0.80×; round 4 left out: its floor broke; "
                              "round 5 left out: its burst left 3 pods unserved; round 6 left out: its burst was of 200 pods, not 500): 58.0 ms against 40.0 ms")
    assert cost[3] is True
    worker = next(x for x in targets(r) if x[0].startswith("worker CPU per node"))
    assert worker[2].startswith("**2.40×** (the median of 3 rounds: 5.00×, 1.50×, 2.40×;") and "24.0 ms" in worker[2] and worker[3] is False
    page = render(r)
    assert "| 2 | 30 s | 58.0 ms | 40.0 ms (40.0, 40.0) | 1.45× | 15.0 ms | 10.0 ms | 1.50× |" in page
    assert "| 3 | 30 s | 48.0 ms | 60.0 ms (40.0, 80.0) | 0.80× |" in page and "| 4 | left out: its floor broke |" in page
    # Of two rounds measured, the higher: never the better one by default.
    two = fig.rounds(r["bursts"]["500"], FLOOR, r["rounds"][:1])
    assert fig.median_round(two, "sum")["ratio"]["sum"] == pytest.approx(2.875)
    # Round 1's floor broke: the page says so, and the later rounds still stand.
    r["temporal_floor"] = {**FLOOR, "error": "broke"}
    del r["temporal_floor"]["two_steps_ms"]
    page = render(r)
    assert "Round 1 not measured" in page and "| 1 | left out: its floor broke |" in page and "| 2 | 30 s | 58.0 ms |" in page


def test_each_burst_is_set_against_the_mean_of_the_floors_on_either_side_of_it() -> None:
    """A host whose pace drifts within a round moves the floor before a burst and the one after
    it alike: each round takes their mean. Round 1's burst (115 ms a node) sits between a floor
    of 60 ms measured right before it and 40 ms right after: 50 ms, 2.30x. Round 2's floor before
    is round 1's after. A round whose floor after it broke is left out, and the round after it
    takes its own floor alone."""
    r = run()
    r["temporal_floor_before"] = {**FLOOR, "two_steps_ms": 60.0, "two_steps_worker_ms": 14.0, "two_steps_server_ms": 46.0, "before_burst": 500}
    again = lambda floor: {"burst": {"pods": 500, "never_served": 0, "instances_bought": 500, "wall_s": 30.0,  # noqa: E731
                                     "usage": usage(worker=7.5, bridge=0.0, temporal=21.5)}, "floor": floor}  # fmt: skip
    r["rounds"] = [again({**FLOOR, "two_steps_ms": 20.0, "two_steps_worker_ms": 6.0, "two_steps_server_ms": 14.0}), again({"error": "broke"}), again(FLOOR)]
    first, second, third, fourth = fig.rounds(r["bursts"]["500"], FLOOR, r["rounds"], r["temporal_floor_before"])
    assert first["floor"]["two_steps_ms"] == 50.0 and first["floor"]["around"] == [60.0, 40.0]
    assert first["ratio"]["sum"] == pytest.approx(115.0 / 50.0) and first["ratio"]["worker"] == pytest.approx(first["cost"]["worker"] / 12.0)
    assert second["floor"]["two_steps_ms"] == 30.0 and second["ratio"]["sum"] == pytest.approx(58.0 / 30.0)
    assert third["left_out"] == "its floor broke"
    assert fourth["floor"] == FLOOR and fourth["ratio"]["sum"] == pytest.approx(58.0 / 40.0)
    page = render(r)
    assert "| 1 | 20 s | 115.0 ms | 50.0 ms (60.0, 40.0) | 2.30× |" in page and "| 4 | 30 s | 58.0 ms | 40.0 ms | 1.45× |" in page
    assert "right before the burst, 60.0 ms, and the one right after, 40.0 ms" in page
    # Without a floor before it (a run recorded before there was one), round 1 takes its floor alone;
    # so does a burst the floor before did not precede (a quick run's workers phase is its largest).
    assert fig.rounds(r["bursts"]["500"], FLOOR, [])[0]["floor"] == FLOOR
    r["temporal_floor_before"]["before_burst"] = 100
    assert "| 1 | 20 s | 115.0 ms | 40.0 ms | 2.88× |" in render(r)


def test_a_floor_before_counts_only_where_it_was_measured_right_before_that_burst() -> None:
    """A floor before that broke leaves round 1 its floor after alone; a run recorded before the
    floor before said which burst it preceded counts it for the run's largest burst; a quick
    run's round 1 (its workers phase's burst, larger) never takes it; and a round left out for
    its burst still hands its floor after to the next round as that round's floor before."""
    r = run()
    r["temporal_floor_before"] = {"error": "broke", "before_burst": 500}
    assert fig.rounds(r["bursts"]["500"], FLOOR, [], r["temporal_floor_before"])[0]["floor"] == FLOOR
    assert "| 1 | 20 s | 115.0 ms | 40.0 ms | 2.88× |" in render({**r, "rounds": [{"burst": r["bursts"]["500"], "floor": FLOOR}]})
    legacy = {**FLOOR, "two_steps_ms": 60.0}  # e369ff7's runs: no before_burst
    r = {**run(), "temporal_floor_before": legacy, "knobs": {"bursts": [100, 500]}}
    assert "the one right after, 40.0 ms" in render(r)
    quick = {**run(), "temporal_floor_before": {**legacy, "before_burst": 500}}
    quick["workers"]["1"] = {**quick["bursts"]["500"], "pods": 800, "instances_bought": 800, "idle": None}
    page = render(quick)
    assert "Burst 800, 1 worker" in page and "the one right after" not in page
    served = lambda floor, **burst: {"burst": {"pods": 500, "never_served": 0, "instances_bought": 500, "wall_s": 30.0,  # noqa: E731
                                               "usage": usage(worker=7.5, bridge=0.0, temporal=21.5), **burst}, "floor": floor}  # fmt: skip
    r = run()
    rounds = fig.rounds(r["bursts"]["500"], FLOOR, [served({**FLOOR, "two_steps_ms": 20.0}, never_served=2), served(FLOOR)])
    assert rounds[1]["left_out"] == "its burst left 2 pods unserved"
    assert rounds[2]["floor"]["around"] == [20.0, 40.0] and rounds[2]["floor"]["two_steps_ms"] == 30.0


def test_two_workers_are_not_judged_where_the_machine_had_no_room_for_them() -> None:
    """With one worker the machine was 78% busy: at the same CPU a node, nodes Ready per second
    can grow at most 1.28x whatever the workers do, so 1.00x is not judged against 1.7x; with
    room (40% busy) it is."""
    r = run()
    r["workers"]["2"]["nodes_ready_per_s"] = r["workers"]["1"]["nodes_ready_per_s"]
    r["workers"]["1"]["machine_busy_pct"] = 78.0
    row = next(x for x in targets(r) if x[0].startswith("nodes Ready per second"))
    assert row[3] is None and "more than 1.28× as fast" in row[2] and "78% busy" in row[2]
    r["workers"]["1"]["machine_busy_pct"] = 40.0
    assert next(x for x in targets(r) if x[0].startswith("nodes Ready per second"))[3] is False


def test_the_overhead_of_a_burst_of_500_is_judged_on_its_run_with_the_most_workers() -> None:
    """bench/device.sh measures the per-node cost with one worker (as the floor has one) and the
    bursts of 500 again with 1, 2 and 4 workers: the overhead target takes the 4 workers' run, as
    a deployment on such a machine runs them; the per-node cost stays the 1-worker burst's."""
    r = run(nproc=16)
    r["bursts"]["500"]["workers"] = 1
    r["workers"] = {n: {**r["bursts"]["500"], "workers": int(n), "overhead_s": {"p99": p99}} for n, p99 in (("1", 12.0), ("2", 9.0), ("4", 8.0))}
    row = next(x for x in targets(r) if x[0].startswith("burst 500"))
    assert "**1.00×**: p99 8 s" in row[2] and "4 worker(s)" in row[2] and row[3] is True
    cost = next(x for x in targets(r) if x[0].startswith("worker CPU per node"))
    assert "(burst 500)" in cost[0]
    r["workers"]["4"]["never_served"] = 3  # the run judged left pods unserved: not met, not another run instead
    assert next(x for x in targets(r) if x[0].startswith("burst 500"))[3] is False
    r["workers"]["4"]["never_served"] = 0
    r["bursts"]["500"] = {"error": "RuntimeError('broke')"}  # a phase that broke is not judged: the most workers' run is
    assert "**1.00×**" in next(x for x in targets(r) if x[0].startswith("burst 500"))[2]
    r["workers"]["4"] = {"error": "RuntimeError('broke')"}
    assert "2 worker(s)" in next(x for x in targets(r) if x[0].startswith("burst 500"))[2]
    only_one = {**r, "workers": {"1": r["workers"]["1"]}}  # as many workers as the broken phase had: still the run that did not break
    assert "**1.50×**: p99 12 s" in next(x for x in targets(only_one) if x[0].startswith("burst 500"))[2]
    r["bursts"]["500"] = run(nproc=16)["bursts"]["500"]
    del r["workers"]  # without a workers phase of 500: the bursts phase's
    assert "**1.50×**" in next(x for x in targets(r) if x[0].startswith("burst 500"))[2]
