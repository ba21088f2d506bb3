"""The secrets a worker handles, registered once, and one `scrub` that keeps them out of
everything that leaves an activity: error messages (workflow history, `describe`, a node's
`last_error` and result), HTTP error bodies, and logs.

Clouds and tailnet APIs echo the request in their error bodies (the Authorization header, the
JSON body with user-data, a startup script, an env; some in base64), so the secret an adapter
sent comes back in the text it would quote. Rather than each adapter guessing which field may
hold what, every secret is registered when it enters the process:

* long-lived credentials (a provider API key, an OAuth client secret, a Headscale API key)
  with `register_process`, when the adapter is built;
* short-lived ones (a minted tailnet key, the join token and the other join material, a
  bearer token) with `register`, inside the `secret_scope()` of the activity that handles
  them. When a scope ends its secrets stay known for a while (a bounded set of recent ones),
  so a late log line about them is still scrubbed.

`scrub(text)` replaces each known secret, in every form it travels in, with `[redacted]`:
the value itself, JSON-, repr- and percent-encoded, its base64 (standard and URL-safe, at any
alignment inside a longer encoded text), and any base64 blob that decodes to text containing
a secret (a whole base64 user-data). Tailnet keys are also recognised by their shape
(`tskey-...`, `hskey-...`), registered or not. Values shorter than `MIN_LENGTH` are not
registered: replacing "true" or "1" would shred every message without hiding anything.

Applied by `activities.http.send` (error bodies and error messages), by `TgpError` itself, by
`activities.node.temporal_errors` (the ApplicationError that reaches history), and by the
structlog processor and stdlib log-record factory that `workers.logs` installs.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, quote_plus

__all__ = [
    "MIN_LENGTH",
    "OWN_SECRET_PREFIX",
    "REDACTED",
    "class_reference_problem",
    "contains_secret",
    "known_secrets",
    "register",
    "register_model",
    "register_process",
    "scrub",
    "scrub_exception",
    "scrub_value",
    "secret_scope",
]

REDACTED = "[redacted]"
# Shorter values are not treated as secrets (see the module docstring).
MIN_LENGTH = 8
# How many secrets of ended scopes (and of registrations outside any scope) stay known: long
# enough for the log lines and failure reports that follow an activity, small enough that
# scrubbing stays cheap.
RECENT_LIMIT = 64
# How many process-wide secrets are kept, the most recently registered: a worker has a handful
# of credentials; only a process that builds adapter after adapter (a test run) reaches this.
PROCESS_LIMIT = 256

# Tailnet credentials by their shape: Tailscale's tskey-client-/-api-/-auth- and Headscale's
# hskey-api-/-auth-, also when wrapped across lines (a line break, or an escaped one in JSON).
TAILNET_KEY = re.compile(r"(tskey|hskey)-[A-Za-z0-9_-]+(?:(?:\r?\n|\\r\\n|\\n)[ \t]*[A-Za-z0-9_-]+)*")
# A run of base64 (either alphabet) long enough to hide a secret.
_B64_RUN = re.compile(r"[A-Za-z0-9+/_-]{16,}={0,2}")
_B64_CHARS = "[A-Za-z0-9+/_-]"
# Base64 inside base64 (a Talos config with base64 certificates, base64 user-data): how deep to look.
_B64_DEPTH = 2


@dataclass(frozen=True)
class _Secret:
    value: str
    plain: tuple[str, ...]  # the value and its escaped / percent-encoded forms
    raw: tuple[bytes, ...]  # what to look for in decoded base64
    cores: tuple[str, ...]  # its base64 at each alignment, either alphabet (a quick check)
    encoded: str | None  # the same, with the partial groups around them: a pattern compiled when a text shows a core (rarely)


def _forms(value: str) -> _Secret:
    plain = {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1], repr(value)[1:-1]}
    plain |= {quote(value, safe=""), quote_plus(value, safe="")}
    raw = value.encode()
    cores = set()
    for skip in range(3):
        # The secret starts at some byte offset of a longer encoded text: the groups of three
        # bytes that lie wholly inside it encode the same way whatever surrounds it.
        part = raw[skip:]
        part = part[: len(part) // 3 * 3]
        if len(part) >= 6:
            core = base64.b64encode(part).decode()
            cores |= {core, core.translate(_URLSAFE)}
    encoded = None
    if cores:
        # Eat the partial groups at both ends too: they carry bits of the secret.
        alternatives = "|".join(re.escape(c) for c in sorted(cores, key=len, reverse=True))
        encoded = f"{_B64_CHARS}{{0,3}}(?:{alternatives}){_B64_CHARS}{{0,3}}={{0,2}}"
    forms = tuple(sorted((p for p in plain if p), key=len, reverse=True))
    return _Secret(value, forms, (raw, *(p.encode() for p in plain if p != value)), tuple(cores), encoded)


_URLSAFE = str.maketrans("+/", "-_")
_STANDARD = str.maketrans("-_", "+/")

# Reentrant: a log line written from a finalizer during garbage collection, while this thread
# holds the lock, scrubs too. Only readers can run that way (nothing registers from a finalizer).
_lock = threading.RLock()
_process: OrderedDict[str, _Secret] = OrderedDict()
_recent: OrderedDict[str, _Secret] = OrderedDict()
# Bumped on every change of the two above, so the index over them is rebuilt only then.
_version = 0


class _Scope:
    """The secrets registered in one `secret_scope`, with their index (built when needed)."""

    def __init__(self) -> None:
        self.secrets: dict[str, _Secret] = {}
        self._index: _Index | None = None

    def add(self, secret: _Secret) -> None:
        self.secrets[secret.value] = secret
        self._index = None

    @property
    def index(self) -> _Index:
        if self._index is None:
            self._index = _Index(self.secrets.values())
        return self._index


# The scopes of the running activity, innermost last.
_scopes: ContextVar[tuple[_Scope, ...]] = ContextVar("tgp_secret_scopes", default=())


def _usable(values: Iterable[object]) -> Iterator[str]:
    for value in values:
        text = _text_of(value)
        if text is not None and len(text) >= MIN_LENGTH:
            yield text


def _text_of(value: object) -> str | None:
    if value is None:
        return None
    getter = getattr(value, "get_secret_value", None)  # pydantic SecretStr
    if callable(getter):
        value = getter()
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value.strip() if isinstance(value, str) else None


def _remember_recent(secrets: Iterable[_Secret]) -> None:
    global _version
    with _lock:
        _version += 1
        for secret in secrets:
            _recent[secret.value] = secret
            _recent.move_to_end(secret.value)
        while len(_recent) > RECENT_LIMIT:
            _recent.popitem(last=False)


# tgp's own Secrets in its namespace are named with this prefix: the install's
# tgp-operator-secret (the worker's provider keys and tailnet credentials), tgp-payload-keys,
# tgp-temporal-tls and tgp-temporal-api-key. No GPUNodeClass may reference one (see
# `class_reference_problem`; docs/security.md, "Who may write a GPUNodeClass"). The chart's
# values.schema.json refuses any other name for the Secrets it hands tgp's processes, so the rule
# holds whatever the operator names them.
OWN_SECRET_PREFIX = "tgp-"


def class_reference_problem(name: str, field: str) -> str | None:
    """What is wrong with a GPUNodeClass naming Secret `name` in `field`, or None: a class may
    not reach tgp's own Secrets (the Temporal credentials, the payload keys, the worker's own
    provider and tailnet keys, the class keys kept for the nodes they bought,
    activities/kept_accounts.py), which are named `tgp-...`. The rule holds for every reference a
    class makes, so it needs no list of what each Secret holds; a class that wants the worker's
    own keys leaves its reference unset."""
    if not name.startswith(OWN_SECRET_PREFIX):
        return None
    return (
        f"{field}: Secret {name!r} is one of tgp's own (its name starts with {OWN_SECRET_PREFIX!r}: the Temporal "
        "credentials, the payload keys, the worker's own provider and tailnet keys, the keys it kept), which no GPUNodeClass may "
        f"reference; put the class's credentials in a Secret named otherwise, or leave {field} unset to use the worker's own"
    )


def register_process(*values: object) -> None:
    """Keep these for the life of the process: the credentials an adapter is built with.
    Accepts str, bytes, SecretStr or None (ignored)."""
    for value in _usable(values):
        secret = _process.get(value) or _recent.get(value) or _forms(value)
        global _version
        with _lock:
            _version += 1
            _process[value] = secret
            _process.move_to_end(value)
            while len(_process) > PROCESS_LIMIT:
                _process.popitem(last=False)


def register(*values: object) -> None:
    """Keep these out of everything for as long as the current `secret_scope` lasts (and a
    while after, among the recent ones). Outside a scope they go straight to the recent ones."""
    scopes = _scopes.get()
    for value in _usable(values):
        if value in _process or (scopes and value in scopes[-1].secrets):
            continue
        secret = _recent.get(value) or _forms(value)
        if scopes:
            scopes[-1].add(secret)
        else:
            _remember_recent([secret])


def register_model(model: object) -> None:
    """`register` every SecretStr field of a pydantic model (join material, say)."""
    for name in getattr(type(model), "model_fields", {}):
        value = getattr(model, name, None)
        if hasattr(value, "get_secret_value"):
            register(value)


@contextmanager
def secret_scope() -> Iterator[None]:
    """Scope for the secrets one activity handles (see `register`). Nested scopes see the
    outer ones' secrets."""
    scope = _Scope()
    token = _scopes.set((*_scopes.get(), scope))
    try:
        yield
    finally:
        _scopes.reset(token)
        _remember_recent(scope.secrets.values())


def known_secrets() -> list[str]:
    """Every secret scrubbed right now (for tests and diagnostics; never log the result)."""
    return [secret.value for index in _indexes() for secret in index.secrets]


class _Index:
    """Secrets looked up by the first ANCHOR characters of each of their forms, so that a
    text is checked with one pass over its substrings rather than one search per form."""

    def __init__(self, secrets: Iterable[_Secret]) -> None:
        self.secrets = sorted(secrets, key=lambda s: len(s.value), reverse=True)
        self.text: dict[str, list[_Secret]] = {}
        self.raw: dict[bytes, list[_Secret]] = {}
        for secret in self.secrets:
            for form in (*secret.plain, *secret.cores):
                self.text.setdefault(form[:_ANCHOR], []).append(secret)
            for raw in secret.raw:
                self.raw.setdefault(raw[:_ANCHOR], []).append(secret)

    def in_text(self, text: str) -> list[_Secret]:
        """The secrets some form of which may be in `text` (a superset, longest first)."""
        return _candidates(text, self.text, self.secrets)

    def in_bytes(self, data: bytes) -> bool:
        """Whether `data` holds one of the secrets."""
        return any(raw in data for secret in _candidates(data, self.raw, self.secrets) for raw in secret.raw)


# Every form of a secret is at least this long (MIN_LENGTH, and base64 of 6 bytes).
_ANCHOR = 8


def _candidates(text: Any, anchors: dict[Any, list[_Secret]], ordered: list[_Secret]) -> list[_Secret]:
    if not anchors or len(text) < _ANCHOR:
        return []
    found: set[int] = set()
    for i in range(len(text) - _ANCHOR + 1):
        hits = anchors.get(text[i : i + _ANCHOR])
        if hits:
            found.update(id(s) for s in hits)
    return [s for s in ordered if id(s) in found] if found else []


_cached: tuple[int, _Index, frozenset[str]] | None = None


def _indexes(extra: Iterable[object] = ()) -> list[_Index]:
    """The index of the process-wide and recent secrets (cached until they change), those of
    the current scopes (cached per scope), and one of `extra` (built per call)."""
    global _cached
    with _lock:
        cached = _cached
        if cached is None or cached[0] != _version:
            base = _Index({**_process, **_recent}.values())
            cached = _cached = (_version, base, frozenset(s.value for s in base.secrets))
    _, base, known = cached
    indexes = [base, *(scope.index for scope in _scopes.get() if scope.secrets)]
    more = {v: _forms(v) for v in _usable(extra) if v not in known}
    if more:
        indexes.append(_Index(more.values()))
    return indexes


def scrub(text: str, extra: Iterable[object] = ()) -> str:
    """`text` with every known secret (and each of `extra`), in any of its forms, and anything
    shaped like a tailnet key replaced by [redacted]."""
    if not text:
        return text
    indexes = _indexes(extra)
    for index in indexes:
        for secret in index.in_text(text):
            for form in secret.plain:
                if form in text:
                    text = text.replace(form, REDACTED)
            if secret.encoded is not None and any(core in text for core in secret.cores):
                text = re.sub(secret.encoded, REDACTED, text)  # compiled at its first use (re keeps it)
    if any(index.secrets for index in indexes):
        text = _B64_RUN.sub(lambda m: REDACTED if _decodes_to_secret(m.group(0), indexes, _B64_DEPTH) else m.group(0), text)
    return TAILNET_KEY.sub(r"\1-[redacted]", text)


def contains_secret(text: str, extra: Iterable[object] = ()) -> bool:
    """Whether `scrub` would change `text`."""
    return scrub(text, extra) != text


def _decodes_to_secret(blob: str, indexes: list[_Index], depth: int) -> bool:
    """Whether the base64 `blob` (either alphabet, any padding, possibly with a few foreign
    characters in front) decodes to text holding a secret or a tailnet key."""
    body = blob.rstrip("=").translate(_STANDARD)
    for start in range(4):
        chunk = body[start:]
        if len(chunk) % 4 == 1:
            chunk = chunk[:-1]  # a lone last character carries no whole byte
        # Pad the last group rather than drop it: the secret may end the blob (nested base64).
        chunk += "=" * (-len(chunk) % 4)
        if len(chunk) < 12:
            break
        try:
            decoded = base64.b64decode(chunk)
        except (binascii.Error, ValueError):
            continue
        if any(index.in_bytes(decoded) for index in indexes):
            return True
        text = decoded.decode("utf-8", "ignore")
        if TAILNET_KEY.search(text):
            return True
        if depth > 1 and any(_decodes_to_secret(m.group(0), indexes, depth - 1) for m in _B64_RUN.finditer(text)):
            return True
    return False


def scrub_value(value: Any) -> Any:
    """`value` with `scrub` applied to every string in it (dicts, lists and tuples walked);
    any other object whose repr would show a secret becomes its scrubbed repr."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, Mapping):
        return {k: scrub_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(scrub_value(v) for v in value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken repr is not our problem here
        return value
    clean = scrub(text)
    return value if clean == text else clean


def scrub_exception(exc: BaseException, extra: Iterable[object] = ()) -> BaseException:
    """`exc` itself with every string in its args scrubbed (its type, traceback and other
    attributes kept): for exceptions whose message reaches history or a log."""
    known = list(extra)
    exc.args = tuple(scrub(a, known) if isinstance(a, str) else a for a in exc.args)
    return exc
