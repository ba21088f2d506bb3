"""The pool workflow (GPUNodePoolWorkflow), one per GPUNodePool: `workflow` is its spine, the
other modules its parts (reports, starts, replacement, disruption, settings, publish) and its
carried state (`state`). Its decisions are pure functions in tgp/ (pool_plan, pool_disruption)."""

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    # Passed through, as every part imports tgp: the sandbox must not make a second copy.
    from tgp.pool_plan import settings_fingerprint as _fingerprint
    # The carried state's pydantic models: built once per process, not again for each run the
    # sandbox imports this package for (~0.1 s of CPU each: a run, a worker's validation).
    from workflows.pool.state import RESYNC_INTERVAL, PoolInput, PoolState
from workflows.pool.workflow import GPUNodePoolWorkflow

__all__ = ["RESYNC_INTERVAL", "GPUNodePoolWorkflow", "PoolInput", "PoolState", "_fingerprint"]
