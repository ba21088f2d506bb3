"""The node lifecycle's activities: all of its I/O, one method per stage.

Each method talks to the outside world only through the ports (CloudProvider, Tailnet,
Cluster) and turns tgp's typed errors into Temporal ApplicationErrors, so the workflow's retry
policies decide what happens next. Secrets (the minted tailnet key, the rendered boot payload)
are created and consumed inside `launch_instance` and never returned.

Split by stage as workflows/node/ is: `offers`, `launch` (its boot payload in `boot`), `join`,
`watch` (looks, budgets, reports), `drain`, `release`; each a mixin of the one `NodeActivities`
(whose method names are the activities' names), on `base`'s adapters; `reports` carries the
node's reports to its pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta

from activities.accounts import ProviderRegistry, TailnetRegistry
from activities.ledger import LedgerBatcher
from activities.node.base import HEARTBEAT_EVERY, POLL_INTERVAL, _utcnow, heartbeating
from activities.node.drain import DRAIN_RELEASE_BOUND, TERMINATE_ONCE_TIMEOUT, Drain, DrainOutcome, DrainRelease
from activities.node.join import JOIN_LOOK_EVERY, JOIN_NODE_LOOK
from activities.node.launch import CREATE_SETTLE, SETTLE_TRIES, Launch, LaunchMemo
from activities.node.offers import Offers
from activities.node.release import MAX_DEVICES_PER_HOSTNAME, RELEASE_STEP_TIMEOUT, ReleaseInput, ReleaseResult
from activities.node.reports import (
    MAX_REPORT_BATCH,
    REPORT_ATTEMPTS,
    REPORT_BATCH_TIMEOUT,
    REPORT_PAUSE,
    REPORT_RPC_TIMEOUT,
    REPORT_TRIES,
    REPORT_WAIT,
    ReportBatcher,
    _reports_in_flight,
    carrying,
    signal_report,
)
from activities.node.watch import MAX_ASK_BATCH, POOL_ANSWER_TIMEOUT, POOL_BUSY_PAUSE, POOL_BUSY_PAUSE_MAX, PoolAskBatcher
from activities.ports import Cluster, CloudProvider, Tailnet

__all__ = [
    "CREATE_SETTLE",
    "DRAIN_RELEASE_BOUND",
    "HEARTBEAT_EVERY",
    "JOIN_LOOK_EVERY",
    "JOIN_NODE_LOOK",
    "MAX_ASK_BATCH",
    "MAX_DEVICES_PER_HOSTNAME",
    "MAX_REPORT_BATCH",
    "POLL_INTERVAL",
    "POOL_ANSWER_TIMEOUT",
    "POOL_BUSY_PAUSE",
    "POOL_BUSY_PAUSE_MAX",
    "RELEASE_STEP_TIMEOUT",
    "REPORT_ATTEMPTS",
    "REPORT_BATCH_TIMEOUT",
    "REPORT_PAUSE",
    "REPORT_RPC_TIMEOUT",
    "REPORT_TRIES",
    "REPORT_WAIT",
    "SETTLE_TRIES",
    "TERMINATE_ONCE_TIMEOUT",
    "DrainOutcome",
    "DrainRelease",
    "LaunchMemo",
    "NodeActivities",
    "PoolAskBatcher",
    "ReleaseInput",
    "ReleaseResult",
    "ReportBatcher",
    "_reports_in_flight",
    "carrying",
    "heartbeating",
    "signal_report",
]


class NodeActivities(Offers, Launch, Drain):
    """Activities of GPUNodeWorkflow, bound to one worker's adapters."""

    def __init__(
        self,
        *,
        providers: Mapping[str, CloudProvider],
        tailnets: Mapping[str, Tailnet],
        cluster: Cluster,
        poll_interval: timedelta = POLL_INTERVAL,
        create_settle: timedelta = CREATE_SETTLE,
        registry: ProviderRegistry | None = None,
        tailnet_registry: TailnetRegistry | None = None,
        ledger: LedgerBatcher | None = None,
        now: Callable[[], datetime] = _utcnow,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        """`now` and `sleep` are the activities' clock (for consistency windows and settle
        lookups): tests pass a fake clock whose sleep moves it."""
        self.providers = dict(providers)
        # Adapters per class account (providers[].credentialsRef); `providers` is the fallback.
        self.registry = registry or ProviderRegistry(cluster=cluster, fallback=self.providers)
        self.tailnets = dict(tailnets)
        # Tailnet adapters per class (tailscaleConfig.oauthSecretRef); `tailnets` is the fallback.
        self.tailnet_registry = tailnet_registry or TailnetRegistry(cluster=cluster, fallback=self.tailnets)
        self.cluster = cluster
        self.pool_asks = PoolAskBatcher()  # the disruption asks of its nodes, one update per pool at a time
        self.reports = ReportBatcher()  # the reports of its nodes, one signal per pool at a time
        # The class ledger's calls a launch and a release carry (one per worker: the class's too).
        self.ledger = ledger or LedgerBatcher()
        # Offers that just failed, kept by the pricing cache beside the offers (shared with the pool).
        self.unavailable = self.registry.offers.unavailable
        self.poll_interval = poll_interval
        self.terminate_once_timeout = TERMINATE_ONCE_TIMEOUT
        self.create_settle = create_settle
        self.now = now
        self.sleep = sleep

    def all(self) -> list[Callable[..., object]]:
        """Every activity, for Worker(activities=...)."""
        return [
            self.select_offer,
            self.mark_offer_unavailable,
            self.launch_instance,
            self.check_stage,
            self.label_and_taint_node,
            self.observe_node,
            self.ask_pool_to_disrupt,
            self.report_to_pool,
            self.drain_node,
            self.terminate_instance,
            self.release_attempt,
            self.watch_for_twins,
            self.remove_from_tailnet,
            self.delete_node,
        ]
