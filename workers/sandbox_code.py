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
from types import CodeType, ModuleType

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
