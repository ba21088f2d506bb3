"""Worker Versioning: which build a worker is, whether it serves as a version of tgp's worker
deployment, and what the server says about each build (current, draining, drained).

A versioned worker polls as build `build_id()` of deployment `tgp`. Every run is pinned to the
build that started it and continues as new onto the deployment's current build at its safe
points (SAFE_POINTS), so an old build's workers stop once the server says it is drained
(`tgp rollout status`). Off unless TGP_WORKER_VERSIONING says on: the demo, the tests and an
installation that upgrades by Recreate run unversioned, exactly as before. The operator's
guide: docs/workflow-versioning.md.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import structlog
from temporalio.api.deployment.v1 import WorkerDeploymentVersion as VersionProto
from temporalio.api.enums.v1 import VersionDrainageStatus, WorkerDeploymentVersionStatus
from temporalio.api.workflowservice.v1 import (
    DescribeWorkerDeploymentRequest,
    DescribeWorkerDeploymentVersionRequest,
)
from temporalio.client import Client
from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import WorkerDeploymentConfig

from activities.visibility import RUNNING_NODES
from tgp.errors import ConfigError
from tgp.types import MAX_LAUNCH_ATTEMPTS, LifecycleTimeouts

log = structlog.get_logger("tgp.versioning")

# One deployment per Temporal namespace: an installation of tgp has a namespace of its own
# (docs/install.md), and every build of it is a version of this deployment.
DEPLOYMENT_NAME = "tgp"
VERSIONING_ENV = "TGP_WORKER_VERSIONING"
BUILD_ID_ENV = "TGP_BUILD_ID"
# The packages whose code decides a workflow's commands: a change in them is a new build.
# The code that decides a workflow's commands: the workflows, the pure decisions, and the
# activities' modules the workflows import (their inputs, timeouts and search attributes).
WORKFLOW_SOURCE_PACKAGES = ("workflows", "tgp", "activities")

# Every tgp workflow type is pinned: a run never changes code in the middle of a segment, where
# a different command would fail its replay; it moves to the current build only at a
# continue-as-new it chooses at a safe point, with nothing in flight but its carried state.
# So a release needs no `workflow.patched`. The worker's deployment default carries it (one
# behaviour for all): `@workflow.defn(versioning_behavior=...)` would fail every workflow task
# of an unversioned worker ("versioning behavior cannot be specified without deployment options").
VERSIONING_BEHAVIORS: dict[str, VersioningBehavior] = {
    "GPUNodeWorkflow": VersioningBehavior.PINNED,
    "GPUNodePoolWorkflow": VersioningBehavior.PINNED,
    "GPUNodeClassWorkflow": VersioningBehavior.PINNED,
    "FleetLookWorkflow": VersioningBehavior.PINNED,
    "SweeperWorkflow": VersioningBehavior.PINNED,
}
# Where each type's run moves to the current build (docs/workflow-versioning.md).
SAFE_POINTS: dict[str, str] = {
    "GPUNodeWorkflow": "a Ready node at each wake of its watch, at the latest its backstop look (watch_interval); "
    "a node in bring-up when it reaches its watch; a draining node never: it ends",
    "GPUNodePoolWorkflow": "at its next pass (within its resync interval, a minute)",
    "GPUNodeClassWorkflow": "at its next pass (within its resync interval, a minute)",
    "FleetLookWorkflow": "after its next look (within a minute)",
    "SweeperWorkflow": "never: a sweep ends within minutes and the next starts on the current build",
}


def deployment_behavior() -> VersioningBehavior:
    """The one behaviour of VERSIONING_BEHAVIORS, the worker's deployment default."""
    (behavior,) = set(VERSIONING_BEHAVIORS.values())
    return behavior


def versioning_on(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the worker serves as a version of the deployment: TGP_WORKER_VERSIONING on/off
    (unset: off)."""
    raw = env.get(VERSIONING_ENV, "").strip().lower()
    if raw in ("", "off", "false", "0"):
        return False
    if raw in ("on", "true", "1"):
        return True
    raise ConfigError(f"{VERSIONING_ENV}={raw!r} is neither on nor off")


def package_version() -> str:
    try:
        return version("tgp")
    except PackageNotFoundError:
        return "0"


def source_hash(packages: tuple[str, ...] = WORKFLOW_SOURCE_PACKAGES) -> str:
    """A short hash of the Python source of `packages` as installed (or in the tree): the same
    for the image and for the checkout it was built from."""
    digest = hashlib.sha256()
    for package in packages:
        root = Path(importlib.import_module(package).__file__ or "").parent
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            digest.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode())
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()[:10]


def build_id(env: Mapping[str, str] = os.environ) -> str:
    """This worker's build: TGP_BUILD_ID, else the package version and a hash of the workflow
    source (`0.2.0-1a2b3c4d5e`)."""
    given = env.get(BUILD_ID_ENV, "").strip()
    if given:
        if not all(c.isalnum() or c in "-._" for c in given) or len(given) > 63:
            raise ConfigError(f"{BUILD_ID_ENV}={given!r}: use at most 63 letters, digits, '-', '.' or '_' (it names a Deployment)")
        return given
    return f"{package_version()}-{source_hash()}"


def deployment_version(env: Mapping[str, str] = os.environ) -> WorkerDeploymentVersion:
    return WorkerDeploymentVersion(deployment_name=DEPLOYMENT_NAME, build_id=build_id(env))


def deployment_config(env: Mapping[str, str] = os.environ) -> WorkerDeploymentConfig | None:
    """The worker's deployment options when versioning is on (None: an unversioned worker)."""
    if not versioning_on(env):
        return None
    return WorkerDeploymentConfig(
        version=deployment_version(env), use_worker_versioning=True, default_versioning_behavior=deployment_behavior()
    )


# --- how long an old build must stay ------------------------------------------------------


def bring_up_bound(timeouts: LifecycleTimeouts | None = None, attempts: int = MAX_LAUNCH_ATTEMPTS) -> timedelta:
    """The longest a node's bring-up lasts before it reaches its watch (or ends): every launch
    attempt using its whole budgets: the launch, then the join's (launch + tailnet, from the
    launch's end), Node Ready and GPUs."""
    t = timeouts or LifecycleTimeouts()
    return attempts * (2 * t.launch + t.tailnet_join + t.node_ready + t.gpu_registration)


def drain_bound(timeouts: LifecycleTimeouts | None = None, attempts: int = MAX_LAUNCH_ATTEMPTS) -> timedelta:
    """How long an old build's node runs may still run on it once another build is current,
    with these settings (the defaults: 3 x 45m = 2h15m): a Ready node moves at its backstop
    look at the latest, a node in bring-up when it reaches its watch. A draining node does not
    move: it ends (its drain, then its release, bounded by the drain and termination budgets)."""
    t = timeouts or LifecycleTimeouts()
    return max(t.watch_interval, bring_up_bound(t, attempts))


def human(d: timedelta) -> str:
    minutes = int(d.total_seconds() // 60)
    if minutes < 1:
        return f"{int(d.total_seconds())}s"
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"


# --- what the server and the listing say --------------------------------------------------

_DRAINAGE = {
    VersionDrainageStatus.VERSION_DRAINAGE_STATUS_DRAINING: "draining",
    VersionDrainageStatus.VERSION_DRAINAGE_STATUS_DRAINED: "drained",
}
_STATUS = {
    WorkerDeploymentVersionStatus.WORKER_DEPLOYMENT_VERSION_STATUS_INACTIVE: "inactive",
    WorkerDeploymentVersionStatus.WORKER_DEPLOYMENT_VERSION_STATUS_CURRENT: "current",
    WorkerDeploymentVersionStatus.WORKER_DEPLOYMENT_VERSION_STATUS_RAMPING: "ramping",
    WorkerDeploymentVersionStatus.WORKER_DEPLOYMENT_VERSION_STATUS_DRAINING: "draining",
    WorkerDeploymentVersionStatus.WORKER_DEPLOYMENT_VERSION_STATUS_DRAINED: "drained",
}
# The system search attribute of the build a pinned run runs on: `tgp:<build>`.
VERSION_ATTRIBUTE = "TemporalWorkerDeploymentVersion"


@dataclass
class Build:
    """A build of the deployment as the server describes it."""

    build_id: str
    status: str  # current, ramping, draining, drained, inactive
    drainage: str = ""  # draining, drained or "" (not asked yet: current, ramping or never current)
    deactivated_at: datetime | None = None  # when it stopped being current or ramping
    task_queues: list[str] = field(default_factory=list)


def _time(ts: object) -> datetime | None:
    seconds = getattr(ts, "seconds", 0)
    return ts.ToDatetime().replace(tzinfo=UTC) if seconds else None  # type: ignore[attr-defined]


async def builds(client: Client) -> list[Build] | None:
    """Every build of the deployment, newest first (None: no versioned worker ever polled)."""
    try:
        info = (
            await client.workflow_service.describe_worker_deployment(
                DescribeWorkerDeploymentRequest(namespace=client.namespace, deployment_name=DEPLOYMENT_NAME)
            )
        ).worker_deployment_info
    except RPCError as exc:
        if exc.status is RPCStatusCode.NOT_FOUND:
            return None
        raise
    found = [
        Build(
            build_id=s.deployment_version.build_id,
            status=_STATUS.get(s.status, "unknown"),
            drainage=_DRAINAGE.get(s.drainage_info.status, ""),
            deactivated_at=_time(s.last_deactivation_time),
        )
        for s in info.version_summaries
    ]
    current = info.routing_config.current_deployment_version.build_id
    for b in found:  # older servers leave the summary's status unset
        if b.status == "unknown" and b.build_id == current:
            b.status = "current"
    return sorted(found, key=lambda b: (b.status != "current", b.build_id), reverse=False)


async def describe_build(client: Client, build: str) -> Build | None:
    """One build as the server describes it (None: no worker of it ever polled)."""
    try:
        info = (
            await client.workflow_service.describe_worker_deployment_version(
                DescribeWorkerDeploymentVersionRequest(
                    namespace=client.namespace, deployment_version=VersionProto(deployment_name=DEPLOYMENT_NAME, build_id=build)
                )
            )
        ).worker_deployment_version_info
    except RPCError as exc:
        if exc.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT):
            return None
        raise
    return Build(
        build_id=build,
        status=_STATUS.get(info.status, "unknown"),
        drainage=_DRAINAGE.get(info.drainage_info.status, ""),
        deactivated_at=_time(info.last_deactivation_time),
        task_queues=sorted({q.name for q in info.task_queue_infos}),
    )


async def current_build(client: Client) -> str | None:
    """The deployment's current build (None: unversioned, or none made current yet)."""
    found = await builds(client)
    return next((b.build_id for b in found or [] if b.status == "current"), None)


@dataclass
class Runs:
    """The running tgp workflows of one build, from the visibility listing."""

    by_type: Counter[str] = field(default_factory=Counter)
    node_phases: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_type.values())


async def runs_by_build(client: Client, build: str | None = None) -> dict[str, Runs]:
    """Running tgp workflows by the build they are pinned to ("" for unversioned runs are not
    listed): from the system search attribute TemporalWorkerDeploymentVersion."""
    query = f"TemporalWorkerDeployment = '{DEPLOYMENT_NAME}' AND ExecutionStatus = 'Running'"
    if build is not None:
        query += f" AND {VERSION_ATTRIBUTE} = '{DEPLOYMENT_NAME}:{_quoted(build)}'"
    out: dict[str, Runs] = {}
    async for wf in client.list_workflows(query):
        of = build_of(wf.search_attributes)
        if not of:
            continue
        runs = out.setdefault(of, Runs())
        runs.by_type[wf.workflow_type] += 1
        if wf.workflow_type == "GPUNodeWorkflow":
            runs.node_phases[str((wf.search_attributes.get("TgpPhase") or ["?"])[0])] += 1
    return out


async def node_builds(client: Client) -> dict[str, str]:
    """The build of each running node workflow, by workflow id (none when unversioned)."""
    query = f"{RUNNING_NODES} AND TemporalWorkerDeployment = '{DEPLOYMENT_NAME}'"
    try:
        return {wf.id: of async for wf in client.list_workflows(query) if (of := build_of(wf.search_attributes))}
    except RPCError as exc:
        if exc.status is not RPCStatusCode.INVALID_ARGUMENT:
            raise
        return {}  # a server without Worker Versioning's search attribute: nothing is versioned


def build_of(attributes: Mapping[str, object]) -> str:
    """The build in a listing's search attributes (`tgp:<build>`), or ""."""
    values = attributes.get(VERSION_ATTRIBUTE) or []
    value = str(values[0]) if isinstance(values, list) and values else ""
    prefix = f"{DEPLOYMENT_NAME}:"
    return value[len(prefix) :] if value.startswith(prefix) else ""


def _quoted(build: str) -> str:
    if not all(c.isalnum() or c in "-._" for c in build):
        raise ConfigError(f"{build!r} is not a build id (letters, digits, '-', '.', '_')")
    return build
