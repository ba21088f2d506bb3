"""What one HTTP request costs the worker beyond the request itself (issue 20: bring-up).

httpcore looks for `sniffio` on every request; without it installed each request paid a failed
import (a search of sys.path: 15-19% of the worker's CPU in a 300-node burst). And the
Kubernetes client (kubernetes.aio, aiohttp with trust_env=True) read ~/.netrc and the proxy
variables on every request; tgp reads the proxy once and never a netrc (the API server's
credentials come from the kubeconfig or the service account).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pydantic import SecretStr

from activities.clouds.simulated import SimulatedProvider
from activities.kube.cluster import KubernetesCluster
from sim.cloud import SimulatedCloud


@contextmanager
def failed_imports() -> Iterator[list[str]]:
    """Names whose import failed while the block ran."""
    failed: list[str] = []
    real = builtins.__import__

    def counting(name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return real(name, *args, **kwargs)
        except ImportError:
            failed.append(name)
            raise

    builtins.__import__ = counting
    try:
        yield failed
    finally:
        builtins.__import__ = real


async def test_a_provider_request_imports_nothing() -> None:
    async with SimulatedCloud(boot_delay=60) as cloud, SimulatedProvider(cloud.url, api_key=SecretStr("k")) as provider:
        await provider.find_all_by_name("warm-up")  # the connection and lazy imports of the first request
        with failed_imports() as failed:
            for _ in range(5):
                await provider.find_all_by_name("tgp-x-1")
        assert failed == [], f"every request tried to import {sorted(set(failed))}"


class _Recorder:
    """An API server that answers 404 to everything and records what each request carried."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.raw_path, request.headers.get("Authorization")))
        return web.json_response({"kind": "Status", "apiVersion": "v1", "code": 404, "reason": "NotFound"}, status=404)


async def _serve(recorder: _Recorder) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_the_kubernetes_client_reads_no_netrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password not-for-the-api-server\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    recorder = _Recorder()
    runner, url = await _serve(recorder)
    try:
        async with KubernetesCluster.from_url(url) as cluster:
            assert await cluster.get_node("gpu-1") is None
        assert recorder.seen and all(auth is None for _, auth in recorder.seen), "a netrc's password went to the API server"
    finally:
        await runner.cleanup()


async def test_the_kubernetes_client_still_goes_through_the_environments_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder()
    runner, proxy = await _serve(recorder)
    try:
        monkeypatch.setenv("HTTP_PROXY", proxy)
        monkeypatch.setenv("NO_PROXY", "")
        monkeypatch.delenv("no_proxy", raising=False)
        async with KubernetesCluster.from_url("http://kube.invalid:6443") as cluster:
            assert await cluster.get_node("gpu-1") is None
        assert recorder.seen and recorder.seen[0][0].endswith("/api/v1/nodes/gpu-1")
    finally:
        await runner.cleanup()
