"""Temporal's sandbox, as tgp's worker runs it: tgp's workflow code passed through, and cheaper
hops into each run.

The sandbox imports a workflow's module again for every new run, so that each run has globals of
its own, and fails a run whose module calls a restricted function (the clock, randomness, files).
tgp's node workflow module took ~4.4 ms of the worker's CPU to import again for each node (its
handlers' signatures and type hints read again by the SDK's decorators), a tenth of the worker's
CPU in a burst, though its stages, all of tgp/ and every model were already passed through (the
sandbox never checked their calls). So the `workflows` package is passed through too (Temporal's
documented lever, `SandboxRestrictions.with_passthrough_modules`): a run imports nothing again.
What the sandbox checked in those modules is checked before they ship instead, in every module
a workflow runs (workflows/ and tgp/), against the sandbox's own list of restricted calls
(tests/test_workflow_determinism.py); the recorded histories replay through this runner in CI
(tests/test_replay.py), and at run time the sandbox still refuses the restricted builtins
(`open`, `input`) and restricted imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import CodeType
from typing import Any

from temporalio.worker import WorkflowInstance, WorkflowInstanceDetails
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions
from temporalio.worker.workflow_sandbox._runner import _Instance as _SandboxInstance  # private: SDK pinned

# tgp's workflow packages: imported once per process, never again for a run.
WORKFLOW_PACKAGES = ("workflows",)
RESTRICTIONS = SandboxRestrictions.default.with_passthrough_modules(*WORKFLOW_PACKAGES)


# --- the sandbox's hops ------------------------------------------------------------------------
# Temporal's sandbox (SDK 1.35, pinned in pyproject.toml) enters a run's sandbox by compiling and
# executing a small source string: for each activation, and for each payload it encodes or
# decodes, twice (the payload's serialization context and its external-store context), each time
# under the sandbox's import hook. Measured here: ~40 us per hop (15 us of them compiling the same
# string again) against under 1 us for the call itself; a node's workflow task makes tens of them,
# and in a burst or a mass idle they were a fifth to a third of the worker's busy time
# (bench/results/findings.md, session 10).

# At most this many distinct strings are kept compiled (the SDK uses a handful, one per workflow
# class for a run's start); past it a string is compiled each time, as the SDK does.
MAX_COMPILED = 64
_compiled: dict[str, CodeType] = {}


def compiled(source: str) -> CodeType:
    """`source` compiled as `exec` compiles a string (file "<string>"), once."""
    code = _compiled.get(source)
    if code is None:
        code = compile(source, "<string>", "exec")
        if len(_compiled) < MAX_COMPILED:
            _compiled[source] = code
    return code


class _Run(_SandboxInstance):
    """One run in the sandbox, entered more cheaply: the source strings the SDK executes are
    compiled once, and the two context look-ups call the run's in-sandbox object directly. Those
    only read the run's state (its info, its pending activities) and import nothing, so the
    sandbox's import hook, which they were wrapped in, has nothing to guard (the SDK's own path
    and this one answer alike: tests/test_sandbox_code.py)."""

    def _run_code(self, code: str | CodeType, **extra_globals: Any) -> None:
        super()._run_code(compiled(code) if isinstance(code, str) else code, **extra_globals)  # type: ignore[arg-type]

    def get_serialization_context(self, command_info: Any) -> Any:
        return self._ask("get_serialization_context", command_info)

    def get_external_store_context(self, command_info: Any) -> Any:
        return self._ask("get_external_store_context", command_info)

    def _ask(self, method: str, command_info: Any) -> Any:
        """The run's in-sandbox object's `method`, called at runtime as the SDK's hop calls it."""
        self.importer.restriction_context.is_runtime = True
        try:
            return getattr(self.globals_and_locals["__temporal_in_sandbox"], method)(command_info)
        finally:
            self.importer.restriction_context.is_runtime = False


@dataclass(frozen=True)
class SandboxRunner(SandboxedWorkflowRunner):
    """Temporal's sandbox with tgp's workflow packages passed through (RESTRICTIONS) and the
    cheaper hops of `_Run`."""

    restrictions: SandboxRestrictions = field(default=RESTRICTIONS)

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        return _Run(det, self.runner_class, self.restrictions)

    def prepare_workflow(self, defn: Any) -> None:
        """Validate a workflow definition in the sandbox once per process: the SDK creates a
        run of it (its module imported afresh, ~40 ms of CPU) for every Worker it is given to.
        A definition (its class) validated under the same restrictions and runner validates
        the same again, so a process that makes several workers (each test; `tgp dev` and the
        demo after a restart of their worker) pays it once. A failed validation is not kept."""
        key = (defn.cls, id(self.restrictions), self.runner_class)
        if key not in _VALIDATED:
            super().prepare_workflow(defn)
            _VALIDATED.add(key)


# The (workflow class, restrictions, runner class) whose validation passed in this process.
_VALIDATED: set[tuple[type, int, type]] = set()
