"""The layout holds: the import-linter contracts of pyproject.toml ([tool.importlinter]: each layer
imports only those below it, tgp/ imports no I/O, nothing imports the command line, no cycle
inside a layer), and no module imports one of ours inside a function, where a cycle or an upward
import would hide from the contracts. README "Where things are" describes the layers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("tgp", "activities", "workflows", "crd_bridge", "workers", "sim")
# Each command of the command line imports what it runs, so `tgp --help` starts quickly.
LAZY_ALLOWED = {"workers/cli.py"}


def test_the_import_contracts_are_kept() -> None:
    linter = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(linter), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout, done.stdout[-2000:]


def _nested_imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
                    found.append((node.lineno, node.module))
                elif isinstance(node, ast.Import):
                    found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in OURS]
    return found


def test_no_module_of_ours_is_imported_inside_a_function() -> None:
    hidden = []
    for package in OURS:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in LAZY_ALLOWED:
                continue
            hidden += [f"{name}:{line} imports {module}" for line, module in _nested_imports(ast.parse(path.read_text()))]
    assert not hidden, "imports inside functions (put them at the top; the contracts then see them):\n" + "\n".join(hidden)
