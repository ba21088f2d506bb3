#!/usr/bin/env bash
# The bench's figures on a many-core machine (issue 37: the 8-core section of docs/benchmarks.md).
# Runs the full `make bench` phases with 1, 2 and 4 workers and writes the JSON to
# $OUT/device-<nproc>core.json. Needs only the project's venv (PYTHON, default .venv/bin/python)
# and the `temporal` binary (beside that Python or on PATH); no network. The page on this machine
# then shows its figures: BENCH_DEVICE_JSON=$OUT/device-<nproc>core.json make bench (or copy the
# file into bench/results/, where `make bench` finds it).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the JSON goes to}"
PYTHON="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"
json="$OUT/device-$(nproc)core.json"
# The bursts with 4 workers on one task queue, as a deployment on such a machine would run them
# (one Python worker is a core at most); the workers phase still tries 1, 2 and 4.
BENCH_BURST_WORKERS="${BENCH_BURST_WORKERS:-4}" BENCH_WORKERS="${BENCH_WORKERS:-1,2,4}" BENCH_OUT="$json" BENCH_DOC=- PYTHONPATH=. "$PYTHON" bench/run.py
echo "wrote $json"
