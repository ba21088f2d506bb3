"""The operator's verbs of a rainbow rollout (Worker Versioning, workers/versioning.py): which
builds run and whether an old one may stop (`tgp rollout status`), making a build current
(`tgp rollout promote`), a new installation's first build current by itself, and `tgp status`'s
line on builds. docs/workflow-versioning.md is the guide."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio.api.workflowservice.v1 import SetWorkerDeploymentCurrentVersionRequest
from temporalio.client import Client
from temporalio.service import RPCError

from tgp.errors import ConfigError
from tgp.types import MAX_LAUNCH_ATTEMPTS, LifecycleTimeouts
from workers.versioning import (
    DEPLOYMENT_NAME,
    SAFE_POINTS,
    VERSIONING_ENV,
    Build,
    Runs,
    _quoted,
    bring_up_bound,
    builds,
    current_build,
    describe_build,
    drain_bound,
    human,
    log,
    runs_by_build,
)

# --- the operator's verbs -------------------------------------------------------------------


def _runs_line(runs: Runs) -> str:
    parts = []
    for kind, n in sorted(runs.by_type.items()):
        if kind == "GPUNodeWorkflow" and runs.node_phases:
            phases = ", ".join(f"{count} {phase}" for phase, count in sorted(runs.node_phases.items()))
            parts.append(f"{n} node(s) ({phases})")
        else:
            parts.append(f"{n} {kind}")
    return "; ".join(parts)


def _bound_line(build: Build, runs: Runs) -> str:
    bound = drain_bound()
    where = (
        f"next safe point within {human(bound)} with the default settings (a Ready node's backstop look, "
        f"{human(LifecycleTimeouts().watch_interval)}; a node in bring-up reaches its watch within "
        f"{MAX_LAUNCH_ATTEMPTS} x {human(bring_up_bound(attempts=1))}; a draining node ends)"
    )
    if build.deactivated_at is not None:
        where += f", so by {(build.deactivated_at + bound):%Y-%m-%d %H:%M}Z"
    entities = sorted(k for k in runs.by_type if k != "GPUNodeWorkflow")
    if entities:
        where += "; " + "; ".join(f"{k} {SAFE_POINTS.get(k, 'at its next continue-as-new')}" for k in entities)
    return where


async def rollout_status(client: Client, build: str | None = None) -> tuple[str, bool]:
    """What the server says of each build (or of `build`): current, or draining with how many
    runs are still pinned to it and when they reach a safe point, or drained: its workers may
    stop. The flag: `build` is drained (always True without `build`)."""
    if build is not None:
        found = await describe_build(client, _quoted(build))
        if found is None:
            raise ConfigError(f"build {build!r} is not a version of worker deployment {DEPLOYMENT_NAME!r} (`tgp rollout status` lists them)")
        listed = [found]
    else:
        listed = await builds(client) or []
        if not listed:
            return (f"No versioned worker has polled worker deployment {DEPLOYMENT_NAME!r}: workers run unversioned "
                    f"({VERSIONING_ENV} is off; docs/workflow-versioning.md)."), True
    running = await runs_by_build(client, build)
    lines, drained = [], True
    for b in listed:
        runs = running.get(b.build_id, Runs())
        if b.status in ("current", "ramping"):
            lines.append(f"build {b.build_id}: {b.status}" + (f": {_runs_line(runs)}" if runs.total else ""))
            drained = False
        elif b.drainage == "drained" and not runs.total:
            lines.append(f"build {b.build_id}: drained: its workers may stop")
        elif b.drainage == "draining" or runs.total:
            lines.append(f"build {b.build_id}: draining: {runs.total} run(s) still pinned to it ({_runs_line(runs) or 'the listing catches up'}); {_bound_line(b, runs)}")
            drained = False
        else:
            # Never current: nothing was pinned to it, but it may yet be made current.
            lines.append(f"build {b.build_id}: {b.status}: never current, no runs pinned to it; its workers may stop unless you promote it")
    return "\n".join(lines), drained


async def promote(client: Client, build: str) -> str:
    """Make `build` the deployment's current build: new runs start on it and pinned runs of the
    others move to it at their next safe point. Refused for a build whose workers have not
    polled (or, by the server, one missing a task queue the current build polls)."""
    found = await describe_build(client, _quoted(build))
    if found is None or not found.task_queues:
        raise ConfigError(
            f"no worker of build {build!r} has polled yet: start its Deployment first (docs/workflow-versioning.md)"
        )
    before = await current_build(client)
    if before == build:
        return f"build {build} is already current"
    await _set_current(client, build)
    moved = f"; runs on {before} move at their next safe point (within {human(drain_bound())}): `tgp rollout status --build {before}` says when its workers may stop" if before else ""
    return f"build {build} is current: new runs start on it{moved}"


async def _set_current(client: Client, build: str) -> None:
    await client.workflow_service.set_worker_deployment_current_version(
        SetWorkerDeploymentCurrentVersionRequest(
            namespace=client.namespace, deployment_name=DEPLOYMENT_NAME, build_id=build, identity=client.identity
        )
    )


async def become_current_if_first(client: Client, build: str, *, within: timedelta = timedelta(minutes=2)) -> bool:
    """Make `build` current when the deployment has no current build yet (a new installation's
    first versioned worker), once the server knows it (its first poll). A later build is never
    made current by its workers: `tgp rollout promote` does that. True if it did."""
    deadline = asyncio.get_running_loop().time() + within.total_seconds()
    while True:
        try:
            if await current_build(client) is not None:
                return False
            if await describe_build(client, build) is not None:
                await _set_current(client, build)
                log.info("first_build_current", build=build, deployment=DEPLOYMENT_NAME)
                return True
        except RPCError as exc:
            if asyncio.get_running_loop().time() > deadline:
                log.warning("first_build_not_made_current", build=build, error=str(exc), hint=f"tgp rollout promote {build}")
                return False
        if asyncio.get_running_loop().time() > deadline:
            log.warning("first_build_not_made_current", build=build, hint=f"tgp rollout promote {build}")
            return False
        await asyncio.sleep(1)


async def builds_line(client: Client) -> str:
    """`tgp status`'s last line: the current build and the runs (of every type) still on older ones."""
    current = await current_build(client)
    running = await runs_by_build(client)
    older = {b: r.total for b, r in sorted(running.items()) if b != current}
    line = f"build {current or '(none current)'}: {running[current].total if current in running else 0} run(s)"
    if older:
        names = ", ".join(sorted(older))
        line += f"; {sum(older.values())} run(s) still on an older build ({names}): `tgp rollout status` says when they move"
    return line
