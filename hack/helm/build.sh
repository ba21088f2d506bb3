#!/usr/bin/env bash
# Builds the helm binary from the Go module proxy at the release pinned in this folder's
# go.mod/go.sum, into a cache outside the source tree keyed by the go.sum hash, as
# hack/kube/build.sh does for the control plane: a rebuild happens only when the pin changes.
# Prints the binary's path on its last line. Nothing is downloaded at run time: the tests
# (tests/test_helm.py) and `make chart` only run what this built.
#
# Usage: hack/helm/build.sh [--path]   (--path: print where the binary is or would be, build nothing)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
key="$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-16)"
version="$(awk '$1 == "require" && $2 ~ /^helm\.sh\/helm\// {print $3; exit}' "$here/go.mod")"
module="$(awk '$1 == "require" && $2 ~ /^helm\.sh\/helm\// {print $2; exit}' "$here/go.mod")"
out="${TGP_HELM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tgp/helm}/${version}-${key}"
if [[ "${1:-}" == "--path" ]]; then echo "$out/helm"; exit 0; fi
if [[ -x "$out/helm" ]]; then echo "$out/helm"; exit 0; fi
command -v go >/dev/null || { echo "hack/helm/build.sh: no Go toolchain on PATH" >&2; exit 3; }
mkdir -p "$out.tmp"
cd "$here"
# A shared 2-core machine: one package at a time, at low priority; CGO off gives a static binary.
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=readonly -trimpath"
start=$(date +%s)
echo "building helm ($version)" >&2
# The version variable `helm version` prints (helm's own Makefile sets it the same way).
nice -n 10 go build -p "${TGP_HELM_BUILD_JOBS:-1}" \
  -ldflags="-s -w -X $module/internal/version.version=$version" \
  -o "$out.tmp/helm" "$module/cmd/helm"
rm -rf "$out"; mv "$out.tmp" "$out"
echo "built in $(( $(date +%s) - start )) s: $(du -sh "$out" | cut -f1) in $out" >&2
echo "$out/helm"
