"""No module a workflow runs calls what Temporal's sandbox refuses: the clock, randomness, the
environment, files, threads.

The worker passes tgp's workflow packages through the sandbox (workers/sandbox_code.py), as it
passes tgp/ and the stages and models they use: a run imports none of them again, and so the
sandbox does not see their calls. This test reads those calls instead, in every module under
workflows/ and tgp/ and in what of activities/ a workflow runs (its search attributes' helpers,
the models it builds), against the sandbox's own list of restricted members
(`SandboxRestrictions.default.invalid_module_members`, as at run time): a workflow that read the
clock would replay differently, and this fails before it ships.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from pathlib import Path

import pydantic
import pytest
from temporalio.worker.workflow_sandbox import SandboxRestrictions
from temporalio.worker.workflow_sandbox._restrictions import RestrictionContext

import activities

ROOT = Path(__file__).resolve().parent.parent
# What a workflow runs: its own packages and the vocabulary and decisions of tgp/, and of
# activities/ (which runs outside workflows) its search attributes' helpers and the models a
# workflow builds, whose validators and methods run in the workflow.
WORKFLOW_CODE = ("workflows", "tgp")
WORKFLOW_HELPERS = ("activities/search_attributes.py",)
BUILTINS = "__builtins__"


def _context(runtime: bool) -> RestrictionContext:
    """A call in a function runs with the workflow (the sandbox's run time); one at a module's top
    level runs once, when the worker imports the module (some members, `threading`'s, are refused
    only at run time)."""
    context = RestrictionContext()
    context.is_runtime = runtime
    return context


def _imported_names(tree: ast.AST) -> dict[str, tuple[str, ...]]:
    """Each name a module binds by import, to the dotted path it stands for."""
    names: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = tuple(a.name.split("."))
                else:
                    root = a.name.split(".")[0]
                    names[root] = (root,)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = (*node.module.split("."), a.name)
    return names


def _runtime_nodes(tree: ast.AST) -> set[int]:
    """The nodes inside a function's or a lambda's body: what runs with the workflow. Defaults and
    decorators are evaluated where the function is defined (at import, for a module's)."""
    inside: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for stmt in fn.body:
                inside |= {id(n) for n in ast.walk(stmt)}
        elif isinstance(fn, ast.Lambda):
            inside |= {id(n) for n in ast.walk(fn.body)}
    return inside


def _dotted(expr: ast.expr) -> tuple[str, ...] | None:
    """`a.b.c` as ("a", "b", "c"); None for anything that is not names and attributes."""
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return (expr.id, *reversed(parts))


def restricted_uses(source: str, names: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """Every use in `source` of what the sandbox would refuse (a call, or a reference that can be
    called or read later: `time.monotonic`, `os.environ[...]`, `open`), as "line: dotted.path".
    `names`: what the module binds by import, for a `source` that is a part of it (a class)."""
    tree = ast.parse(source)
    names = {**(names or {}), **_imported_names(tree)}
    runtime = _runtime_nodes(tree)
    members = SandboxRestrictions.default.invalid_module_members
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute | ast.Name) or not isinstance(node.ctx, ast.Load):
            continue
        chain = _dotted(node)
        if chain is None:
            continue
        if chain[0] in names:
            path = (*names[chain[0]], *chain[1:])
        elif len(chain) == 1:
            path = (BUILTINS, chain[0])
        else:
            continue  # a local object's attribute
        if len(path) > 1 and members.match_access(_context(id(node) in runtime), *path, include_use=True):
            found.add((node.lineno, ".".join(path)))
    return [f"{line}: {path}" for line, path in sorted(found)]


def global_statements(source: str) -> list[str]:
    """Every `global` statement: module state that runs share, now that tgp's workflow modules are
    imported once per worker, not once per run."""
    return [f"{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Global)]


@pytest.mark.parametrize(
    "source, refused",
    [
        ("from datetime import datetime\ndef f():\n    return datetime.now()", True),
        ("import datetime\nx = datetime.datetime.utcnow()", True),
        ("import time\ndef f():\n    return time.monotonic()", True),
        ("import random\nrandom.shuffle([])", True),
        ("import uuid\ndef f():\n    return uuid.uuid4()", True),
        ("import os\ndef f():\n    return os.environ.get('X')", True),
        ("from os import getenv as env\nf = lambda: env('X')", True),
        ("def f():\n    return open('x')", True),
        ("import threading\ndef f():\n    threading.Lock()", True),
        ("from datetime import datetime\nSTARTED = datetime.now()  # at import: refused there too", True),
        ("from datetime import timedelta, datetime\ntimedelta(1)\ndatetime.fromisoformat('2026-01-01')", False),
        ("import time\nclock = time.monotonic  # a reference at import, called by an activity's caller", False),
        ("import hashlib, json\nhashlib.sha256(json.dumps({}).encode())", False),
        ("from temporalio import workflow\nworkflow.now()\nworkflow.uuid4()", False),
        ("import threading\n_lock = threading.RLock()  # once, at import", False),
        ("import time\ndef f(clock=time.monotonic):  # a default, evaluated at import\n    return clock", False),
        ("import time\ndef f():\n    clock = time.monotonic\n    return clock()", True),
        ("import os\ndef f():\n    return 'X' in os.environ", True),
        ("from time import monotonic\ndef f():\n    return monotonic", True),
        ("def f():\n    return open", True),
    ],
)
def test_the_reading_tells_what_the_sandbox_refuses(source: str, refused: bool) -> None:
    assert bool(restricted_uses(source)) is refused, restricted_uses(source)


def test_no_module_a_workflow_runs_calls_what_the_sandbox_refuses() -> None:
    found = []
    for package in WORKFLOW_CODE:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{hit}" for hit in restricted_uses(path.read_text())]
    assert not found, (
        "workflow code must not read the clock, draw random numbers, read the environment or do I/O "
        "(use workflow.now(), workflow.random(), workflow.uuid4(), or an activity):\n" + "\n".join(found)
    )


def test_no_workflow_module_keeps_state_with_global() -> None:
    found = []
    for path in sorted((ROOT / "workflows").rglob("*.py")):
        found += [f"{path.relative_to(ROOT)}:{hit}" for hit in global_statements(path.read_text())]
    assert not found, "a workflow module's globals are shared by every run on the worker: keep state on the run\n" + "\n".join(found)


def _activity_models() -> list[tuple[str, str, dict[str, tuple[str, ...]]]]:
    """Each pydantic model defined in activities/: (where, its source, its module's imports)."""
    found = []
    for info in pkgutil.walk_packages(activities.__path__, "activities."):
        module = importlib.import_module(info.name)
        path = Path(inspect.getfile(module))
        names = _imported_names(ast.parse(path.read_text()))
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, pydantic.BaseModel) and obj.__module__ == info.name:
                found.append((f"{path.relative_to(ROOT)}:{obj.__qualname__}", textwrap.dedent(inspect.getsource(obj)), names))
    return found


def test_no_helper_or_model_of_activities_a_workflow_runs_calls_what_the_sandbox_refuses() -> None:
    found = [f"{path}:{hit}" for path in WORKFLOW_HELPERS for hit in restricted_uses((ROOT / path).read_text())]
    models = _activity_models()
    assert len(models) > 10, "the models of activities/ were not found"
    found += [f"{where}, its line {hit}" for where, source, names in models for hit in restricted_uses(source, names)]
    assert not found, "a workflow runs these (helpers, models' validators and methods): keep them deterministic\n" + "\n".join(found)
