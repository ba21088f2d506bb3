"""One retry discipline for every HTTP API tgp calls (clouds, Tailscale, Headscale).

Each call has a timeout (set on the client) and a short, bounded retry on 429 / 5xx /
connection errors that honours `Retry-After`. Past that the caller gets a TransientError and
Temporal's activity retry policy takes over, so a long outage never blocks a worker slot.
A request that buys something is retried only after a 429 (see `send`).

Error messages reach workflow history, and many APIs echo the request (Authorization header,
user-data) in their error bodies: `send` registers the credentials it sends with
`tgp.secrets`, scrubs every error body it receives before anyone reads it, and scrubs the
message of every error it raises (docs/security.md, "Scrubbing").
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable
from email.utils import parsedate_to_datetime
from datetime import datetime, timezone
from types import TracebackType
from typing import Any, Self

import httpx
from pydantic import SecretStr

from tgp import secrets as secret_registry
from tgp.errors import AuthError, PermissionDenied, TgpError, TransientError

# Requests to cloud APIs answer in well under a second; 30 s catches a hung connection.
DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
# In-call attempts before handing the retry over to Temporal.
IN_CALL_ATTEMPTS = 3
# Cap on one in-call wait; a longer Retry-After is passed on to Temporal as next_retry_delay.
MAX_IN_CALL_WAIT = 5.0

RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class HttpAdapter:
    """Base of an adapter that talks to one HTTP API through one httpx.AsyncClient, `_client`.
    Use it as `async with Adapter(...) as a:` or call `aclose()`. The client is closed only
    when the adapter created it (`_owns_client`); one passed in belongs to whoever made it."""

    _client: httpx.AsyncClient
    _owns_client: bool

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client if this adapter created it."""
        if self._owns_client:
            await self._client.aclose()


class OutcomeUnknown(TransientError):
    """A request that is not idempotent (a create that buys) failed without a clear answer:
    a timeout, a connection error, 408, 425 or 5xx. It may have taken effect, so the caller
    looks the result up before sending it again."""


def retry_after_seconds(response: httpx.Response) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP date), if present."""
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def backoff(attempt: int, base: float = 0.5) -> float:
    """Exponential backoff with full jitter for the given 1-based attempt."""
    return random.uniform(0, base * 2 ** (attempt - 1))


async def send(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    system: str,
    ok: Iterable[int] = (),
    attempts: int = IN_CALL_ATTEMPTS,
    idempotent: bool = True,
    rate_limit_wait: float | None = None,
    sleep: Callable[[float], object] = asyncio.sleep,
    bearer: SecretStr | None = None,
    secrets: Iterable[str | None] = (),
    **kwargs: object,
) -> httpx.Response:
    """Send a request, retrying transient failures; raise typed errors for the rest.

    `bearer` is sent as `Authorization: Bearer ...`. It, `secrets` and the credential in the
    client's own Authorization header are registered with `tgp.secrets`; every error body
    (status >= 400) is scrubbed before it is returned or quoted, and so is the message of any
    error raised here, since messages reach workflow history.

    Returns the response for 2xx and for any status listed in `ok` (for example 404 on a
    delete). 401 -> AuthError, 403 -> PermissionDenied, 429/5xx/network -> retried, then
    TransientError. Other statuses are returned for the adapter to interpret.
    `system` names the API in messages ("Tailscale API", "RunPod").

    A request that buys something is not idempotent (`idempotent=False`): only a 429, which
    the API answers before doing any work, is retried; a timeout, connection error, 408, 425
    or 5xx raises OutcomeUnknown at once. `rate_limit_wait` is the wait assumed after a 429
    without Retry-After (default: exponential backoff), for an API with a documented interval.
    """
    hidden = [*secrets, _credential(client.headers.get("Authorization"))]
    if bearer is not None:
        hidden.append(bearer.get_secret_value())
        kwargs["headers"] = {**dict(kwargs.get("headers") or {}), "Authorization": f"Bearer {bearer.get_secret_value()}"}  # type: ignore[dict-item]
    hidden.append(_credential(dict(kwargs.get("headers") or {}).get("Authorization")))  # type: ignore[call-overload]
    secret_registry.register(*hidden)
    try:
        return await _send(client, method, url, system, set(ok), attempts, idempotent, rate_limit_wait, sleep, kwargs)
    except TgpError as exc:
        raise scrubbed(exc, hidden) from None


def _credential(header: str | None) -> str | None:
    """The credential in an Authorization header value ("Bearer x", "Basic x", "x")."""
    if not header:
        return None
    return header.partition(" ")[2] or header


async def _send(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    system: str,
    ok: set[int],
    attempts: int,
    idempotent: bool,
    rate_limit_wait: float | None,
    sleep: Callable[[float], object],
    kwargs: dict[str, object],
) -> httpx.Response:
    last: TransientError | None = None
    for attempt in range(1, attempts + 1):
        try:
            response = await client.request(method, url, **kwargs)  # type: ignore[arg-type]
        except httpx.TransportError as exc:
            message = f"{system}: {method} {_path(url)} failed: {type(exc).__name__}"
            if not idempotent:
                raise OutcomeUnknown(message) from None
            last = TransientError(message)
            wait = backoff(attempt)
        else:
            status = response.status_code
            if status >= 400:
                # Many APIs quote the request (credentials, user-data) in their errors.
                response = scrubbed_response(response)
            if status < 300 or status in ok:
                return response
            if status == 401:
                raise AuthError(f"{system} rejected the credentials (401): check the API key or OAuth client in the referenced Secret")
            if status == 403:
                raise PermissionDenied(f"{system} refused {method} {_path(url)} (403): {error_message(response)}")
            if status not in RETRYABLE_STATUSES:
                return response
            retry_after = retry_after_seconds(response)
            if retry_after is None and status == 429:
                retry_after = rate_limit_wait
            message = f"{system}: {method} {_path(url)} answered {status}: {error_message(response)}"
            if not idempotent and status != 429:
                raise OutcomeUnknown(message, retry_after=retry_after)
            last = TransientError(message, retry_after=retry_after)
            wait = retry_after if retry_after is not None else backoff(attempt)
            if wait > MAX_IN_CALL_WAIT:
                break
        if attempt < attempts:
            await sleep(wait)  # type: ignore[func-returns-value]
    assert last is not None
    raise last


def json_object(response: httpx.Response, *, system: str) -> dict[str, Any]:
    """The body as a JSON object; TransientError when it is anything else (a proxy's error
    page, a cut-off answer)."""
    try:
        data = response.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise TransientError(f"{system}: {response.request.method} {response.request.url.path} answered non-JSON")
    return data


def json_items(response: httpx.Response, field: str, *, system: str) -> list[dict[str, Any]]:
    """The objects listed under `field` of a JSON object body; other entries are skipped."""
    return [item for item in json_object(response, system=system).get(field) or [] if isinstance(item, dict)]


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


def error_message(response: httpx.Response, limit: int = 300) -> str:
    """The API's own error text, scrubbed, then shortened (a secret cut in half by the limit
    would no longer be recognised)."""
    try:
        body = response.json()
    except ValueError:
        return scrub(response.text)[:limit] or response.reason_phrase
    return scrub(_message_in(body))[:limit]


def _message_in(body: object) -> str:
    """The human part of an error body: `{"message": ...}`, `{"error": {"message": ...}}`, ..."""
    if isinstance(body, dict):
        for key in ("message", "error", "msg", "detail", "errors"):
            if body.get(key):
                return _message_in(body[key])
    if isinstance(body, list) and body:
        return "; ".join(_message_in(item) for item in body)
    return str(body)


def _path(url: str) -> str:
    return httpx.URL(url).path if "://" in url else url
