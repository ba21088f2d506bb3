#!/usr/bin/env bash
# The real-cluster lane (`make test-real-cluster`): build the control plane (cached), start it,
# run the real-cluster-capable tests (marker real_cluster: every test that asks for kube_api)
# against it, print its version and the lane's counts, check nothing was left behind, stop it.
# Without Go (and no built binaries) it says so in one line and is skipped; under CI=true a
# lane that cannot run fails.
set -uo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
cannot_run() {
  if [[ "${CI:-}" == "true" ]]; then echo "real-cluster lane: FAILED, cannot run under CI: $1"; exit 1; fi
  echo "real-cluster lane: skipped: $1"; exit 0
}
dir="$(hack/kube/build.sh --dir)"
for b in etcd kube-apiserver kube-scheduler kube-controller-manager; do
  [[ -x "$dir/$b" ]] && continue
  command -v go >/dev/null || cannot_run "no Go toolchain to build the control plane (install Go, then make kube)"
  hack/kube/build.sh >/dev/null || { echo "real-cluster lane: FAILED: building the control plane failed (hack/kube/build.sh)"; exit 1; }
  break
done
report="$(mktemp -d)/real-cluster.xml"
TGP_KUBE_BIN_DIR="$dir" nice -n 10 "$py" -m sim.kube_control_plane run -- \
  "$py" -m pytest -q -rs -m real_cluster --junitxml="$report" ${PYTEST_ARGS:-}
status=$?
"$py" - "$report" "$status" <<'PY'
import sys, xml.etree.ElementTree as ET
path, status = sys.argv[1], int(sys.argv[2])
try:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
    skipped = int(suite.get("skipped"))
    print(f"real-cluster lane: {total - failed - skipped} passed, {failed} failed, {skipped} skipped (exit {status})")
except (OSError, ET.ParseError, AttributeError, TypeError):
    print(f"real-cluster lane: no test report (exit {status})")
PY
# pytest's 5 (no test collected) is a broken lane, not a pass.
exit "$status"
