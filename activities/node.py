"""The node lifecycle's activities: all of its I/O, one method per stage.

Each method talks to the outside world only through the ports (CloudProvider, Tailnet,
Cluster) and turns tgp's typed errors into Temporal ApplicationErrors, so the workflow's retry
policies decide what happens next. Secrets (the minted tailnet key, the rendered boot payload)
are created and consumed inside `launch_instance` and never returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import base64
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, Field
from temporalio import activity
from temporalio.client import WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.exceptions import ApplicationError

from activities.boot.render import (
    BootSettings,
    JoinSecrets,
    TemplateError,
    join_secrets_from_secret,
    render_boot_payload,
    template_error_for_admin,
    template_join_keys,
)
from activities.batching import UpdateBatcher
from activities.boot.sandbox import RendersBusy, bounded
from activities.drain import drain
from activities.errors import temporal_errors
from activities.ledger import LedgerBatcher, LedgerCall
from activities.ports import Cluster, CloudProvider, Tailnet
from activities.termination import VERIFY_FOR, consistency_window, end_for_good, settled_at
from activities.accounts import ProviderRegistry, TailnetRegistry
from activities import metrics
from tgp.errors import AuthError, CapacityError, ConfigError, OfferRefused, PermissionDenied, QuotaExceeded, TransientError
from tgp.secrets import known_secrets, register, register_model, secret_scope
from tgp.lifecycle import holders_of, pod_keeps_node_busy
from tgp.messages import DisruptionAnswer, DisruptionAnswers, DisruptionAsks, NodeReports, PoolAsk, PoolReport
from tgp.offers import UnavailableOffers, block_for, choose_offer
from tgp.types import (
    LABEL_PROVIDER,
    BootPayload,
    CredentialsRef,
    TailnetRef,
    DrainInput,
    DrainResult,
    Instance,
    InstanceRef,
    InstanceState,
    LabelInput,
    LaunchInput,
    LaunchResult,
    BlockScope,
    MarkUnavailableInput,
    OfferBlock,
    NodeObservation,
    Offer,
    ObserveInput,
    OfferChoice,
    SelectOfferInput,
    StageCheck,
    StageLook,
    TailnetCleanupInput,
    TailnetCleanupResult,
    TailnetDevice,
    TwinWatchInput,
    instance_name,
)

log = structlog.get_logger("tgp.activities")


T = TypeVar("T")


async def _bounded(inp: LaunchInput, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn` (a blocking template inspection or render) in the renders' queue, under the share
    of the node's class (sandbox.bounded); a full queue is a TransientError (retried)."""
    try:
        return await bounded(inp.boot.node_class or inp.pool, fn, *args, **kwargs)
    except RendersBusy as exc:
        raise TransientError(f"cannot render the boot template now: {exc}") from None


async def _at_once(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn` (a render of no class template: microseconds) here, as an awaitable step."""
    return fn(*args, **kwargs)


def _whose(inp: LaunchInput) -> str:
    return f"GPUNodeClass {inp.boot.node_class}" if inp.boot.node_class else "the GPUNodeClass"


# How often a waiting or verifying activity reads the provider again (`wait_for_join` until the
# instance runs, a terminate's verification, the twin watch). Each read is one API call.
POLL_INTERVAL = timedelta(seconds=5)
# `wait_for_join` looks for the device this often (the tailnet's API, not a provider's).
JOIN_LOOK_EVERY = timedelta(seconds=1)
# Once the device joined, `wait_for_join` looks at the Node (Ready, its GPUs) for this long: the
# join's first look, which spares the workflow a timer where the Node registers with its device.
JOIN_NODE_LOOK = timedelta(seconds=2)
# How long a node waits for its pool's answer to "may I be disrupted now?" (budgets). A pool that
# is deleted, stuck or replaying a long history must not hold its nodes for ever: past this the
# node goes ahead as it would without budgets.
POOL_ANSWER_TIMEOUT = timedelta(seconds=10)
# An ask the server refused for the pool's in-flight update limit is sent again after a
# jittered pause from this, doubling up to the max (seconds).
POOL_BUSY_PAUSE = 0.2
POOL_BUSY_PAUSE_MAX = 2.0
# Upper bound on devices removed for one hostname in one cleanup (guards a runaway loop).
MAX_DEVICES_PER_HOSTNAME = 10
# A launch's settle with the class ledger (`launch_instance`'s `settle`) is tried in this many
# attempts of the launch before it gives up as `LedgerUnavailable`.
SETTLE_TRIES = 3
# In a release (`release_attempt`), each step after the terminate (tailnet, Node, class ledger)
# is tried once within this; one that fails or takes longer is left to the workflow,
# which makes it as a call of its own with its retries.
RELEASE_STEP_TIMEOUT = timedelta(seconds=20)
# A drain whose node goes releases it (`drain_node`'s `then`): its terminate, until the provider
# confirms, at most this long; past it, or failed, the workflow's release (retried until confirmed,
# TerminationStuck shown) is the one. Clouds that honour a terminate show it within seconds.
TERMINATE_ONCE_TIMEOUT = timedelta(seconds=30)
# Long calls (a create behind a provider's pacer) heartbeat at least this often.
HEARTBEAT_EVERY = timedelta(seconds=5)
# After a create that answered nothing clear (timeout, reset, 429, 5xx), the least time to look
# for the instance by name before buying again; a provider whose consistency window is longer
# is looked at for its whole window (a create can complete after its caller gave up).
CREATE_SETTLE = timedelta(seconds=30)


async def _not_the_providers(step: Awaitable[T], system: str) -> T:
    """`step`'s result. Its auth or permission error is not the provider account's (which would
    block that account, tgp.offers.block_for): a ConfigError naming the system that refused,
    which ends the node (no other offer would get past it)."""
    try:
        return await step
    except (AuthError, PermissionDenied) as exc:
        kind = type(exc).__name__
    raise ConfigError(f"{system} refused tgp's credentials ({kind}): fix its credentials or their scopes; no offer was blocked")


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


@contextmanager
def heartbeating(details: Callable[[], Sequence[Any]] = tuple) -> Iterator[None]:
    """Heartbeat in the background while the block runs, a few times per heartbeat timeout,
    each beat carrying `details()` (what a retried attempt of the activity reads back)."""
    if activity.info().is_local:
        yield  # a local activity (`check_stage`, `observe_node`) has no heartbeat to send
        return
    timeout = activity.info().heartbeat_timeout
    every = min(HEARTBEAT_EVERY, timeout / 3 if timeout else HEARTBEAT_EVERY).total_seconds()

    async def beat() -> None:
        while True:
            activity.heartbeat(*details())
            await asyncio.sleep(every)

    task = asyncio.get_running_loop().create_task(beat())
    try:
        yield
    finally:
        task.cancel()


# A report carried by an activity (`carrying`) is signalled this many times at most, pausing
# REPORT_PAUSE, doubled each time, between tries; each try's signal bounded by REPORT_RPC_TIMEOUT
# (with the reports made meanwhile: REPORT_BATCH_TIMEOUT, the client's retries included).
REPORT_TRIES = 4
REPORT_PAUSE = 0.5
REPORT_RPC_TIMEOUT = timedelta(seconds=5)
# Only the first attempts of an activity send its report, and its end waits this long at most
# for the send (`carrying`).
REPORT_ATTEMPTS = 2
REPORT_WAIT = timedelta(seconds=2)
# What a drain that releases its node (`then`) may take beyond the drain: terminate, steps, report.
DRAIN_RELEASE_BOUND = TERMINATE_ONCE_TIMEOUT + 3 * RELEASE_STEP_TIMEOUT + REPORT_WAIT


# Reports to one pool sent as one signal (`node_phases`); more wait for the next.
MAX_REPORT_BATCH = 100
# The most one batch's signal may take, the client's retries included (its default retry
# gives up after 10 s, each try bounded by REPORT_RPC_TIMEOUT).
REPORT_BATCH_TIMEOUT = timedelta(seconds=20)


class ReportBatcher(UpdateBatcher):
    """Per worker process: the reports of a pool's nodes go to it together, one signal in
    flight per pool at a time (activities.batching). A pool's 100 nodes going idle at once
    reported Draining, Terminating and Terminated as 300 signals: each an event in the pool's
    history and a write of the server's. A report alone goes as before (`node_phase`)."""

    def __init__(self) -> None:
        # Past the client's own retries of the signal (each try bounded by REPORT_RPC_TIMEOUT):
        # a batch that still hangs then is given up, and `carrying` tries its reports again.
        super().__init__(MAX_REPORT_BATCH, timeout=REPORT_BATCH_TIMEOUT.total_seconds())

    async def _update(self, client: Any, pool_workflow_id: str, kind: str, items: list[Any]) -> list[Any]:
        handle = client.get_workflow_handle(pool_workflow_id)
        try:
            if len(items) == 1:
                await handle.signal("node_phase", items[0], rpc_timeout=REPORT_RPC_TIMEOUT)
            else:
                await handle.signal("node_phases", NodeReports(reports=items), rpc_timeout=REPORT_RPC_TIMEOUT)
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                return [False] * len(items)
            raise
        return [True] * len(items)


async def signal_report(call: PoolReport, reports: ReportBatcher) -> bool:
    """Signal a node's report to its pool (`node_phase`, or with the reports this worker made
    meanwhile `node_phases`). False when the pool is gone (deleted, or a node started by hand):
    nobody is listening. Other RPC errors are raised."""
    sent: bool = await reports.call(call.pool_workflow_id, "report", call.report)
    return sent


# Reports still being signalled when their activity ended (held here, so none is collected
# mid-flight).
_reports_in_flight: set[asyncio.Task[None]] = set()


@asynccontextmanager
async def carrying(report: PoolReport | None, reports: ReportBatcher) -> AsyncIterator[None]:
    """While the block (an activity's work) runs, signal `report`, the phase the activity
    begins, to the node's pool: the activity starts at once, where a local activity in the same workflow task held its schedule until
    the pool's signal was accepted. A few tries, then given up (logged): a report is the pool's
    view, never the node's progress, and the next one carries the phase again. Sent by the
    first REPORT_ATTEMPTS attempts of the activity only (a terminate the provider refuses for
    hours is retried every two minutes: each repeat would cost the pool a workflow task). At
    the end of the block the send is waited for REPORT_WAIT at most, then left to finish on its
    own: the activity's heartbeats have stopped by then, and its result must not wait on the
    pool. Nothing the send raises reaches the activity."""
    if report is None or activity.info().attempt > REPORT_ATTEMPTS:
        yield
        return

    async def send() -> None:
        pause = REPORT_PAUSE
        for attempt in range(1, REPORT_TRIES + 1):
            try:
                await signal_report(report, reports)
                return
            except Exception as exc:  # noqa: BLE001 - a report never fails its activity
                status = exc.status.name if isinstance(exc, RPCError) and exc.status else type(exc).__name__
                if attempt == REPORT_TRIES or not isinstance(exc, (RPCError, TimeoutError)):
                    log.warning("report_not_sent", pool=report.pool_workflow_id, phase=report.report.phase.value, status=status)
                    return
                await asyncio.sleep(pause)
                pause *= 2

    sent = asyncio.get_running_loop().create_task(send())
    _reports_in_flight.add(sent)
    sent.add_done_callback(_reports_in_flight.discard)
    try:
        yield
    finally:
        await asyncio.wait([sent], timeout=REPORT_WAIT.total_seconds())


# Asks gathered into one `may_disrupt_many` update; a bigger backlog goes in the next one.
MAX_ASK_BATCH = 500


class ReleaseInput(BaseModel):
    """The release of a launch attempt, in one activity: terminate its instance, then remove it
    from the tailnet, delete its Node and (the last attempt of a life) give its place back to
    the class ledger."""

    model_config = ConfigDict(extra="forbid")
    instance: InstanceRef
    tailnet: TailnetCleanupInput
    node_name: str
    ledger: LedgerCall | None = None
    stuck_at: datetime | None = Field(
        None,
        description="An attempt whose terminate fails past this time returns `stuck` (nothing else done) instead of being "
        "retried; the workflow shows TerminationStuck and releases again without it. None: retried until it succeeds.",
    )


class JoinResult(BaseModel):
    """What `wait_for_join` saw: the joined device, and the twin watch's names with every id
    seen under them (None: the watch was not done when the device joined, or failed)."""

    model_config = ConfigDict(extra="forbid")
    device: TailnetDevice
    twins: list[InstanceRef] | None = None
    node: StageLook | None = Field(None, description="With the check's node_name: the look at the Node after the device joined.")


class ReleaseResult(BaseModel):
    """What `release_attempt` did: the terminate always (or it fails and is retried), each later
    step only if it says so; the workflow makes the steps not done itself."""

    model_config = ConfigDict(extra="forbid")
    anything_seen: bool
    tailnet_cleaned: bool = False
    node_deleted: bool = False
    released: bool = False
    stuck: bool = Field(False, description="The provider had not confirmed the terminate by `stuck_at`: nothing after it was done.")


class DrainRelease(BaseModel):
    """What a drain whose node goes does next, in the same activity: the release of the current
    attempt (`release_attempt`'s input, without `stuck_at`) and its Terminating report."""

    model_config = ConfigDict(extra="forbid")
    release: ReleaseInput
    report: PoolReport | None = None
    at: datetime = Field(description="The workflow's time at the drain's start: the release begins no earlier.")


class DrainOutcome(DrainResult):
    """The drain's result and, when the node went and the drain released it, the release's."""

    released: ReleaseResult | None = Field(None, description="The release made by the drain (its terminate confirmed); None: the workflow releases.")
    released_at: datetime | None = Field(None, description="When the drain's release began: the node's Terminating, as its pool was told.")


class PoolAskBatcher(UpdateBatcher):
    """Per worker process: the disruption asks of a pool's nodes go to it together
    (activities.batching): `call(pool_workflow_id, "ask", a DisruptionAsk)`, its answer."""

    def __init__(self) -> None:
        # As each ask was before they went together: a pool that does not answer within
        # POOL_ANSWER_TIMEOUT does not hold its nodes, and its update is not left open.
        super().__init__(MAX_ASK_BATCH, timeout=POOL_ANSWER_TIMEOUT.total_seconds())

    async def _update(self, client: Any, pool_workflow_id: str, kind: str, items: list[Any]) -> list[Any]:
        handle = client.get_workflow_handle(pool_workflow_id)
        batch = await handle.execute_update("may_disrupt_many", DisruptionAsks(asks=items), result_type=DisruptionAnswers)
        return list(batch.answers)


class NodeActivities:
    """Activities of GPUNodeWorkflow, bound to one worker's adapters."""

    def __init__(
        self,
        *,
        providers: Mapping[str, CloudProvider],
        tailnets: Mapping[str, Tailnet],
        cluster: Cluster,
        unavailable: UnavailableOffers | None = None,
        poll_interval: timedelta = POLL_INTERVAL,
        create_settle: timedelta = CREATE_SETTLE,
        registry: ProviderRegistry | None = None,
        tailnet_registry: TailnetRegistry | None = None,
        ledger: LedgerBatcher | None = None,
        now: Callable[[], datetime] = _utcnow,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        """`now` and `sleep` are the activities' clock (for consistency windows and settle
        lookups): tests pass a fake clock whose sleep moves it."""
        self.providers = dict(providers)
        # Adapters per class account (providers[].credentialsRef); `providers` is the fallback.
        self.registry = registry or ProviderRegistry(cluster=cluster, fallback=self.providers)
        self.tailnets = dict(tailnets)
        # Tailnet adapters per class (tailscaleConfig.oauthSecretRef); `tailnets` is the fallback.
        self.tailnet_registry = tailnet_registry or TailnetRegistry(cluster=cluster, fallback=self.tailnets)
        self.cluster = cluster
        self.pool_asks = PoolAskBatcher()  # the disruption asks of its nodes, one update per pool at a time
        self.reports = ReportBatcher()  # the reports of its nodes, one signal per pool at a time
        # The class ledger's calls a launch and a release carry (one per worker: the class's too).
        self.ledger = ledger or LedgerBatcher()
        # Offers that just failed, kept by the pricing cache beside the offers (shared with the pool).
        self.unavailable = unavailable or self.registry.offers.unavailable
        self.poll_interval = poll_interval
        self.terminate_once_timeout = TERMINATE_ONCE_TIMEOUT
        self.create_settle = create_settle
        self.now = now
        self.sleep = sleep

    def _settle_for(self, provider: CloudProvider) -> timedelta:
        """How long to look by name after a create whose outcome is unknown before buying again."""
        return max(self.create_settle, consistency_window(provider))

    def _lagging(self, ref: InstanceRef, provider: CloudProvider) -> bool:
        """Whether a 404 for `ref` may still be the provider lagging behind its create."""
        settle = settled_at(ref.created_by, provider, self.now())
        return settle is not None and self.now() < settle

    def _provider(self, name: str) -> CloudProvider:
        try:
            return self.providers[name]
        except KeyError:
            raise ConfigError(
                f"provider {name!r} is not configured on this worker (configured: {', '.join(sorted(self.providers)) or 'none'})"
            ) from None

    async def _provider_for(self, name: str, credentials: CredentialsRef | None, account: str | None = None) -> CloudProvider:
        """The adapter billing the class's account (`credentials`, read now), or the worker's own.
        `account`: the key an instance was bought with, which reaches it until it ends."""
        if credentials is None:
            return self._provider(name)
        return await self.registry.get(name, credentials, account)

    async def _tailnet_for(self, name: str, ref: TailnetRef | None) -> Tailnet:
        """The class's own tailnet (its Secret, read now), or the worker's."""
        return self._tailnet(name) if ref is None else await self.tailnet_registry.get(name, ref)

    def _tailnet(self, name: str) -> Tailnet:
        try:
            return self.tailnets[name]
        except KeyError:
            raise ConfigError(
                f"tailnet backend {name!r} is not configured on this worker (configured: {', '.join(sorted(self.tailnets)) or 'none'}); "
                "set TS_OAUTH_CLIENT_ID/TS_OAUTH_CLIENT_SECRET for Tailscale or HEADSCALE_URL/HEADSCALE_API_KEY for Headscale"
            ) from None

    async def _join_secrets(self, inp: LaunchInput) -> JoinSecrets | None:
        """The cluster join material from the class's join Secret, read now and kept in memory
        (None: the class references none). Which keys it must hold comes from the template,
        inspected in a bounded child process (the worker never parses a template)."""
        ref, template = inp.boot.join_secret, inp.boot.template
        if not ref:
            return None
        required = await _bounded(inp, template_join_keys, template) if template else ()
        namespace, _, name = ref.partition("/")
        failed: ConfigError | None = None
        try:
            data = await self.cluster.read_secret(namespace, name)
            if data is None:
                raise ConfigError(f"join Secret {ref} does not exist: create it or fix the GPUNodeClass's joinSecretRef (see docs/bootstrap.md)")
            encoded = {k: base64.b64encode(v).decode() for k, v in data.items()}
            return join_secrets_from_secret(encoded, secret_ref=f"Secret {ref}", required=required)
        except ConfigError as exc:
            failed = exc
        # The Secret's name and keys are the class admin's business, not the tenant's (whose
        # LaunchFailed Event carries this error): they go to the class's Events.
        await self._tell_class(inp, "JoinSecretInvalid", f"node {inp.node_name} could not be launched: {failed}")
        raise ConfigError(
            f"the join Secret of {_whose(inp)} is missing or incomplete; the class's admin sees which in its Events (reason JoinSecretInvalid)"
        )

    async def _tell_class(self, inp: LaunchInput, reason: str, message: str) -> None:
        """A Warning Event on the node's GPUNodeClass, for its admin (best effort)."""
        await self._warn_class(inp.boot.node_class, reason, message)

    async def _warn_class(self, owner: str, reason: str, message: str) -> None:
        """A Warning Event on GPUNodeClass `owner`, for its admin (best effort)."""
        try:
            if owner:
                await self.cluster.record_class_event(owner, type="Warning", reason=reason, message=message)
        except Exception as exc:  # noqa: BLE001 - the launch fails either way; the event is a courtesy
            log.warning("class_event_failed", node_class=owner, error_type=type(exc).__name__)

    async def _render_boot(self, inp: LaunchInput, kind: str, **kwargs: Any) -> BootPayload:
        """The boot payload. The class's own template renders in a bounded child process waited
        for off the event loop, in the renders' queue under the class's share (sandbox.bounded);
        without one (env, or tgp's shipped cloud-init/Talos template) it renders here, in
        microseconds, with no queue: a burst's launches no longer wait one by one per class. A
        template that fails is the class's fault, reported as `_class_template` says."""
        if kwargs.get("template") is None:
            return await self._class_template(inp, _at_once(render_boot_payload, kind, **kwargs))
        return await self._class_template(inp, _bounded(inp, render_boot_payload, kind, **kwargs))

    async def _class_template(self, inp: LaunchInput, step: Awaitable[T]) -> T:
        """`step`'s result; when the class's template fails (TemplateError), its text (which may
        quote a value made of a secret: a sliced, upper-cased join token) goes, scrubbed, to the
        class's admin as a Warning Event on the GPUNodeClass, and the error raised (what the
        node's history, the pool's LaunchFailed Event and the tenant see) says only that the
        class's template failed, and on which line."""
        failed: TemplateError | None = None
        try:
            return await step
        except TemplateError as exc:
            failed = exc
        # Raised outside the handler: the new error has neither cause nor context to show.
        assert failed is not None
        detail = template_error_for_admin(str(failed), inp.boot.template or "", known_secrets())
        await self._tell_class(inp, "TemplateFailed", f"the boot template failed for node {inp.node_name}: {detail}")
        raise TemplateError(
            f"the boot template of {_whose(inp)} failed for this node; the class's admin sees why in its Events (reason TemplateFailed)",
            line=failed.line,
        )

    # --- select offer ----------------------------------------------------------------------

    @activity.defn
    async def select_offer(self, inp: SelectOfferInput) -> OfferChoice:
        """The cheapest offer that meets the requirements and has not failed recently. Offers
        come from the pricing cache of each provider account (listed once per TTL for the whole
        worker); a provider whose listing fails serves its last good offers for a bounded time,
        and one that has none is skipped while the others' offers are still chosen from."""
        names = inp.requirements.providers or sorted(self.providers)
        with temporal_errors():
            providers = [await self._provider_for(n, inp.requirements.credentials.get(n)) for n in names]
            listed = await asyncio.gather(*(self.registry.list_offers(p) for p in providers), return_exceptions=True)
        offers, stale = [], {}
        for provider, result in zip(providers, listed, strict=True):
            if isinstance(result, BaseException):
                log.warning("offers_unavailable", provider=provider.name, error=str(result))
            else:
                if result.stale:
                    stale[provider.name] = f"offers listed {result.age:.0f}s ago; listing them again failed: {result.error}"[:300]
                    log.warning("offers_stale", provider=provider.name, age_seconds=round(result.age), error=result.error)
                offers.extend(result.offers)
        if not offers and any(isinstance(r, BaseException) for r in listed):
            with temporal_errors():
                raise TransientError(f"no provider could list offers ({', '.join(names)}); retrying")
        # What this node's own attempts failed on, and what failed on this worker lately, each
        # for the account that failed: another class's account is not hidden.
        choice = choose_offer(offers, inp.requirements, exclude=inp.exclude, blocks=[*inp.blocked, *self.unavailable.blocks()])
        return OfferChoice(
            offer=choice.offer,
            seen=len(offers),
            matching=choice.matching,
            unavailable=choice.matching - choice.eligible,
            stale=stale,
        )

    @activity.defn
    async def mark_offer_unavailable(self, inp: MarkUnavailableInput) -> None:
        """Take what a failed launch or join blocks out of rotation on this worker: the offer,
        its GPU type on its provider, or the provider account (`tgp.offers.block_for`), for the
        account that failed. A blocked account is told to the class's admin as a Warning Event
        (reason ProviderAccountBlocked): its credentials need fixing."""
        # Without a block (a workflow of an earlier build): the offer, as then.
        block = inp.block or OfferBlock(scope=BlockScope.OFFER, provider=inp.offer_key.split("/", 1)[0], offer_key=inp.offer_key)
        self.unavailable.mark(block, inp.ttl)
        log.info("offers_blocked", block=block.describe(), cause=block.cause, ttl_seconds=inp.ttl.total_seconds(), node=inp.node_name)
        if block.scope is BlockScope.ACCOUNT and inp.node_class:
            await self._warn_class(
                inp.node_class,
                "ProviderAccountBlocked",
                f"{block.describe()} is skipped by new nodes for {inp.ttl}, and by node {inp.node_name} for its whole life: "
                f"the launch failed with {block.cause} ({inp.error[:300]}); fix the credentials or the account's standing",
            )

    # --- launch ----------------------------------------------------------------------------

    @activity.defn
    async def launch_instance(self, inp: LaunchInput, report: PoolReport | None = None, settle: LedgerCall | None = None) -> LaunchResult:
        """Mint a tailnet key, render the boot payload and buy the instance, idempotently.

        The instance name comes from the workflow, so a retried or crashed attempt finds what
        it already bought and adopts it instead of buying twice. `report` (Launching) goes to
        the pool meanwhile (`carrying`). With `settle`, the price is settled with the class
        ledger first, before anything is minted or bought (`_settle`: what a refusal
        or a silent ledger raises; settling again is idempotent, a retried attempt settles the
        same reservation).
        """
        async with carrying(report, self.reports):
            if settle is not None:
                await self._settle(settle, inp.offer)
            return await self._launch_instance(inp)

    async def _settle(self, call: LedgerCall, offer: Offer) -> None:
        """The launch's settle. Refused on the activity's first attempt, nothing can have been
        bought (the settle comes first): `ClassBudgetRefused`. Refused on a later attempt, an
        earlier one may have sent a create before it died: `ClassBudgetRefusedOnRetry`, and the
        workflow's release looks for what that name bought. A ledger that does not answer is
        tried again with the launch (its retry policy), SETTLE_TRIES attempts in all, then
        `LedgerUnavailable`: not the offer's fault (the workflow marks nothing unavailable)."""
        info = activity.info()
        # The heartbeats carry an earlier attempt's memo through (LaunchMemo: what it sent and
        # bought), which `_launch_instance` reads back; an empty beat would erase it.
        previous = tuple(info.heartbeat_details)
        try:
            with heartbeating(lambda: previous):
                grant = await self.ledger.settle(call)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if info.attempt < SETTLE_TRIES:
                raise ApplicationError(
                    f"the class ledger {call.class_workflow_id} did not take the settle ({type(exc).__name__}); trying again", type="TransientError"
                ) from None
            raise ApplicationError(
                f"the class ledger {call.class_workflow_id} did not take the launch's settle in {info.attempt} tries ({type(exc).__name__})",
                type="LedgerUnavailable",
                non_retryable=True,
            ) from None
        if not grant.granted:
            # The reason is the ledger's own (its budgets, or that it is not running).
            raise ApplicationError(
                f"class budget refused {offer.key} at ${offer.hourly_price}/h: {grant.reason}",
                type="ClassBudgetRefused" if info.attempt == 1 else "ClassBudgetRefusedOnRetry",
                non_retryable=True,
            )

    async def _launch_instance(self, inp: LaunchInput) -> LaunchResult:
        name = instance_name(inp.node_name, inp.attempt)
        bound = log.bind(node=inp.node_name, provider=inp.offer.provider, offer=inp.offer.key, instance_name=name)
        # What earlier attempts of this activity sent and bought (their heartbeats): a worker
        # killed during a create leaves its successor that much to look for.
        memo = LaunchMemo.read(activity.info().heartbeat_details)
        # The heartbeat runs through the whole call, pacing waits included: a live attempt is
        # never timed out and retried beside itself; a dead worker's attempt is, within the
        # heartbeat timeout.
        # The secret scope holds the minted key and the join material (tgp.secrets): every
        # error message and log line of this activity is scrubbed of them.
        launching = metrics.counting_launch(inp.offer.provider, demand_since=inp.demand_since)
        with secret_scope(), heartbeating(memo.details), temporal_errors(), launching:
            provider = await self._provider_for(inp.offer.provider, inp.credentials)
            tailnet = await self._tailnet_for(inp.tailnet, inp.tailnet_ref)
            # An earlier attempt may have sent a create whose record died with its worker: the
            # SDK sends at most one heartbeat per 0.8 x the heartbeat timeout, and a beat made
            # within that interval of the last (`sent_at`, right before the create) goes only at
            # its end. So a retried attempt buys nothing until the provider's settle time has
            # passed since it began (every earlier create was sent before): an earlier create is
            # adopted, or known absent, first.
            settled = self.now() + self._settle_for(provider) if activity.info().attempt > 1 else self.now()
            existing = await self._adopt(provider, name, bound, memo, until=settled)
            if existing is not None:
                return LaunchResult(instance=existing, adopted=True, account=self.registry.account(provider), seen_ids=sorted(memo.seen))
            # Read the join material before minting: a missing Secret must not cost a key.
            join = await _not_the_providers(self._class_template(inp, self._join_secrets(inp)), "the Kubernetes API (reading the class's join Secret)")
            if join is not None:
                register_model(join)
            settings = BootSettings(
                node_pool=inp.pool,
                node_labels=inp.labels,
                node_taints=inp.taints,
                tailscale_tags=inp.tailnet_tags,
                tailscale_login_server=inp.boot.login_server or getattr(tailnet, "login_server", None),
                kubernetes_version=inp.boot.kubernetes_version,
                tailscale_accept_routes=inp.boot.accept_routes,
                talos_install_image=inp.boot.talos_image,
            )
            mint = tailnet.mint_auth_key(hostname=inp.node_name, tags=inp.tailnet_tags, expiry=inp.key_expiry, ephemeral=inp.boot.ephemeral)
            key = await _not_the_providers(mint, f"the tailnet ({inp.tailnet}, minting the node's key)")
            register(key.secret)
            sent = False
            try:
                boot = await self._render_boot(
                    inp,
                    provider.capabilities.boot_payload,
                    hostname=inp.node_name,
                    auth_key=key.secret,
                    template=inp.boot.template,
                    settings=settings,
                    join=join,
                    node_index=inp.attempt - 1,
                )
                # Once more right before buying: an earlier attempt's create may have landed
                # while this one minted and rendered.
                existing = await self._adopt(provider, name, bound, memo, until=self.now())
                if existing is not None:
                    await asyncio.shield(self._revoke_quietly(tailnet, key.key_id))
                    return LaunchResult(instance=existing, adopted=True, account=self.registry.account(provider), seen_ids=sorted(memo.seen))
                sent = True
                memo.sent_at = self.now()
                activity.heartbeat(*memo.details())  # at once: a worker killed from here on leaves this behind
                instance = await self._create_or_find(provider, inp, name, boot, memo)
            except BaseException as exc:
                if isinstance(exc, (CapacityError, OfferRefused, QuotaExceeded, AuthError, PermissionDenied)):
                    # At once, for the other nodes on this worker; the workflow marks it too.
                    self.unavailable.mark(block_for(type(exc).__name__, inp.offer, inp.credentials), inp.unavailable_offer_ttl)
                if not (sent and isinstance(exc, TransientError)):
                    # The key was never handed to a machine: revoke it now rather than let it
                    # age out. After an unanswered create it may be in one: keep it, so the
                    # instance that appears later can still join (cleanup revokes by hostname).
                    await asyncio.shield(self._revoke_quietly(tailnet, key.key_id))
                bound.warning("launch_failed", error=str(exc), error_type=type(exc).__name__)
                raise
            # Clouds do not enforce unique names: a create that overlapped this one (a retry
            # while the first was still in flight) bought a twin. Every attempt keeps the same
            # one (the lowest id), so two overlapping attempts never end each other's.
            live = await self._live(provider, name, memo)
            if all(i.instance_id != instance.instance_id for i in live):
                live.append(instance)  # a listing that lags behind the create
            survivor = min(live, key=lambda i: i.instance_id)
            await self._terminate_twins(provider, name, keep=survivor.instance_id, bound=bound, known=live)
            if survivor.instance_id != instance.instance_id:
                await asyncio.shield(self._revoke_quietly(tailnet, key.key_id))  # our twin is gone with its key
                bound.info("instance_adopted", instance_id=survivor.instance_id)
                return LaunchResult(instance=survivor, adopted=True, account=self.registry.account(provider), seen_ids=sorted(memo.seen))
        bound.info("instance_launched", instance_id=instance.instance_id, key_id=key.key_id)
        return LaunchResult(instance=instance, key_id=key.key_id, account=self.registry.account(provider), seen_ids=sorted(memo.seen))

    async def _look_until(self, provider: CloudProvider, name: str, memo: LaunchMemo, until: datetime) -> list[Instance]:
        """The live instances under `name`, looked for until some show up or `until` has passed
        (at least one look)."""
        while True:
            found = await self._live(provider, name, memo)
            if found or self.now() >= until:
                return found
            await self.sleep(self.poll_interval.total_seconds())

    async def _live(self, provider: CloudProvider, name: str, memo: LaunchMemo) -> list[Instance]:
        """Every live instance under `name`: listed, or bought by an earlier attempt (its create
        answered; a 404 for it while the window is open is the provider lagging)."""
        # Coalesced with the account's other launches, never older than this call (name_lists).
        found = {i.instance_id: i for i in await self.registry.lookups.find_all_by_name(provider, name)}
        for bought in memo.bought:
            if bought.instance_id in found:
                continue
            now = await provider.describe(bought.instance_id)
            if now is not None and now.state is not InstanceState.TERMINATED:
                found[now.instance_id] = now
            elif now is None and memo.sent_at is not None and self.now() < memo.sent_at + consistency_window(provider):
                found[bought.instance_id] = bought
        memo.seen.update(found)
        return list(found.values())

    async def _adopt(self, provider: CloudProvider, name: str, bound: structlog.BoundLogger, memo: LaunchMemo, *, until: datetime) -> Instance | None:
        """The live instance an earlier attempt bought under `name`, if any, looked for until
        `until` (at least once); twins beyond the first are terminated, so at most one instance
        per name is left running."""
        found = await self._look_until(provider, name, memo, until)
        if not found:
            return None
        keep = min(found, key=lambda i: i.instance_id)  # the same rule as after a create: the lowest id survives
        await self._terminate_twins(provider, name, keep=keep.instance_id, bound=bound, known=found)
        bound.info("instance_adopted", instance_id=keep.instance_id)
        return keep

    async def _terminate_twins(
        self, provider: CloudProvider, name: str, *, keep: str, bound: structlog.BoundLogger, known: list[Instance] | None = None
    ) -> None:
        for twin in known if known is not None else await provider.find_all_by_name(name):
            if twin.instance_id != keep:
                bound.warning("duplicate_instance_terminated", instance_id=twin.instance_id, kept=keep)
                await provider.terminate(twin.instance_id)

    async def _create_or_find(self, provider: CloudProvider, inp: LaunchInput, name: str, boot, memo: LaunchMemo) -> Instance:  # type: ignore[no-untyped-def]
        try:
            instance = await provider.launch(inp.offer, name=name, boot=boot)
        except TransientError:
            # A 429, 5xx, reset or timeout on create may still have bought the instance, or
            # may buy it later, and a cloud may take a while to list it: look for it over the
            # settle time (the provider's consistency window) before giving up; never resend
            # blind. The heartbeat goes on.
            found = await self._look_until(provider, name, memo, self.now() + self._settle_for(provider))
            if not found:
                raise
            return min(found, key=lambda i: i.instance_id)
        memo.bought.append(instance)
        memo.seen[instance.instance_id] = instance
        activity.heartbeat(*memo.details())
        return instance

    async def _revoke_quietly(self, tailnet: Tailnet, key_id: str) -> None:
        try:
            await tailnet.revoke_auth_key(key_id)
        except Exception as exc:  # the key expires on its own; cleanup also revokes by hostname
            log.warning("key_revoke_failed", key_id=key_id, error=str(exc))

    # --- join ------------------------------------------------------------------------------

    @activity.defn
    async def wait_for_join(self, q: StageCheck, twins: TwinWatchInput | None = None) -> JoinResult:
        """Wait for the instance to boot and its device to join the tailnet, and beside it
        `watch_for_twins` (one activity and one workflow task instead of two). The device is
        looked for every JOIN_LOOK_EVERY (the tailnet is ours to ask; a joined device means a
        running machine); the provider is read every poll interval until the instance runs:
        LaunchFailed if it fails or vanishes meanwhile (a 404 inside the provider's consistency
        window after the create is the provider lagging, not a vanished instance). Heartbeats go
        on through every look, however slow; how long to wait is the workflow's stage deadline.

        The join decides when it ends: a twin watch not done by then (a provider whose
        consistency window outlasts the boot) or failed is cancelled and reported not done, and
        the workflow watches on in the background."""
        watch = asyncio.ensure_future(self._watch_for_twins(twins)) if twins is not None else None
        try:
            device = await self._wait_for_tailnet_join(q)
            node = await self._look_at_node(q) if q.node_name is not None else None
        finally:
            if watch is not None:
                if not watch.done():
                    watch.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watch  # its end taken, whatever it was (an error is logged below)
        if watch is None or watch.cancelled():
            return JoinResult(device=device, node=node)
        if (error := watch.exception()) is not None:
            log.info("twin_watch_left_to_the_workflow", error=type(error).__name__)
            return JoinResult(device=device, node=node)
        return JoinResult(device=device, twins=watch.result(), node=node)

    async def _look_at_node(self, q: StageCheck) -> StageLook | None:
        """The Node Ready with its GPUs (`q.gpus`), looked for JOIN_NODE_LOOK after the device
        joined; what the last look saw (None: it failed, the workflow waits for the facts)."""
        until = time.monotonic() + JOIN_NODE_LOOK.total_seconds()
        while True:
            try:
                look = await self.check_stage(StageCheck(node_name=q.node_name, gpus=q.gpus))
            except Exception as exc:  # noqa: BLE001 - the workflow waits for the facts instead
                log.info("node_look_failed", error=type(exc).__name__)
                return None
            if look.up or time.monotonic() >= until:
                return look
            await asyncio.sleep(JOIN_LOOK_EVERY.total_seconds())

    async def _wait_for_tailnet_join(self, q: StageCheck) -> TailnetDevice:
        assert q.instance is not None and q.device is not None
        ref, dq = q.instance, q.device
        running = False
        next_read = 0.0
        with heartbeating():
            while True:
                try:
                    with temporal_errors():
                        device = await (await self._tailnet_for(dq.tailnet, dq.tailnet_ref)).find_device(dq.hostname, dq.tags)
                        if device is not None:
                            return device
                        if not running and time.monotonic() >= next_read:
                            next_read = time.monotonic() + self.poll_interval.total_seconds()
                            provider = await self._provider_for(ref.provider, ref.credentials, ref.account)
                            inst = await provider.describe(ref.instance_id or "")
                            if inst is None and self._lagging(ref, provider):
                                pass  # a 404 right after the create: the provider has not caught up yet
                            elif inst is None or inst.interrupted or inst.state in (InstanceState.FAILED, InstanceState.TERMINATED, InstanceState.STOPPED):
                                state = "vanished" if inst is None else ("was interrupted" if inst.interrupted else inst.state.value.lower())
                                metrics.LAUNCH_FAILURES.labels(ref.provider, "LaunchFailed").inc()
                                raise ApplicationError(
                                    f"instance {ref.instance_id} on {ref.provider} {state} while booting", type="LaunchFailed", non_retryable=True
                                )
                            else:
                                running = inst.state is InstanceState.RUNNING
                except ApplicationError as exc:
                    if exc.non_retryable:
                        raise
                    log.info("poll_transient_error", activity=activity.info().activity_type, error=str(exc))
                await asyncio.sleep(min(self.poll_interval, JOIN_LOOK_EVERY).total_seconds())

    @activity.defn
    async def check_stage(self, inp: StageCheck) -> StageLook:
        """One look at a join stage: is the instance running, the device in the tailnet, the
        Node Ready, its GPUs registered? Taken as the join's backstop while the bridge says
        nothing, and once more when a stage's deadline has passed, before the attempt is failed
        over: the wait may have missed them by a slow look or by a worker that died, and a
        healthy instance must not be released for that."""
        with heartbeating(), temporal_errors():
            seen: list[str] = []
            if inp.instance is not None:
                ref = inp.instance
                provider = await self._provider_for(ref.provider, ref.credentials, ref.account)
                inst = await provider.describe(ref.instance_id or "")
                if inst is None and self._lagging(ref, provider):
                    return StageLook(up=False, seen=f"instance {ref.instance_id} is not visible yet ({provider.name} lags behind its create)")
                state = "gone" if inst is None else ("interrupted" if inst.interrupted else inst.state.value.lower())
                if inst is None or inst.interrupted or inst.state is not InstanceState.RUNNING:
                    return StageLook(up=False, seen=f"instance {ref.instance_id} is {state}")
                seen.append(f"instance {ref.instance_id} is {state}")
            if inp.device is not None:
                tailnet = await self._tailnet_for(inp.device.tailnet, inp.device.tailnet_ref)
                device = await tailnet.find_device(inp.device.hostname, inp.device.tags)
                if device is None:
                    return StageLook(up=False, seen=f"no tailnet device {inp.device.hostname}")
                seen.append(f"tailnet device {inp.device.hostname} is there")
            if inp.node_name is not None:
                node = await self.cluster.get_node(inp.node_name)
                if node is None or not node.ready:
                    return StageLook(up=False, seen=f"Node {inp.node_name} is {'missing' if node is None else 'not Ready'}")
                seen.append(f"Node {inp.node_name} is Ready")
                if inp.gpus is not None:
                    if node.gpus < inp.gpus:
                        return StageLook(up=False, seen=f"Node {inp.node_name} has {node.gpus} of {inp.gpus} GPUs allocatable")
                    seen.append(f"its {node.gpus} GPUs are registered")
        return StageLook(up=True, seen=", ".join(seen))

    @activity.defn
    async def label_and_taint_node(self, inp: LabelInput, report: PoolReport | None = None) -> None:
        """Give the Node its pool's labels and taints, and take off those tgp had set that the pool
        no longer lists (idempotent). `report` (Ready) goes to the pool once they are on
        (`carrying`: waited for REPORT_WAIT at most)."""
        with temporal_errors():
            await self.cluster.label_and_taint(inp.node_name, inp.labels, inp.taints, remove_labels=inp.remove_labels, remove_taints=inp.remove_taints)
        async with carrying(report, self.reports):
            pass  # Ready once the labels and taints are on: the pool may act on it (make-before-break)
        if inp.launched_at is not None:
            metrics.LAUNCH_TO_READY.labels(inp.labels.get(LABEL_PROVIDER, "")).observe(metrics.seconds_since(inp.launched_at))

    # --- watch -----------------------------------------------------------------------------

    @activity.defn
    async def observe_node(self, inp: ObserveInput) -> NodeObservation:
        """One look at a Ready node: is the instance alive, is the Node Ready, is it busy?"""
        with temporal_errors():
            provider = await self._provider_for(inp.instance.provider, inp.instance.credentials, inp.instance.account)
            instance = await provider.describe(inp.instance.instance_id or "")
            if instance is None and self._lagging(inp.instance, provider):
                # A running instance can read 404 while the provider lags behind its create:
                # an unknown, not a vanished instance (the watch looks again).
                raise TransientError(f"instance {inp.instance.instance_id} is not visible on {provider.name} yet")
            node = await self.cluster.get_node(inp.node_name)
            pods = await self.cluster.list_pods_on_node(inp.node_name) if node is not None else []
        holders, holding = holders_of(pods)
        return NodeObservation(instance=instance, node=node, busy_pods=sum(1 for p in pods if pod_keeps_node_busy(p)), holders=holders, holding=holding)

    # --- disruption budgets ----------------------------------------------------------------

    @activity.defn
    async def ask_pool_to_disrupt(self, call: PoolAsk) -> DisruptionAnswer:
        """Ask the node's pool whether it may begin a voluntary disruption now (its budgets).
        A pool that is gone or does not answer within POOL_ANSWER_TIMEOUT does not hold the
        node: it goes ahead as before budgets. Any other failure (the pool's update queue full,
        Temporal unreachable) is a refusal for now: the node asks again later."""
        return await self._ask_pool(call)

    async def _ask_pool(self, call: PoolAsk) -> DisruptionAnswer:
        busy = False
        try:
            async with asyncio.timeout(POOL_ANSWER_TIMEOUT.total_seconds()):
                pause = POOL_BUSY_PAUSE
                while True:
                    try:
                        # With the asks of this worker's other nodes of the pool made meanwhile.
                        answer: DisruptionAnswer = await self.pool_asks.call(call.pool_workflow_id, "ask", call.ask)
                        return answer
                    except RPCError as exc:
                        # Temporal admits 10 updates in flight per workflow: when more workers'
                        # nodes of a pool ask at once, the others are refused by the server, not by
                        # the pool (RESOURCE_EXHAUSTED; an admitted update the server dropped says
                        # UNAVAILABLE, "update was aborted"). Ask again after a jittered, growing
                        # pause: not a refusal.
                        if exc.status not in (RPCStatusCode.RESOURCE_EXHAUSTED, RPCStatusCode.UNAVAILABLE):
                            raise
                        busy = True
                        await asyncio.sleep(random.uniform(pause / 2, pause))
                        pause = min(pause * 2, POOL_BUSY_PAUSE_MAX)
        except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError):
            if busy:
                return DisruptionAnswer(allowed=False, unasked=True, message="the pool's updates stayed at Temporal's in-flight limit: asking again soon")
            # The SDK reports the update's wait cut short by the timeout as its own error type.
            return DisruptionAnswer(allowed=True, message=f"the pool did not answer within {POOL_ANSWER_TIMEOUT.total_seconds():.0f}s: not held")
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                return DisruptionAnswer(allowed=True, message="the pool is gone: not held")
            return DisruptionAnswer(allowed=False, message=f"could not ask the pool ({exc.status.name if exc.status else 'RPCError'}): asking again later")
        except WorkflowUpdateFailedError as exc:
            return DisruptionAnswer(allowed=True, message=f"the pool could not answer ({type(exc.cause).__name__}): not held")

    @activity.defn
    async def report_to_pool(self, call: PoolReport) -> bool:
        """Signal the node's report to its pool (`node_phase`) from a local activity: a phase
        that no activity begins (Ready again, TerminationStuck, the final one). Sent again when a
        worker dies around it: the pool keeps the newest report per node (by `at`), so a repeat
        changes nothing. A pool that is gone (deleted, or a node started by hand) has nobody
        listening: False."""
        return await signal_report(call, self.reports)

    # --- drain -----------------------------------------------------------------------------

    @activity.defn
    async def drain_node(self, inp: DrainInput, report: PoolReport | None = None, then: DrainRelease | None = None) -> DrainOutcome:
        """Cordon, evict the workload pods and wait until they are gone, as `kubectl drain`
        does (activities.drain). Never fails for a stuck pod: the result says which pods were
        not evicted or still shutting down, and the node goes anyway. `report` (Draining) goes to
        the pool meanwhile (`carrying`).

        With `inp.ask` (a voluntary end) the pool's budgets are asked first, as
        `ask_pool_to_disrupt` asks them: refused, the result carries the answer and nothing is
        touched (nor reported); the node stays Ready.

        With `then`, a node that goes is released here (`release_attempt` without its own
        activity and workflow task), carrying the Terminating report: billing stops at the
        drain's end. A terminate the provider does not confirm within TERMINATE_ONCE_TIMEOUT is
        left to the workflow's release."""
        if inp.ask is not None and activity.info().attempt == 1:  # a retry holds the first attempt's grant
            answer = await self._ask_pool(inp.ask)
            if not answer.allowed:
                return DrainOutcome(evicted=0, answer=answer)
        started = time.monotonic()
        async with carrying(report, self.reports):
            with temporal_errors():
                result = await drain(
                    self.cluster, inp, poll_interval=self.poll_interval, heartbeat=activity.heartbeat, retry=activity.info().attempt > 1
                )
        outcome = "timed_out" if result.remaining or result.terminating else "drained"
        metrics.DRAIN_DURATION.labels(outcome).observe(time.monotonic() - started)
        if then is None or result.called_off or result.held:
            return DrainOutcome(**dict(result))
        at = max(then.at, datetime.now(timezone.utc))  # never before the workflow's time (a test server's runs ahead)
        async with carrying(_dated(then.report, at), self.reports):
            released = await self._release_after_drain(then.release)
        return DrainOutcome(**dict(result), released=released, released_at=at)

    async def _release_after_drain(self, inp: ReleaseInput) -> ReleaseResult | None:
        """A drained node's release. Its terminate is bounded and never raised (None: the
        workflow's release makes it, with its retries and TerminationStuck)."""
        try:
            async with asyncio.timeout(self.terminate_once_timeout.total_seconds()):
                seen = await self._terminate_instance(inp.instance)
        except Exception as exc:  # noqa: BLE001 - the workflow's release makes it
            log.warning("release_after_drain_left_to_the_workflow", instance_name=inp.instance.instance_name, error=type(exc).__name__)
            return None
        return await self._release_rest(inp, seen)

    # --- terminate -------------------------------------------------------------------------

    @activity.defn
    async def terminate_instance(self, ref: InstanceRef, report: PoolReport | None = None) -> bool:
        """Stop paying for every instance of a launch attempt: the recorded one, every id ever
        seen under its name, and every live one carrying its name (a twin bought by an
        overlapping or late create bills as much). Works without an instance id (a launch
        cancelled in flight). Done only when a read shows each terminated or gone, and (when
        the attempt's creates are recent) once the provider's consistency window has passed.
        Returns whether anything was seen. `report` (Terminating) goes to the pool meanwhile
        (`carrying`)."""
        async with carrying(report, self.reports):
            return await self._terminate_instance(ref)

    async def _terminate_instance(self, ref: InstanceRef) -> bool:
        with heartbeating(), temporal_errors(always_retry=True), metrics.counting_failures(metrics.TERMINATION_FAILURES, ref.provider):
            # Its look-ups by name share the account's listings (never older than its own).
            provider = self.registry.sharing_lookups(await self._provider_for(ref.provider, ref.credentials, ref.account))
            seen = await end_for_good(
                provider,
                [*ref.known_ids, ref.instance_id or ""],
                names=[ref.instance_name],
                settle=settled_at(ref.created_by, provider, self.now()),
                now=self.now,
                sleep=self.sleep,
                every=self.poll_interval,
            )
            log.info("instances_terminated", provider=ref.provider, instance_name=ref.instance_name, instance_ids=sorted(seen))
        return bool(seen)

    @activity.defn
    async def release_attempt(self, inp: ReleaseInput, report: PoolReport | None = None) -> ReleaseResult:
        """A launch attempt's release: terminate (as `terminate_instance`, until the provider
        confirms), then the cleanup that follows it (`remove_from_tailnet`, `delete_node`, the
        class ledger's release), each tried once and bounded (RELEASE_STEP_TIMEOUT). A step that
        fails is reported not done, never raised: the terminate is not made again for it, and
        the workflow makes that step as a call of its own. One activity and one workflow task
        for four steps. `report` (Terminating) goes to the pool meanwhile.

        With `inp.stuck_at`, an attempt scheduled at or past that time whose terminate fails
        returns `stuck` instead: the workflow needs no timer of its own beside it."""
        async with carrying(report, self.reports):
            try:
                seen = await self._terminate_instance(inp.instance)
            except Exception:
                # Temporal's clock (the attempt's schedule), as the workflow's that set stuck_at.
                if inp.stuck_at is None or activity.info().current_attempt_scheduled_time < inp.stuck_at:
                    raise  # retried by Temporal (CLEANUP_RETRY)
                log.warning("termination_stuck", provider=inp.instance.provider, instance_name=inp.instance.instance_name)
                return ReleaseResult(anything_seen=True, stuck=True)
            return await self._release_rest(inp, seen)

    async def _release_rest(self, inp: ReleaseInput, seen: bool) -> ReleaseResult:
        """The steps after a confirmed terminate, each tried once (`_step`)."""
        with heartbeating():
            tailnet = await _step("remove_from_tailnet", self.remove_from_tailnet(inp.tailnet))
            node = await _step("delete_node", self.delete_node(inp.node_name))
            released = inp.ledger is not None and await _step("release_reservation", self.ledger.release(inp.ledger))
        return ReleaseResult(anything_seen=seen, tailnet_cleaned=tailnet, node_deleted=node, released=released)

    @activity.defn
    async def watch_for_twins(self, inp: TwinWatchInput) -> list[InstanceRef]:
        """While the node lives: end (and verify) every instance under its attempts' names
        that is not the one it recorded (`keep`), until each name's consistency window has
        passed, since a create can complete after its caller gave up. Returns the names with
        every id seen under them, for the workflow to remember."""
        return await self._watch_for_twins(inp)

    async def _watch_for_twins(self, inp: TwinWatchInput) -> list[InstanceRef]:
        with heartbeating(), temporal_errors():

            async def watch(ref: InstanceRef) -> InstanceRef:
                # Its look-ups by name share the account's listings with launches and other
                # watches (activities.name_lists: never an older view than its own call).
                provider = self.registry.sharing_lookups(await self._provider_for(ref.provider, ref.credentials, ref.account))
                settle = settled_at(ref.created_by, provider, self.now())
                budget = VERIFY_FOR + max(timedelta(0), (settle - self.now()) if settle else timedelta(0))
                seen = await end_for_good(
                    provider, ref.known_ids, names=[ref.instance_name], keep=inp.keep, settle=settle,
                    now=self.now, sleep=self.sleep, every=self.poll_interval, budget=budget,
                )
                return ref.model_copy(update={"known_ids": sorted(set(ref.known_ids) | seen)})

            return list(await asyncio.gather(*(watch(ref) for ref in inp.instances)))

    @activity.defn
    async def remove_from_tailnet(self, inp: TailnetCleanupInput) -> TailnetCleanupResult:
        """Revoke the node's unused keys and delete its tailnet devices. A tailnet this worker has
        no backend for, through which no key of the node was ever minted, has nothing of the
        node to clean: done (retrying would hold a deleted pool, and its budget, for ever)."""
        revoked = deleted = 0
        if inp.tailnet_ref is None and inp.tailnet not in self.tailnets and not inp.key_ids:
            log.warning("tailnet_cleanup_skipped", hostname=inp.hostname, tailnet=inp.tailnet, reason="backend not configured, no key minted")
            return TailnetCleanupResult(keys_revoked=0, devices_deleted=0)
        with temporal_errors(always_retry=True):
            tailnet = await self._tailnet_for(inp.tailnet, inp.tailnet_ref)
            for key_id in inp.key_ids:
                await tailnet.revoke_auth_key(key_id)
            revoked = await tailnet.revoke_keys_for(inp.hostname)
            for _ in range(MAX_DEVICES_PER_HOSTNAME):
                device = await tailnet.find_device(inp.hostname, inp.tags)
                if device is None:
                    break
                await tailnet.delete_device(device.device_id)
                deleted += 1
        return TailnetCleanupResult(keys_revoked=revoked, devices_deleted=deleted)

    @activity.defn
    async def delete_node(self, node_name: str) -> None:
        """Delete the Node object (already gone counts as deleted)."""
        with temporal_errors(always_retry=True):
            await self.cluster.delete_node(node_name)

    def all(self) -> list[Callable[..., object]]:
        """Every activity, for Worker(activities=...)."""
        return [
            self.select_offer,
            self.mark_offer_unavailable,
            self.launch_instance,
            self.wait_for_join,
            self.check_stage,
            self.label_and_taint_node,
            self.observe_node,
            self.ask_pool_to_disrupt,
            self.report_to_pool,
            self.drain_node,
            self.terminate_instance,
            self.release_attempt,
            self.watch_for_twins,
            self.remove_from_tailnet,
            self.delete_node,
        ]


def _dated(report: PoolReport | None, at: datetime) -> PoolReport | None:
    """A report the workflow made ahead (the Terminating a drain may begin), dated when it began."""
    if report is None:
        return None
    stages = [s.model_copy(update={"at": at}) for s in report.report.stages]
    return report.model_copy(update={"report": report.report.model_copy(update={"at": at, "stages": stages})})


async def _step(name: str, call: Awaitable[object]) -> bool:
    """One cleanup step of `release_attempt`: whether it was done within RELEASE_STEP_TIMEOUT.
    A failure is logged by its type only (an adapter's message may quote a response body)."""
    try:
        async with asyncio.timeout(RELEASE_STEP_TIMEOUT.total_seconds()):
            await call
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the workflow makes the step again on its own
        log.warning("release_step_left_to_the_workflow", step=name, error=type(exc).__name__)
        return False
    return True


class LaunchMemo:
    """What one launch activity carries from a failed or killed attempt to the next, in its
    heartbeat details: when it last sent a create, and what its creates answered with."""

    def __init__(self, sent_at: datetime | None = None, bought: list[Instance] | None = None) -> None:
        self.sent_at = sent_at
        self.bought = list(bought or [])
        self.seen: dict[str, Instance] = {i.instance_id: i for i in self.bought}

    @classmethod
    def read(cls, details: Sequence[Any]) -> LaunchMemo:
        """The memo of the last heartbeat an earlier attempt sent (none: a fresh memo)."""
        raw = details[0] if details else None
        if not isinstance(raw, dict):
            return cls()
        sent = raw.get("sent_at")
        return cls(
            sent_at=datetime.fromisoformat(sent) if isinstance(sent, str) else None,
            bought=[Instance.model_validate(i) for i in raw.get("bought") or []],
        )

    def details(self) -> tuple[dict[str, Any], ...]:
        if self.sent_at is None and not self.bought:
            return ()
        return ({"sent_at": self.sent_at.isoformat() if self.sent_at else None, "bought": [i.model_dump(mode="json") for i in self.bought]},)
