"""What the local fake APIs in sim share: an aiohttp app on a loopback port the OS picks,
`async with` to start and stop it, a log of the requests it received, and failures injected
from Python (`fail`) that answer the next matching requests with an error.

A fake subclasses `FakeServer`, adds its routes in `_add_routes`, orders its middlewares in
`_middlewares` (its authentication before or after the injected faults, as the real API's
limiter sits), and words an injected error the way its API does in `_fault_response`.

Echo mode (`echo = "json" | "raw" | "base64"`): many real APIs quote the request in an error
answer, Authorization header and body (user-data, startup script, env) included. With `echo`
set, every error answer (status >= 400: injected, refused by the fake's own checks, or a
401) carries the request in its message field, as `echo_request` words it: the JSON request
("json"), the raw HTTP request ("raw"), or the headers and every long body field in base64
("base64", as APIs that return user-data do). The tests use it to prove no secret an adapter
sent comes back out of an error path. `echo` may also be a function of a string (a
composition of `ECHO_FORMS`: truncated, wrapped across lines, upper-cased, hex, `\\u`- or
`%XX`-escaped, HTML entities, base64): the request is then quoted with that function applied to
the Authorization header and to every string in the body, the forms no scrubber can list.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import html
import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self, TypedDict

from aiohttp import web
from aiohttp.typedefs import Middleware

__all__ = [
    "ECHO_FORMS",
    "ECHO_MODES",
    "GATEWAY_404_HTML",
    "GATEWAY_404_TEXT",
    "EchoForm",
    "EchoMode",
    "Fault",
    "FaultOptions",
    "FakeServer",
    "Handler",
    "RecordedRequest",
    "echo_errors",
    "echo_request",
    "fault_body_response",
]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
EchoMode = Literal["json", "raw", "base64"]
ECHO_MODES: tuple[EchoMode, ...] = ("json", "raw", "base64")
# How an API may quote a value it echoes; `echo` takes one, or a composition of them.
EchoForm = Callable[[str], str]


def _wrap(text: str, width: int = 19) -> str:
    return "\n".join(text[i : i + width] for i in range(0, len(text), width))


ECHO_FORMS: dict[str, EchoForm] = {
    "truncated": lambda s: s[:20],
    "wrapped": _wrap,
    "wrapped_crlf": lambda s: _wrap(s, 11).replace("\n", "\r\n "),
    "upper": str.upper,
    "lower": str.lower,
    "hex": lambda s: s.encode().hex(),
    "u_escaped": lambda s: "".join(f"\\u{ord(c):04x}" for c in s),
    "percent": lambda s: "".join(f"%{b:02X}" for b in s.encode()),
    "html_entities": lambda s: "".join(f"&#{ord(c)};" for c in s),
    "html_escaped": lambda s: html.escape(s).replace("-", "&#45;").replace("_", "&lowbar;"),
    "base64": lambda s: base64.b64encode(s.encode()).decode(),
    "base64_unpadded": lambda s: base64.urlsafe_b64encode(s.encode()).decode().rstrip("="),
}
# What answers a 404 that is not the API's own "no such object": a wrong base URL or path on a Go
# server or gateway (plain text), or a reverse proxy in front of it (nginx's HTML page). Pass
# either as `fail(..., 404, body=...)` to see that an adapter does not read it as "gone".
GATEWAY_404_TEXT = "404 page not found"
GATEWAY_404_HTML = (
    "<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n"
    "<center><h1>404 Not Found</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
)
# Body strings at least this long are base64-encoded in the "base64" echo (user-data, scripts, keys).
_ECHO_B64_MIN = 16


def fault_body_response(body: Any, status: int, headers: dict[str, str] | None = None) -> web.Response:
    """An injected answer whose body a test gave: a str as is (text/html when it is markup, else
    text/plain: what a gateway, proxy or wrong URL answers, outside any API's envelope), anything
    else as JSON."""
    if isinstance(body, str):
        kind = "text/html" if body.lstrip().startswith("<") else "text/plain"
        return web.Response(text=body, status=status, headers=headers, content_type=kind)
    return web.json_response(body, status=status, headers=headers)


def echo_request(request: web.Request, raw: bytes, mode: EchoMode | EchoForm) -> str:
    """The request as an API that quotes it in its errors would: the Authorization header and
    the body. The JSON modes quote the biggest body fields first (user-data, a script, an
    env: what an API complaining about a field quotes), so that they fall within what an
    adapter keeps of a message; "raw" quotes the body exactly as sent."""
    auth = request.headers.get("Authorization", "")
    text = raw.decode("utf-8", "replace")
    try:
        body: Any = json.loads(raw) if raw else None
    except ValueError:
        body = text
    if isinstance(body, dict):
        body = dict(sorted(body.items(), key=lambda kv: len(json.dumps(kv[1], default=str)), reverse=True))
    if callable(mode):
        quoted = json.dumps(_map_strings(body, mode), ensure_ascii=False) if not isinstance(body, str) else mode(body)
        return f"Authorization: {mode(auth)}\n{request.method} {request.path_qs}\n{quoted}"
    if mode == "raw":
        return f"Authorization: {auth}\n{request.method} {request.path_qs}\n{text}"
    if mode == "base64":
        encoded_auth = base64.b64encode(f"Authorization: {auth}".encode()).decode()
        return json.dumps({"body": _b64_fields(body), "headers": encoded_auth, "method": request.method, "path": request.path_qs})
    return json.dumps({"body": body, "headers": {"Authorization": auth}, "method": request.method, "path": request.path_qs})


def _map_strings(value: Any, form: EchoForm) -> Any:
    if isinstance(value, str):
        return form(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, form) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, form) for v in value]
    return value


def _b64_fields(value: Any) -> Any:
    if isinstance(value, str):
        return base64.b64encode(value.encode()).decode() if len(value) >= _ECHO_B64_MIN else value
    if isinstance(value, dict):
        return {k: _b64_fields(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_b64_fields(v) for v in value]
    return value


def _put_echo(body: Any, echo: str) -> bool:
    """Append `echo` to the human message of an error body (detail, message, msg, or the
    message inside an `error` object), where an adapter would quote it from."""
    if not isinstance(body, dict):
        return False
    for key in ("detail", "message", "msg", "error"):
        value = body.get(key)
        if isinstance(value, str) and value:
            body[key] = f"{value} (request: {echo})"
            return True
    return isinstance(body.get("error"), dict) and _put_echo(body["error"], echo)


async def echo_errors(request: web.Request, response: web.StreamResponse, mode: EchoMode | EchoForm | None) -> web.StreamResponse:
    """`response`, or when it is an error and `mode` is set, the same error quoting the request."""
    if mode is None or response.status < 400 or not isinstance(response, web.Response):
        return response
    echo = echo_request(request, await request.read() if request.body_exists else b"", mode)  # read() is cached
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-type", "content-length")}
    try:
        body = json.loads(response.body or b"") if isinstance(response.body, bytes) else None
    except ValueError:
        body = None
    if isinstance(body, dict):
        if not _put_echo(body, echo):
            body["request"] = echo
        return web.json_response(body, status=response.status, headers=headers, content_type=response.content_type)
    text = response.text or response.reason or ""
    return web.Response(status=response.status, headers=headers, text=f"{text} (request: {echo})", content_type=response.content_type)


@dataclass
class RecordedRequest:
    """One request a fake received. Headers are not kept (they carry the credentials)."""

    method: str
    path: str
    query: dict[str, str]
    json: Any = None
    # A form body, for the fakes that take one (an OAuth token request, its secret left out).
    form: dict[str, str] | None = None
    status: int = 0


class FaultOptions(TypedDict, total=False):
    """What `FakeServer.fail` takes besides the wording, for a fake's own `fail` to pass on."""

    times: int
    retry_after: float | str | None
    method: str | None


@dataclass
class Fault:
    """An injected failure: the next `remaining` requests whose path matches the fnmatch
    `pattern` (and `method`, unless None) are answered `status`, worded from `body`."""

    pattern: str
    method: str | None
    status: int
    remaining: int
    retry_after: str | None
    body: Any = None
    # Let the request take effect before answering the error (a create that buys, then 500s).
    after_handling: bool = False
    # The error's wording, for the fakes whose errors are a message (Tailscale, Headscale).
    message: str = ""

    @property
    def headers(self) -> dict[str, str] | None:
        """The Retry-After header, when the fault has one."""
        return {"Retry-After": self.retry_after} if self.retry_after is not None else None


class FakeServer:
    """An HTTP fake on a loopback port chosen by the OS. After `start` (or `async with`),
    `origin` is `http://127.0.0.1:<port>` and `url` the base URL to give the adapter (the
    origin plus `base_path`). `requests` logs every request received."""

    # Where the API lives under the origin; `url` points there.
    base_path = ""
    # Quote the request in every error answer (see the module docstring); None: do not.
    echo: EchoMode | EchoForm | None = None
    # Fault patterns are matched against the path without this prefix ("/pods", not "/v2/pods").
    fault_prefix = ""

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        self.requests: list[RecordedRequest] = []
        self._faults: list[Fault] = []
        self._host = host
        self._runner: web.AppRunner | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self.origin = ""
        self.url = ""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Listen on a free loopback port; `url` is then the base URL to give the adapter."""
        app = web.Application(middlewares=self._middlewares())
        self._add_routes(app.router)
        # Binding the socket ourselves gives a free port without reaching into aiohttp.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, 0))
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        self.origin = f"http://{self._host}:{sock.getsockname()[1]}"
        self.url = self.origin + self.base_path

    @property
    def root(self) -> str:
        """The server's origin, without `base_path` (to point an adapter at another version)."""
        return self.origin

    async def stop(self) -> None:
        """Stop listening and cancel pending timers."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        model = getattr(self, "model", None)  # a provider fake's ProviderModel: end held answers
        if model is not None:
            model.held.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def fail(
        self,
        path: str,
        status: int = 429,
        *,
        times: int = 1,
        retry_after: float | str | None = None,
        method: str | None = None,
        body: Any = None,
        message: str | None = None,
        after_handling: bool = False,
    ) -> None:
        """Answer the next `times` requests whose path matches the fnmatch pattern `path`, and
        `method` if given, with `status` and an error worded from `body` (None: the fake's
        default error; a str: that text as is, not in the API's envelope, as a proxy or a wrong
        base URL answers, see GATEWAY_404_TEXT), plus a Retry-After header when `retry_after` is given. A fake whose
        errors are a message words it from `message` (None: "rate limited" for a 429, else
        "injected failure"). `after_handling` lets the request take effect first (create-then-500)."""
        ra = None if retry_after is None else str(retry_after)
        wording = message or ("rate limited" if status == 429 else "injected failure")
        fault = Fault(path, method.upper() if method else None, status, times, ra, body, after_handling, wording)
        self._faults.append(fault)

    def _call_later(self, delay: float, callback: Callable[..., object], *args: object) -> asyncio.TimerHandle:
        """Run `callback(*args)` in `delay` seconds (a machine booting on its own), unless the
        server stops first."""
        timer = asyncio.get_running_loop().call_later(delay, callback, *args)
        self._timers.append(timer)
        return timer

    # --- what a fake fills in ---------------------------------------------------------

    def _add_routes(self, router: web.UrlDispatcher) -> None:
        raise NotImplementedError

    def _middlewares(self) -> list[Middleware]:
        """Log, then injected faults; a fake adds its authentication where its API checks it."""
        return [self._record, self._inject_faults]

    def _fault_response(self, fault: Fault) -> web.Response:
        """The answer to a request an injected fault catches: `body` as JSON by default, a str
        as text (see `fault_body_response`)."""
        return fault_body_response(fault.body, fault.status, fault.headers)

    async def _record_body(self, request: web.Request, entry: RecordedRequest) -> None:
        """Keep the body in the log: JSON when it parses, else None."""
        try:
            entry.json = json.loads(await request.read() or b"null")  # cached: the handler can read it again
        except ValueError:
            entry.json = None

    # --- middleware -------------------------------------------------------------------

    @web.middleware
    async def _record(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        entry = RecordedRequest(method=request.method, path=request.path, query=dict(request.query))
        if request.can_read_body:
            await self._record_body(request, entry)
        self.requests.append(entry)
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            entry.status = exc.status
            if self.echo is None or exc.status < 400:
                raise
            response = web.Response(status=exc.status, text=exc.text or exc.reason)
        entry.status = response.status
        return await echo_errors(request, response, self.echo)

    @web.middleware
    async def _inject_faults(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path.removeprefix(self.fault_prefix)
        for fault in self._faults:
            if fault.remaining > 0 and fnmatch.fnmatchcase(path, fault.pattern) and fault.method in (None, request.method):
                fault.remaining -= 1
                if fault.after_handling:
                    await handler(request)
                return self._fault_response(fault)
        self._faults = [f for f in self._faults if f.remaining > 0]
        return await handler(request)
