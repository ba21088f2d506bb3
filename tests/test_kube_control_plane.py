"""The real-cluster lane where it cannot run (issue 19): without Go and without built binaries it
says so in one line and is skipped, and under CI that is a failure, never a silent pass. The lane
itself (`make test-real-cluster`) runs the real control plane; these need none."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from activities.kube.connection import authenticated_http
from sim.kube_control_plane import ControlPlaneUnavailable, binary_dir
from tests.kube_env import KUBECONFIG_ENV, KubeApi, eventually

ROOT = Path(__file__).resolve().parent.parent
LANE = ROOT / "hack" / "kube" / "lane.sh"
RBAC = ROOT / "deploy" / "kustomize" / "base" / "rbac.yaml"


NO_GO_PATH = "/usr/bin:/bin"


def lane(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # No Go on PATH, and a cache directory holding no binaries.
    if shutil.which("go", path=NO_GO_PATH):
        pytest.skip(f"this machine has Go in {NO_GO_PATH}: the lane would build the control plane")
    base = {"PATH": NO_GO_PATH, "HOME": str(tmp_path), "TGP_KUBE_CACHE": str(tmp_path / "cache")}
    return subprocess.run(["bash", str(LANE)], env={**base, **env}, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_without_go_the_lane_says_so_in_one_line_and_is_skipped(tmp_path: Path) -> None:
    result = lane(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines() == [
        "real-cluster lane: skipped: no Go toolchain to build the control plane (install Go, then make kube)"
    ]
    assert result.stderr == ""


def test_under_ci_a_lane_that_cannot_run_fails(tmp_path: Path) -> None:
    result = lane(tmp_path, CI="true")
    assert result.returncode == 1
    assert result.stdout.strip().startswith("real-cluster lane: FAILED, cannot run under CI: no Go toolchain")


def test_missing_binaries_name_the_directory_and_how_to_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TGP_KUBE_BIN_DIR", str(tmp_path))
    (tmp_path / "etcd").write_text("#!/bin/sh\n")
    os.chmod(tmp_path / "etcd", 0o755)
    with pytest.raises(ControlPlaneUnavailable, match=r"no kube-apiserver, kube-scheduler, kube-controller-manager in .*make kube"):
        binary_dir()


async def test_the_processes_run_on_their_own_service_account_tokens(kube_api: KubeApi, tmp_path: Path) -> None:
    """On a real control plane (RBAC, ServiceAccount tokens): the bridge's ClusterRole from
    deploy/kustomize/base/rbac.yaml, bound to a ServiceAccount, lets a bound token do what the
    bridge does and nothing more. The emulator has no RBAC."""
    if not kube_api.real:
        pytest.skip("RBAC and ServiceAccount tokens need a real API server: runs in `make test-real-cluster`")
    http, ns = kube_api.http, kube_api.namespace
    [role] = [d for d in yaml.safe_load_all(RBAC.read_text()) if d and d["kind"] == "ClusterRole" and d["metadata"]["name"] == "tgp-bridge"]
    role["metadata"]["name"] = f"{ns}-bridge"  # a role of this test's own, deleted after it
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": f"{ns}-bridge"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{ns}-bridge"},
        "subjects": [{"kind": "ServiceAccount", "name": "tgp-bridge", "namespace": ns}],
    }
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    try:
        await kube_api.create(f"/api/v1/namespaces/{ns}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tgp-bridge"}})
        await kube_api.create(f"{rbac}/clusterroles", role)
        await kube_api.create(f"{rbac}/clusterrolebindings", binding)
        token = (await kube_api.create(f"/api/v1/namespaces/{ns}/serviceaccounts/tgp-bridge/token",
                                       {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}))["status"]["token"]
        config = yaml.safe_load(Path(os.environ[KUBECONFIG_ENV]).read_text())
        config["users"] = [{"name": u["name"], "user": {"token": token}} for u in config["users"]]
        kubeconfig = tmp_path / "bridge-kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))

        async def answers(client: httpx.AsyncClient, path: str, wanted: int) -> bool:
            return (await client.get(path)).status_code == wanted

        async with authenticated_http(str(kubeconfig)) as bridge:
            # RBAC caches refresh within a second or two of the binding.
            await eventually(lambda: answers(bridge, "/apis/tgp.io/v1/gpunodepools", 200), timeout=30)
            assert (await bridge.get("/api/v1/nodes")).status_code == 200
            assert (await bridge.get(f"/api/v1/namespaces/{ns}/secrets")).status_code == 403
            assert (await bridge.delete("/api/v1/nodes/anything")).status_code == 403
    finally:
        await http.delete(f"{rbac}/clusterrolebindings/{ns}-bridge")
        await http.delete(f"{rbac}/clusterroles/{ns}-bridge")
