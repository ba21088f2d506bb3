"""Choosing the node's offer, and taking one that failed out of rotation on this worker."""

from __future__ import annotations

from temporalio import activity

from activities.errors import temporal_errors
from activities.node.base import NodeBase, log
from activities.offer_choice import choose
from tgp.types import BlockScope, MarkUnavailableInput, OfferBlock, OfferChoice, SelectOfferInput


class Offers(NodeBase):
    """The offer's activities: `select_offer`, `mark_offer_unavailable`."""

    @activity.defn
    async def select_offer(self, inp: SelectOfferInput) -> OfferChoice:
        """The cheapest offer that meets the requirements and has not failed recently
        (activities.offer_choice). Offers come from the pricing cache of each provider account
        (listed once per TTL for the whole worker); a provider whose listing fails serves its
        last good offers for a bounded time, and one that has none is skipped while the others'
        offers are still chosen from."""
        with temporal_errors():
            return await choose(self.registry, inp.requirements, exclude=inp.exclude, blocked=inp.blocked)

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
