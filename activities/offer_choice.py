"""A node's offer: the cheapest that meets its requirements and is not blocked, from the pricing
cache of each provider account it may buy from. The node's own `select_offer` chooses it, and
so does the pool's start for a node's first launch (the run then starts Launching)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

from activities.accounts import ProviderRegistry
from tgp.errors import TransientError
from tgp.offers import choose_offer
from tgp.types import OfferBlock, OfferChoice, OfferRequirements

log = structlog.get_logger("tgp.activities")


async def choose(registry: ProviderRegistry, req: OfferRequirements, *, exclude: Iterable[str] = (), blocked: Iterable[OfferBlock] = ()) -> OfferChoice:
    """The best offer for `req` not in `exclude`, blocked by neither `blocked` (the node's) nor
    this worker's unavailable offers (the registry's pricing cache keeps them), with the counts
    that say why there is none. A provider whose listing fails serves its last good offers for a
    bounded time; one that has none is skipped while the others' are chosen from; none listing
    at all is a TransientError."""
    names = req.providers or registry.configured()
    # The class's account for each provider (its Secret read now), or the worker's own.
    adapters = [await registry.get(n, req.credentials.get(n)) for n in names]
    listed = await asyncio.gather(*(registry.list_offers(a) for a in adapters), return_exceptions=True)
    offers, stale = [], {}
    for adapter, result in zip(adapters, listed, strict=True):
        if isinstance(result, BaseException):
            log.warning("offers_unavailable", provider=adapter.name, error=str(result))
        else:
            if result.stale:
                stale[adapter.name] = f"offers listed {result.age:.0f}s ago; listing them again failed: {result.error}"[:300]
                log.warning("offers_stale", provider=adapter.name, age_seconds=round(result.age), error=result.error)
            offers.extend(result.offers)
    if not offers and any(isinstance(r, BaseException) for r in listed):
        raise TransientError(f"no provider could list offers ({', '.join(names)}); retrying")
    # What the node's own attempts failed on, and what failed on this worker lately, each for
    # the account that failed: another class's account is not hidden.
    choice = choose_offer(offers, req, exclude=exclude, blocks=[*blocked, *registry.offers.unavailable.blocks()])
    return OfferChoice(offer=choice.offer, seen=len(offers), matching=choice.matching, unavailable=choice.matching - choice.eligible, stale=stale)

