"""Offer and launch: choose the best offer not yet tried, buy it (the class ledger settles the
price first, inside the launch), and fail over to the next offer when an attempt gives no node.

Money by ids: the attempt's instance name is remembered before the create goes out, and every
id seen under it after; a launch that failed may still have bought (an unknown outcome, a
killed worker), so its name is looked at until the provider's consistency window has passed."""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from activities.node import NodeActivities
    from activities.node_class import LedgerCall
    from tgp.offers import block_for
    from tgp.types import TAINT_JOINING, DeviceQuery, InstanceRef, JoinPlan, JoinResult, LaunchAttempt, LaunchInput, LaunchResult, MarkUnavailableInput, NodePhase, Offer, OfferBlock, SelectOfferInput, StageCheck, instance_name
    from workflows.entity import describe
    from workflows.node.join import check_stage, join
    from workflows.node.labels import label_and_taint, ready_labels
    from workflows.node.life import Life, LaunchAttemptFailed, NotSettled, human
    from workflows.node.release import release_attempt
    from workflows.retries import API_RETRY, LAUNCH_RETRY

# A launch that failed with one of these was refused before anything was bought: no create of
# it can still be landing, so its release need not wait out the consistency window.
CLEAR_REFUSALS = ("CapacityError", "OfferRefused", "QuotaExceeded", "ConfigError", "TemplateError", "AuthError", "PermissionDenied", "ClassBudgetRefused")
# The launch's settle with the class ledger stopped it: no other offer is tried.
NOT_SETTLED = ("ClassBudgetRefused", "ClassBudgetRefusedOnRetry", "LedgerUnavailable")


class OfferFailed(LaunchAttemptFailed):
    """The launch failed with the provider's error `cause` (its type: CapacityError,
    QuotaExceeded, AuthError, ...), which says what to block (`tgp.offers.block_for`)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


async def bring_up(life: Life) -> None:
    """Select, launch, join and label, failing over until one works: by cause, like SkyPilot.
    A failed attempt blocks what its cause covers (the offer; for a quota, its GPU type in every
    region of the provider; for rejected credentials, the provider account), for the class's
    account: no later attempt of this node is spent on it, and other nodes on the worker skip it
    for a while (`unavailable_offer_ttl`). The first offer may come with the request (the
    pool's start chose it, and started the run Launching): no choice, no Pending."""
    tried = [a.offer.key for a in life.state.attempts]
    chosen = life.req.offer if not tried else None
    if chosen is None:
        life.enter(NodePhase.PENDING)
    while len(life.state.attempts) < life.req.max_launch_attempts:
        life.check_evicted()
        offer, chosen = chosen or await select_offer(life, tried), None
        life.state.offer = offer
        life.check_evicted()  # evicted while choosing: buy nothing
        attempt = LaunchAttempt(attempt=len(life.state.attempts) + 1, offer=offer, started_at=workflow.now())
        life.state.attempts.append(attempt)
        tried.append(offer.key)
        try:
            launched = await launch(life, attempt)
            await join(life, launched)
            await label_and_taint(life, labelled=launched.join is not None and launched.join.labelled)
            return
        except NotSettled:
            raise  # not the offer's fault: the node ends Failed
        except LaunchAttemptFailed as exc:
            if life.cancel_requested():
                raise asyncio.CancelledError() from None  # not this offer's fault: buy nothing more
            life.record(attempt, str(exc))
            life.state.last_error = f"attempt {attempt.attempt} on {offer.key}: {exc}"
            workflow.logger.warning("launch attempt failed, trying the next offer: %s", life.state.last_error)
            await release_attempt(life)
            block = block_for(getattr(exc, "cause", ""), offer, life.req.requirements.credentials.get(offer.provider))
            if block not in life.state.blocked:
                life.state.blocked.append(block)
            await mark_unavailable(life, block, str(exc))
    raise LaunchAttemptFailed(f"gave up after {life.req.max_launch_attempts} launch attempts; last error: {life.state.last_error}")


async def select_offer(life: Life, tried: list[str]) -> Offer:
    """The best offer not yet tried. None left ends the node Failed, saying why."""
    choice = await life.call(
        NodeActivities.select_offer,
        SelectOfferInput(requirements=life.req.requirements, exclude=tried, blocked=life.state.blocked),
        timeout=life.timeouts.api_call,
        retry=API_RETRY,
        summary="select offer",
    )
    if choice.offer is None:
        if choice.matching == 0:
            why = f"no offer among {choice.seen} satisfies the requirements {life.req.requirements.model_dump(mode='json', exclude_defaults=True)}"
        else:
            why = f"all {choice.matching} matching offers were tried or recently failed"
            if life.state.blocked:
                why += f" (blocked: {'; '.join(b.describe() for b in life.state.blocked)})"
        raise LaunchAttemptFailed(why if not life.state.last_error else f"{why}; last error: {life.state.last_error}")
    return choice.offer


async def launch(life: Life, attempt: LaunchAttempt) -> LaunchResult:
    """Mint the tailnet key, buy the instance and wait for it to join the tailnet: one activity
    (the key never leaves it; one workflow task for the buy and the join, issue 37)."""
    offer, req, t = attempt.offer, life.req, life.timeouts
    # Before the phase: its upsert then says this attempt has no instance yet (not the last one's).
    # The credentials: the class's account for this provider (a reference; the activities read the key).
    credentials = req.requirements.credentials.get(offer.provider)
    life.state.instance = InstanceRef(provider=offer.provider, instance_name=instance_name(req.node_name, attempt.attempt), credentials=credentials)
    life.enter(NodePhase.LAUNCHING)
    report = life.tell_pool(carry=True)
    life.remember(life.state.instance)
    plan = _join_plan(life)
    handle = workflow.start_activity_method(
        NodeActivities.launch_instance,
        args=[_launch_input(life, attempt), report, settle_call(life, offer), plan, life.report_ahead(NodePhase.READY)],
        # The buy's whole budget (a create may wait behind a provider's pacer), the join's, its last look. The
        # heartbeat notices a dead worker; a live attempt is never retried beside itself (that is how twins get bought).
        start_to_close_timeout=t.launch + plan.within + t.api_call, schedule_to_close_timeout=t.launch + plan.within + t.api_call,
        heartbeat_timeout=life.heartbeat(), retry_policy=LAUNCH_RETRY,
        # A cancel (evicted, or the node cancelled) is waited out: during the join the activity
        # answers what it bought; a buy it cuts short is found by its name by the release.
        cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        summary=f"launch {offer.gpu_type} on {offer.provider} ({offer.region}, ${offer.hourly_price}/h) and join",
    )
    cancelled, evicted = False, asyncio.ensure_future(workflow.wait_condition(lambda: life.state.evict_reason is not None))
    try:
        await workflow.wait([handle, evicted], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        cancelled = True
    for pending in (evicted, handle):
        if not pending.done():
            pending.cancel()
    try:
        result: LaunchResult = await handle
    except ActivityError as exc:
        kept = None if cancelled else await _kept_at_deadline(life, plan, exc)
        if kept is None:
            _launch_failed(life, exc)  # nothing bought, or the release finds it by name
            if cancelled:
                raise asyncio.CancelledError() from None
            life.check_evicted()  # the evict's cancel cut the buy short: not the offer's failure
            _raise_for(life, attempt, exc)
        result = kept
    _launched(life, result)
    life.record(attempt, "launched", result.instance.instance_id)
    if cancelled:
        raise asyncio.CancelledError()
    life.check_evicted()
    return result


def _launch_input(life: Life, attempt: LaunchAttempt) -> LaunchInput:
    req, offer = life.req, attempt.offer
    assert life.state.instance is not None
    return LaunchInput(
        node_name=req.node_name, attempt=attempt.attempt, offer=offer, credentials=life.state.instance.credentials, boot=req.boot,
        pool=req.pool, tailnet_tags=req.tailnet_tags, tailnet=req.tailnet, tailnet_ref=req.tailnet_ref,
        # The Node registers with the labels that name its workflow, so the bridge's facts reach the join (Ready, GPUs) before tgp labels it.
        labels={**life.template.labels, **life.own_labels(pool_only=True)}, taints=[*life.template.taints, TAINT_JOINING],
        unavailable_offer_ttl=req.unavailable_offer_ttl, demand_since=req.demand_since,
    )


def _join_plan(life: Life) -> JoinPlan:
    """The join the launch waits for once it has bought: the device in the tailnet within
    `launch + tailnetJoin` of the buy, then a first look at the Node."""
    req, within = life.req, life.timeouts.launch + life.timeouts.tailnet_join
    return JoinPlan(
        seen=list(life.state.seen), node_name=req.node_name, gpus=life.state.offer.gpu_count if life.state.offer else 1,
        device=DeviceQuery(hostname=req.node_name, tags=req.tailnet_tags, tailnet=req.tailnet, tailnet_ref=req.tailnet_ref), within=within,
        timeout_error=f"join timeout: no tailnet device within {human(within)} of the launch (did the instance boot, the boot payload run and reach the control server?)",
        label=ready_labels(life),
    )


async def _kept_at_deadline(life: Life, plan: JoinPlan, exc: ActivityError) -> LaunchResult | None:
    """A launch that ran out of time (its workers dead past its deadline) may have bought: one
    look by the attempt's name keeps an instance that runs with its device in the tailnet (a dead
    worker is not a broken instance), and the join goes on from there."""
    if not isinstance(exc.cause, TimeoutError) or life.state.instance is None:
        return None
    look = await check_stage(life, StageCheck(instance=life.state.instance, device=plan.device))
    if look is None or not look.up or look.instance is None:
        return None
    workflow.logger.info("the launch ran out of time, but %s: kept", look.seen)
    return LaunchResult(instance=look.instance, account=look.account, joining_at=workflow.now(), join=JoinResult())


def _raise_for(life: Life, attempt: LaunchAttempt, exc: ActivityError) -> None:
    """What a failed launch means for the life: not settled (ends it), a bad template or join
    Secret (fails on every offer: ends it, saying what to fix), else this offer failed."""
    cause = exc.cause
    if isinstance(cause, ApplicationError) and cause.type in NOT_SETTLED:
        if cause.type == "ClassBudgetRefused" and life.state.instance is not None:
            # Refused on the launch's first try, before anything was minted or bought: no
            # attempt to release. (On a later try an earlier one may have bought: it stays.)
            name = life.state.instance.instance_name
            life.state.attempts.remove(attempt)
            life.state.seen = [ref for ref in life.state.seen if ref.instance_name != name]
            life.state.instance = None
        raise NotSettled(cause.message) from None
    if isinstance(cause, ApplicationError) and cause.type in ("ConfigError", "TemplateError"):
        raise exc
    raise OfferFailed(describe(exc), cause.type if isinstance(cause, ApplicationError) and cause.type else "") from None


def _launched(life: Life, result: LaunchResult) -> None:
    assert life.state.instance is not None
    life.state.instance = life.state.instance.bought(result, workflow.now())
    life.remember(life.state.instance)
    if result.key_id:
        life.state.key_ids.append(result.key_id)


def _launch_failed(life: Life, exc: ActivityError) -> None:
    """A launch that failed may still have bought: its name is looked at until the consistency
    window after now has passed. A clear refusal bought nothing."""
    if life.state.instance is None:
        return
    if isinstance(exc.cause, ApplicationError) and exc.cause.type in CLEAR_REFUSALS:
        return
    life.remember(life.state.instance.model_copy(update={"created_by": workflow.now()}))


def settle_call(life: Life, offer: Offer) -> LedgerCall | None:
    """The settle the launch makes before it buys, if the ledger's price for the node may differ
    from the offer's. Not when the pool reserved exactly this price and no launch of this life
    settled another (a burst's nodes, bought at the price they were sized for, do not queue on
    their class ledger before buying)."""
    reserved = life.req.reserved_price
    prices = [offer.hourly_price, *(a.offer.hourly_price for a in life.state.attempts)]
    if reserved is not None and all(price == reserved for price in prices):
        return None
    return life.ledger_call(offer)


async def mark_unavailable(life: Life, block: OfferBlock, error: str) -> None:
    """Take what failed out of rotation on the worker for a while (Karpenter's
    unavailable-offerings cache, by cause)."""
    inp = MarkUnavailableInput(
        offer_key=block.offer_key or f"{block.provider}/", ttl=life.req.unavailable_offer_ttl, block=block,
        node_class=life.req.boot.node_class, node_name=life.req.node_name, error=error,
    )
    await life.call(NodeActivities.mark_offer_unavailable, inp, timeout=life.timeouts.api_call, retry=API_RETRY)
