"""The worker's `/metrics` endpoint and its fleet gauges.

Nodes by pool, provider and phase, their $/h and the money spent are read from Temporal
visibility (the search attributes each node workflow keeps current) by a background task of
the worker, every `REFRESH_EVERY`: workflows stay free of metrics, and every worker replica
reports the same fleet (aggregate with `max`, not `sum`; docs/metrics.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

import structlog
from temporalio.client import Client

from activities import metrics
from activities.visibility import running_node_workflows
from tgp.types import BILLING_PHASES, NodePhase

log = structlog.get_logger("tgp.metrics")

# One visibility listing per refresh however many nodes run, but it pages through every
# running node workflow and decodes its search attributes: at 1,000 nodes that was about 3 points
# of a core every 15 s (issue 20). Node phases move over minutes (boots, idle timeouts), so a
# minute is fresh enough for the gauges and the cost ledger, and costs a quarter of that.
REFRESH_EVERY = timedelta(seconds=60)
# A refresh reads at most this many node workflows (the query pages 1,000 at a time).
MAX_NODES_LISTED = 10_000
# A visibility query slower than this is abandoned; the gauges keep their last values.
REFRESH_TIMEOUT = timedelta(seconds=30)


@dataclass(frozen=True)
class NodeSample:
    """One running node workflow as visibility shows it."""

    pool: str
    provider: str
    phase: str
    hourly_price: Decimal | None

    @property
    def billing(self) -> bool:
        return self.phase in BILLING_PHASES and self.hourly_price is not None


@dataclass(frozen=True)
class FleetTotals:
    nodes: dict[tuple[str, str, str], int]  # (pool, provider, phase) -> count
    hourly: dict[tuple[str, str], Decimal]  # (pool, provider) -> $/h of the billing nodes
    stuck: dict[tuple[str, str], int]  # (pool, provider) -> nodes in TerminationStuck


def fleet_totals(nodes: Iterable[NodeSample]) -> FleetTotals:
    """Counts and $/h of `nodes`, by the labels of the fleet gauges."""
    counts: Tally[tuple[str, str, str]] = Tally()
    hourly: dict[tuple[str, str], Decimal] = {}
    stuck: Tally[tuple[str, str]] = Tally()
    for n in nodes:
        counts[(n.pool, n.provider, n.phase)] += 1
        if n.billing:
            hourly[(n.pool, n.provider)] = hourly.get((n.pool, n.provider), Decimal(0)) + (n.hourly_price or Decimal(0))
        if n.phase == NodePhase.TERMINATION_STUCK:
            stuck[(n.pool, n.provider)] += 1
    return FleetTotals(nodes=dict(counts), hourly=hourly, stuck=dict(stuck))


class FleetMetrics:
    """Keeps tgp_nodes, tgp_hourly_cost_dollars, tgp_terminations_stuck and tgp_cost_dollars_total
    current from visibility."""

    def __init__(self, client: Client, *, limit: int = MAX_NODES_LISTED, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.limit = limit
        self.clock = clock
        self._last: float | None = None  # when the previous refresh's totals were taken

    async def list_nodes(self) -> list[NodeSample]:
        return [
            NodeSample(pool=s.pool, provider=s.provider or "", phase=s.phase.value if s.phase else "", hourly_price=s.hourly_price)
            for s in await running_node_workflows(self.client, limit=self.limit)
        ]

    def record(self, nodes: list[NodeSample]) -> None:
        """Set the gauges to `nodes`; charge the billing ones for the time since the last refresh."""
        now = self.clock()
        totals = fleet_totals(nodes)
        metrics.NODES.clear()  # a pool, provider or phase with no node any more must not linger
        for (pool, provider, phase), count in totals.nodes.items():
            metrics.NODES.labels(pool, provider, phase).set(count)
        metrics.HOURLY_COST.clear()
        for (pool, provider), hourly in totals.hourly.items():
            metrics.HOURLY_COST.labels(pool, provider).set(float(hourly))
        metrics.TERMINATIONS_STUCK.clear()
        for (pool, provider), count in totals.stuck.items():
            metrics.TERMINATIONS_STUCK.labels(pool, provider).set(count)
        if self._last is not None:
            hours = Decimal(str(now - self._last)) / 3600
            for (pool, provider), hourly in totals.hourly.items():
                metrics.COST.labels(pool, provider).inc(float(hourly * hours))
        self._last = now
        metrics.FLEET_REFRESHED.set_to_current_time()

    async def refresh(self) -> None:
        async with asyncio.timeout(REFRESH_TIMEOUT.total_seconds()):  # not wait_for: it can swallow a cancel on 3.11
            nodes = await self.list_nodes()
        self.record(nodes)

    async def run(self, every: timedelta = REFRESH_EVERY) -> None:
        """Refresh until cancelled; a failed refresh is logged and counted, and tried again."""
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - visibility down: keep the last values, try again
                metrics.FLEET_REFRESH_ERRORS.inc()
                log.warning("fleet_refresh_failed", error=str(exc), error_type=type(exc).__name__)
            await asyncio.sleep(every.total_seconds())


async def start_worker_metrics(
    client: Client,
    stack: AsyncExitStack,
    *,
    port: int,
    host: str = "0.0.0.0",
    unavailable: Callable[[], int] | None = None,
    forward: str | None = None,
    refresh: timedelta = REFRESH_EVERY,
) -> int | None:
    """Serve the worker's /metrics (with the SDK's metrics at `forward`) and keep the fleet
    gauges current, until `stack` closes. `unavailable` counts the unavailable-offers cache.
    Returns the port bound (`port` 0: any free one), None if it could not be bound (logged)."""
    if unavailable is not None:
        metrics.UNAVAILABLE_OFFERS.set_function(unavailable)
    served = await metrics.serve_metrics_or_log(port, host=host, forward=forward)
    if served is None:
        return None
    runner, bound = served
    stack.push_async_callback(runner.cleanup)
    task = asyncio.get_running_loop().create_task(FleetMetrics(client).run(refresh))

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(stop)
    log.info("metrics_serving", port=bound, refresh_seconds=refresh.total_seconds())
    return bound
