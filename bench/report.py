"""docs/benchmarks.md from the JSON `make bench` writes (bench/run.py): the current page only.
Each target of issue 37 with its ratio measured in the run and met / not met, the saturated
processes of each phase, nodes Ready per second by workers, what a burst asks of a production
Temporal, and the 8-core figures of each many-core run's JSON (bench/device.sh). The
arithmetic is bench/figures.py; earlier runs are bench/results/HISTORY.md."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from bench import figures as fig
from bench.actions import RULE

RESULTS = Path(__file__).resolve().parent / "results"
# How the lead runs the 8-core figures (bench/device.sh writes its JSON to $OUT).
DEVICE_COMMAND = "OUT=bench/results bench/device.sh   # then: make bench (it shows every bench/results/device-*.json; or BENCH_DEVICE_JSON=a.json,b.json)"
# What the time-boxed build of a Temporal server that is not the dev server found (issue 37, item 4).
SERVER_BUILD = (
    "No run against a Temporal server that is not the dev server is on this page. go.temporal.io/server is served by the Go "
    "module proxy (v1.32.2 newest), but it needs Go ≥ 1.26.10 (this machine has 1.26.8); with the approved GOTOOLCHAIN=go1.27.3, "
    "`go install go.temporal.io/server/cmd/server@v1.32.2` (niced, on this 2-core machine shared with other sessions at load 20-30) "
    "had not finished after its 20-minute bound: 1.7 GB of modules downloaded, 0.3 GB of build cache, no binary. Its embedded store "
    "would anyway be the dev server's SQLite (one writer); a production-like cluster needs PostgreSQL (Debian's packages) beside it. "
    "The figures below model it from each life's counted events and actions instead."
)

Row = tuple[str, str, str, "bool | None"]  # (scenario, target, measured, met)


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _f(v: Any, unit: str = "", digits: int = 2) -> str:
    if v is None:
        return "not measured"
    if isinstance(v, float):
        v = f"{v:.{digits}f}".rstrip("0").rstrip(".") if digits else f"{v:.0f}"
    return f"{v}{unit}"


def _err(error: str) -> str:
    """A phase's error on one table line: its end, where a traceback says what broke."""
    return " ".join(error.replace("\\n", " ").split())[-160:].replace("|", "/")


def _met(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "**not met**")


def largest_burst(r: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The burst the per-node figures come from: the biggest whose every pod was served (a burst
    cut off by its deadline has spent CPU on nodes not yet up), the 1-worker run of the workers
    phase among them; else the biggest that bought any."""
    runs = {n: b for n, b in (r.get("bursts") or {}).items()}
    if "1" in (r.get("workers") or {}):
        w = r["workers"]["1"]
        runs[f"{w.get('pods', '?')}, 1 worker"] = w
    done = [(n, b) for n, b in runs.items() if "error" not in b and b.get("instances_bought")]
    whole = [(n, b) for n, b in done if b.get("never_served") == 0]
    return max(whole or done, key=lambda nb: nb[1]["instances_bought"]) if done else None


def short_life(r: dict[str, Any]) -> dict[str, Any] | None:
    return next((b["idle"]["short_life"] for b in (r.get("bursts") or {}).values() if _get(b, "idle", "short_life", "workflows")), None)


def cost_rounds(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The rounds of the per-node comparison (bench.figures.rounds): the largest burst between
    the floors right before and right after it, then each later round."""
    big = largest_burst(r)
    before = r.get("temporal_floor_before") or {}
    # The burst the floor before preceded (recorded since d5fb0e6; before that, always the run's
    # largest burst): a quick run's round 1 is its workers phase's burst, which it did not.
    preceded = before.get("before_burst", max(_get(r, "knobs", "bursts") or [0]))
    right_before = before if big is not None and big[0] == str(preceded) else None
    return fig.rounds(big[1] if big else None, r.get("temporal_floor") or {}, r.get("rounds") or [], right_before)


def cost_rows(r: dict[str, Any]) -> list[Row]:
    """Per node brought up against the two-step floor: the sum and the worker, each its median round."""
    big, floor, every = largest_burst(r), r.get("temporal_floor") or {}, cost_rounds(r)
    measured = [m for m in every if "left_out" not in m]
    if big is None or not measured:
        failed = [f"burst {n} failed: {_err(b['error'])}" for n, b in (r.get("bursts") or {}).items() if "error" in b]
        failed += [f"the floor failed: {_err(floor['error'])}"] if "error" in floor else []
        shown = "; ".join(failed) or "not measured (a burst or the floor is missing)"
        return [("CPU per node brought up, against the two-step floor", f"≤ {fig.SUM_VS_FLOOR}× (sum), ≤ {fig.WORKER_VS_FLOOR}× (worker)", shown, False if failed else None)]
    left = "".join(f"; round {m['round']} left out: {m['left_out']}" for m in every if "left_out" in m)
    rows: list[Row] = []
    for key, floor_key, what, target in (
        ("sum", "two_steps_ms", f"worker + bridge + Temporal server CPU per node brought up (burst {big[0]}), against the two-step floor", fig.SUM_VS_FLOOR),
        ("worker", "two_steps_worker_ms", f"worker CPU per node (burst {big[0]}), against the floor's worker share for two steps", fig.WORKER_VS_FLOOR),
    ):
        mid = fig.median_round(measured, key)
        ratios = ", ".join(f"{m['ratio'][key]:.2f}×" for m in measured)
        each = f" (the median of {len(measured)} rounds: {ratios}{left})" if len(every) > 1 else ""
        rows.append((what, f"≤ {target}×", f"**{mid['ratio'][key]:.2f}×**{each}: {mid['cost'][key]:.1f} ms against {mid['floor'][floor_key]} ms", mid["ratio"][key] <= target))
    return rows


def life_rows(r: dict[str, Any]) -> list[Row]:
    life = short_life(r)
    if life is None:
        return [("history events for one short life", f"≤ {fig.LIFE_EVENTS}", "not measured", None)]
    med = _get(life, "history_events", "p50")
    acts = life.get("actions") or {}
    return [
        ("history events for one short life (pending pod → bought → Ready → ran → idle → terminated)", f"≤ {fig.LIFE_EVENTS}",
         f"**{_f(med, '', 0)}** (median of {life['workflows']}, a {_f(_get(life, 'life_s', 'p50'), ' s', 0)} life)", med is not None and med <= fig.LIFE_EVENTS),
        ("Temporal Cloud actions for the same life (rule below)", "printed beside (the two-step floor: 3)",
         f"**{_f(acts.get('p50'))}** (median of {acts.get('sampled', 0)}; {', '.join(f'{k} {v}' for k, v in (acts.get('by_kind') or {}).items())})", None),
    ]  # fmt: skip


def scaling_row(r: dict[str, Any]) -> Row:
    cores = _get(r, "machine", "nproc") or 1
    s = fig.scaling(r.get("workers") or {}, cores, r.get("temporal_floor"))
    target = f"≥ {fig.SCALING_2_VS_1}× with a server that is not saturated"
    if s is None:
        return ("nodes Ready per second, 2 workers against 1", target, "not measured", None)
    how = "while nodes come Ready (10th to 90th percentile)" if s["steady"] else "first pod created → last node Ready"
    span = f"; over the whole burst {s['span_ratio']:.2f}×" if s["steady"] and s["span_ratio"] else ""
    shown = (f"**{s['ratio']:.2f}×** ({', '.join(f'{n} worker(s) {_f(v)}/s' for n, v in sorted(s['rates'].items()))}, {how}{span}); Temporal server at "
             f"{s['server_pct']}% of a core with 2 workers ({'saturated' if s['server_saturated'] else 'not saturated'}: it used {s['server_ceiling_pct']:.0f}% in the floor), "
             f"the machine {s['machine_pct']:.0f}% busy")  # fmt: skip
    if not s["all_served"]:
        return ("nodes Ready per second, 2 workers against 1", target, f"{shown}; not judged here: a run left pods unserved by its deadline", None)
    if s["ratio"] >= fig.SCALING_2_VS_1:
        return ("nodes Ready per second, 2 workers against 1", target, shown, True)
    if s["server_saturated"] or s["machine_saturated"] or s["headroom"] < fig.SCALING_2_VS_1:
        # The target holds the workers to it only where something else is not the limit.
        why = ("the server was saturated" if s["server_saturated"] else f"all {cores} cores were saturated" if s["machine_saturated"] else
               f"with one worker the machine was already {100 / s['headroom']:.0f}% busy, so at the same CPU a node no number of workers "
               f"can bring nodes up more than {s['headroom']:.2f}× as fast (bench/device.sh: 8+ cores)")  # fmt: skip
        return ("nodes Ready per second, 2 workers against 1", target, f"{shown}; not judged here: {why}", None)
    return ("nodes Ready per second, 2 workers against 1", target, shown, False)


def p99_burst(r: dict[str, Any]) -> dict[str, Any]:
    """The burst of 500 the overhead target is judged on: of the bursts phase's and the workers
    phase's, the one with the most workers (as a deployment on a many-core machine runs them;
    bench/device.sh measures the per-node cost with one worker, as the floor has), the bursts
    phase's where they have as many; a run that broke is not one of them."""
    phase = (r.get("bursts") or {}).get("500") or {}
    runs = [b for b in (phase, *(r.get("workers") or {}).values()) if b.get("pods") == 500 and "error" not in b]
    return max(runs, key=lambda b: b.get("workers", 1)) if runs else phase


def p99_row(r: dict[str, Any]) -> Row:
    b, floor = p99_burst(r), r.get("temporal_floor") or {}
    target = f"≤ {fig.P99_VS_FLOOR_WALL}× the floor's wall for 500 two-step lives, every pod served (8+ cores)"
    p99, wall = _get(b, "overhead_s", "p99"), floor.get("two_steps_wall_s")
    if p99 is None or not wall or floor.get("n") != 500:
        return ("burst 500: overhead p99", target, "not measured (needs the full run's burst 500 and floor of 500)", None)
    ratio = p99 / wall
    shown = f"**{ratio:.2f}×**: p99 {_f(p99, ' s')} (of the pods served) against {_f(wall, ' s')}; never served {b.get('never_served')}; {b.get('workers', 1)} worker(s)"
    judged = (_get(r, "machine", "nproc") or 1) >= 8
    return ("burst 500: overhead p99 (bound − created − boot)", target, shown if judged else f"{shown}; judged on 8+ cores only", (ratio <= fig.P99_VS_FLOOR_WALL and b.get("never_served") == 0) if judged else None)


def kept_rows(r: dict[str, Any]) -> list[Row]:
    """Issue 20's targets kept: the idle reaction, 1,000 nodes at rest, offers."""
    rows: list[Row] = []
    idle = next((b["idle"] for b in (r.get("bursts") or {}).values() if "idle" in b), None)
    if idle:
        p99 = _get(idle, "reaction_s", "p99")
        rows.append((f"idle reaction: terminate call − pod deletion − idle timeout, p99 ({idle['nodes']} nodes)", "< 2 s",
                     f"{_f(p99, ' s')}; never terminated {idle['never_terminated']}", p99 is not None and p99 < 2 and idle["never_terminated"] == 0))  # fmt: skip
    h = r.get("hold") or {}
    if "usage" in h:
        w = h["usage"]["worker"]
        full = h["nodes"] >= 1000 and h.get("ready") == h["nodes"] and _get(h, "settle", "quiet") is not False
        note = "" if _get(h, "settle", "quiet") is not False else " (the settle ran out: not quiet)"
        rows.append((f"{h['nodes']:,} nodes at rest: worker CPU and RSS", "< 5% of a core, < 300 MB",
                     f"{w['cpu_pct_of_core']}%, {_f(w['rss_mb'], ' MB', 0)}; {h.get('ready')} Ready{note}", (w["cpu_pct_of_core"] < 5 and w["rss_mb"] < 300) if full else None))  # fmt: skip
        # A stack still bringing nodes up or adopting them is not at rest: shown, not judged.
        at_rest = full and _get(h, "settle", "quiet") is not False and h.get("history_events_per_node_hour") is not None
        rows.append(("same: history events per node-hour at rest", "< 10", _f(h.get("history_events_per_node_hour"), "", 1) + note, h["history_events_per_node_hour"] < 10 if at_rest else None))
    elif h:
        rows.append(("1,000 nodes at rest", "< 5% of a core, < 300 MB", f"failed: {str(h.get('error'))[:120]}", False))
    per_node = [b["offer_listings_per_node"] for b in (r.get("bursts") or {}).values() if b.get("offer_listings_per_node") is not None]
    if per_node:
        rows.append(("offer listings per node started (bursts)", "< 0.2", ", ".join(_f(p, "", 3) for p in per_node), max(per_node) < 0.2))
    o = r.get("offer_selection") or {}
    if "select_cpu_worst_ms" in o:
        rows.append((f"a node's offer choice over {o['offers']:,} offers (CPU, worst)", "< 50 ms", _f(o["select_cpu_worst_ms"], " ms", 1), o["select_cpu_worst_ms"] < 50))
    return rows


def targets(r: dict[str, Any]) -> list[Row]:
    """Every target: issue 37's ratios first, then issue 20's kept ones."""
    return [*cost_rows(r), *life_rows(r), scaling_row(r), p99_row(r), *kept_rows(r)]


def phases(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every phase that recorded each process's CPU, by a readable name."""
    out: dict[str, dict[str, Any]] = {}
    for n, b in (r.get("bursts") or {}).items():
        out[f"burst {n}"] = b
        if "usage" in (b.get("idle") or {}):
            out[f"idle reaction ({n})"] = b["idle"]
    for n, b in (r.get("workers") or {}).items():
        out[f"burst {b.get('pods', '?')}, {n} worker(s)"] = b
    if "usage" in (r.get("latency") or {}):
        out[f"burst {r['latency']['pods']} (unsaturated)"] = r["latency"]
    h = r.get("hold") or {}
    if "bringup_usage" in h:
        out[f"hold: {h['nodes']} nodes brought up"] = {"usage": h["bringup_usage"], "wall_s": h["bringup_s"]}
        out[f"hold: {h['nodes']} nodes at rest"] = {"usage": h["usage"], "wall_s": h["stretch_s"]}
    return {k: v for k, v in out.items() if "usage" in v}


def saturation_table(r: dict[str, Any]) -> list[str]:
    cores = _get(r, "machine", "nproc") or 1
    lines = ["| phase | wall | busiest process | its share of a core | saturated processes | every process (% of a core) |", "|---|---|---|---|---|---|"]
    for name, p in phases(r).items():
        s = fig.saturation(p["usage"], cores, p.get("machine_busy_pct"), fig.server_ceiling_pct(r.get("temporal_floor")))
        flag = (f"**{', '.join(s['saturated'])}**" if s["saturated"] else "no") + (f"; the machine was ({s['machine_pct']:.0f}% of {cores} cores busy, every process on it)" if s["machine_saturated"] else "")
        each = ", ".join(f"{k} {u['cpu_pct_of_core']}" for k, u in sorted(p["usage"].items(), key=lambda kv: -kv[1]["cpu_pct_of_core"]))
        lines.append(f"| {name} | {_f(p.get('wall_s'), ' s', 0)} | {s['busiest']} | {s['pct']}% | {flag} | {each} |")
    return lines


def cost_table(r: dict[str, Any]) -> list[str]:
    big, first = largest_burst(r), cost_rounds(r)[0]
    if big is None or "left_out" in first:
        return ["Round 1 not measured: a burst or the floor is missing from this run.", "", *rounds_table(r)]
    cost, floor, ratio = first["cost"], first["floor"], first["ratio"]
    share = {"worker": floor["two_steps_worker_ms"], "bridge": None, "temporal": floor["two_steps_server_ms"], "sum": floor["two_steps_ms"]}
    around = f" (the mean of the floor right before the burst, {floor['around'][0]} ms, and the one right after, {floor['around'][1]} ms)" if "around" in floor else ""
    lines = [f"Burst {big[0]}, {big[1]['instances_bought']} nodes brought up; the floor: {floor['n']} two-step lives at once on a dev server of their own, in the same run{around}.", "",
             "| CPU per node brought up | tgp | floor (two steps) | ratio |", "|---|---|---|---|"]  # fmt: skip
    for k, label in (("worker", "worker"), ("bridge", "bridge"), ("temporal", "Temporal server"), ("sum", "sum")):
        lines.append(f"| {label} | {cost[k]:.1f} ms | {_f(share[k], ' ms', 1) if share[k] is not None else '— (the floor has none)'} | {f'{ratio[k]:.2f}×' if k in ratio else '—'} |")
    world = {k: 1000 * u["cpu_s"] / big[1]["instances_bought"] for k, u in big[1]["usage"].items() if k.startswith(("sim", "harness"))}
    lines += ["", "The simulated world and this harness, per node (not tgp's, not in the sum): " + ", ".join(f"{k} {v:.1f} ms" for k, v in world.items()) + "."]
    return lines + ["", *rounds_table(r)]


def rounds_table(r: dict[str, Any]) -> list[str]:
    """Every round of the comparison, those left out with why; the targets take each ratio's
    median round."""
    every = cost_rounds(r)
    if len(every) < 2:
        return []
    first = "with a floor right before it too" if "around" in (every[0].get("floor") or {}) else "without a floor before it"
    lines = [f"The same comparison in {len(every)} rounds, each the burst and then the floor (BENCH_ROUNDS; round 1 is the one above where it "
             f"was measured, {first}); on a shared host the CPU one piece of work costs moves from minute to minute, so each burst is set "
             "against the mean of the floors on either side of it where both were measured (in brackets: before, after), and the targets "
             "take each ratio's median round (of an even number, the higher of the middle two).", "",
             "| round | burst wall | tgp: sum | floor | ratio | tgp: worker | floor: worker | ratio |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for m in every:
        if "left_out" in m:
            lines.append(f"| {m['round']} | left out: {m['left_out']} | | | | | | |")
            continue
        c, fl, x = m["cost"], m["floor"], m["ratio"]
        around = f" ({fl['around'][0]}, {fl['around'][1]})" if "around" in fl else ""
        lines.append(f"| {m['round']} | {_f(m['wall_s'], ' s', 0)} | {c['sum']:.1f} ms | {fl['two_steps_ms']} ms{around} | {x['sum']:.2f}× | {c['worker']:.1f} ms | {fl['two_steps_worker_ms']} ms | {x['worker']:.2f}× |")
    return lines


IDLE_STAGES = {
    "facts_dated": "pod deletion sent → the bridge's facts (their date starts the idle timeout)",
    "signal_arrived": "→ their signal in the node's history",
    "timer_late": "the idle timer's firing − its due time (a timer starts when its workflow task completes)",
    "task_picked": "fired → its workflow task picked up by the worker",
    "task_done": "→ completed: the drain scheduled",
    "drain_started": "→ the drain started",
    "terminate_called": "→ its terminate call (cordon, pods listed, terminate)",
}


def idle_section(r: dict[str, Any]) -> list[str]:
    """Where the idle reaction's time went, step by step (bench/history.py idle_stages)."""
    idle = next((b["idle"] for b in (r.get("bursts") or {}).values() if "stages_s" in (b.get("idle") or {})), None)
    if idle is None:
        return ["Not measured in this run."]
    stages = idle["stages_s"]
    lines = [f"{stages['nodes']} of {idle['nodes']} nodes, from their histories; every node's timer fires within the same second, so "
             "the p99 is the last of them through the worker, the dev server and the simulated world at once "
             "(the idle phase's row in the table above).", "", "| step | p50 | p99 |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {label} | {_f(_get(stages, key, 'p50'), ' s')} | {_f(_get(stages, key, 'p99'), ' s')} |" for key, label in IDLE_STAGES.items()]
    return lines


def workers_table(r: dict[str, Any]) -> list[str]:
    lines = ["| workers | pods | nodes Ready per second: whole burst | while coming Ready | against 1 worker | Temporal server (% of a core) | busiest process | overhead p99 |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    runs = {int(n): w for n, w in (r.get("workers") or {}).items() if "error" not in w}
    rates, _ = fig.ready_rates(r.get("workers") or {})
    for n, w in sorted(runs.items()):
        rate, one = rates.get(n), rates.get(1)
        s = fig.saturation(w["usage"], _get(r, "machine", "nproc") or 1, w.get("machine_busy_pct"), fig.server_ceiling_pct(r.get("temporal_floor")))
        lines.append(f"| {n} | {w['pods']} | {_f(w.get('nodes_ready_per_s'))} | {_f(w.get('nodes_ready_per_s_steady'))} | {f'{rate / one:.2f}×' if rate and one else '—'} | "
                     f"{w['usage']['temporal']['cpu_pct_of_core']} | {s['busiest']} {s['pct']}% | {_f(_get(w, 'overhead_s', 'p99'), ' s')} |")  # fmt: skip
    return lines if runs else ["Not measured in this run (BENCH_PHASES without workers)."]


# A worker's share of a core at rest that leaves it room for bursts (launches, drains).
WORKER_CORE_BUDGET = 0.5


def fleet_section(r: dict[str, Any]) -> list[str]:
    """How many workers a fleet needs at rest, from the hold's worker (docs/install.md links here)."""
    h = r.get("hold") or {}
    if "usage" not in h:
        return ["Not measured in this run (no hold)."]
    w = h["usage"]["worker"]
    per_1000 = w["cpu_pct_of_core"] / 100 * 1000 / h["nodes"]
    need = {f: max(1, math.ceil(per_1000 * f / 1000 / WORKER_CORE_BUDGET)) for f in (1000, 5000, 10000)}
    return [
        f"At rest a worker spent {per_1000 * 100:.1f}% of a core per 1,000 nodes (RSS {w['rss_mb']:.0f} MB, workflow cache "
        f"{_get(r, 'knobs', 'workflow_cache')}, `TGP_WORKFLOW_CACHE`; {h['nodes']:,} nodes held). Keeping each worker under "
        f"{WORKER_CORE_BUDGET:.0%} of a core at rest, so that it has room for a burst, a fleet needs: "
        + ", ".join(f"{f:,} nodes → {k} worker(s)" for f, k in need.items())
        + ". Its memory at rest is bounded by its workflow cache, not by the fleet; for bursts, see the workers table above."
    ]


def scale_section(r: dict[str, Any]) -> list[str]:
    life = short_life(r)
    acts = (life or {}).get("actions") or {}
    if life is None or not acts:
        return ["Not modelled: this run counted no short life."]
    events = _get(life, "history_events", "p50") or 0
    upserts = (acts.get("by_kind") or {}).get("search attribute upsert", 0)
    out = [SERVER_BUILD, "", f"Model (bench/figures.py): Temporal commits about {fig.EVENTS_PER_TRANSITION:.0f} events a transaction; a history shard serialises its "
           f"transactions and commits about {fig.TRANSITIONS_PER_SHARD_S:.0f} a second on a SQL store (~5 ms a write); visibility writes are a life's start, each "
           f"search-attribute upsert and its close. One short life here: {events:.0f} events, {acts['p50']} actions, {upserts} upserts.", "",
           "| burst | actions per second | history writes per life | history writes per second | visibility writes per second | history shards at least |", "|---|---|---|---|---|---|"]  # fmt: skip
    for nodes, seconds in ((500, 10.0), (500, 60.0), (5000, 60.0)):
        m = fig.scale_model(nodes, seconds, events, float(acts["p50"]), float(upserts))
        out.append(f"| {nodes:,} nodes in {seconds:.0f} s | {m['actions_per_s']:,.0f} | {m['history_writes_per_life']:.0f} | {m['history_writes_per_s']:,.0f} | {m['visibility_writes_per_s']:,.0f} | {m['shards_at_least']} |")
    out += ["", "The Helm chart's default of 512 history shards is far above these; what bounds a burst there is the store's write rate "
            "and, on Temporal Cloud, the namespace's actions-per-second limit (compare the first column)."]  # fmt: skip
    return out


def device_figures() -> list[dict[str, Any]]:
    """The many-core runs' JSON (bench/device.sh), each shown with its own targets: the files
    BENCH_DEVICE_JSON names (comma-separated), else every bench/results/device-*.json from 8 or
    more cores, by name."""
    named = os.environ.get("BENCH_DEVICE_JSON")
    files = [Path(n) for n in named.split(",") if n] if named else sorted(RESULTS.glob("device-*.json"))
    runs = []
    for path in files:
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError) as exc:  # a run cut off mid-write: said on the page, the rest shown
            runs.append({"file": str(path), "unreadable": type(exc).__name__})
            continue
        if (_get(run, "machine", "nproc") or 0) >= 8:
            shown = path.resolve().relative_to(RESULTS.parent.parent) if path.resolve().is_relative_to(RESULTS.parent.parent) else path
            runs.append({**run, "file": str(shown)})
    return runs


def _table(rows: list[Row]) -> list[str]:
    return ["| scenario | target | measured | |", "|---|---|---|---|", *(f"| {s} | {t} | {m} | {_met(ok)} |" for s, t, m, ok in rows)]


def device_section(devices: list[dict[str, Any]], commit: str = "") -> list[str]:
    """Each many-core run with the targets it measured, every ratio from its own figures; a run
    of another commit than this page's (`commit`) is said to be of that code."""
    if not devices:
        return [f"Not run here (this machine has fewer than 8 cores). Run it with:", "", "```sh", DEVICE_COMMAND, "```"]
    lines = []
    for device in devices:
        if "unreadable" in device:
            lines += [f"### `{device['file']}`", "", f"Not shown: the file could not be read ({device['unreadable']}).", ""]
            continue
        m = device["machine"]
        measured = [row for row in targets(device) if not (row[3] is None and row[2].startswith("not measured"))]
        older = (f" Its code is commit `{m['commit']}`'s, not this page's (`{commit}`): `bench/device.sh` at this commit measures this code there."
                 if commit and m.get("commit") and m["commit"] != commit else "")
        lines += [f"### `{device['file']}`", "", f"{m['nproc']} × {m['cpu_model']}, Python {m['python']}, commit `{m['commit']}`, {device['date']}"
                  + (f"; {device['made']}" if device.get("made") else "") + "." + older, "", *_table(measured), "", "Saturated process per phase there:", "",
                  *saturation_table(device), ""]  # fmt: skip
        if device.get("workers"):
            lines += ["Workers there:", "", *workers_table(device), ""]
    return lines[:-1]


def render(r: dict[str, Any], devices: list[dict[str, Any]] | None = None) -> str:
    """The whole page."""
    m = r["machine"]
    lines = [
        "# Benchmarks", "",
        f"Written by `make bench` (bench/run.py; the figures in bench/results/latest.json; earlier runs in bench/results/HISTORY.md). "
        f"Run {r['date']}, commit `{m['commit']}`, {m['nproc']} × {m['cpu_model']}, Python {m['python']}; load {', '.join(f'{x:.1f}' for x in r.get('load_at_start', []))} "
        f"at start{' (a quick run: smaller bursts)' if r.get('quick') else ''}.", "",
        "Every part is a process of its own: the Temporal dev server, `tgp worker` (one, or n on one task queue), `tgp bridge`, and the "
        "simulated world in four (the Kubernetes API; its scheduler; the kubelets; the cloud with the tailnet), each one's CPU read "
        "from /proc over each phase. Each target is a ratio of figures measured in this same run, so it holds on any machine.", "",
        "## Targets", "", *_table(targets(r)), "",
        "## Per node brought up, against Temporal's floor", "", *cost_table(r), "",
        f"Actions are counted from each life's history as Temporal Cloud meters them: {RULE}.", "",
        "## Which process was saturated, per phase", "",
        f"Saturated: at least {fig.SATURATED_PCT:.0f}% of what the process can use over the phase: one core for each Python process (tgp's and the "
        f"simulated world's), for the dev server (Go) what it used in this run's floor phase, at least one core "
        f"(here {fig.server_ceiling_pct(r.get('temporal_floor')):.0f}%).", "",
        *saturation_table(r), "",
        "## The idle reaction, step by step", "", *idle_section(r), "",
        "## Workers: nodes Ready per second", "", "The same burst with 1, 2 and 4 `tgp worker` processes on one task queue (BENCH_WORKERS); "
        "nodes Ready per second over the whole burst (first pod created → last node Ready) and while nodes come Ready (between the 10th and "
        "the 90th percentile of their Ready times: without the batch window and the boot, which no worker shortens); \"against 1 worker\" "
        "compares the latter where every run has it.", "", *workers_table(r), "",
        "## Workers per fleet", "", *fleet_section(r), "",
        "## Past one server: what a burst asks of a production Temporal", "", *scale_section(r), "",
        "## On 8 or more cores", "", *device_section(devices or [], m["commit"]), "",
    ]  # fmt: skip
    return "\n".join(lines)
