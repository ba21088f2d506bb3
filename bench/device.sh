#!/usr/bin/env bash
# The bench's figures on a many-core machine (issue 37: the 8-core section of docs/benchmarks.md),
# all from one run, so that every ratio has the same floor: the bursts of 100 and 500 with one
# worker, as the floor has one (the per-node cost, in BENCH_ROUNDS rounds: 3 here, on a machine
# not shared with other work), nodes Ready per second with 1, 2 and 4 workers (a burst of 500
# each; the overhead target is judged on the one with the most workers, as a deployment on such a
# machine runs them), and the floor. Writes $OUT/device-<nproc>core.json. Needs only the
# project's venv (PYTHON, default .venv/bin/python) and the `temporal` binary (beside that Python
# or on PATH); no network. With OUT=bench/results the next `make bench` shows it (every
# bench/results/device-*.json from 8+ cores, each with the targets it measured against its own
# floor; move a run you keep for the record to another name); BENCH_DEVICE_JSON=a.json,b.json
# names others. A machine without the venv: PYTHON=python3 with PYTHONPATH=<the runtime wheels
# installed with --target>:. (bench/results/HISTORY.md, 2026-11-29 night, has the recipe used on
# a 16-core machine: 150-190 s a run then, without rounds; each further round adds a burst of 500
# and a floor, about a minute.)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the JSON goes to}"
PYTHON="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"
json="$OUT/device-$(nproc)core.json"
BENCH_PHASES="${BENCH_PHASES:-burst,workers,floor}" BENCH_LATENCY_PODS="${BENCH_LATENCY_PODS:-0}" BENCH_ROUNDS="${BENCH_ROUNDS:-3}" \
  BENCH_BURST_WORKERS="${BENCH_BURST_WORKERS:-1}" BENCH_WORKERS="${BENCH_WORKERS:-1,2,4}" BENCH_WORKERS_BURST="${BENCH_WORKERS_BURST:-500}" \
  BENCH_OUT="$json" BENCH_DOC=- PYTHONPATH="${PYTHONPATH:-.}" "$PYTHON" bench/run.py
echo "wrote $json"
