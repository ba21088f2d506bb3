"""tgp's Prometheus metrics and the `/metrics` endpoint of the worker and the bridge.

Workflows never touch these (they must replay deterministically): activities count what they
do, and the worker's fleet collector (`workers.metrics`) derives the node and cost gauges from
Temporal visibility. Names and labels are listed in docs/metrics.md; a test checks that every
metric the Grafana dashboard (deploy/grafana/tgp-dashboard.json) queries is defined here.

One endpoint per process: `/metrics` on TGP_METRICS_PORT serves tgp's metrics followed by the
Temporal SDK's own (`temporal_*`), which the SDK's runtime serves on a loopback port that this
endpoint reads at each scrape.
"""

from __future__ import annotations

import asyncio
import socket
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import structlog
from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector
from temporalio.exceptions import ApplicationError
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from activities.http_wire import default_tls
from tgp.errors import ConfigError

log = structlog.get_logger("tgp.metrics")

METRICS_PORT_ENV = "TGP_METRICS_PORT"
# Distinct defaults, so a worker and a bridge on one machine do not collide; in Kubernetes each
# pod has its own address and the port is named `metrics`.
WORKER_METRICS_PORT = 9464
BRIDGE_METRICS_PORT = 9465
# Reading the SDK's endpoint is a loopback call; a scrape must not hang on it.
SDK_SCRAPE_TIMEOUT = timedelta(seconds=5)

# No `_created` series beside each counter and histogram: nothing here queries them, and they
# double the series Prometheus stores.
disable_created_metrics()

# Launches take minutes, drains up to the pool's drain timeout (default 10 min).
_MINUTES_BUCKETS = (1, 5, 10, 30, 60, 120, 180, 300, 600, 900, 1200, 1800, 3600, 7200)

# --- activities: what the worker did -----------------------------------------------------

LAUNCHES = Counter("tgp_launches", "Instances bought (or adopted after a retry) by launch_instance.", ["provider"])
LAUNCH_FAILURES = Counter(
    "tgp_launch_failures",
    "Failed launch_instance attempts, and instances that failed while booting (reason LaunchFailed); "
    "reason is the error type (CapacityError, OfferRefused, TransientError, AuthError, ...).",
    ["provider", "reason"],
)
DEMAND_TO_LAUNCH = Histogram(
    "tgp_demand_to_launch_seconds",
    "From the pool first hearing of the pending pod a node is bought for to its instance being bought.",
    ["provider"],
    buckets=_MINUTES_BUCKETS,
)
LAUNCH_TO_READY = Histogram(
    "tgp_launch_to_ready_seconds",
    "From the start of the launch attempt that worked to its Node being Ready (labelled and tainted).",
    ["provider"],
    buckets=_MINUTES_BUCKETS,
)
DRAIN_DURATION = Histogram(
    "tgp_drain_duration_seconds",
    "How long drain_node took; outcome drained, or timed_out (pods still there at the drain timeout).",
    ["outcome"],
    buckets=_MINUTES_BUCKETS,
)
TERMINATIONS = Counter(
    "tgp_terminations", "Terminate requests sent to a provider: a drain's and a release's, twins included, repeats until confirmed included.", ["provider"]
)
TERMINATION_FAILURES = Counter(
    "tgp_termination_failures", "Failed terminate_instance attempts (each is retried until it works).", ["provider", "reason"]
)
ORPHANS_FOUND = Counter(
    "tgp_orphans_found",
    "Instances and tailnet devices the sweeper found without a running node workflow (kind instance, device, "
    "or stray: a second instance of a running node's name).",
    ["kind", "system"],
)
ORPHANS_REMOVED = Counter("tgp_orphans_removed", "Orphans the sweeper removed after their grace period.", ["kind", "system"])
SWEEP_OVERDUE = Gauge(
    "tgp_sweep_overdue",
    "1 when no sweep started by the sweeper's Schedule has completed for two of its intervals (its task queue has no "
    "worker, sweeps fail or hang, or the Schedule is gone), else 0. Set by every worker (workers.main.check_sweeps).",
)
UNAVAILABLE_OFFERS = Gauge(
    "tgp_unavailable_offers", "Offers in this worker's unavailable-offers cache (recently failed, skipped until they expire)."
)

# --- the fleet, from Temporal visibility (workers.metrics.FleetMetrics) ------------------

NODES = Gauge("tgp_nodes", "Running node workflows by pool (namespace/name), provider and phase.", ["pool", "provider", "phase"])
HOURLY_COST = Gauge(
    "tgp_hourly_cost_dollars", "What the nodes in a billing phase (Launching to Terminating) cost now, US$ per hour.", ["pool", "provider"]
)
COST = Counter(
    "tgp_cost_dollars",
    "US$ spent on nodes in a billing phase since this process started, sampled at each fleet refresh; "
    "use increase() (it spans restarts).",
    ["pool", "provider"],
)
TERMINATIONS_STUCK = Gauge(
    "tgp_terminations_stuck", "Nodes whose provider has not confirmed the termination for a while (phase TerminationStuck).", ["pool", "provider"]
)
FLEET_REFRESHED = Gauge("tgp_fleet_refresh_timestamp_seconds", "When the fleet gauges were last refreshed from Temporal visibility.")
FLEET_REFRESH_ERRORS = Counter("tgp_fleet_refresh_errors", "Fleet refreshes that failed (the gauges keep their last values).")


# --- the pricing cache (activities.offer_cache) --------------------------------------------

OFFER_CACHE_HITS = Counter(
    "tgp_offer_cache_hits",
    "Offer lookups (a node's selection, a pool's offer check) served without a provider call of their own: fresh "
    "offers, a listing already in flight, or a listing that failed moments ago.",
    ["provider"],
)
OFFER_CACHE_MISSES = Counter("tgp_offer_cache_misses", "Offer lookups that listed the provider's offers (none cached, or older than the TTL).", ["provider"])
OFFER_CACHE_STALE_SERVED = Counter(
    "tgp_offer_cache_stale_served",
    "Offer lookups served offers older than the TTL because listing them again failed (stale while error, bounded).",
    ["provider"],
)
OFFER_LISTINGS = Counter(
    "tgp_offer_listings", "Offer listings the pricing cache made, by trigger: demand (a lookup) or schedule.", ["provider", "trigger"]
)
OFFER_CACHE_REFRESH_FAILURES = Counter(
    "tgp_offer_cache_refresh_failures", "Offer listings that failed, by error type (the cache keeps the last good offers, bounded).", ["provider", "reason"]
)


class OfferCacheAges(Collector):
    """`tgp_offer_cache_age_seconds{provider, account}`, computed at scrape time from every
    pricing cache of this process (normally one; tests make more): how old the offers that
    selections get are. Above the cache's TTL only while listings fail (stale while error)."""

    def __init__(self) -> None:
        self.caches: weakref.WeakSet[Any] = weakref.WeakSet()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "tgp_offer_cache_age_seconds",
            "Seconds since the offers this worker's pricing cache holds for a provider account were listed.",
            labels=["provider", "account"],
        )
        youngest: dict[tuple[str, str], float] = {}
        for cache in list(self.caches):
            for provider, account, age in cache.ages():
                youngest[(provider, account)] = min(age, youngest.get((provider, account), age))
        for (provider, account), age in sorted(youngest.items()):
            family.add_metric([provider, account], age)
        yield family


OFFER_CACHE_AGES = OfferCacheAges()
REGISTRY.register(OFFER_CACHE_AGES)


def failure_reason(exc: BaseException) -> str:
    """A bounded label for an error: tgp's error type, or an ApplicationError's type."""
    if isinstance(exc, ApplicationError):
        return exc.type or "ApplicationError"
    return type(exc).__name__


@contextmanager
def counting_launch(provider: str, *, demand_since: datetime | None = None) -> Iterator[None]:
    """Count the block as a launch of `provider` (and observe the time since `demand_since`),
    or as a launch failure with its reason. A cancelled attempt is neither."""
    with counting_failures(LAUNCH_FAILURES, provider):
        yield
    LAUNCHES.labels(provider).inc()
    if demand_since is not None:
        DEMAND_TO_LAUNCH.labels(provider).observe(seconds_since(demand_since))


@contextmanager
def counting_failures(counter: Counter, *labels: str) -> Iterator[None]:
    """Count an exception leaving the block in `counter{*labels, reason}`. Cancellation (the
    workflow gave up on the activity) is not a failure."""
    try:
        yield
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        counter.labels(*labels, failure_reason(exc)).inc()
        raise


def seconds_since(then: datetime) -> float:
    """Seconds from `then` (a workflow's timestamp, UTC) to now; never negative (clock skew)."""
    if then.tzinfo is None:
        then = then.replace(tzinfo=timezone.utc)
    return max(0.0, (datetime.now(timezone.utc) - then).total_seconds())


def metrics_port(env: Mapping[str, str], default: int) -> int | None:
    """The port TGP_METRICS_PORT names (`default` when unset); None when it is 0 (disabled)."""
    raw = env.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return default
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"{METRICS_PORT_ENV}={raw!r} is not a port number (0 turns the metrics endpoint off)") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{METRICS_PORT_ENV}={port} is not a port number (0 turns the metrics endpoint off)")
    return port or None


@dataclass
class SdkMetrics:
    """A Temporal runtime exporting the SDK's metrics on a loopback port, for `Client.connect`."""

    runtime: Runtime
    url: str


def sdk_metrics(service: str) -> SdkMetrics:
    """A Temporal runtime whose metrics (`temporal_*`, durations in seconds) `/metrics` forwards."""
    with socket.socket() as probe:  # a free loopback port for the SDK's own endpoint
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    runtime = Runtime(
        telemetry=TelemetryConfig(
            metrics=PrometheusConfig(
                bind_address=f"127.0.0.1:{port}", counters_total_suffix=True, unit_suffix=True, durations_as_seconds=True
            ),
            global_tags={"service": service},
        )
    )
    return SdkMetrics(runtime=runtime, url=f"http://127.0.0.1:{port}/metrics")


async def serve_metrics(
    port: int, *, host: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY, forward: str | None = None
) -> tuple[web.AppRunner, int]:
    """Serve `registry` (and the text of `forward`, the SDK's endpoint) at /metrics. Returns the
    runner (clean it up to stop) and the port bound (`port` 0: any free one)."""
    client = httpx.AsyncClient(timeout=SDK_SCRAPE_TIMEOUT.total_seconds(), verify=default_tls())

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(registry)
        if forward:
            try:
                response = await client.get(forward)
                response.raise_for_status()
                body += response.content
            except httpx.HTTPError as exc:
                log.warning("sdk_metrics_unavailable", url=forward, error=str(exc))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    app = web.Application()
    app.router.add_get("/metrics", metrics)

    async def close(_: web.Application) -> None:
        await client.aclose()

    app.on_cleanup.append(close)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


async def serve_metrics_or_log(port: int, **options: object) -> tuple[web.AppRunner, int] | None:
    """`serve_metrics`, except that a port that cannot be bound is logged rather than fatal: the
    process's work (buying and, above all, releasing nodes) matters more than its metrics, and
    Prometheus shows the target down."""
    try:
        return await serve_metrics(port, **options)  # type: ignore[arg-type]
    except OSError as exc:
        log.error("metrics_not_served", port=port, error=str(exc), hint=f"set {METRICS_PORT_ENV} to a free port, or 0")
        return None
