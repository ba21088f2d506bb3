"""One retry discipline and one error wording for every HTTP API tgp calls (clouds, Tailscale,
Headscale).

`send` makes one request: a timeout (set on the client), a deadline for the whole of each
attempt and a cap on the body it reads (REQUEST_DEADLINE, MAX_RESPONSE_BYTES), a short,
bounded retry on 429 / 5xx / connection errors that honours `Retry-After`, and one deadline for
the whole call, its attempts, waits and turns at the pacing included (CALL_DEADLINE). Past that the caller gets a TransientError
and Temporal's activity retry policy takes over, so a long outage never blocks a worker slot.
A request that buys something is never retried in-call (see `send`).

`HttpAdapter` is the base of every adapter: its `_call` sends through `send` and turns each
answer the caller did not ask for into one of tgp's errors, worded the same way for every API
(see `HttpAdapter`), so a refused key reads alike whichever cloud refused it and names what to
fix. An adapter adds only what its API does differently.

Error messages reach workflow history, and many APIs echo the request in their error bodies,
so no provider text enters an error: a message names the status, the request's method and
path (never its query string), and only what activities/http_errors.py's `error_message` keeps
of the API's error envelope that its adapter's `Quotable` allows. The scrubbing that `send` also
does (it registers the credentials it sends with `tgp.secrets`, scrubs every error body it
receives and the message of every error it raises) stays as defence in depth (docs/security.md,
"What enters an error").
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from datetime import datetime, timedelta, timezone
from types import TracebackType
from typing import Any, Self

import httpx
from pydantic import SecretStr

from activities.http_errors import NOTHING, Fixes, Quotable, error_message, scrub, scrubbed, scrubbed_response
from activities.http_wire import WIRE_ONLY, TooLarge, new_client, read_capped, wire_of
from tgp import secrets as secret_registry
from tgp.errors import AuthError, ConfigError, PermissionDenied, TgpError, TransientError

# Requests to cloud APIs answer in well under a second; 30 s catches a hung connection.
DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
# The whole of one attempt, from sending to the answer's last byte. httpx's timeouts bound each
# read, so an answer that drips a byte at a time was still being read after 100 s (issue 35);
# this bounds it. An API answers in seconds; a minute leaves room for a slow list.
REQUEST_DEADLINE = 60.0
# The whole of one call: every attempt, the waits between them and each turn at the adapter's
# pacing (a rate limiter's queue). Three attempts of REQUEST_DEADLINE and their waits came to
# over three minutes, longer than the two minutes (tgp.types.API_CALL_TIMEOUT) Temporal gives the
# shortest activities that make these calls (describe, terminate, a tailnet's cleanup, a label),
# which then timed out saying nothing; 90 s ends the call first, with a TransientError that says
# why, and leaves the activity 30 s for its own reads and writes.
CALL_DEADLINE = 90.0
# The most of an answer's body that is read (decoded). The largest answer tgp reads, a cloud's
# offer list, is well under 1 MiB; a 100 MB body once raised the worker's memory by ~424 MB.
MAX_RESPONSE_BYTES = 8 * 1024 * 1024
# The consistency window of a real cloud API (HttpAdapter.consistency_window): lists lagging
# 30-90 s behind a create and creates completing 65-75 s after the client gave up were seen
# (issue 17); three minutes covers both with room.
CONSISTENCY_WINDOW = timedelta(minutes=3)
# In-call attempts before handing the retry over to Temporal.
IN_CALL_ATTEMPTS = 3
# Cap on one in-call wait; a longer Retry-After is passed on to Temporal as next_retry_delay.
MAX_IN_CALL_WAIT = 5.0

RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
# The 4xx answers `send` hands back at once (it retries the others): what a create's adapter
# lists in `ok` to sort the refusals itself (capacity, a refused offer, a bad request).
CLIENT_ERRORS = frozenset(range(400, 500)) - RETRYABLE_STATUSES

Sleep = Callable[[float], Awaitable[object]]
Pace = AbstractAsyncContextManager[object]


class HttpAdapter:
    """Base of an adapter that talks to one HTTP API through one httpx.AsyncClient, `_client`.

    Every request goes through `_call`: `send` (timeout, retries, scrubbing), then every answer
    outside 2xx that the caller did not list in `ok` becomes one of tgp's errors, in the one
    wording below, whose last part is the adapter's `Fixes`:

        401        AuthError         "<system> refused the credentials for GET /p (401: <answer>); <auth>"
        403        PermissionDenied  "<system> refused GET /p (403: <answer>); <denied>"
        404        ConfigError       "<system>: GET /p was not found (404: <answer>); <not_found>"
        any other  ConfigError       "<system>: GET /p answered 422: <answer>"

    <answer> is `error_message`: the API's error code (or a standard HTTP phrase), never its
    free text, which may echo the request.

    429 and 5xx never get that far: `send` retries them, then raises TransientError (for a
    request that buys: OutcomeUnknown at once, see `_create`). An adapter
    supplies `system` and its `Fixes` as data, and overrides a hook only where its API speaks
    its own way: `_answer` (what of an error answer a message may quote), `_refusal` (an answer
    that means something else, say "try again") and `_says_missing` (whether a 404 is the API's
    own "no such object" rather than a wrong URL, see `_gone`). `_create` sends a request that
    buys something.

    Use it as `async with Adapter(...) as a:` or call `aclose()`. The client is closed only
    when the adapter created it (`_owns_client`); one passed in belongs to whoever made it.
    """

    # The API as messages name it ("RunPod API").
    system = "HTTP API"
    # What a create that may have bought something is found again by (see `_create`).
    found_by = "name"
    # How long after a create this API may still show less than the truth: lists and
    # describe-by-id lag behind it, and a create the client gave up on may still complete.
    # Twins are looked for, and a 404 is not taken for "gone", until this has passed since
    # the last create of a name (docs/providers.md lists each provider's value).
    consistency_window = CONSISTENCY_WINDOW
    # What of this API's error answers a message may quote: its documented codes, no more.
    quotable = NOTHING
    # The bounds of one attempt and of one call (see REQUEST_DEADLINE, MAX_RESPONSE_BYTES,
    # CALL_DEADLINE); an instance may set its own.
    deadline = REQUEST_DEADLINE
    max_response_bytes = MAX_RESPONSE_BYTES
    call_deadline = CALL_DEADLINE

    def __init__(
        self,
        *,
        fixes: Fixes,
        base_url: str = "",
        api_key: SecretStr | None = None,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        sleep: Sleep = asyncio.sleep,
        pace: Pace | None = None,
    ) -> None:
        """`api_key` goes with every request as a Bearer token and, from here on, is kept out of
        every message and log line (tgp.secrets). `timeout` applies to every request, whoever
        made the client. `pace` (a rate limiter) is entered before every attempt of every
        request. `sleep` is the seam for retry waits in tests."""
        secret_registry.register_process(api_key)
        self._fixes = fixes
        self._base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._timeout = timeout
        self._sleep = sleep
        self._pace = pace
        self._owns_client = client is None
        self._client = client or new_client(timeout=timeout, transport=transport, headers={"User-Agent": "tgp"})

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

    async def _call(
        self,
        method: str,
        path: str,
        *,
        ok: Iterable[int] = (),
        bearer: SecretStr | None = None,
        secrets: Iterable[str] = (),
        pace: Pace | None = None,
        settles: Callable[[httpx.Response], bool] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send one request to `path` (under the base URL, or a whole URL) and return the answer
        when it is 2xx, listed in `ok` or one `settles` (see `send`); raise the error of any other
        (see the class docstring). `bearer` and `pace` replace the adapter's API key and pacing
        for this request; `secrets` (values in the request body) are kept out of messages too;
        the rest goes to `send` (json, params, idempotent, ...)."""
        accepted = set(ok)
        hidden = [*self._secrets(), *secrets]
        response = await send(
            self._client,
            method,
            path if "://" in path else self._base_url + path,
            system=self.system,
            ok=accepted,
            sleep=self._sleep,
            bearer=bearer if bearer is not None else self._api_key,
            secrets=hidden,
            pace=pace if pace is not None else self._pace,
            timeout=self._timeout,
            quotable=self.quotable,
            deadline=self.deadline,
            max_bytes=self.max_response_bytes,
            call_deadline=self.call_deadline,
            settles=settles,
            **kwargs,
        )
        if response.status_code < 300 or response.status_code in accepted or (settles is not None and settles(response)):
            return response
        raise scrubbed(self._refusal(response), hidden)

    async def _create(self, method: str, path: str, *, what: str, ok: Iterable[int], **kwargs: Any) -> httpx.Response:
        """Send a request that buys `what`, returning the refusals listed in `ok` for the
        adapter to sort (capacity, a refused offer, ...). Nothing is retried here: after a 429,
        5xx, reset or timeout `what` may have been bought all the same (gateways throttle after
        the backend acted), so the OutcomeUnknown says to look it up by `found_by` before
        buying again; the caller settles it by looking (activities.node)."""
        try:
            return await self._call(method, path, ok=ok, idempotent=False, **kwargs)
        except OutcomeUnknown as exc:
            raise OutcomeUnknown(
                f"{exc}; {what} may exist anyway: look it up by {self.found_by} before creating it again",
                retry_after=exc.retry_after,
            ) from None

    def _refusal(self, response: httpx.Response) -> TgpError:
        """The error for an answer no caller asked for, in the wording of the class docstring."""
        status, where = response.status_code, request_line(response)
        if status == 401:
            return self._auth_error(response)
        if status == 403:
            return PermissionDenied(f"{self.system} refused {where} (403: {self._answer(response)}); {self._fixes.denied}")
        if status == 404:
            fix = self._fixes.not_found or f"check the base URL {self._base_url!r}"
            return ConfigError(f"{self.system}: {where} was not found (404: {self._answer(response)}); {fix}")
        return ConfigError(f"{self.system}: {where} answered {status}: {self._answer(response)}")

    def _auth_error(self, response: httpx.Response) -> AuthError:
        """The error for credentials the API refused, whatever status it said so with (an OAuth
        token endpoint answers 400, Vast.ai's offer search 404)."""
        return AuthError(
            f"{self.system} refused the credentials for {request_line(response)} "
            f"({response.status_code}: {self._answer(response)}); {self._fixes.auth}"
        )

    def _answer(self, response: httpx.Response) -> str:
        """What a message quotes of an error answer: `error_message` (a documented code, never
        the provider's free text), scrubbed all the same."""
        return self._scrub(error_message(response, self.quotable))

    def _shown(self, response: httpx.Response) -> str:
        """"<status> <documented code>" of an error answer, for an adapter's own wording."""
        return f"{response.status_code} {self.quotable.code(response) or 'no documented error code'}"

    def _gone(self, response: httpx.Response) -> bool:
        """Whether `response` says the object no longer exists: a 404 in the API's own words.
        Any other 404 (a wrong base URL, a proxy) raises its ConfigError instead, since reading
        it as "gone" would leak a billing instance."""
        if response.status_code != 404:
            return False
        if not self._says_missing(response):
            raise self._refusal(response)
        return True

    def _says_missing(self, response: httpx.Response) -> bool:
        """Whether a 404 is the API's own "no such object"; an API with an error envelope of its
        own checks for it."""
        return True

    def _secrets(self) -> list[str]:
        """What must never reach a message: the API key."""
        return [self._api_key.get_secret_value()] if self._api_key is not None else []

    def _scrub(self, text: str, *extra: str) -> str:
        return scrub(text, [*self._secrets(), *extra])

    def _error(self, kind: type[TgpError], message: str) -> TgpError:
        """A `kind` error whose message is scrubbed of this adapter's secrets. `message` is
        tgp's own wording: it quotes an error answer only through `_answer`/`error_message`."""
        return kind(self._scrub(message))


def request_line(response: httpx.Response) -> str:
    """The request `response` answers, as messages name it ("GET /v1/x")."""
    return f"{response.request.method} {response.request.url.path}"


class OutcomeUnknown(TransientError):
    """A request that is not idempotent (a create that buys) failed without a clear answer:
    a timeout, a connection error, 408, 425, 429 or 5xx. It may have taken effect (a gateway
    can throttle or fail after its backend acted), so the caller looks the result up before
    sending it again, and never retries it blind."""


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
    pace: Pace | None = None,
    quotable: Quotable | None = None,
    deadline: float = REQUEST_DEADLINE,
    max_bytes: int = MAX_RESPONSE_BYTES,
    settles: Callable[[httpx.Response], bool] | None = None,
    call_deadline: float = CALL_DEADLINE,
    **kwargs: object,
) -> httpx.Response:
    """Send a request, retrying transient failures; return every other answer.

    `bearer` is sent as `Authorization: Bearer ...`. It, `secrets` and the credential in the
    client's own Authorization header are registered with `tgp.secrets`; every error body
    (status >= 400) is scrubbed before it is returned or quoted, and so is the message of any
    error raised here, since messages reach workflow history.

    429/5xx/network -> retried, then TransientError; a status listed in `ok` is returned at
    once instead (a probe that expects a 500). Every other answer, 401 and 403 included, is
    returned for the adapter to interpret (`HttpAdapter._call` words them all one way). A
    retryable answer that `settles` (scrubbed) is returned at once too: an API that reports a
    missing object as a 500 (Headscale 0.29), which no retry changes.
    `system` names the API in messages ("Tailscale API", "RunPod"). `pace`, a rate limiter, is
    entered before each attempt, so a retry waits its turn like any other request.
    `quotable` is what of an error answer a message may quote (the API's documented codes).

    Each attempt, from sending to the answer's last byte, has `deadline` seconds (after its
    turn at `pace`): past it the attempt counts as a timeout. At most `max_bytes` of a body are
    read: a larger answer stops the reading and raises ConfigError (OutcomeUnknown for a
    request that buys), which names the limit and quotes nothing of the body. The whole call,
    every attempt, every wait between them and every turn at `pace`, has `call_deadline`
    seconds: past it, a TransientError that says so (OutcomeUnknown for a request that buys, once
    sent; one still waiting for its turn at `pace` sent nothing); a
    wait that would end past it is not begun, and the last answer's error is raised instead.

    A request that buys something is not idempotent (`idempotent=False`): it is never
    retried here. A timeout, connection error, 408, 425, 429 or 5xx raises OutcomeUnknown at
    once: a gateway may throttle or fail after the backend bought. `rate_limit_wait` is the wait assumed after a 429
    without Retry-After (default: exponential backoff), for an API with a documented interval.
    """
    hidden = [*secrets, _credential(client.headers.get("Authorization"))]
    if bearer is not None:
        hidden.append(bearer.get_secret_value())
        kwargs["headers"] = {**dict(kwargs.get("headers") or {}), "Authorization": f"Bearer {bearer.get_secret_value()}"}  # type: ignore[dict-item]
    hidden.append(_credential(dict(kwargs.get("headers") or {}).get("Authorization")))  # type: ignore[call-overload]
    secret_registry.register(*hidden)
    try:
        ends = asyncio.get_running_loop().time() + call_deadline
        bounds = _Bounds(deadline, max_bytes, ends)
        try:
            async with asyncio.timeout_at(ends):
                return await _send(
                    client, method, url, system, set(ok), attempts, idempotent, rate_limit_wait, sleep, pace, quotable or NOTHING, bounds, settles, kwargs
                )
        except TimeoutError:
            message = (
                f"{system}: {method} {_path(url)} got no answer within {call_deadline:g} s, the whole call's deadline "
                "(its attempts, the waits between them and its turns at the rate limit)"
            )
            if not idempotent and bounds.sent:
                raise OutcomeUnknown(message) from None
            # Still waiting for its turn: nothing was sent, so nothing was bought.
            raise TransientError(message if bounds.sent else f"{message}; nothing was sent") from None
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
    pace: Pace | None,
    quotable: Quotable,
    bounds: _Bounds,
    settles: Callable[[httpx.Response], bool] | None,
    kwargs: dict[str, object],
) -> httpx.Response:
    last: TransientError | None = None
    for attempt in range(1, attempts + 1):
        try:
            async with pace or nullcontext():
                bounds.sent = True
                response = await _bounded_request(client, method, url, bounds, kwargs)
        except TooLarge:
            message = (
                f"{system}: {method} {_path(url)} answered with a body over {bounds.max_bytes} bytes, which tgp stopped "
                "reading; check the API's base URL (a proxy or another service may answer there)"
            )
            if not idempotent:
                raise OutcomeUnknown(message) from None
            raise ConfigError(message) from None
        except (httpx.TransportError, _DeadlinePassed) as exc:
            name = f"no complete answer within {bounds.deadline:g} s" if isinstance(exc, _DeadlinePassed) else type(exc).__name__
            message = f"{system}: {method} {_path(url)} failed: {name}"
            if not idempotent:
                raise OutcomeUnknown(message) from None
            last = TransientError(message)
            wait = backoff(attempt)
        else:
            status = response.status_code
            if status >= 400:
                # Many APIs quote the request (credentials, user-data) in their errors.
                response = scrubbed_response(response)
            if status in ok or status not in RETRYABLE_STATUSES or (settles is not None and settles(response)):
                return response
            retry_after = retry_after_seconds(response)
            if retry_after is None and status == 429:
                retry_after = rate_limit_wait
            message = f"{system}: {method} {_path(url)} answered {status}: {error_message(response, quotable)}"
            if not idempotent:
                raise OutcomeUnknown(message, retry_after=retry_after)
            last = TransientError(message, retry_after=retry_after)
            wait = retry_after if retry_after is not None else backoff(attempt)
            if wait > MAX_IN_CALL_WAIT:
                break
        if attempt < attempts:
            if asyncio.get_running_loop().time() + wait >= bounds.ends:
                break  # the call's deadline would pass during the wait: say what the last attempt got
            await sleep(wait)  # type: ignore[func-returns-value]
    assert last is not None
    raise last


@dataclass
class _Bounds:
    deadline: float  # of each attempt, seconds
    max_bytes: int
    ends: float  # the whole call's deadline, on the event loop's clock
    sent: bool = False  # whether an attempt got past the pacing (a request that buys may have)


class _DeadlinePassed(Exception):
    """An attempt passed its deadline."""


async def _bounded_request(
    client: httpx.AsyncClient, method: str, url: str, bounds: _Bounds, kwargs: dict[str, object]
) -> httpx.Response:
    """One attempt within `bounds`: the answer with its whole body read (at most max_bytes,
    decoded), in at most `deadline` seconds from sending to the last byte. On the client's own
    aiohttp wire where it can (activities.http_wire), else through httpx's client."""
    wire = wire_of(client, url, kwargs)
    try:
        async with asyncio.timeout(bounds.deadline):
            if wire is not None:
                return await wire.exchange(method, url, client.headers, client.timeout, bounds.max_bytes, **kwargs)
            return await _through_httpx(client, method, url, bounds.max_bytes, kwargs)
    except TimeoutError:
        raise _DeadlinePassed() from None


async def _through_httpx(client: httpx.AsyncClient, method: str, url: str, max_bytes: int, kwargs: dict[str, object]) -> httpx.Response:
    """One attempt through httpx's client and its transport (a test's MockTransport, a proxy)."""
    request = client.build_request(method, url, **kwargs)  # type: ignore[arg-type]
    response = await client.send(request, stream=True)
    try:
        content = await read_capped(response.aiter_bytes(), max_bytes)
    except httpx.DecodingError:
        # A body its encoding does not decode is a broken answer, as on the wire (a ReadError).
        raise httpx.ReadError("the answer's body could not be decoded") from None
    finally:
        await response.aclose()
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in WIRE_ONLY]
    return httpx.Response(response.status_code, headers=headers, content=content, request=request)


def json_object(response: httpx.Response, *, system: str) -> dict[str, Any]:
    """The body as a JSON object; TransientError when it is anything else (a proxy's error
    page, a cut-off answer)."""
    try:
        data = response.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise TransientError(f"{system}: {request_line(response)} answered non-JSON")
    return data


def json_items(response: httpx.Response, field: str, *, system: str) -> list[dict[str, Any]]:
    """The objects listed under `field` of a JSON object body; other entries are skipped."""
    return [item for item in json_object(response, system=system).get(field) or [] if isinstance(item, dict)]


def _path(url: str) -> str:
    return httpx.URL(url).path if "://" in url else url
