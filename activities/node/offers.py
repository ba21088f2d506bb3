"""Choosing the node's offer, and taking one that failed out of rotation on this worker."""

from __future__ import annotations

import asyncio

from temporalio import activity

from activities.errors import temporal_errors
from activities.node.base import NodeBase, log
from tgp.errors import TransientError
from tgp.offers import choose_offer
from tgp.types import BlockScope, MarkUnavailableInput, OfferBlock, OfferChoice, SelectOfferInput


class Offers(NodeBase):
    """The offer's activities: `select_offer`, `mark_offer_unavailable`."""

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
