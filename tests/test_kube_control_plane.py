"""The real-cluster lane where it cannot run (issue 19): without Go and without built binaries it
says so in one line and is skipped, and under CI that is a failure, never a silent pass. The lane
itself (`make test-real-cluster`) runs the real control plane; these need none."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sim.kube_control_plane import ControlPlaneUnavailable, binary_dir

ROOT = Path(__file__).resolve().parent.parent
LANE = ROOT / "hack" / "kube" / "lane.sh"


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
