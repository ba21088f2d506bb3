"""The worker process: hosts tgp's workflows and activities on one task queue.

Scale out by running more replicas on the same queue. The worker's own adapters are built from
the environment (a Kubernetes Secret in production); a class's own credentials
(`credentialsRef`, `oauthSecretRef`) are read from its Secrets by the activities
(activities/accounts.py). Secrets stay inside the activities, never in workflow inputs.
"""

from __future__ import annotations

import os
from datetime import timedelta
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
)
from temporalio.worker import Worker

from activities.kube.cluster import KubernetesCluster
from activities.entity import EntityActivities
from activities.node_class import NodeClassActivities
from activities.pool import PoolActivities
from activities.node import NodeActivities
from activities.sweeper import SweeperActivities
from activities.ports import CloudProvider
from activities.accounts import ProviderRegistry, TailnetRegistry
from activities.clouds.registry import API_KEY_ENV, providers_from_env
from activities.tailnets.headscale import HeadscaleTailnet
from activities.ports import Tailnet
from activities.tailnets.tailscale import TailscaleTailnet
from tgp.errors import ConfigError
from workers.interceptors import ActivityLogContext
from tgp.types import DEFAULT_TASK_QUEUE
from workflows.node import GPUNodeWorkflow
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow
from workflows.sweeper import SWEEP_EVERY, SweeperWorkflow, SweepRequest

log = structlog.get_logger("tgp.worker")

WORKFLOWS = [GPUNodeWorkflow, GPUNodePoolWorkflow, GPUNodeClassWorkflow, SweeperWorkflow]
SWEEPER_SCHEDULE_ID = "tgp-sweeper"


@dataclass
class Activities:
    """Every activity of a worker, bound to its adapters."""

    node: NodeActivities
    pool: PoolActivities
    node_class: NodeClassActivities
    entity: EntityActivities
    sweeper: SweeperActivities

    def all(self) -> list[object]:
        return [*self.node.all(), *self.pool.all(), *self.node_class.all(), *self.entity.all(), *self.sweeper.all()]


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
    # Likewise the tailnets of classes with their own tailscaleConfig.oauthSecretRef.
    tailnet_env = {**config.env, "TGP_TAILSCALE_API_URL": config.tailscale_api_url}
    tailnet_registry = TailnetRegistry(cluster=cluster, env=tailnet_env, fallback=tailnets)
    stack.push_async_callback(tailnet_registry.aclose)
    return Activities(
        node=NodeActivities(
            providers=providers, tailnets=tailnets, cluster=cluster, registry=registry, tailnet_registry=tailnet_registry
        ),
        pool=PoolActivities(cluster=cluster, providers=providers, registry=registry),
        node_class=NodeClassActivities(cluster=cluster, providers=providers, registry=registry, tailnets=sorted(tailnets)),
        entity=EntityActivities(cluster=cluster),
        sweeper=SweeperActivities(providers=providers, tailnets=tailnets, cluster=cluster),
    )


async def ensure_sweeper_schedule(client: Client, task_queue: str, every: timedelta = SWEEP_EVERY) -> None:
    """Create the sweeper's Schedule unless it exists (every worker calls this at start)."""
    schedule = Schedule(
        action=ScheduleActionStartWorkflow(SweeperWorkflow.run, SweepRequest(), id=SWEEPER_SCHEDULE_ID, task_queue=task_queue),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=every)]),
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )
    try:
        await client.create_schedule(SWEEPER_SCHEDULE_ID, schedule)
    except ScheduleAlreadyRunningError:
        pass


def make_worker(client: Client, activities: Activities, task_queue: str = DEFAULT_TASK_QUEUE, **options: object) -> Worker:
    """A Worker hosting every tgp workflow and activity."""
    interceptors = [ActivityLogContext(), *options.pop("interceptors", [])]  # type: ignore[misc]
    return Worker(
        client, task_queue=task_queue, workflows=WORKFLOWS, activities=activities.all(), interceptors=interceptors, **options  # type: ignore[arg-type]
    )
