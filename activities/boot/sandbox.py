"""Where boot templates render: a Jinja sandbox with bounds, run in a child process.

A GPUNodeClass template is code from the cluster admin, rendered by the worker next to join
secrets. Jinja's sandbox stops attribute walks into Python internals; it bounds nothing else.
Nested loops, `lipsum(10**8)`, `"x" * 10**9` or `9 ** 9 ** 9` used to run until done on the
worker's event loop. Here:

* **Loop work.** Every `{% for %}` counts its iterations against one budget per render
  (`MAX_LOOP_ITERATIONS`); `range()` takes at most `MAX_RANGE` items; `lipsum` is gone;
  `*` may not build a string or list longer than `MAX_OUTPUT_BYTES` and `**` takes no
  exponent above `MAX_EXPONENT`.
* **Output.** The template streams (`generate()`); past `MAX_OUTPUT_BYTES` it stops.
* **Time and memory.** Every parse, compile and render of a class's template runs in a fresh
  child process (`main()` here; the worker's side, which starts, bounds and queues the children,
  is activities/boot/renders.py) whose render is stopped after `RENDER_TIMEOUT_SECONDS` of CPU
  time counted from the render's start (ITIMER_PROF, with RLIMIT_CPU behind it), not wall time,
  so a loaded machine does not make a template invalid, with its address space capped at
  `MEMORY_LIMIT_BYTES`. The worker never parses a template: Jinja folds constant
  expressions while compiling, and even the name-lookup pass compiles, so the one-line
  `{{ '%0999999999d' % 1 }}` once took the worker to 2.9 GB and stalled its event loop for
  12 s. A thread cannot be stopped, and cooperative checks cannot interrupt work inside one C
  call (a huge `%` format, a big sort); a process can be killed, so the bound holds for
  whatever the sandbox did not foresee. Starting it costs about a tenth of a second, paid at
  class validation and once per launch: so this module imports only the standard library,
  jinja2 and tgp.labels (asyncio alone was 70 ms of every child's start).

The child gets the template and its variables (secrets included) on stdin and answers with JSON
on stdout: nothing on its command line or in its environment, which holds only what Python
needs (not the worker's credentials).

Filters for putting values into each context of a boot payload (see docs/bootstrap.md):
`quote` (YAML/JSON string), `to_json` (YAML flow collection), `shell_quote` (one shell word),
`systemd_quote` (one word of a systemd command line) and `kubelet_labels` (the value of
`--node-labels`). None of them lets a value start a new line.
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from jinja2 import StrictUndefined, TemplateSyntaxError, UndefinedError, meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from tgp.labels import label_value_problems, qualified_name_problems, shown

MAX_OUTPUT_BYTES = 1024 * 1024  # provider user data is smaller still (Lambda: 1 MB)
MAX_LOOP_ITERATIONS = 100_000  # all loops of one render together
MAX_RANGE = 10_000
MAX_EXPONENT = 1024
# CPU time of one render, from its start in the child (the interpreter's start and imports
# not counted): a bound on the template's work, the same on an idle and a loaded machine. It
# was wall time including the child's start, so under load a 256 KiB template validated in
# 3.9-5.1 s, valid in one run and InvalidSpec in the next (issue 35).
RENDER_TIMEOUT_SECONDS = 5.0
MEMORY_LIMIT_BYTES = 256 * 1024 * 1024
_MESSAGE_LIMIT = 2000


class RenderLimit(Exception):
    """A bound was hit: too many loop iterations, too much output, too long, too big."""


class UnsafeValue(Exception):
    """A filter was given a value it cannot put into its context without changing the
    meaning of the surrounding text (a line break into a shell line, a bad label)."""


class RenderFailed(Exception):
    """What went wrong in a render, as the child reported it: `kind` is syntax, undefined,
    security, limit, unsafe or error; `line` the template line if known. The message may quote
    a value (a secret, even): the caller scrubs it."""

    def __init__(self, kind: str, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.line = kind, message, line


# --- filters ----------------------------------------------------------------------------


def yaml_quote(value: object) -> str:
    """A YAML double-quoted scalar, every character outside printable ASCII escaped, so the
    value can never end the line or the document. For text below U+10000 it is JSON too."""
    text = str(value)
    if all(ord(c) < 0x10000 for c in text):
        return json.dumps(text)  # ensure_ascii: \n, \u2028, \u0085 ... all escaped
    out = ['"']
    for c in text:
        code = ord(c)
        if c in '"\\':
            out.append("\\" + c)
        elif 0x20 <= code < 0x7F:
            out.append(c)
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")  # YAML (not JSON): PyYAML does not join surrogate pairs
    out.append('"')
    return "".join(out)


# YAML reads an implicit key (every key of a JSON object) of at most 1024 characters.
MAX_FLOW_KEY = 1024


def to_json(value: object) -> str:
    """JSON on one line, which YAML reads as a flow collection. A mapping key longer than YAML
    allows an implicit key to be is refused: the document would not load."""
    text = json.dumps(value)
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, Mapping):
            for key, sub in item.items():
                if len(json.dumps(key)) > MAX_FLOW_KEY:
                    raise UnsafeValue(f"to_json: key {shown(str(key), 40)} is longer than the {MAX_FLOW_KEY} characters YAML reads as a key")
                pending.append(sub)
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return text


# Line breaks in YAML (and so inside a block scalar holding a script or unit) and controls.
_BREAKS = frozenset("\x85\u2028\u2029")


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F or c in _BREAKS for c in text)


def shell_quote(value: object) -> str:
    """One POSIX shell word (`shlex.quote`). A value with a line break or another control
    character is refused: no quoting keeps it on one line in every shell, and the line
    usually sits inside a YAML block scalar."""
    text = str(value)
    if _has_control(text):
        raise UnsafeValue(f"shell_quote: {shown(text, 40)} holds a line break or control character; it cannot be one shell word on one line")
    return shlex.quote(text)


_SYSTEMD_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_@+=:,./-")


def systemd_quote(value: object) -> str:
    """One word of a systemd command line (ExecStart=, ExecStartPre=): bare when it only holds
    safe characters, else double-quoted with C escapes; `$` and `%` doubled so that neither
    environment nor specifier expansion applies. The result is printable ASCII on one line."""
    text = str(value)
    if text and all(c in _SYSTEMD_SAFE for c in text):
        return text
    out = ['"']
    for c in text:
        code = ord(c)
        if c in '"\\':
            out.append("\\" + c)
        elif c in "$%":
            out.append(c + c)
        elif 0x20 <= code < 0x7F:
            out.append(c)
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def kubelet_labels(labels: Mapping[str, str]) -> str:
    """`key=value,key=value` for the kubelet's --node-labels, sorted. Every key and value must
    be in Kubernetes label syntax: a `,` or `=` would add another label, and anything else
    makes the kubelet refuse to start."""
    if not isinstance(labels, Mapping):
        raise UnsafeValue("kubelet_labels: needs a mapping of labels")
    pairs = []
    for key, value in sorted(labels.items()):
        problems = qualified_name_problems(key) + [f"value {p}" for p in label_value_problems(value)]
        if problems:
            raise UnsafeValue(f"kubelet_labels: label {shown(str(key), 40)} is not Kubernetes label syntax: {problems[0]}")
        pairs.append(f"{key}={value}")
    return ",".join(pairs)


# --- the bounded environment ------------------------------------------------------------


class _Budget(threading.local):
    """The bounds of the render in progress, per thread (one render per child process; in the
    worker, renders of tgp's own shipped templates, `render_trusted`)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.iterations = 0
        self.deadline = time.monotonic() + RENDER_TIMEOUT_SECONDS

    def tick(self) -> None:
        self.iterations += 1
        if self.iterations > MAX_LOOP_ITERATIONS:
            raise RenderLimit(f"the template's loops ran more than {MAX_LOOP_ITERATIONS} iterations")
        if self.iterations % 1024 == 0:
            self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimit(f"rendering took longer than {RENDER_TIMEOUT_SECONDS:g} s")


_BUDGET = _Budget()


def counted(iterable: Iterable[Any]) -> Iterator[Any]:
    """What every `{% for %}` iterates: the template's own iterable, each item counted."""
    for item in iterable:
        _BUDGET.tick()
        yield item


def bounded_range(*args: int) -> range:
    items = range(*args)
    if len(items) > MAX_RANGE:
        raise RenderLimit(f"range() of {len(items)} items; at most {MAX_RANGE}")
    return items


_GLOBALS_REMOVED = ("lipsum",)  # lipsum(n) writes n paragraphs: output without a loop


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with loop, range, `*` and `**` bounds (see the module doc)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_OUTPUT_BYTES:
                    raise RenderLimit(f"'*' would build {len(seq) * times} items; at most {MAX_OUTPUT_BYTES}")
        elif operator == "**":
            if isinstance(right, int) and abs(right) > MAX_EXPONENT and isinstance(left, (int, float)) and abs(left) > 1:
                raise RenderLimit(f"'**' with an exponent of {right}; at most {MAX_EXPONENT}")
        return super().call_binop(context, operator, left, right)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in list(tree.find_all(nodes.For)):
            loop.iter = nodes.Call(
                nodes.ImportedName(f"{__name__}.counted", lineno=loop.lineno), [loop.iter], [], None, None, lineno=loop.lineno
            )
        return tree


def environment() -> BoundedEnvironment:
    # trim_blocks/lstrip_blocks: `{% if %}` lines leave no blank lines or indentation behind,
    # which matters in YAML. keep_trailing_newline: cloud-init and shells expect one.
    env = BoundedEnvironment(
        undefined=StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    for name in _GLOBALS_REMOVED:
        env.globals.pop(name, None)
    env.globals["range"] = bounded_range
    env.filters["quote"] = yaml_quote
    env.filters["to_json"] = to_json
    env.filters["shell_quote"] = shell_quote
    env.filters["systemd_quote"] = systemd_quote
    env.filters["kubelet_labels"] = kubelet_labels
    return env


# --- the child ------------------------------------------------------------------------------


def render_here(source: str, variables: Mapping[str, Any]) -> str:
    """Render with the loop and output bounds, in this process (the child calls this)."""
    _BUDGET.reset()
    try:
        template = environment().from_string(source)
    except RecursionError:
        raise RenderLimit("the template is nested too deeply to parse") from None
    chunks, size = [], 0
    for chunk in template.generate(dict(variables)):
        size += len(chunk.encode("utf-8", "surrogatepass"))
        if size > MAX_OUTPUT_BYTES:
            raise RenderLimit(f"the rendered template is larger than {MAX_OUTPUT_BYTES // 1024} KiB")
        _BUDGET.check_time()
        chunks.append(chunk)
    return "".join(chunks)


_TRUSTED: dict[str, Any] = {}
_TRUSTED_LOCK = threading.Lock()


def render_trusted(source: str, variables: Mapping[str, Any]) -> str:
    """Render one of tgp's own shipped templates (activities/boot/templates/) in this process:
    compiled once per process, rendered with the same environment, filters and output and loop
    bounds as in the child. Never a class's template: that is code from the cluster, parsed and
    rendered only in a bounded child (`render`). The variables are data: what a tenant gave (a
    pool's labels and taints, already checked) reaches the output only through the template's
    own filters, exactly as in the child. Microseconds instead of a child Python (about 0.1 s
    of CPU) per launch. Raises RenderFailed as the child would report it."""
    try:
        with _TRUSTED_LOCK:
            template = _TRUSTED.get(source)
            if template is None:
                template = _TRUSTED[source] = environment().from_string(source)
        _BUDGET.reset()
        chunks, size = [], 0
        for chunk in template.generate(dict(variables)):
            size += len(chunk.encode("utf-8", "surrogatepass"))
            if size > MAX_OUTPUT_BYTES:
                raise RenderLimit(f"the rendered template is larger than {MAX_OUTPUT_BYTES // 1024} KiB")
            chunks.append(chunk)
        return "".join(chunks)
    except Exception as exc:  # noqa: BLE001 - reported as the child reports a failed render
        raise RenderFailed(**_describe(exc)) from None


def _template_line(exc: BaseException) -> int | None:
    """The template line Jinja's rewritten traceback points at."""
    line = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename == "<template>":
            line = lineno
    return line


def _describe(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, TemplateSyntaxError):
        return {"kind": "syntax", "message": exc.message or str(exc), "line": exc.lineno}
    line = _template_line(exc)
    if isinstance(exc, RenderLimit):
        kind, message = "limit", str(exc)
    elif isinstance(exc, MemoryError):
        kind, message = "limit", f"rendering needs more than {MEMORY_LIMIT_BYTES // 2**20} MiB of memory (a string or list built too large?)"
    elif isinstance(exc, RecursionError):
        kind, message = "limit", "rendering recursed too deeply (a macro or recursive loop that calls itself without end?)"
    elif isinstance(exc, UnsafeValue):
        kind, message = "unsafe", str(exc)
    elif isinstance(exc, SecurityError):
        kind, message = "security", str(exc)
    elif isinstance(exc, UndefinedError):
        kind, message = "undefined", str(exc)
    else:  # a filter or operator failed on a value, or Python refused the compiled template
        kind, message = "error", f"{type(exc).__name__}: {exc}"
    return {"kind": kind, "message": message[:_MESSAGE_LIMIT], "line": line}


def _limit_resources() -> None:
    """The child's bounds, set once the interpreter has started and imported what it needs, so
    that only the render's own work counts: RENDER_TIMEOUT_SECONDS of CPU from now (ITIMER_PROF,
    whose SIGPROF ends the process even inside one long C call), RLIMIT_CPU a second or two
    later as a backstop, and MEMORY_LIMIT_BYTES of address space."""
    try:
        import resource
        import signal
    except ImportError:  # not POSIX: the parent's wall-time bound still ends the render
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(usage.ru_utime + usage.ru_stime + RENDER_TIMEOUT_SECONDS) + 2
    for limit, value in ((resource.RLIMIT_AS, MEMORY_LIMIT_BYTES), (resource.RLIMIT_CPU, cpu)):
        try:
            resource.setrlimit(limit, (value, value + (1 if limit == resource.RLIMIT_CPU else 0)))
        except (ValueError, OSError):
            pass  # a lower hard limit is already in force
    signal.signal(signal.SIGPROF, signal.SIG_DFL)  # the default action ends the process
    signal.setitimer(signal.ITIMER_PROF, RENDER_TIMEOUT_SECONDS)


def inspect_here(source: str) -> dict[str, int]:
    """The variables `source` reads without defining them, each with the first line naming it
    (parsing and Jinja's name-lookup pass, which compiles: the child calls this)."""
    try:
        tree = environment().parse(source)
        undeclared = meta.find_undeclared_variables(tree)
    except RecursionError:
        raise RenderLimit("the template is nested too deeply to parse") from None
    lines: dict[str, int] = {}
    for name in tree.find_all(nodes.Name):
        if name.name in undeclared:
            lines.setdefault(name.name, name.lineno)
    return {name: lines.get(name, 0) for name in sorted(undeclared)}


def serve(request: Mapping[str, Any]) -> dict[str, Any]:
    """One request: `inspect` (the names a template reads), a render with `variables`, or both,
    the render only when every name read is one of `known` (when given)."""
    answer: dict[str, Any] = {}
    if request.get("inspect"):
        answer["names"] = inspect_here(request["source"])
    variables, known = request.get("variables"), request.get("known")
    if variables is not None and (known is None or set(answer.get("names", ())) <= set(known)):
        answer["output"] = render_here(request["source"], variables)
    return answer


def main() -> None:
    """The child: one request on stdin, one JSON answer on stdout."""
    _limit_resources()
    request = json.loads(sys.stdin.buffer.read())
    try:
        answer = serve(request)
    except BaseException as exc:  # noqa: BLE001 - every failure is the template's, reported
        answer = {"error": _describe(exc)}
    data = json.dumps(answer).encode()
    sys.stdout.buffer.write(data)
    sys.stdout.flush()
