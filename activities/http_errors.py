"""What of an HTTP API's answers may enter an error, and how an adapter reads the rest
(docs/security.md, "What enters an error").

Error messages reach workflow history, and many APIs echo the request (Authorization header,
user-data, a startup script) in their error bodies, truncated, wrapped, escaped or encoded in
ways no scrubber can list. So a message quotes only what `error_message` keeps of the API's
error envelope that its adapter's `Quotable` allows: a code from the API's documented list
(never one merely shaped like a code) or a standard HTTP phrase, capped in length; of a
tailnet's answers (Tailscale, Headscale, `NOTHING`) nothing but the status. An adapter may read
the provider's words to sort an answer (`error_code`, `error_detail`, `mentions`), never to
quote them. `scrub`, `scrubbed` and `scrubbed_response` (what activities/http.py's `send` does to
every error body and error) stay as defence in depth. `Fixes` is the part of a message that
says what to do, in each adapter's own terms.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httpx

from tgp import secrets as secret_registry
from tgp.errors import TgpError


@dataclass(frozen=True)
class Fixes:
    """What an operator should do after each refusal, in the adapter's own terms (which Secret
    or Secret key holds the credential, where to make a new one, which scope it needs): the
    part of an error message that differs from one API to the next."""

    auth: str  # after a 401
    denied: str  # after a 403
    not_found: str = ""  # after a 404 nobody expected; "" says to check the base URL


@dataclass(frozen=True)
class Quotable:
    """What of one API's error answers a message may quote (docs/security.md, "What enters an
    error"): `codes`, the API's documented error codes, quoted only when a code field holds
    exactly one of them; `titles`, a problem+json `title` that is a standard HTTP phrase
    (RunPod v2). Everything else of an answer is only read to sort it: a code that merely
    looks like one may be the request (the API key upper-cased, reversed, in base64) in the
    code field."""

    codes: frozenset[str] = frozenset()
    titles: bool = False

    def code(self, response: httpx.Response) -> str:
        """The first documented code in the answer's code fields (`error.code`, `code`, a
        string `error`), or ""."""
        for value in _code_fields(error_body(response)):
            if isinstance(value, str) and value in self.codes:
                return value
        return ""


# An API whose answers a message quotes nothing of, only the status (the tailnets: Tailscale,
# Headscale; issue 35 item 13).
NOTHING = Quotable()


def _code_fields(body: dict[str, Any]) -> list[object]:
    error = body.get("error")
    return [error.get("code") if isinstance(error, dict) else None, body.get("code"), error]


def error_body(response: httpx.Response) -> dict[str, Any]:
    """The body as a JSON object, for reading an error's fields; {} when it is anything else
    (a proxy's page, plain text, a JSON list): such a body carries none of the API's fields."""
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def scrub(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with every registered secret (tgp.secrets), each of `secrets`, in any form
    (plain, escaped, base64), and anything shaped like a tailnet key replaced by [redacted]."""
    return secret_registry.scrub(text, secrets)


def scrubbed(exc: TgpError, secrets: Iterable[str | None] = ()) -> TgpError:
    """`exc` itself (type and retry_after kept) with its message scrubbed (see `scrub`)."""
    known = list(secrets)
    exc.args = tuple(scrub(str(a), known) for a in exc.args)
    return exc


def scrubbed_response(response: httpx.Response) -> httpx.Response:
    """`response`, or when its body shows a secret (an API echoing the request), a copy with
    the body scrubbed: every later reader (error_message, an adapter's own parsing) sees only
    the scrubbed text."""
    text = response.text
    clean = secret_registry.scrub(text)
    if clean == text:
        return response
    skip = {"content-length", "content-encoding", "transfer-encoding"}
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in skip]
    return httpx.Response(response.status_code, headers=headers, content=clean.encode(response.encoding or "utf-8", "replace"), request=response.request)


# What of an error envelope may be quoted, at most.
MESSAGE_LIMIT = 120
# A machine-readable error code as the documented envelopes carry one: Lambda's
# "global/invalid-api-key", Vast.ai's "no_such_ask", Paperspace's code, the simulated cloud's
# "no-capacity". Free text (spaces, quotes, a colon and what follows) is not a code.
_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_./-]{0,63}")
# gRPC status codes by number, as a grpc-gateway (Headscale before 0.30) puts them in `code`.
GRPC_CODES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
    6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION", 10: "ABORTED",
    11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}  # fmt: skip
_PHRASES = {status.phrase.lower(): status.phrase for status in HTTPStatus}


def error_code(response: httpx.Response) -> str:
    """The machine-readable code of an error answer's envelope, or "", for **sorting** the
    answer and never for quoting (quote `Quotable.code`, which keeps only documented codes):
    `error.code` (Lambda, the simulated cloud), a string `error` shaped like a code (Vast.ai),
    `code` (Paperspace; a number is a gRPC code, Headscale's grpc-gateway)."""
    for value in _code_fields(error_body(response)):
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            return GRPC_CODES.get(value, str(value))
        if isinstance(value, str) and _CODE.fullmatch(value):
            return value
    return ""


def error_message(response: httpx.Response, quotable: Quotable = NOTHING, limit: int = MESSAGE_LIMIT) -> str:
    """What an error message may quote of an error answer, never the provider's free text
    (which may echo the request in any encoding): what `quotable` allows (a documented code, a
    standard HTTP phrase as a problem+json title); when neither,
    the standard phrase of its status (not the server's reason line)."""
    body = error_body(response)
    parts = [quotable.code(response)]
    title = body.get("title")
    if quotable.titles and isinstance(title, str) and title.lower() in _PHRASES:
        parts.append(_standard_phrase(title))
    text = ": ".join(dict.fromkeys(p for p in parts if p))
    if not text:
        text = status_phrase(response.status_code)
    return text[:limit]


def status_phrase(status: int) -> str:
    """The standard phrase of an HTTP status ("Not Found"), never a server's own reason line."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "no standard meaning"


def _standard_phrase(title: str) -> str:
    """`title`, a standard HTTP phrase in any letter case, as the standard spells it."""
    return _PHRASES[title.lower()]


def error_detail(response: httpx.Response) -> str:
    """The provider's own words in an error answer (its message, detail or text), scrubbed, for
    sorting the answer (capacity? "not found"?) and never for quoting: they may echo the
    request in a form no scrubber recognises. Quote `error_message` instead."""
    try:
        body = response.json()
    except ValueError:
        return scrub(response.text)
    return scrub(_message_in(body))


def mentions(code: str, message: str, markers: Iterable[str]) -> bool:
    """Whether an error's code or message holds one of `markers` (lowercase): how an adapter
    sorts the refusals its API gives no machine-readable code for."""
    text = f"{code} {message}".lower()
    return any(marker in text for marker in markers)


def _message_in(body: object) -> str:
    """The human part of an error body: `{"message": ...}`, `{"error": {"message": ...}}`, ...
    (for `error_detail`: sorting, never quoting)."""
    if isinstance(body, dict):
        for key in ("message", "error", "msg", "detail", "errors"):
            if body.get(key):
                return _message_in(body[key])
    if isinstance(body, list) and body:
        return "; ".join(_message_in(item) for item in body)
    return str(body)
