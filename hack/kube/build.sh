#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver, kube-scheduler, kube-controller-manager, etcd)
# from the Go module proxy at the release pinned in this folder's go.mod/go.sum, into a cache
# outside the source tree, keyed by the go.sum hash: a rebuild happens only when the pin changes.
# Prints the directory holding the binaries on its last line. Nothing is downloaded at run time:
# the fixture (tests/kube_control_plane.py) only runs what this built.
#
# Usage: hack/kube/build.sh [--dir]   (--dir: print the cache directory and exit, build nothing)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
key="$(cat "$here/go.mod" "$here/go.sum" "$here/etcd/main.go" | sha256sum | cut -c1-16)"
version="$(awk '$1 == "k8s.io/kubernetes" {print $2; exit}' "$here/go.mod")"
out="${TGP_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tgp/kube}/${version}-${key}"
if [[ "${1:-}" == "--dir" ]]; then echo "$out"; exit 0; fi
bins=(kube-apiserver kube-scheduler kube-controller-manager etcd)
complete=1
for b in "${bins[@]}"; do [[ -x "$out/$b" ]] || complete=0; done
if [[ $complete == 1 ]]; then echo "$out"; exit 0; fi
command -v go >/dev/null || { echo "hack/kube/build.sh: no Go toolchain on PATH" >&2; exit 3; }
mkdir -p "$out.tmp"
cd "$here"
# A shared 2-core machine: one package at a time, at low priority; CGO off gives static binaries.
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=readonly -trimpath"
start=$(date +%s)
for b in kube-apiserver kube-scheduler kube-controller-manager; do
  echo "building $b ($version)" >&2
  nice -n 10 go build -p "${TGP_KUBE_BUILD_JOBS:-1}" -ldflags="-s -w \
-X k8s.io/component-base/version.gitVersion=$version \
-X k8s.io/client-go/pkg/version.gitVersion=$version \
-X k8s.io/component-base/version.gitMajor=1 \
-X k8s.io/component-base/version.gitMinor=$(echo "$version" | cut -d. -f2)" \
    -o "$out.tmp/$b" "k8s.io/kubernetes/cmd/$b"
done
echo "building etcd" >&2
nice -n 10 go build -p "${TGP_KUBE_BUILD_JOBS:-1}" -ldflags="-s -w" -o "$out.tmp/etcd" ./etcd
rm -rf "$out"; mv "$out.tmp" "$out"
echo "built in $(( $(date +%s) - start )) s: $(du -sh "$out" | cut -f1) in $out" >&2
echo "$out"
