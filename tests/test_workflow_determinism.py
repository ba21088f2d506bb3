"""No module a workflow runs calls what Temporal's sandbox refuses: the clock, randomness, the
environment, files, threads.

The worker passes tgp's workflow packages through the sandbox (workers/sandbox_code.py), as it
passes tgp/ and the stages and models they use: a run imports none of them again, and so the
sandbox does not see their calls. This test reads those calls instead, in every module under
workflows/ and tgp/, against the sandbox's own list of restricted members
(`SandboxRestrictions.default.invalid_module_members`, as at run time): a workflow that read the
clock would replay differently, and this fails before it ships.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from temporalio.worker.workflow_sandbox import SandboxRestrictions
from temporalio.worker.workflow_sandbox._restrictions import RestrictionContext

ROOT = Path(__file__).resolve().parent.parent
# What a workflow runs: its own packages and the vocabulary and decisions of tgp/ (activities run
# outside workflows, and the layers keep workflows/ from calling them: tests/test_layout.py).
WORKFLOW_CODE = ("workflows", "tgp")
BUILTINS = "__builtins__"


def _context(runtime: bool) -> RestrictionContext:
    """A call in a function runs with the workflow (the sandbox's run time); one at a module's top
    level runs once, when the worker imports the module (some members, `threading`'s, are refused
    only at run time)."""
    context = RestrictionContext()
    context.is_runtime = runtime
    return context


def _calls(tree: ast.AST) -> list[tuple[ast.Call, bool]]:
    """Every call in `tree`, and whether it is inside a function (runs at run time)."""
    inside: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            inside |= {id(n) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    return [(n, id(n) in inside) for n in ast.walk(tree) if isinstance(n, ast.Call)]


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


def _dotted(expr: ast.expr) -> tuple[str, ...] | None:
    """`a.b.c` as ("a", "b", "c"); None for anything that is not names and attributes."""
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return (expr.id, *reversed(parts))


def restricted_calls(source: str) -> list[str]:
    """Every call in `source` the sandbox would refuse at run time, as "line: dotted.path"."""
    tree = ast.parse(source)
    names = _imported_names(tree)
    members = SandboxRestrictions.default.invalid_module_members
    found = []
    for node, runtime in _calls(tree):
        chain = _dotted(node.func)
        if chain is None:
            continue
        if chain[0] in names:
            path = (*names[chain[0]], *chain[1:])
        elif len(chain) == 1:
            path = (BUILTINS, chain[0])
        else:
            continue  # a local object's method
        if members.match_access(_context(runtime), *path, include_use=True):
            found.append(f"{node.lineno}: {'.'.join(path)}")
    return found


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
        ("import time\nclock = time.monotonic  # a reference, called by an activity's caller", False),
        ("import hashlib, json\nhashlib.sha256(json.dumps({}).encode())", False),
        ("from temporalio import workflow\nworkflow.now()\nworkflow.uuid4()", False),
        ("import threading\n_lock = threading.RLock()  # once, at import", False),
    ],
)
def test_the_reading_tells_what_the_sandbox_refuses(source: str, refused: bool) -> None:
    assert bool(restricted_calls(source)) is refused, restricted_calls(source)


def test_no_module_a_workflow_runs_calls_what_the_sandbox_refuses() -> None:
    found = []
    for package in WORKFLOW_CODE:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{hit}" for hit in restricted_calls(path.read_text())]
    assert not found, (
        "workflow code must not read the clock, draw random numbers, read the environment or do I/O "
        "(use workflow.now(), workflow.random(), workflow.uuid4(), or an activity):\n" + "\n".join(found)
    )
