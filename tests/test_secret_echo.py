"""Secrets never leave through error paths, even when the API echoes the request.

Many real APIs quote the request in an error answer: the Authorization header, the JSON body
with the user-data / startup script / env, sometimes in base64. Every fake can do the same
(`echo`, sim.fakeserver). tests/test_error_echo.py holds the property over every adapter,
operation, status and echo form; here, a launch per provider, with the fake echoing in one of
its ways: the API key, a minted tailnet key and a join token carried in the boot payload (and
their base64 forms) must appear in none of: the raised exception (str, repr, args, cause), the
ApplicationError `temporal_errors` makes of it, and the logs at every level (structlog as
`workers.logs.configure_logging` sets it up, and stdlib logging).

A launch runs through the real `launch_instance` activity (ActivityEnvironment), so the
minted key and the join material are the ones the activity handles. One more test runs a
whole node on the dev server against an echoing simulated cloud whose creates all fail, and
searches the exported history, `describe`, the `status` query, the result and the logs.
The scrubber itself (tgp.secrets) has a few direct tests at the end.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import re
import secrets
import string
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import structlog
from pydantic import SecretStr
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.http_wire import default_tls
import activities.http
from activities.errors import temporal_errors
from activities.node import NodeActivities
from activities.ports import AuthKey
from activities.clouds.lambdalabs import LambdaProvider
from activities.clouds.paperspace import PaperspaceProvider
from activities.clouds.runpod import RunPodProvider
from activities.clouds.simulated import SimulatedProvider
from activities.clouds.vastai import VastProvider
from tests.conftest import running_world
from tests.test_join import put_secret
from tests.test_node_lifecycle import readable, request, start, temporal_cli
from tgp.errors import AuthError, CapacityError, ConfigError, OfferRefused, PermissionDenied, TgpError, TransientError
from activities.http import OutcomeUnknown
from workers.logs import configure_logging
from sim.cloud import SimulatedCloud
from sim.fakeserver import ECHO_FORMS, ECHO_MODES
from sim.lambdalabs import FakeLambda
from sim.paperspace import FakePaperspace
from sim.runpod import FakeRunPod
from sim.vastai import FakeAsk, FakeVast
from tgp.types import BootConfig, LaunchInput, NodePhase, NodeStatus, TailnetDevice
from workflows.node import GPUNodeWorkflow

PROVIDERS = ("runpod", "lambdalabs", "paperspace", "vastai", "simulated")
# Every payload kind carries the tailnet key and the join token on a line of its own.
TEMPLATE = "K3S_TOKEN={{ BootstrapToken }}\nTS_AUTHKEY={{ TailscaleAuthKey }}\nTS_HOSTNAME={{ NodeName }}\n"
JOIN_SECRET = "tgp-system/cluster-join"
PEM = "-----BEGIN CERTIFICATE-----\nMIIBkTCB+wIJAKHBfpegPjMCMA0GCSqGSIb3DQEBCwUAMBExDzANBgNVBAMMBnRl\n-----END CERTIFICATE-----\n"
TYPED_ERRORS = {c.__name__ for c in (TgpError, TransientError, OutcomeUnknown, CapacityError, OfferRefused, AuthError, PermissionDenied, ConfigError)}
FAULTS = 20
# A leak is any run of this many characters of a secret (or of its base64): a message cut
# short in the middle of a key leaks as surely as the whole key.
WINDOW = 16


def _random(n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(n))


def join_token() -> str:
    lower = string.ascii_lowercase + string.digits
    return f"{_random(6, lower)}.{_random(16, lower)}"


def forms(secret: str) -> set[str]:
    """The ways a secret travels: itself, percent- and JSON-encoded, and its base64 (either
    alphabet) at each of the three alignments it can have inside a longer encoded text."""
    found = {secret, quote(secret, safe=""), json.dumps(secret)[1:-1]}
    raw = secret.encode()
    for skip in range(3):
        part = raw[skip:]
        part = part[: len(part) // 3 * 3]
        core = base64.b64encode(part).decode()
        found |= {core, core.replace("+", "-").replace("/", "_")}
    return {f for f in found if len(f) >= WINDOW}


# Tailscale keys embed their (public) id: tskey-auth-<key id>-<secret>, tskey-client-<client id>-<secret>.
_KEY_WITH_ID = re.compile(r"^(?:tskey|hskey)-[a-z]+-[A-Za-z0-9]+-(?=.{16})")


def leaks(text: str, secret_values: list[str]) -> list[str]:
    """The secrets some form of which shows in `text`, by any WINDOW-long run (of the part
    after a tailnet key's public id, which history and logs name on purpose)."""
    out = []
    for secret in secret_values:
        private = _KEY_WITH_ID.sub("", secret)
        if any(form[i : i + WINDOW] in text for form in forms(private) for i in range(len(form) - WINDOW + 1)):
            out.append(secret)
    return out


def exception_text(exc: BaseException | None) -> str:
    """Everything an exception shows: str, repr, args, an ApplicationError's message and
    details, and the same for its cause and context."""
    parts: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts += [str(exc), repr(exc), *map(repr, exc.args)]
        if isinstance(exc, ApplicationError):
            parts += [exc.message, repr(exc.details)]
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], str]]:
    """Logging as the worker configures it, at DEBUG, captured: structlog's rendered output
    (configure_logging prints to the sys.stderr it finds, here a buffer) and every stdlib
    record (Temporal's, httpx's)."""
    caplog.set_level(logging.DEBUG)
    rendered = io.StringIO()
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stderr", rendered)
        configure_logging("DEBUG")
    yield lambda: rendered.getvalue() + "\n" + caplog.text
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-call retries without their jittered waits (the status matrix retries a lot)."""
    monkeypatch.setattr(activities.http, "backoff", lambda attempt, base=0.5: 0.0)


async def no_sleep(seconds: float) -> None:
    return None


# --- the adapters under test, each against its fake -------------------------------------


class StubTailnet:
    """A tailnet whose minted key is a known secret (the provider matrix is about clouds)."""

    login_server = None

    def __init__(self, secret: str) -> None:
        self.secret = secret

    async def mint_auth_key(self, *, hostname: str, tags: list[str], expiry: timedelta, ephemeral: bool = True) -> AuthKey:
        return AuthKey(key_id="kstub", secret=SecretStr(self.secret))

    async def revoke_auth_key(self, key_id: str) -> None:
        return None

    async def revoke_keys_for(self, hostname: str) -> int:
        return 0

    async def find_device(self, hostname: str, tags: list[str], *, within: float = 0.0) -> TailnetDevice | None:
        return None

    async def list_devices(self, tags: list[str]) -> list[TailnetDevice]:
        return []

    async def delete_device(self, device_id: str) -> None:
        return None


class StubCluster:
    """Only what launch_instance reads: the join Secret."""

    def __init__(self, data: dict[str, bytes]) -> None:
        self.data = data

    async def read_secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        return self.data if f"{namespace}/{name}" == JOIN_SECRET else None


@dataclass
class Case:
    """One adapter against its fake: what to fault for each operation, and the secrets."""

    fake: Any
    target: Any
    paths: dict[str, tuple[str, str]]  # operation -> (fault path pattern, method)
    secrets: list[str]
    call: dict[str, Callable[[], Awaitable[object]]] = field(default_factory=dict)
    injected: Any = None

    def fault(self, op: str, status: int) -> None:
        path, method = self.paths[op]
        # Enough answers to outlast every in-call retry.
        self.fake.fail(path, status, times=FAULTS, method=method)
        self.injected = self.fake._faults[-1]

    def answered_the_error(self) -> bool:
        return self.injected.remaining < FAULTS


@asynccontextmanager
async def provider_case(name: str) -> AsyncIterator[Case]:
    key = f"{name[:3]}_{_random(32)}"
    async with AsyncExitStack() as stack:
        if name == "runpod":
            fake = await stack.enter_async_context(FakeRunPod(api_key=key))
            target = RunPodProvider(SecretStr(key), base_url=fake.url, sleep=no_sleep)
            paths = {"launch": ("/pods", "POST"), "describe": ("/pods/*", "GET"), "terminate": ("/pods/*", "DELETE"),
                     "list": ("/pods", "GET"), "offers": ("/catalog/gpus", "GET")}  # fmt: skip
        elif name == "lambdalabs":
            fake = await stack.enter_async_context(FakeLambda(api_key=key, launch_interval=0))
            target = LambdaProvider(
                SecretStr(key), ssh_key_name="tgp", base_url=fake.url, request_interval=0, launch_interval=0, sleep=no_sleep
            )
            paths = {"launch": ("/instance-operations/launch", "POST"), "describe": ("/instances/*", "GET"),
                     "terminate": ("/instance-operations/terminate", "POST"), "list": ("/instances", "GET"),
                     "offers": ("/instance-types", "GET")}  # fmt: skip
        elif name == "paperspace":
            fake = await stack.enter_async_context(FakePaperspace(api_key=key))
            target = PaperspaceProvider(SecretStr(key), base_url=fake.url, template_id=fake.template_id, sleep=no_sleep)
            paths = {"launch": ("/v1/machines", "POST"), "describe": ("/v1/machines/*", "GET"),
                     "terminate": ("/v1/machines/*", "DELETE"), "list": ("/v1/machines", "GET"),
                     "offers": ("/v1/os-templates", "GET")}  # fmt: skip
        elif name == "vastai":
            ask = FakeAsk(id=101, gpu_name="RTX 4090", geolocation="Helsinki, FI", dph_base=Decimal("0.30"))
            fake = await stack.enter_async_context(FakeVast(api_key=key, asks=[ask], min_intervals={}))
            target = VastProvider(SecretStr(key), base_url=fake.url, sleep=no_sleep, min_intervals={}, spot=False)
            paths = {"launch": ("/api/v0/asks/*", "PUT"), "describe": ("/api/v0/instances/*", "GET"),
                     "terminate": ("/api/v0/instances/*", "DELETE"), "list": ("/api/v1/instances/", "GET"),
                     "offers": ("/api/v0/bundles/", "POST")}  # fmt: skip
        else:
            fake = await stack.enter_async_context(SimulatedCloud(api_key=key, boot_delay=60))
            target = SimulatedProvider(fake.url, api_key=SecretStr(key))
            paths = {"launch": ("/v1/instances", "POST"), "describe": ("/v1/instances/*", "GET"),
                     "terminate": ("/v1/instances/*", "DELETE"), "list": ("/v1/instances", "GET"),
                     "offers": ("/v1/offers", "GET")}  # fmt: skip
        stack.push_async_callback(target.aclose)
        # A create's unknown outcome is looked up over the provider's consistency window: this
        # test is about what errors carry, so it is settled at once.
        target.consistency_window = timedelta(0)
        offers = await target.list_offers()
        assert offers, f"{name}: the fake lists no offer"
        offer = offers[0]
        auth_key, token = f"tskey-auth-k{_random(10)}CNTRL-{_random(32)}", join_token()
        join = {"controlPlaneEndpoint": b"https://100.64.0.1:6443", "clusterCA": PEM.encode(), "bootstrapToken": token.encode()}
        acts = NodeActivities(
            providers={target.name: target},
            tailnets={"stub": StubTailnet(auth_key)},  # type: ignore[dict-item]
            cluster=StubCluster(join),  # type: ignore[arg-type]
            poll_interval=timedelta(seconds=0.01),
            create_settle=timedelta(0),
        )
        launch = LaunchInput(
            node_name=f"gpu-{uuid.uuid4().hex[:6]}",
            attempt=1,
            offer=offer,
            tailnet_tags=["tag:tgp-node"],
            tailnet="stub",
            boot=BootConfig(template=TEMPLATE, join_secret=JOIN_SECRET),
        )
        case = Case(fake, target, paths, [key, auth_key, token])
        case.call = {
            "launch": lambda: ActivityEnvironment().run(acts.launch_instance, launch),
            "describe": lambda: target.describe("i-0123456789"),
            "terminate": lambda: target.terminate("i-0123456789"),
            "list": lambda: target.list_instances("gpu-"),
            "offers": lambda: target.list_offers(),
        }
        yield case


async def outcome(call: Callable[[], Awaitable[object]]) -> tuple[BaseException | None, ApplicationError | None]:
    """The exception the call raised (if any), and the ApplicationError temporal_errors makes of it."""
    try:
        await call()
    except BaseException as exc:  # noqa: BLE001 - whatever it is, its text is checked
        raised: BaseException = exc
    else:
        return None, None
    if isinstance(raised, ApplicationError):
        return raised, raised
    try:
        with temporal_errors():
            raise raised
    except ApplicationError as app:
        return raised, app
    except BaseException:  # noqa: BLE001 - not a TgpError: Temporal would record it as it is
        return raised, None


def assert_launch_failed_on_purpose(raised: BaseException | None) -> None:
    """Every error answer to a create fails the launch with one of tgp's typed errors (not,
    say, in the logging setup)."""
    assert isinstance(raised, ApplicationError) and raised.type in TYPED_ERRORS, repr(raised)


def assert_no_leak(case: Case, raised: BaseException | None, app: ApplicationError | None, logs: str) -> None:
    found = {
        "exception": leaks(exception_text(raised), case.secrets),
        "ApplicationError": leaks(exception_text(app), case.secrets),
        "logs": leaks(logs, case.secrets),
    }
    assert {where: s for where, s in found.items() if s} == {}, f"secrets leaked; raised: {raised!r}"


# --- a launch through the activity ---------------------------------------------------------
# tests/test_error_echo.py proves, over every adapter, operation, status and echo form, that no
# provider text enters an error. What is left here is the activity around a launch: the minted
# key and the join material it handles, the ApplicationError that reaches history, and the logs
# at DEBUG, once per provider (each answering a different status and echo mode).


@pytest.mark.parametrize(
    ("name", "status", "echo"),
    [(name, (400, 500, 409, 422, 503)[i], ECHO_MODES[i % len(ECHO_MODES)]) for i, name in enumerate(PROVIDERS)],
)
async def test_a_launch_whose_error_echoes_the_request_leaks_no_secret_to_history_or_logs(
    name: str, status: int, echo: str, logs: Callable[[], str]
) -> None:
    async with provider_case(name) as case:
        case.fake.echo = echo
        case.fault("launch", status)
        raised, app = await outcome(case.call["launch"])
        assert case.answered_the_error()
        assert_launch_failed_on_purpose(raised)
        assert_no_leak(case, raised, app, logs())


async def test_an_echoing_fake_does_quote_the_secrets() -> None:
    """The matrix means something: unscrubbed, an echoed error carries every secret."""
    async with provider_case("simulated") as case:
        case.fake.echo = "json"
        case.fault("launch", 400)
        async with httpx.AsyncClient(verify=default_tls(), base_url=case.fake.url) as client:
            body = {"offerId": "rtx4090-us-east", "name": "x", "userData": f"TS_AUTHKEY={case.secrets[1]}\nK3S_TOKEN={case.secrets[2]}\n"}
            answer = await client.post("/v1/instances", json=body, headers={"Authorization": f"Bearer {case.secrets[0]}"})
        assert answer.status_code == 400
        assert leaks(answer.text, case.secrets) == case.secrets
        case.fake.echo = "base64"
        case.fault("describe", 500)
        async with httpx.AsyncClient(verify=default_tls(), base_url=case.fake.url) as client:
            answer = await client.get("/v1/instances/x", headers={"Authorization": f"Bearer {case.secrets[0]}"})
        assert case.secrets[0] not in answer.text and leaks(answer.text, case.secrets[:1]) == case.secrets[:1]


# --- a whole node on the dev server -------------------------------------------------------


async def test_a_node_whose_creates_echo_the_request_keeps_every_secret_out_of_history_status_and_logs(
    temporal: WorkflowEnvironment, logs: Callable[[], str]
) -> None:
    token = join_token()
    async with running_world(temporal) as (world, _, queue):
        # Quoted in a form no scrubber lists: wrapped across lines, then upper-cased.
        world.cloud.echo = lambda s: ECHO_FORMS["upper"](ECHO_FORMS["wrapped"](s))
        for offer_id in world.cloud.catalog:
            world.cloud.set_capacity(offer_id, False)  # every create answers 409, quoting the request
        await put_secret(world.kube_url, "cluster-join", {"controlPlaneEndpoint": "https://100.64.0.1:6443", "clusterCA": PEM, "bootstrapToken": token})
        req = request(boot=BootConfig(template=TEMPLATE, join_secret=JOIN_SECRET))
        handle = await start(temporal, queue, req)
        final: NodeStatus = await handle.result()
        status: NodeStatus = await handle.query(GPUNodeWorkflow.status)

        assert final.phase is NodePhase.FAILED and world.cloud.create_requests >= 1
        reported = json.dumps(final.model_dump(mode="json"))
        assert "no capacity" in reported and "request:" not in reported, "the creates' errors are reported, without their echo"
        minted = [k.secret for k in world.tailscale.keys.values()]
        assert minted, "a key was minted for each create"
        secret_values = [*world.secrets(), token]
        history = readable(temporal_cli(temporal, "workflow", "show", "--workflow-id", req.workflow_id, "--output", "json").stdout)
        described = temporal_cli(temporal, "workflow", "describe", "--workflow-id", req.workflow_id, "--output", "json").stdout
        found = {
            "history": leaks(history, secret_values),
            "describe": leaks(readable(described), secret_values),
            "status": leaks(json.dumps(status.model_dump(mode="json")), secret_values),
            "result": leaks(json.dumps(final.model_dump(mode="json")), secret_values),
            "logs": leaks(logs(), secret_values),
        }
        assert {where: s for where, s in found.items() if s} == {}
        # Nor any 8 characters of one, in any letter case (a tailnet key's public id aside).
        private = [_KEY_WITH_ID.sub("", s) for s in secret_values]
        texts = {"history": history, "describe": described, "status": json.dumps(status.model_dump(mode="json")), "logs": logs()}
        runs = {w: [s for s in private if any(s[i : i + 8].lower() in t.lower() for i in range(len(s) - 7))] for w, t in texts.items()}
        assert {w: s for w, s in runs.items() if s} == {}


# --- the scrubber itself ------------------------------------------------------------------


def test_scrub_hides_every_form_a_registered_secret_travels_in() -> None:
    from tgp.secrets import register, scrub, secret_scope

    token, key = join_token(), f"tskey-auth-k{_random(10)}CNTRL-{_random(32)}"
    other = "pw+/" + _random(20)  # characters that JSON, percent-encoding and base64 all treat differently
    payload = f"#!/bin/sh\nexport K3S_TOKEN={token}\ntailscale up --authkey={key}\n"
    texts = [
        token,
        json.dumps({"user_data": payload}),
        quote(other, safe=""),
        json.dumps(other),
        repr(other),
        base64.b64encode(payload.encode()).decode(),  # the whole user-data, standard alphabet
        base64.urlsafe_b64encode(payload.encode()).decode().rstrip("="),  # URL-safe, unpadded
        base64.b64encode(base64.b64encode(payload.encode())).decode(),  # base64 inside base64
        "x" + base64.b64encode(f"ab{token}cd".encode()).decode()[:-3],  # misaligned, cut short
        base64.b64encode(other.encode()).decode(),
    ]
    with secret_scope():
        register(token, key, other)
        for text in texts:
            clean = scrub(f"error: {text} (end)")
            assert leaks(clean, [token, key, other]) == [], (text, clean)
            assert clean.startswith("error: ") and clean.endswith(" (end)")


def test_a_scope_forgets_its_secrets_only_after_a_while_and_short_values_are_not_secrets() -> None:
    from tgp.secrets import RECENT_LIMIT, register, scrub, secret_scope

    token = join_token()
    with secret_scope():
        register(token, "true", "1234567")
        assert scrub(f"a {token} b true 1234567") == "a [redacted] b true 1234567"
    assert scrub(token) == "[redacted]", "a late log line about the activity's secrets is still scrubbed"
    with secret_scope():
        register(*(join_token() for _ in range(RECENT_LIMIT)))
    assert scrub(token) == token, "the recent ones are bounded"


def test_an_adapter_key_is_known_from_when_the_adapter_is_built() -> None:
    from tgp.secrets import scrub

    key = "rpa_" + _random(32)
    assert scrub(f"Bearer {key}") == f"Bearer {key}"
    RunPodProvider(SecretStr(key))
    assert scrub(f"Bearer {key}") == "Bearer [redacted]"


def test_log_lines_are_scrubbed_at_every_level_stdlib_and_structlog(logs: Callable[[], str]) -> None:
    from tgp.secrets import register, secret_scope

    token = join_token()
    with secret_scope():
        register(token)
        log = structlog.get_logger("test")
        log.debug("debug", token=token, nested={"payload": [base64.b64encode(f"K={token}".encode()).decode()]})
        log.warning(f"warning {token}")
        try:
            raise RuntimeError(f"boom {token}")
        except RuntimeError:
            log.exception("failed")
            logging.getLogger("temporalio.activity").warning("Completing activity as failed %s", token, exc_info=True)
    text = logs()
    assert "boom [redacted]" in text and "Completing activity as failed [redacted]" in text
    assert leaks(text, [token]) == []
