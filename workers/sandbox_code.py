"""One copy of the workflow modules' bytecode for all the sandbox's runs.

Temporal's sandbox imports a workflow's module again for every workflow run: each run gets
globals of its own (that is its isolation), and each import read and unmarshalled the module's
bytecode again: ~70 KB of code objects for `workflows/node.py`, kept by each cached run (300 in
a worker with the default cache), and the CPU to load them at each run's first task. Code
objects are immutable, so the runs can share one: `share_workflow_code` puts a finder in front
of the import system that gives the `workflows` package's modules a loader which keeps the code
it compiled. Each run still executes the module body into a module of its own, inside the
sandbox and under its restrictions; only the immutable code is shared.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import CodeType, ModuleType
from typing import Any

from temporalio.worker import WorkflowInstance, WorkflowInstanceDetails
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.worker.workflow_sandbox._runner import _Instance as _SandboxInstance  # private: SDK pinned

# The packages whose modules the sandbox imports for each run (the rest are passed through).
WORKFLOW_PACKAGES = ("workflows",)


class SharedCodeLoader(importlib.machinery.SourceFileLoader):
    """A source loader that compiles (or unmarshals) each file once per content."""

    # (path, mtime, size) -> code: a changed file is read again, as the import system would.
    codes: dict[tuple[str, int, int], CodeType] = {}

    def get_code(self, fullname: str) -> CodeType:
        st = os.stat(self.path)
        key = (self.path, st.st_mtime_ns, st.st_size)
        code = self.codes.get(key)
        if code is None:
            code = super().get_code(fullname)
            assert code is not None  # a source file always has code
            self.codes[key] = code
        return code


class SharedCodeFinder(importlib.abc.MetaPathFinder):
    """Finds the given packages' source modules as the path finder does, with SharedCodeLoader."""

    def __init__(self, packages: Sequence[str]) -> None:
        self.packages = frozenset(packages)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in self.packages:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = spec.loader if spec is not None else None
        if spec is None or type(loader) is not importlib.machinery.SourceFileLoader:
            return spec  # not a plain source file (a namespace package, a zip): as found
        spec.loader = SharedCodeLoader(loader.name, loader.path)
        return spec


def share_workflow_code(packages: Sequence[str] = WORKFLOW_PACKAGES) -> SharedCodeFinder:
    """Install a finder for `packages` once, before the path finder; returns the one installed."""
    wanted = frozenset(packages)
    for finder in sys.meta_path:
        if isinstance(finder, SharedCodeFinder) and wanted <= finder.packages:
            return finder
    finder = SharedCodeFinder(packages)
    sys.meta_path.insert(0, finder)
    return finder


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
    """Temporal's sandbox with the cheaper hops of `_Run`; restrictions and isolation as the SDK's."""

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
