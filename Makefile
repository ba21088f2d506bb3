# The two commands of the README: `make demo` and `make test`. Both create .venv when absent.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test fault-matrix venv clean histories bench bench-extra crds kube test-real-cluster dev-real-cluster

# Python may write bytecode here (__pycache__/ is ignored), whatever the shell says: the suite
# and the demo start many Python processes, and Temporal's workflow sandbox imports the workflow
# modules afresh for every workflow run; without .pyc files each of those compiled them from
# source (20-30% of a worker's CPU in a burst). The image compiles at install (pip), as here.
unexport PYTHONDONTWRITEBYTECODE

venv: $(STAMP)

# tgp and, beside it, the simulated world (sim/, its own distribution tgp-sim: never in the
# runtime wheel or image) that `make demo` and the tests run on.
# One line says what the silent minutes are; pip (25+) relays setuptools' "Editable installation"
# notice as a warning even under --quiet, and it reads like a fault, so -W drops that one notice.
$(STAMP): pyproject.toml sim/pyproject.toml
	@echo "Installing tgp and its dependencies into $(VENV) (3 to 5 minutes on 2 cores, once)..."
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@$(BIN)/python -W 'ignore:Editable installation:UserWarning' -m pip install --quiet -e ./sim -e '.[dev]'
	@touch $(STAMP)

# The demo's Temporal server takes PORT and its Web UI PORT+1000 (`make demo PORT=8233` runs a
# second one beside the first; TGP_DEMO_PORT does the same for `tgp demo`).
PORT ?= $(or $(TGP_DEMO_PORT),7233)
demo: $(STAMP)
	$(BIN)/tgp demo --port $(PORT)

# The suite, without the fault matrix: the suite alone takes most of its 10-minute budget on
# 2 cores, so the matrix is a target of its own. Five workers on 2 cores: the suite is CPU-bound
# (~650 CPU-seconds; 187% of the 2 cores at five), and the tests wait on their servers in
# between. Measured 2026-11-29, `make test`: three workers 7 min 41 s, four 6 min 16-19 s, five
# 5 min 47-52 s (five runs; three failed a test, each a race or the strand below, each fixed).
# Five used to stall: the time-skipping test server strands a run whose workflow task cancels a
# timer that fired while the task was with the worker (sdk-java#2606), so whole pool lives run
# on the dev server (the consolidation, merge and never-binding-pod tests), and a skip of minutes
# could run in real time (158 s for the merge test). CI runs on a loaded machine: no flakes
# first. Every machine here (a developer's, CI's) has 2 cores; elsewhere `make test TEST_WORKERS=n`.
TEST_WORKERS ?= 5
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not fault_matrix" -n $(TEST_WORKERS) --dist loadfile --durations=30

# The fault matrix (tests/test_fault_matrix.py, marked fault_matrix): every lifecycle stage x
# every fault with real worker, bridge and Temporal processes, then the 40-node burst; it prints
# its table whether it passes or not. CI (.ci/run) runs it after `make test`.
fault-matrix: $(STAMP)
	$(BIN)/python -m pytest -q -m fault_matrix

clean:
	rm -rf $(VENV) .demo

# Re-record tests/histories/ (the current code's histories, gzipped; tests/test_replay.py replays
# them) after a change that alters a workflow's commands: such a change ships as a new build
# (Worker Versioning, docs/workflow-versioning.md), never into a running build's workers.
histories: $(STAMP)
	rm -f tests/histories/*.json.gz
	TGP_RECORD_HISTORIES=1 $(BIN)/python -m pytest -q -n 2 tests/test_node_lifecycle.py tests/test_node_cancel.py tests/test_node_drain.py \
		tests/test_node_long_lived.py tests/test_node_join_gpus.py tests/test_watch_events.py tests/test_fleet_look.py tests/test_whole_life.py

# The benchmarks (bench/run.py, issues 20 and 37): bursts of pending pods through the bridge, the
# idle reaction, the same burst with 1, 2 and 4 workers (BENCH_WORKERS), 1,000 nodes at rest, history
# events and Temporal Cloud actions per life, and Temporal's floor, each process's CPU per phase
# (the simulated world in processes of its own); writes bench/results/latest.json and
# docs/benchmarks.md. `make bench BENCH_QUICK=1` is a 2-3 minute run for development (its JSON goes
# to bench/results/quick.json, the page is left alone); bench/device.sh runs it on a many-core
# machine (the page shows every bench/results/device-*.json from 8+ cores). Not part of the test suite.
BENCH_QUICK ?=
bench: $(STAMP)
	BENCH_QUICK=$(BENCH_QUICK) PYTHONPATH=. $(BIN)/python bench/run.py

# The older single-purpose benchmarks: template rendering bounds, the CPU of a request on each
# HTTP transport (bench/http_client.py), the emulator at rest for a
# simulated hour (about 3 minutes).
bench-extra: $(STAMP)
	PYTHONPATH=. $(BIN)/python bench/template_bounds.py
	PYTHONPATH=. $(BIN)/python bench/http_client.py
	$(BIN)/python bench/emulator_at_rest.py

# Regenerate deploy/crds and deploy/helm/tgp/crds from tgp/crds/ (a test fails while they are stale).
crds: $(STAMP)
	$(BIN)/python -m workers.crdgen

# The test control plane (hack/kube): kube-apiserver, kube-scheduler, kube-controller-manager and
# etcd built from the Go module proxy at the pinned release into
# ${XDG_CACHE_HOME:-~/.cache}/tgp/kube/<version>-<go.sum hash>/; a rebuild happens only when the
# pin changes. The first build takes long (CONTRIBUTING.md "The real-cluster lane"); later ones are instant.
kube:
	@command -v go >/dev/null || { echo "make kube: no Go toolchain on PATH: the control plane is built from the Go module proxy"; exit 3; }
	hack/kube/build.sh

# The helm binary (hack/helm): built from the Go module proxy at the pinned release into
# ${XDG_CACHE_HOME:-~/.cache}/tgp/helm/<version>-<go.sum hash>/, as `make kube` builds the control
# plane; tests/test_helm.py lints and renders the chart with it (a failure under CI=true without it).
.PHONY: helm chart
helm:
	@command -v go >/dev/null || { echo "make helm: no Go toolchain on PATH: helm is built from the Go module proxy"; exit 3; }
	hack/helm/build.sh

# The chart as an archive, build/chart/tgp-<version>.tgz, for `helm push` (docs/install.md).
chart: helm
	"$$(hack/helm/build.sh --path)" package deploy/helm/tgp --destination build/chart

# The real-cluster lane: the tests that ask for kube_api, against that control plane (with its
# scheduler and controller-manager). Skipped in one line without Go; a failure under CI=true.
# CI (.ci/run) runs it after `make test` and `make fault-matrix`.
test-real-cluster: $(STAMP)
	hack/kube/lane.sh

# The product against the real control plane instead of the emulator: `tgp dev` (Temporal dev
# server, worker, bridge, simulated cloud whose machines run kubelet stand-ins) against a fresh
# kube-apiserver + scheduler + controller-manager. It prints the kubeconfig to apply examples/
# with; Ctrl-C stops everything. `make demo` stays on the emulator (no Go needed, faster start).
dev-real-cluster: $(STAMP) kube
	TGP_KUBE_BIN_DIR="$$(hack/kube/build.sh --dir)" $(BIN)/python -m sim.kube_control_plane run -- \
	  sh -c 'KUBECONFIG="$$TGP_TEST_KUBECONFIG" exec $(BIN)/tgp dev --port $(PORT) --boot-delay 1'
