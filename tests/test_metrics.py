"""Metrics and structured logs, end to end: a real node lifecycle on the Temporal dev server with
the worker's /metrics endpoint served on a free port and scraped over HTTP while the node lives,
and the JSON log lines its activities write. Plus the pieces on their own: the fleet gauges'
arithmetic, the port setting, the Grafana dashboard and docs/metrics.md against the metrics
that exist."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import structlog
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from tests.conftest import binary, eventually, running_world
from tests.kube_env import KubeApi
from tests.test_bridge import NO_IDLING, apply, gpu_class, gpu_pool, pending_pod, ready_nodes, running_stack
from tests.test_node_lifecycle import request, start, wait_phase
from activities import metrics
from tgp.errors import ConfigError
from workers.logs import activity_context, configure_logging, log_format, stdlib_handler
from sim.world import sim_world
from workers.temporal import DATA_CONVERTER
from tgp.types import LABEL_PROVIDER, InstanceRef, LabelInput, LaunchInput, NodePhase, NodeStatus, Offer
from workers.main import SWEEPER_SCHEDULE_ID, WorkerConfig, build_activities, make_worker
from workers.metrics import FleetMetrics, NodeSample, start_worker_metrics
from workflows.node import GPUNodeWorkflow

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "tgp-dashboard.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
REFRESH = timedelta(seconds=0.3)


class Scrape:
    """One scrape of a /metrics endpoint, parsed by prometheus_client's own text parser."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples `name` whose labels include `labels` (0 when there are none)."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


async def scrape(port: int) -> Scrape:
    async with httpx.AsyncClient(verify=default_tls()) as http:
        response = await http.get(f"http://127.0.0.1:{port}/metrics")
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain")
    return Scrape(response.text)


@asynccontextmanager
async def metrics_world(client: Client, *, forward: str | None = None) -> AsyncIterator[tuple[object, str, int]]:
    """`running_world`, with the worker's client given, and its /metrics served on a free port
    the way `tgp worker` serves it (fleet gauges refreshed every REFRESH)."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.1)
        port = await start_worker_metrics(
            client, stack, port=0, host="127.0.0.1", unavailable=lambda: len(activities.node.unavailable.keys()), forward=forward, refresh=REFRESH
        )
        assert port is not None
        queue = f"metrics-{uuid.uuid4().hex[:8]}"
        await stack.enter_async_context(make_worker(client, activities, task_queue=queue))
        yield world, queue, port


def dashboard_metric_names() -> set[str]:
    exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel.get("targets") or []]
    return {name for expr in exprs for name in re.findall(r"\b((?:tgp|temporal)_[a-z0-9_]+)\b", expr)}


# --- a lifecycle, scraped ----------------------------------------------------------------


async def test_a_node_lifecycle_moves_the_counters_gauges_and_histograms(temporal: WorkflowEnvironment) -> None:
    sdk = metrics.sdk_metrics("tgp-test")
    client = await Client.connect(
        temporal.client.service_client.config.target_host,
        namespace=temporal.client.namespace,
        data_converter=DATA_CONVERTER,
        runtime=sdk.runtime,
    )
    async with metrics_world(client, forward=sdk.url) as (world, queue, port):
        world.cloud.set_capacity("rtx4090-us-east", False)  # type: ignore[attr-defined]
        pool = f"metrics-{uuid.uuid4().hex[:6]}"
        here = {"pool": f"ml/{pool}", "provider": "simulated"}
        before = await scrape(port)
        req = request(pool=pool, demand_since=datetime.now(timezone.utc) - timedelta(seconds=5))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)

        async def shows_ready() -> Scrape | None:
            s = await scrape(port)
            return s if s.value("tgp_nodes", phase="Ready", **here) == 1 else None

        ready = await eventually(shows_ready, what="tgp_nodes to show the node Ready")
        grew = lambda name, **labels: ready.value(name, **labels) - before.value(name, **labels)  # noqa: E731
        assert grew("tgp_launches_total", provider="simulated") >= 1
        assert grew("tgp_launch_failures_total", provider="simulated", reason="CapacityError") >= 1, "the sold-out offer"
        assert grew("tgp_launch_to_ready_seconds_count", provider="simulated") >= 1
        assert grew("tgp_demand_to_launch_seconds_count", provider="simulated") >= 1
        assert grew("tgp_demand_to_launch_seconds_sum", provider="simulated") >= 5
        assert ready.value("tgp_hourly_cost_dollars", **here) == pytest.approx(0.49), "the eu-west offer it failed over to"
        assert ready.value("tgp_unavailable_offers") >= 1
        assert ready.value("tgp_offer_cache_age_seconds", provider="simulated") < 60
        assert ready.value("tgp_fleet_refresh_timestamp_seconds") > 0

        async def charged() -> Scrape | None:
            s = await scrape(port)
            return s if s.value("tgp_cost_dollars_total", **here) > 0 else None

        await eventually(charged, what="tgp_cost_dollars_total to grow while the node is up")

        # The Temporal SDK's own metrics come through the same endpoint.
        sdk_names = {n for n in ready.names() if n.startswith("temporal_")}
        assert "temporal_activity_execution_latency_seconds_count" in sdk_names, sorted(sdk_names)
        assert ready.value("temporal_activity_execution_latency_seconds_count", activity_type="launch_instance") >= 1

        await handle.signal(GPUNodeWorkflow.evict, {"reason": "test done"})
        final: NodeStatus = await handle.result()
        assert final.phase is NodePhase.TERMINATED

        async def gone() -> Scrape | None:
            s = await scrape(port)
            return s if s.value("tgp_nodes", **here) == 0 and s.value("tgp_hourly_cost_dollars", **here) == 0 else None

        after = await eventually(gone, what="the node to leave tgp_nodes")
        assert after.value("tgp_drain_duration_seconds_count", outcome="drained") - before.value(
            "tgp_drain_duration_seconds_count", outcome="drained"
        ) >= 1
        assert after.value("tgp_terminations_total", provider="simulated") - before.value("tgp_terminations_total", provider="simulated") >= 1
        assert after.value("tgp_cost_dollars_total", **here) > 0, "the money spent stays counted"
        sdk_names = {n for n in after.names() if n.startswith("temporal_")}
        base = {re.sub(r"_(bucket|count|sum)$", "", n) for n in sdk_names}
        missing = {n for n in dashboard_metric_names() if n.startswith("temporal_") and n not in sdk_names | base}
        assert missing == set(), "the dashboard queries SDK metrics the SDK does not export"


async def test_a_pool_measures_demand_to_launch_from_the_pending_pod(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    before = REGISTRY.get_sample_value("tgp_demand_to_launch_seconds_count", {"provider": "simulated"}) or 0.0
    pool = f"demand-{uuid.uuid4().hex[:6]}"
    async with running_stack(temporal, kube_api) as s:
        await apply(s.kube, gpu_class())
        await apply(s.kube, gpu_pool(pool, disruption=NO_IDLING))
        await pending_pod(s.kube, f"train-{pool}")
        await ready_nodes(s, "ml", pool, 1)
    after = REGISTRY.get_sample_value("tgp_demand_to_launch_seconds_count", {"provider": "simulated"}) or 0.0
    assert after - before >= 1, "the node the pool bought for the pod observed demand -> launch"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_tgp_worker_and_tgp_bridge_serve_metrics_on_tgp_metrics_port(temporal: WorkflowEnvironment) -> None:
    """The commands the Deployments run: one port each (their probes and the ServiceMonitor use it)."""
    try:
        await temporal.client.get_schedule_handle(SWEEPER_SCHEDULE_ID).describe()
        schedule_existed = True
    except Exception:  # noqa: BLE001 - not there
        schedule_existed = False
    async with sim_world(boot_delay=0.2) as world:
        env = {
            **os.environ,
            **world.worker_env(),
            "TEMPORAL_ADDRESS": temporal.client.service_client.config.target_host,
            "TEMPORAL_NAMESPACE": temporal.client.namespace,
            "TGP_TASK_QUEUE": f"cli-{uuid.uuid4().hex[:8]}",
            "TGP_KUBE_URL": world.kube_url,
        }
        ports = {"worker": free_port(), "bridge": free_port()}
        procs = {
            cmd: subprocess.Popen(
                [binary("tgp"), cmd], env={**env, "TGP_METRICS_PORT": str(port)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            for cmd, port in ports.items()
        }
        try:

            def serving(cmd: str, *names: str):  # type: ignore[no-untyped-def]
                async def check() -> Scrape | None:
                    assert procs[cmd].poll() is None, f"tgp {cmd} exited: {procs[cmd].stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
                    try:
                        s = await scrape(ports[cmd])
                    except httpx.HTTPError:
                        return None
                    return s if all(f"# TYPE {n} " in s.text for n in names) else None

                return check

            await eventually(serving("worker", "tgp_nodes", "tgp_launches_total", "temporal_num_pollers"), timeout=60, what="tgp worker's /metrics")
            await eventually(serving("bridge", "tgp_bridge_objects_skipped_total"), timeout=60, what="tgp bridge's /metrics")
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait()
            if not schedule_existed:
                await temporal.client.get_schedule_handle(SWEEPER_SCHEDULE_ID).delete()


# --- structured logs ---------------------------------------------------------------------


async def test_activity_log_lines_are_json_with_workflow_pool_node_and_provider(
    temporal: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TGP_LOG_FORMAT", raising=False)  # not a terminal: JSON by default
    rendered = io.StringIO()
    handlers = list(logging.getLogger().handlers)
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stderr", rendered)
        configure_logging("INFO")
    try:
        async with running_world(temporal) as (_, _, queue):
            req = request()
            handle = await start(temporal, queue, req)
            await wait_phase(handle, NodePhase.READY)
            await handle.signal(GPUNodeWorkflow.evict, {"reason": "test done"})
            await handle.result()
    finally:
        structlog.reset_defaults()
        for handler in set(logging.getLogger().handlers) - set(handlers):
            logging.getLogger().removeHandler(handler)

    lines = [line for line in rendered.getvalue().splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    ours = [e for e in events if e.get("workflow_id") == req.workflow_id]
    launched = next(e for e in ours if e["event"] == "instance_launched")
    assert launched["activity"] == "launch_instance"
    assert (launched["pool"], launched["node"], launched["provider"]) == ("ml/rtx", req.node_name, "simulated")
    assert launched["level"] == "info" and launched["timestamp"]
    terminated = next(e for e in ours if e["event"] == "instance_terminated")
    # (an evicted node's drain releases it: the terminate is logged by `drain_node`)
    assert (terminated["activity"], terminated["node"], terminated["provider"]) == ("drain_node", req.node_name, "simulated")
    assert not [e for e in events if e.get("activity") and e.get("workflow_id") != req.workflow_id], "context leaked between activities"


def test_log_format_is_json_unless_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert log_format({}, io.StringIO()) == "json"
    assert log_format({}, Terminal()) == "console"
    assert log_format({"TGP_LOG_FORMAT": "json"}, Terminal()) == "json"
    assert log_format({"TGP_LOG_FORMAT": "console"}, io.StringIO()) == "console"


def test_stdlib_records_render_as_json_with_temporal_details() -> None:
    out = io.StringIO()
    logger = logging.getLogger(f"test.{uuid.uuid4().hex}")
    logger.propagate = False
    logger.addHandler(stdlib_handler(structlog.processors.JSONRenderer(), out))
    logger.warning("could not report %s", "Ready", extra={"temporal_workflow": {"workflow_id": "gpunode/ml/rtx/n1"}})
    line = json.loads(out.getvalue())
    assert line["event"] == "could not report Ready" and line["level"] == "warning"
    assert line["temporal_workflow"] == {"workflow_id": "gpunode/ml/rtx/n1"} and line["logger"] == logger.name


def test_activity_context_names_the_node_pool_and_provider() -> None:
    offer = Offer(provider="runpod", offer_id="a", gpu_type="A100", region="us", hourly_price=Decimal("1.2"))
    launch = LaunchInput(node_name="n1", attempt=1, offer=offer, tailnet_tags=[])
    assert activity_context("gpunode/ml/rtx/n1", "launch_instance", [launch]) == {
        "workflow_id": "gpunode/ml/rtx/n1", "activity": "launch_instance", "pool": "ml/rtx", "node": "n1", "provider": "runpod",
    }
    ref = InstanceRef(provider="vastai", instance_name="tgp-n1-1")
    assert activity_context("gpunode/ml/rtx/n1", "terminate_instance", [ref])["provider"] == "vastai"
    # Given fewer arguments than it takes (an older schedule), an activity's input comes as a mapping.
    plain = {"instance": ref.model_dump(mode="json"), "node_name": "n1"}
    assert activity_context("gpunode/ml/rtx/n1", "release_attempt", [plain])["provider"] == "vastai"
    assert activity_context("other", "launch_instance", [launch.model_dump(mode="json")])["provider"] == "runpod"
    label = LabelInput(node_name="n2", labels={LABEL_PROVIDER: "lambdalabs"}, taints=[])
    assert activity_context("other", "label_and_taint_node", [label]) == {
        "workflow_id": "other", "activity": "label_and_taint_node", "node": "n2", "provider": "lambdalabs",
    }
    assert activity_context("gpunodepool/ml/rtx", "write_status", [])["pool"] == "ml/rtx"
    assert activity_context("gpunode/ml/rtx/n1", "delete_node", ["n1"])["node"] == "n1"


# --- the fleet gauges, the port, the dashboard and the docs ------------------------------


def test_fleet_cost_accrues_for_billing_phases_only() -> None:
    pool = f"ml/fleet-{uuid.uuid4().hex[:6]}"
    now = [1000.0]
    fleet = FleetMetrics(client=None, clock=lambda: now[0])  # type: ignore[arg-type]
    nodes = [
        NodeSample(pool=pool, provider="runpod", phase="Ready", hourly_price=Decimal("2.00")),
        NodeSample(pool=pool, provider="runpod", phase="Launching", hourly_price=Decimal("1.00")),
        NodeSample(pool=pool, provider="", phase="Pending", hourly_price=None),
        NodeSample(pool=pool, provider="vastai", phase="TerminationStuck", hourly_price=Decimal("0.50")),
    ]
    value = lambda name, **labels: REGISTRY.get_sample_value(name, {"pool": pool, **labels}) or 0.0  # noqa: E731
    fleet.record(nodes)
    assert value("tgp_cost_dollars_total", provider="runpod") == 0, "nothing is charged before a first interval"
    now[0] += 1800  # half an hour
    fleet.record(nodes)
    assert value("tgp_cost_dollars_total", provider="runpod") == pytest.approx(1.5)
    assert value("tgp_cost_dollars_total", provider="vastai") == pytest.approx(0.25), "a stuck termination still bills"
    assert value("tgp_hourly_cost_dollars", provider="runpod") == 3.0
    assert value("tgp_nodes", provider="runpod", phase="Ready") == 1
    assert value("tgp_nodes", provider="", phase="Pending") == 1
    assert value("tgp_terminations_stuck", provider="vastai") == 1

    fleet.record([])  # every node gone
    assert value("tgp_nodes", provider="runpod", phase="Ready") == 0
    assert value("tgp_terminations_stuck", provider="vastai") == 0
    assert value("tgp_cost_dollars_total", provider="runpod") == pytest.approx(1.5), "a counter keeps what was spent"


def test_metrics_port_setting() -> None:
    assert metrics.metrics_port({}, 9464) == 9464
    assert metrics.metrics_port({"TGP_METRICS_PORT": "9100"}, 9464) == 9100
    assert metrics.metrics_port({"TGP_METRICS_PORT": "0"}, 9464) is None
    for bad in ("http", "70000"):
        with pytest.raises(ConfigError, match="TGP_METRICS_PORT"):
            metrics.metrics_port({"TGP_METRICS_PORT": bad}, 9464)


async def test_a_taken_port_is_logged_not_fatal() -> None:
    runner, port = await metrics.serve_metrics(0, host="127.0.0.1")
    try:
        assert await metrics.serve_metrics_or_log(port, host="127.0.0.1") is None
    finally:
        await runner.cleanup()


def tgp_metric_names() -> set[str]:
    """Every name a tgp_* metric of this process can be queried by (histogram series included)."""
    names: set[str] = set()
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith("# TYPE tgp_"):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return names


def test_the_dashboard_queries_only_metrics_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["panels"]
    used = {n for n in dashboard_metric_names() if n.startswith("tgp_")}
    assert used - tgp_metric_names() == set()
    # Every metric of tgp has a panel.
    bases = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}
    assert {re.sub(r"_(bucket|count|sum)$", "", n) for n in tgp_metric_names()} - bases == set()


def test_docs_list_every_metric() -> None:
    doc = METRICS_DOC.read_text()
    documented = set(re.findall(r"`((?:tgp|temporal)_[a-z0-9_]+)", doc))
    kinds = {line.split()[2]: line.split()[3] for line in generate_latest(REGISTRY).decode().splitlines() if line.startswith("# TYPE tgp_")}
    assert set(kinds) - documented == set(), "docs/metrics.md misses metrics"
    assert {n for n in documented if n.startswith("tgp_")} - tgp_metric_names() == set(), "docs/metrics.md names metrics that do not exist"
