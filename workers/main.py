"""The worker process: hosts tgp's workflows and activities on one task queue.

Scale out by running more replicas on the same queue. The worker's own adapters are built from
the environment (a Kubernetes Secret in production); a class's own credentials
(`credentialsRef`, `oauthSecretRef`) are read from its Secrets by the activities
(activities/accounts.py). Secrets stay inside the activities, never in workflow inputs.
"""

from __future__ import annotations

import asyncio
import os
import dataclasses
from datetime import datetime, timedelta, timezone
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import structlog
from pydantic import SecretStr
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleUpdate,
    ScheduleUpdateInput,
    WorkflowExecutionStatus,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import PollerBehaviorSimpleMaximum, UnsandboxedWorkflowRunner, Worker, WorkflowRunner

from activities.kube.cluster import KubernetesCluster
from activities.entity import EntityActivities
from activities.ledger import LedgerBatcher
from activities.node_class import NodeClassActivities
from activities.pool import PoolActivities
from activities.node import NodeActivities
from activities.fleet import FleetActivities
from activities.sweeper import SweeperActivities
from activities.ports import CloudProvider
from activities.accounts import ProviderRegistry, TailnetRegistry
from activities.clouds.registry import API_KEY_ENV, providers_from_env
from activities.metrics import SWEEP_OVERDUE
from activities.tailnets.headscale import HeadscaleTailnet
from activities.ports import Tailnet
from activities.tailnets.tailscale import TailscaleTailnet
from tgp.errors import ConfigError
from workers.interceptors import ActivityLogContext
from workers.sandbox_code import SandboxRunner
from workers.versioning import deployment_config
from tgp.types import DEFAULT_TASK_QUEUE
from workflows.node import GPUNodeWorkflow
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow
from workflows.fleet import FLEET_LOOK_ID, FleetLookRequest, FleetLookWorkflow, fleet_look_id
from workflows.sweeper import SWEEP_EVERY, SweeperWorkflow, SweepRequest

log = structlog.get_logger("tgp.worker")

WORKFLOWS = [GPUNodeWorkflow, GPUNodePoolWorkflow, GPUNodeClassWorkflow, SweeperWorkflow, FleetLookWorkflow]
SWEEPER_SCHEDULE_ID = "tgp-sweeper"
# Sweeps are overdue when none completed for this many of the Schedule's intervals.
SWEEP_OVERDUE_INTERVALS = 2
# How many workflows a worker keeps in memory (Temporal's sticky cache; the SDK's default is
# 1,000). A cached node workflow cost about 0.45 MB when each run imported its module again in the
# sandbox (issue 20; make bench's hold of 1,000 at rest, without the arena limit of
# workers/memory.py: 400 MB with 300, 310 MB with 100), so the SDK's default held 1,000 nodes at
# ~450 MB on top of the process's ~175 MB, past the 300 MB a worker may use for them. An
# evicted workflow is replayed from its history at its next wake: ~36 ms of CPU for a node's
# 79-event life (measured with the Replayer, docs/benchmarks.md). A node at rest that meets the
# history target (< 10 events per node-hour) wakes about once an hour, so 1,000 evicted resting
# nodes cost ~1% of a core in replays, against ~290 MB to keep them all. Workflows that are busy
# stay cached (LRU) as long as the busy set fits: a burst that launches more nodes at once than
# the cache holds evicts each one before its next task (a 40-node burst with a cache of 10 cost
# the worker 3.5x the CPU); with more than ~550 nodes launching at once per worker, raise it
# (TGP_WORKFLOW_CACHE; 0 turns the cache off: every task replays) or run more workers, which
# split the active set between their caches. 600, not 300 (issue 37): with tgp's workflow code
# passed through the sandbox a cached node costs ~80 KB, and a burst of 500 on a cache of 300
# evicted ~200 runs mid-burst (each torn down, some replayed): paired quick bursts of 500, the
# worker 5-10% less CPU for the same work with 600; a worker holding 1,000 nodes at rest 275 MB
# (1,000 cached: 287 MB, within 13 MB of the 300 MB target, so not the default).
WORKFLOW_CACHE = 600
WORKFLOW_CACHE_ENV = "TGP_WORKFLOW_CACHE"
# Workflows run in Temporal's sandbox, with tgp's own workflow packages passed through
# (workers/sandbox_code.py): a new run imports nothing again, and the sandbox costs only its hops
# into each run and its checks of builtins and imports at run time (a 100-node burst: 64.7-69.0 ms
# of the worker's CPU a node, against 64.6 unsandboxed and 73-76 when each run imported the node
# workflow's module again). TGP_WORKFLOW_SANDBOX=off runs workflows without it; the tests and
# the replay of recorded histories in CI run sandboxed either way.
WORKFLOW_SANDBOX_ENV = "TGP_WORKFLOW_SANDBOX"
# How many activities a worker runs at once (the SDK's default is 100). Every activity is async
# and most of a launch's time is spent waiting in one (the instance to run, the device, the
# Node, its GPUs; the twin watch over the provider's consistency window), so a node being brought
# up holds one or two slots for minutes while costing next to nothing: with 100, a burst of 500
# brought up ~50 nodes at a time and the rest of the burst queued behind them (7 of 500 pods
# served after 2 minutes in `make bench`). The provider clients' own pacers bound the requests.
ACTIVITY_SLOTS = 2000
ACTIVITY_SLOTS_ENV = "TGP_ACTIVITY_SLOTS"
# How many workflow task polls a worker keeps open (the SDK's default is 5, of which a fifth
# polls the task queue itself, where every new workflow's first task waits, and the rest the
# worker's sticky queue). In a burst each node workflow's first task then waited for that one
# poller: start -> first workflow task p50 1.5-2.6 s at 100 pods while the worker used half a
# core; with 20, 0.4-0.5 s and the tgp overhead's p99 10 s instead of 12-22 s (make bench, back
# to back at load ~5, docs/benchmarks.md). An open poll is one long-poll RPC waiting at the server.
WORKFLOW_TASK_POLLS = 20
WORKFLOW_TASK_POLLS_ENV = "TGP_WORKFLOW_TASK_POLLS"
# How many workflow tasks a worker works on at once (the SDK's default is 100). Workflow code
# runs under Python's one interpreter lock, so tasks in flight share one core: with 20 polls
# bringing in up to 100 at once, 1,000 node workflows started together each took over 5 s a task
# and hundreds timed out (10 s) and were replayed; 543 of 1,000 were Ready after 182 s. With 20
# at once: all 1,000 Ready after 112 s (make bench's hold, one run each, 2026-11-24).
WORKFLOW_TASK_SLOTS = 20
WORKFLOW_TASK_SLOTS_ENV = "TGP_WORKFLOW_TASK_SLOTS"


@dataclass
class Activities:
    """Every activity of a worker, bound to its adapters."""

    node: NodeActivities
    pool: PoolActivities
    node_class: NodeClassActivities
    entity: EntityActivities
    sweeper: SweeperActivities
    fleet: FleetActivities | None = None

    def all(self) -> list[object]:
        fleet = self.fleet.all() if self.fleet is not None else []
        return [*self.node.all(), *self.pool.all(), *self.node_class.all(), *self.entity.all(), *self.sweeper.all(), *fleet]


@dataclass
class WorkerConfig:
    """Where the worker's adapters point. Read from the environment by `from_env`."""

    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # provider credentials and options
    tailscale_api_url: str = "https://api.tailscale.com"
    tailscale_client_id: str | None = None
    tailscale_client_secret: SecretStr | None = field(default=None, repr=False)
    kube_url: str | None = None
    kubeconfig: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> WorkerConfig:
        secret = env.get("TS_OAUTH_CLIENT_SECRET")
        return cls(
            env=dict(env),
            tailscale_api_url=env.get("TGP_TAILSCALE_API_URL", "https://api.tailscale.com"),
            tailscale_client_id=env.get("TS_OAUTH_CLIENT_ID"),
            tailscale_client_secret=SecretStr(secret) if secret else None,
            kube_url=env.get("TGP_KUBE_URL"),
            kubeconfig=env.get("KUBECONFIG"),
        )


async def build_activities(config: WorkerConfig, stack: AsyncExitStack) -> Activities:
    """Adapters for every configured system; closed when `stack` closes."""
    # The worker's own adapters, from its environment: for classes whose providers have no
    # credentialsRef. A class's credentialsRef gets its own adapter (ProviderRegistry), so a
    # worker without any provider key still serves classes that bring theirs.
    providers: dict[str, CloudProvider] = providers_from_env(config.env)
    for provider in providers.values():
        stack.push_async_callback(provider.aclose)  # type: ignore[attr-defined]
    tailnets: dict[str, Tailnet] = {}
    if config.tailscale_client_id and config.tailscale_client_secret:
        tailscale = TailscaleTailnet(
            base_url=config.tailscale_api_url,
            client_id=config.tailscale_client_id,
            client_secret=config.tailscale_client_secret,
        )
        stack.push_async_callback(tailscale.aclose)
        tailnets["tailscale"] = tailscale
    headscale_url, headscale_key = config.env.get("HEADSCALE_URL"), config.env.get("HEADSCALE_API_KEY")
    if headscale_url and headscale_key:
        headscale = HeadscaleTailnet(base_url=headscale_url, api_key=SecretStr(headscale_key), user=config.env.get("HEADSCALE_USER"))
        stack.push_async_callback(headscale.aclose)
        tailnets["headscale"] = headscale
    if not tailnets:
        raise ConfigError(
            "no tailnet configured: set TS_OAUTH_CLIENT_ID and TS_OAUTH_CLIENT_SECRET (Tailscale) "
            "or HEADSCALE_URL and HEADSCALE_API_KEY (Headscale)"
        )
    if not providers:
        log.warning(
            "no_worker_provider_keys",
            hint=f"only classes whose providers have a credentialsRef can buy nodes; or set one of {', '.join(API_KEY_ENV.values())}",
        )
    cluster = KubernetesCluster.from_url(config.kube_url) if config.kube_url else KubernetesCluster.from_kubeconfig(config.kubeconfig)
    stack.push_async_callback(cluster.close)
    # Adapters per (provider, class Secret key), shared by the node, pool and class activities; the
    # environment's adapters are the fallback. Closed before the cluster it reads through.
    registry = ProviderRegistry(cluster=cluster, env=config.env, fallback=providers)
    stack.push_async_callback(registry.aclose)
    # The pricing cache's scheduled refresh (activities.offer_cache): accounts in use are listed
    # again shortly before their offers expire; stopped before the adapters it lists with close.
    refresher = asyncio.get_running_loop().create_task(registry.offers.refresh_loop())
    stack.callback(refresher.cancel)
    # Likewise the tailnets of classes with their own tailscaleConfig.oauthSecretRef.
    tailnet_env = {**config.env, "TGP_TAILSCALE_API_URL": config.tailscale_api_url}
    tailnet_registry = TailnetRegistry(cluster=cluster, env=tailnet_env, fallback=tailnets)
    stack.push_async_callback(tailnet_registry.aclose)
    # One batcher for the class ledger's calls: the class's settle and release and, in a v4
    # life, the node's launch and release that carry them go in the same updates.
    ledger = LedgerBatcher()
    return Activities(
        node=NodeActivities(
            providers=providers, tailnets=tailnets, cluster=cluster, registry=registry, tailnet_registry=tailnet_registry, ledger=ledger
        ),
        pool=PoolActivities(cluster=cluster, providers=providers, registry=registry),
        node_class=NodeClassActivities(cluster=cluster, providers=providers, registry=registry, tailnets=sorted(tailnets), ledger=ledger),
        entity=EntityActivities(cluster=cluster),
        sweeper=SweeperActivities(providers=providers, tailnets=tailnets, cluster=cluster, kept=registry.kept),
        fleet=FleetActivities(registry=registry, cluster=cluster),
    )


def sweeper_schedule(task_queue: str, every: timedelta = SWEEP_EVERY) -> Schedule:
    """The sweeper's Schedule as a worker on `task_queue` wants it."""
    return Schedule(
        action=ScheduleActionStartWorkflow(SweeperWorkflow.run, SweepRequest(), id=SWEEPER_SCHEDULE_ID, task_queue=task_queue),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=every)]),
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )


async def ensure_sweeper_schedule(client: Client, task_queue: str, every: timedelta = SWEEP_EVERY) -> None:
    """Create the sweeper's Schedule, or bring the existing one to this worker's task queue and
    interval (every worker calls this at start). A Schedule left pointing at a queue no worker
    polls (one worker once started with another `--task-queue`) would start sweeps nobody runs;
    the last worker to start wins, so run every worker on one queue. A pause set by hand stays."""
    wanted = sweeper_schedule(task_queue, every)
    try:
        await client.create_schedule(SWEEPER_SCHEDULE_ID, wanted)
        return
    except ScheduleAlreadyRunningError:
        pass

    def reconcile(current: ScheduleUpdateInput) -> ScheduleUpdate | None:
        schedule = current.description.schedule
        action, intervals = schedule.action, schedule.spec.intervals
        queue = action.task_queue if isinstance(action, ScheduleActionStartWorkflow) else None
        if queue == task_queue and [i.every for i in intervals] == [every] and not schedule.spec.calendars:
            return None
        log.info("sweeper_schedule_reconciled", task_queue=task_queue, was_task_queue=queue, every_s=int(every.total_seconds()))
        return ScheduleUpdate(schedule=dataclasses.replace(wanted, state=schedule.state))

    handle = client.get_schedule_handle(SWEEPER_SCHEDULE_ID)
    await handle.update(reconcile)
    # A sweep started on another queue may wait there for ever, and with overlap SKIP it would
    # hold back every sweep after it: end it (a sweep is redone by the next one).
    for running in (await handle.describe()).info.running_actions:
        sweep = client.get_workflow_handle(running.workflow_id, run_id=running.first_execution_run_id)
        try:
            if (await sweep.describe()).task_queue != task_queue:
                await sweep.terminate(f"the sweeper's Schedule moved to task queue {task_queue!r}")
                log.warning("sweep_on_old_queue_terminated", workflow_id=running.workflow_id, task_queue=task_queue)
        except RPCError:
            pass  # it ended meanwhile


async def ensure_fleet_look(client: Client, task_queue: str, every: timedelta | None = None, *, workflow_id: str | None = None) -> None:
    """Start this task queue's fleet look (workflows.fleet, id `fleet_look_id(task_queue)`), or
    keep the one running (every worker calls this at start). One running under `workflow_id` on
    another task queue than this worker's is replaced, as the sweeper's Schedule is moved: its
    looks would wait there for a worker that never comes. The one look per namespace of earlier
    releases (`tgp-fleet-look`) is ended when it runs on this queue (it would look twice); one
    on another queue is another installation's, left to it.
    `every`: the interval (None: FLEET_LOOK_EVERY of the code running the look)."""
    if workflow_id is None:
        workflow_id = fleet_look_id(task_queue)
        await _retire_namespace_look(client, task_queue)
    for _ in range(2):
        handle = await client.start_workflow(
            FleetLookWorkflow.run,
            FleetLookRequest(every=every),
            id=workflow_id,
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            static_summary="lists each provider account's instances every interval and tells nodes whose instance ended",
        )
        if (await handle.describe()).task_queue == task_queue:
            return
        try:
            await handle.terminate(f"the fleet look moved to task queue {task_queue!r}")
        except RPCError as exc:
            if exc.status is not RPCStatusCode.NOT_FOUND:
                raise
        log.warning("fleet_look_moved", task_queue=task_queue)


async def _retire_namespace_look(client: Client, task_queue: str) -> None:
    """End the earlier releases' fleet look (one per namespace) when it runs on `task_queue`."""
    handle = client.get_workflow_handle(FLEET_LOOK_ID)
    try:
        desc = await handle.describe()
        if desc.status is WorkflowExecutionStatus.RUNNING and desc.task_queue == task_queue:
            await handle.terminate(f"replaced by the task queue's own fleet look {fleet_look_id(task_queue)!r}")
            log.info("fleet_look_per_queue", task_queue=task_queue, replaced=FLEET_LOOK_ID)
    except RPCError as exc:
        if exc.status is not RPCStatusCode.NOT_FOUND:
            raise


async def check_sweeps(client: Client, *, now: datetime | None = None) -> bool:
    """Whether sweeps are overdue: the Schedule has existed for SWEEP_OVERDUE_INTERVALS of its
    intervals and no sweep it started completed within them (or it is gone). Sets
    tgp_sweep_overdue and logs an error saying where the Schedule sends its sweeps."""
    now = now or datetime.now(timezone.utc)
    try:
        desc = await client.get_schedule_handle(SWEEPER_SCHEDULE_ID).describe()
    except RPCError as exc:
        if exc.status is not RPCStatusCode.NOT_FOUND:
            raise
        SWEEP_OVERDUE.set(1)
        log.error("sweeps_overdue", reason="the sweeper's Schedule does not exist; restart a worker to create it", schedule=SWEEPER_SCHEDULE_ID)
        return True
    intervals = desc.schedule.spec.intervals
    window = SWEEP_OVERDUE_INTERVALS * (intervals[0].every if intervals else SWEEP_EVERY)
    since = now - window
    overdue = desc.info.created_at < since
    if overdue:
        stamp = since.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        query = f"TemporalScheduledById = '{SWEEPER_SCHEDULE_ID}' AND ExecutionStatus = 'Completed' AND CloseTime > '{stamp}'"
        overdue = not [w async for w in client.list_workflows(query, limit=1)]
    SWEEP_OVERDUE.set(1 if overdue else 0)
    if overdue:
        action = desc.schedule.action
        started = desc.info.recent_actions[-1].started_at if desc.info.recent_actions else None
        log.error(
            "sweeps_overdue",
            reason=f"no sweep completed in the last {window}; is a worker polling the Schedule's task queue?",
            task_queue=action.task_queue if isinstance(action, ScheduleActionStartWorkflow) else None,
            last_started=started.isoformat() if started else None,
            running=len(desc.info.running_actions),
            paused=desc.schedule.state.paused,
        )
    return overdue


async def watch_sweeps(client: Client, every: timedelta = SWEEP_EVERY) -> None:
    """Check the sweeps (check_sweeps) every interval, until cancelled."""
    while True:
        try:
            await check_sweeps(client)
        except RPCError as exc:
            log.warning("sweeps_not_checked", error=str(exc))
        await asyncio.sleep(every.total_seconds())


def workflow_cache(env: Mapping[str, str] = os.environ) -> int:
    """The worker's workflow cache size: TGP_WORKFLOW_CACHE, else WORKFLOW_CACHE."""
    return _count(env, WORKFLOW_CACHE_ENV, WORKFLOW_CACHE, at_least=0, what="a number of workflows (0 turns the cache off)")


def workflow_runner(env: Mapping[str, str] = os.environ) -> WorkflowRunner:
    """Temporal's sandbox (the default, tgp's workflow packages passed through:
    workers.sandbox_code) or, with TGP_WORKFLOW_SANDBOX=off, none."""
    raw = env.get(WORKFLOW_SANDBOX_ENV, "").strip().lower()
    if raw in ("", "on", "true", "1"):
        return SandboxRunner()
    if raw in ("off", "false", "0"):
        return UnsandboxedWorkflowRunner()
    raise ConfigError(f"{WORKFLOW_SANDBOX_ENV}={raw!r} is neither on nor off")


def activity_slots(env: Mapping[str, str] = os.environ) -> int:
    """How many activities the worker runs at once: TGP_ACTIVITY_SLOTS, else ACTIVITY_SLOTS."""
    return _count(env, ACTIVITY_SLOTS_ENV, ACTIVITY_SLOTS, at_least=1, what="a positive number of activities")


def workflow_task_polls(env: Mapping[str, str] = os.environ) -> int:
    """How many workflow task polls the worker keeps open: TGP_WORKFLOW_TASK_POLLS, else
    WORKFLOW_TASK_POLLS."""
    # The SDK needs one poll for the task queue and one for the worker's sticky queue.
    return _count(env, WORKFLOW_TASK_POLLS_ENV, WORKFLOW_TASK_POLLS, at_least=2, what="a number of polls (at least 2)")


def workflow_task_slots(env: Mapping[str, str] = os.environ) -> int:
    """How many workflow tasks the worker works on at once: TGP_WORKFLOW_TASK_SLOTS, else
    WORKFLOW_TASK_SLOTS."""
    return _count(env, WORKFLOW_TASK_SLOTS_ENV, WORKFLOW_TASK_SLOTS, at_least=2, what="a number of workflow tasks (at least 2)")


def _count(env: Mapping[str, str], name: str, default: int, *, at_least: int, what: str) -> int:
    """A whole number from the environment variable `name`, `default` when unset; anything else
    (not a number, under `at_least`) is a ConfigError saying what it must be."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < at_least:
        raise ConfigError(f"{name}={raw!r} is not {what}")
    return int(raw)


# The SDK visits each activation's payloads once more for external storage, which tgp does not
# configure, at most this many at a time. At its default (3) each visit was an asyncio task, and
# an activation of the pool with a batch of signals queued them behind a semaphore whose every
# acquire walks its waiters (~1% of the worker's CPU in a burst of 500); at 1 the SDK visits them
# in place, one after another, and with nothing stored each visit is a call that returns.
EXTERNAL_STORAGE_VISITS = 1


def worker_options(**options: object) -> dict[str, object]:
    """The options `make_worker` gives the SDK's Worker beyond `options`: its workflow cache
    (`workflow_cache`), activity slots (`activity_slots`), workflow task polls
    (`workflow_task_polls`), workflow tasks at once (`workflow_task_slots`), workflow runner
    (`workflow_runner`: the sandbox unless turned off), external storage visits at once
    (EXTERNAL_STORAGE_VISITS) and, with TGP_WORKER_VERSIONING on, its
    build of the worker deployment (`workers.versioning.deployment_config`: every run pinned),
    each unless given."""
    if "deployment_config" not in options and (config := deployment_config()) is not None:
        options["deployment_config"] = config
    options.setdefault("max_cached_workflows", workflow_cache())
    options.setdefault("max_concurrent_activities", activity_slots())
    options.setdefault("workflow_task_poller_behavior", PollerBehaviorSimpleMaximum(maximum=workflow_task_polls()))
    options.setdefault("max_concurrent_workflow_tasks", workflow_task_slots())
    options.setdefault("workflow_runner", workflow_runner())
    options.setdefault("max_workflow_task_external_storage_concurrency", EXTERNAL_STORAGE_VISITS)
    return options


def make_worker(client: Client, activities: Activities, task_queue: str = DEFAULT_TASK_QUEUE, **options: object) -> Worker:
    """A Worker hosting every tgp workflow (or `workflows=`: a test's other build) and activity,
    with `worker_options`."""
    options = worker_options(**options)
    interceptors = [ActivityLogContext(), *options.pop("interceptors", [])]  # type: ignore[misc]
    workflows = options.pop("workflows", WORKFLOWS)
    return Worker(
        client, task_queue=task_queue, workflows=workflows, activities=activities.all(), interceptors=interceptors, **options  # type: ignore[arg-type]
    )
