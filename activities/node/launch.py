"""Buying the node's instance, idempotently: the class ledger's settle first, then the key, the
boot payload and the create, an earlier attempt's instance adopted, twins ended."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import metrics
from activities.boot.render import BootSettings
from activities.errors import temporal_errors
from activities.ledger import LedgerCall
from activities.node.base import CARRIED, _not_the_providers, heartbeating, log, survivor
from activities.node.boot import Boot
from activities.node.join import Join
from activities.node.reports import carrying
from activities.ports import CloudProvider, Tailnet
from activities.termination import consistency_window
from tgp.errors import AuthError, CapacityError, OfferRefused, PermissionDenied, QuotaExceeded, TransientError
from tgp.messages import PoolReport
from tgp.offers import block_for
from tgp.secrets import register, register_model, secret_scope
from tgp.types import Instance, InstanceState, JoinPlan, JoinResult, LaunchInput, LaunchResult, Offer, instance_name

# A launch's settle with the class ledger (`launch_instance`'s `settle`) is tried in this many
# attempts of the launch before it gives up as `LedgerUnavailable`.
SETTLE_TRIES = 3
# After a create that answered nothing clear (timeout, reset, 429, 5xx), the least time to look
# for the instance by name before buying again; a provider whose consistency window is longer
# is looked at for its whole window (a create can complete after its caller gave up).
CREATE_SETTLE = timedelta(seconds=30)
# A first attempt's look before minting stands for the look right before its create for this
# long. Past it (a slow mint or render), the look is made again: another attempt of the name (a
# retry Temporal started while this one, cut off, went on) may have bought meanwhile. Such a
# retry buys only once the heartbeat timeout and CREATE_SETTLE have passed since it began.
LOOK_FRESH_FOR = timedelta(seconds=5)


class Launch(Boot, Join):
    """The launch's activity, `launch_instance`, and its steps (the join's from `Join`)."""

    create_settle: timedelta

    def _settle_for(self, provider: CloudProvider) -> timedelta:
        """How long to look by name after a create whose outcome is unknown before buying again."""
        return max(self.create_settle, consistency_window(provider))

    @activity.defn
    async def launch_instance(
        self, inp: LaunchInput, report: PoolReport | None = None, settle: LedgerCall | None = None, join: JoinPlan | None = None,
        ready: PoolReport | None = None,
    ) -> LaunchResult:
        """Mint a tailnet key, render the boot payload and buy the instance, idempotently; with
        `join`, then wait for it to boot and join (`join_after_buy`), and a Node up by then gets
        its labels and taints, and the pool the `ready` report (`label_on_join`): one activity
        and one workflow task for all of it (issue 37).

        The instance name comes from the workflow, so a retried or crashed attempt finds what
        it already bought and adopts it instead of buying twice. `report` (Launching) goes to
        the pool meanwhile (`carrying`). With `settle`, the price is settled with the class
        ledger first, before anything is minted or bought (`_settle`: what a refusal
        or a silent ledger raises; settling again is idempotent, a retried attempt settles the
        same reservation).

        A cancel (the node evicted or cancelled) during the buy ends it as a dead worker's end
        would: what it may have bought is found by its name (money by ids). During the join it
        ends the wait, and the activity answers what it bought (`join` None).
        """
        self._refuse_if_blocked(inp)
        async with carrying(report, self.reports):
            if settle is not None:
                await self._settle(settle, inp.offer)
            bought = await self._launch_instance(inp)
        if join is None:
            return bought
        joining_at = self.now()
        try:
            joined: JoinResult | None = await self.join_after_buy(instance_name(inp.node_name, inp.attempt), bought, join)
            if joined.node is not None and joined.node.up and join.label is not None:
                joined = joined.model_copy(update={"labelled": await self.label_on_join(join.label, ready)})
        except asyncio.CancelledError:
            details = activity.cancellation_details()
            if details is None or not details.cancel_requested:
                raise  # a worker shutting down: the retry on another adopts it and joins on
            joined = None  # the workflow stopped waiting: it hears what was bought, and releases it
        return bought.model_copy(update={"joining_at": joining_at, "join": joined})

    def _refuse_if_blocked(self, inp: LaunchInput) -> None:
        """A first attempt buys nothing this worker blocked after the offer was chosen (a
        failure of another node's between the choice, the pool's start or `select_offer`, and
        now): refused as OfferRefused, before anything is settled or sent, so the node fails over.
        A later attempt goes on: an earlier one may have bought, which it adopts."""
        if activity.info().attempt > 1:
            return
        block = next((b for b in self.unavailable.blocks() if b.covers(inp.offer, inp.credentials)), None)
        if block is not None:
            raise ApplicationError(f"{block.describe()} failed on this worker since the offer was chosen: not bought", type="OfferRefused", non_retryable=True)

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
        CARRIED.set(memo.details)  # the join's beats carry it on: a retry in the join adopts what was bought
        # The heartbeat runs through the whole call, pacing waits included: a live attempt is
        # never timed out and retried beside itself; a dead worker's attempt is, within the
        # heartbeat timeout.
        # The secret scope holds the minted key and the join material (tgp.secrets): every
        # error message and log line of this activity is scrubbed of them.
        launching = metrics.counting_launch(inp.offer.provider, demand_since=inp.demand_since)
        with secret_scope(), heartbeating(memo.details), temporal_errors(), launching:
            provider = await self._provider_to_buy(inp.offer.provider, inp.credentials)
            tailnet = await self._tailnet_for(inp.tailnet, inp.tailnet_ref)
            # An earlier attempt may have sent a create whose record died with its worker: the
            # SDK sends at most one heartbeat per 0.8 x the heartbeat timeout, and a beat made
            # within that interval of the last (`sent_at`, right before the create) goes only at
            # its end. So a retried attempt buys nothing until the provider's settle time has
            # passed since it began (every earlier create was sent before): an earlier create is
            # adopted, or known absent, first.
            # A first attempt looks too, before anything is read or minted: an instance an
            # earlier run of the name bought (a reset workflow) is adopted even where the join
            # Secret, the tailnet or the template would now fail.
            settled = self.now() + self._settle_for(provider) if activity.info().attempt > 1 else self.now()
            existing = await self._adopt(provider, name, bound, memo, until=settled)
            if existing is not None:
                return LaunchResult(instance=existing, adopted=True, account=self.registry.account(provider), seen_ids=sorted(memo.seen))
            result = await self._buy(inp, provider, tailnet, name, bound, memo, looked_at=self.now())
        if not result.adopted:
            bound.info("instance_launched", instance_id=result.instance.instance_id, key_id=result.key_id)
        return result

    async def _buy(
        self, inp: LaunchInput, provider: CloudProvider, tailnet: Tailnet, name: str, bound: structlog.BoundLogger, memo: LaunchMemo,
        *, looked_at: datetime,
    ) -> LaunchResult:
        """Mint the node's key, render its boot payload and buy the instance (nothing bought under
        `name` as of `looked_at`): an earlier attempt's create that lands meanwhile is adopted instead."""
        # Read the join material before minting: a missing Secret must not cost a key.
        join = await _not_the_providers(self._class_template(inp, self._join_secrets(inp)), "the Kubernetes API (reading the class's join Secret)")
        if join is not None:
            register_model(join)
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
                settings=_boot_settings(inp, tailnet),
                join=join,
                node_index=inp.attempt - 1,
            )
            # Once more right before buying, on a retry (an earlier attempt's create may have
            # landed while this one minted and rendered) or after a slow mint or render. A first
            # attempt whose look is moments old has no earlier attempt to wait for; what another
            # run of the name may buy meanwhile, the look after the create finds (`_keep_one`).
            again = activity.info().attempt > 1 or self.now() >= looked_at + LOOK_FRESH_FOR
            existing = await self._adopt(provider, name, bound, memo, until=self.now()) if again else None
            if existing is not None:
                await asyncio.shield(self._revoke_quietly(tailnet, key.key_id))
                return LaunchResult(instance=existing, adopted=True, account=self.registry.account(provider), seen_ids=sorted(memo.seen))
            sent = True
            memo.sent_at = self.now()
            activity.heartbeat(*memo.details())  # at once: a worker killed from here on leaves this behind
            instance = await self._create_or_find(provider, inp, name, boot, memo)
        except BaseException as exc:
            await self._launch_failed(exc, inp, tailnet, key.key_id, sent=sent, bound=bound)
            raise
        return await self._keep_one(provider, tailnet, name, bound, memo, instance, key.key_id)

    async def _launch_failed(
        self, exc: BaseException, inp: LaunchInput, tailnet: Tailnet, key_id: str, *, sent: bool, bound: structlog.BoundLogger
    ) -> None:
        """What a launch that raised `exc` leaves: its offer marked, its key revoked unless a
        machine may hold it, a log line."""
        if isinstance(exc, (CapacityError, OfferRefused, QuotaExceeded, AuthError, PermissionDenied)):
            # At once, for the other nodes on this worker; the workflow marks it too.
            self.unavailable.mark(block_for(type(exc).__name__, inp.offer, inp.credentials), inp.unavailable_offer_ttl)
        if not (sent and isinstance(exc, TransientError)):
            # The key was never handed to a machine: revoke it now rather than let it
            # age out. After an unanswered create it may be in one: keep it, so the
            # instance that appears later can still join (cleanup revokes by hostname).
            await asyncio.shield(self._revoke_quietly(tailnet, key_id))
        bound.warning("launch_failed", error=str(exc), error_type=type(exc).__name__)

    async def _keep_one(
        self, provider: CloudProvider, tailnet: Tailnet, name: str, bound: structlog.BoundLogger, memo: LaunchMemo, instance: Instance, key_id: str
    ) -> LaunchResult:
        """The launch's result once `instance` is bought: the one instance kept under `name`."""
        # Clouds do not enforce unique names: a create that overlapped this one (a retry
        # while the first was still in flight) bought a twin. Every attempt keeps the same
        # one (the lowest id), so two overlapping attempts never end each other's.
        live = await self._live(provider, name, memo)
        if all(i.instance_id != instance.instance_id for i in live):
            live.append(instance)  # a listing that lags behind the create
        kept = survivor(live)
        await self._terminate_twins(provider, name, keep=kept.instance_id, bound=bound, known=live)
        if kept.instance_id != instance.instance_id:
            await asyncio.shield(self._revoke_quietly(tailnet, key_id))  # our twin is gone with its key
            bound.info("instance_adopted", instance_id=kept.instance_id)
            return LaunchResult(instance=kept, adopted=True, account=self.registry.account(provider), seen_ids=sorted(memo.seen))
        return LaunchResult(instance=instance, key_id=key_id, account=self.registry.account(provider), seen_ids=sorted(memo.seen))

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
        keep = survivor(found)  # the same rule as after a create
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
            return survivor(found)
        memo.bought.append(instance)
        memo.seen[instance.instance_id] = instance
        activity.heartbeat(*memo.details())
        return instance

    async def _revoke_quietly(self, tailnet: Tailnet, key_id: str) -> None:
        try:
            await tailnet.revoke_auth_key(key_id)
        except Exception as exc:  # the key expires on its own; cleanup also revokes by hostname
            log.warning("key_revoke_failed", key_id=key_id, error=str(exc))


def _boot_settings(inp: LaunchInput, tailnet: Tailnet) -> BootSettings:
    """What the boot payload configures on the node, from the launch's input."""
    return BootSettings(
        node_pool=inp.pool,
        node_labels=inp.labels,
        node_taints=inp.taints,
        tailscale_tags=inp.tailnet_tags,
        tailscale_login_server=inp.boot.login_server or getattr(tailnet, "login_server", None),
        kubernetes_version=inp.boot.kubernetes_version,
        tailscale_accept_routes=inp.boot.accept_routes,
        talos_install_image=inp.boot.talos_image,
    )


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
