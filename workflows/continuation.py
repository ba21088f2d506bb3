"""Continue-as-new, the one way every tgp workflow ends a run and goes on: at a safe point (the
run's whole state in its input), when the history grew long or when the worker deployment's
current build changed. Runs are pinned to their build (Worker Versioning, workers/versioning.py);
the next run starts on the current build (AUTO_UPGRADE), so an old build drains within one
segment of each workflow (docs/workflow-versioning.md)."""

from __future__ import annotations

from typing import Any, NoReturn

from temporalio import workflow


def continue_as_new_due(history_limit: int) -> bool:
    """A new build is current, Temporal suggests continuing, or this run passed `history_limit` events."""
    info = workflow.info()
    return info.is_target_worker_deployment_version_changed() or info.is_continue_as_new_suggested() or info.get_current_history_length() > history_limit


def continue_as_new(arg: Any) -> NoReturn:
    """Continue as new with `arg`, the new run on the deployment's current build."""
    workflow.continue_as_new(arg, initial_versioning_behavior=workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE)
