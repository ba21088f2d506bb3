"""docs/benchmarks.md is written from the JSON `make bench` records (bench/report.py): the page
renders from the recorded baseline, with and without a baseline column, so a change to either
side cannot leave `make bench` failing at its last step."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import render, targets

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
