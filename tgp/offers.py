"""Offer choice: pure ranking plus the per-worker cache of what recently failed, blocked by
cause (SkyPilot's failover): an offer, a GPU type of a provider, or a provider account, always
for the account that failed (the class's CredentialsRef for that provider, None: the worker's
own key), so one class's failures never hide another account's offers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from tgp.types import BlockScope, CredentialsRef, Offer, OfferBlock, OfferRequirements

# What a launch failure's error type blocks; any other failure (capacity, a refusal of the
# offer, a boot or join that failed) blocks the offer alone.
SCOPE_OF_CAUSE = {
    "QuotaExceeded": BlockScope.GPU_TYPE,
    "AuthError": BlockScope.ACCOUNT,
    "PermissionDenied": BlockScope.ACCOUNT,
}


def block_for(cause: str, offer: Offer, account: CredentialsRef | None) -> OfferBlock:
    """What a launch of `offer` with `account` that failed with error type `cause` blocks."""
    scope = SCOPE_OF_CAUSE.get(cause, BlockScope.OFFER)
    return OfferBlock(
        scope=scope,
        provider=offer.provider,
        account=account,
        gpu_type=offer.gpu_type if scope is BlockScope.GPU_TYPE else "",
        offer_key=offer.key if scope is BlockScope.OFFER else "",
        cause=cause,
    )


class Blocked:
    """The blocks that apply to one class's accounts, as sets: one offer is tested in three
    look-ups (a node tests up to 10,000 offers, issue 20)."""

    def __init__(self, blocks: Iterable[OfferBlock], credentials: Mapping[str, CredentialsRef]) -> None:
        self.accounts: set[str] = set()
        self.gpu_types: set[tuple[str, str]] = set()
        self.offers: set[str] = set()
        for b in blocks:
            if b.account != credentials.get(b.provider):
                continue  # another account's failure
            if b.scope is BlockScope.ACCOUNT:
                self.accounts.add(b.provider)
            elif b.scope is BlockScope.GPU_TYPE:
                self.gpu_types.add((b.provider, b.gpu_type))
            else:
                self.offers.add(b.offer_key)

    def __bool__(self) -> bool:
        return bool(self.accounts or self.gpu_types or self.offers)

    def __call__(self, offer: Offer) -> bool:
        return offer.provider in self.accounts or (offer.provider, offer.gpu_type) in self.gpu_types or offer.key in self.offers


def offer_satisfies(offer: Offer, req: OfferRequirements) -> bool:
    """True when `offer` meets every requirement of `req`.

    The same tests as `rejection_reasons`, without building its sentences: ranking runs this
    over every listed offer (10,000 on Vast) for each node, and only `tgp offers` reports why
    (issue 20: building every rejection string to test for emptiness cost 2.7x the CPU)."""
    return (
        (not req.gpu_types or offer.gpu_type in req.gpu_types)
        and (not req.regions or offer.region in req.regions)
        and (not req.providers or offer.provider in req.providers)
        and offer.gpu_count >= req.min_gpu_count
        and (req.max_hourly_price is None or offer.hourly_price <= req.max_hourly_price)
        and (not offer.spot or req.allow_spot)
    )


def rejection_reasons(offer: Offer, req: OfferRequirements) -> list[str]:
    """Why `offer` does not meet `req` (empty when it does), in words a user can act on.
    Keep each test here in step with `offer_satisfies` (a property test holds them equal)."""
    reasons = []
    if req.gpu_types and offer.gpu_type not in req.gpu_types:
        reasons.append(f"GPU {offer.gpu_type} not in {', '.join(req.gpu_types)}")
    if req.regions and offer.region not in req.regions:
        reasons.append(f"region {offer.region} not in {', '.join(req.regions)}")
    if req.providers and offer.provider not in req.providers:
        reasons.append(f"provider {offer.provider} not enabled in the class")
    if offer.gpu_count < req.min_gpu_count:
        reasons.append(f"{offer.gpu_count} GPU(s), fewer than {req.min_gpu_count}")
    if req.max_hourly_price is not None and offer.hourly_price > req.max_hourly_price:
        reasons.append(f"${offer.hourly_price}/h above maxHourlyPrice ${req.max_hourly_price}/h")
    if offer.spot and not req.allow_spot:
        reasons.append("spot, and the class does not allow spot")
    return reasons


def rank_offers(
    offers: Iterable[Offer],
    req: OfferRequirements,
    *,
    exclude: Iterable[str] = (),
    provider_priority: dict[str, int] | None = None,
) -> list[Offer]:
    """Offers that satisfy `req` and are not excluded, cheapest first.

    Ties on price go to the provider with the lower priority number (1 = preferred; from
    `req.provider_priority` unless `provider_priority` is given; unlisted providers last),
    then to the offer key so the order is stable.
    """
    excluded = set(exclude)
    priority = req.provider_priority if provider_priority is None else provider_priority
    eligible = [o for o in offers if o.key not in excluded and offer_satisfies(o, req)]
    return sorted(eligible, key=lambda o: (o.hourly_price, priority.get(o.provider, 1_000), o.key))


@dataclass(frozen=True)
class Choice:
    """The cheapest offer left to try (`rank_offers`' first), and how many offers satisfy the
    requirements at all, excluded ones included."""

    offer: Offer | None
    matching: int
    eligible: int  # matching and not excluded: what `rank_offers` would list


def choose_offer(
    offers: Iterable[Offer], req: OfferRequirements, *, exclude: Iterable[str] = (), blocks: Iterable[OfferBlock] = ()
) -> Choice:
    """What a node needs of the ranking, in one pass: the first offer `rank_offers` lists that
    no block covers for the class's accounts (`req.credentials`), and the counts beside it. No
    sort: a node takes one offer from up to 10,000 (Vast), and sorting them all by their
    tie-break tuples cost it more than testing them (issue 20)."""
    excluded = set(exclude)
    blocked = Blocked(blocks, req.credentials)
    priority = req.provider_priority
    best, best_order, matching, eligible = None, None, 0, 0
    for o in offers:
        if not offer_satisfies(o, req):
            continue
        matching += 1
        if o.key in excluded or (blocked and blocked(o)):
            continue
        eligible += 1
        # The tuple only for a price that can win: most offers lose on price alone.
        if best is None or o.hourly_price <= best.hourly_price:
            order = (o.hourly_price, priority.get(o.provider, 1_000), o.key)
            if best_order is None or order < best_order:
                best, best_order = o, order
    return Choice(offer=best, matching=matching, eligible=eligible)


class UnavailableOffers:
    """What just failed to launch or join, blocked by cause (`block_for`: an offer, a GPU type
    of a provider, or a provider account, each for the account that failed) and skipped by
    every node on this worker until the block expires. Like Karpenter's unavailable-offerings
    cache, scoped like SkyPilot's failover."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until: dict[OfferBlock, float] = {}

    def mark(self, block: OfferBlock, ttl: timedelta) -> bool:
        """Block `block` for `ttl` from now; whether it was not blocked already."""
        live = block in self._until and self._until[block] > self._clock()
        self._until[block] = max(self._until.get(block, 0.0), self._clock() + ttl.total_seconds())
        return not live

    def blocks(self) -> list[OfferBlock]:
        """The blocks still in force now; expired ones are dropped."""
        now = self._clock()
        self._until = {b: t for b, t in self._until.items() if t > now}
        return list(self._until)

    def keys(self) -> set[str]:
        """The blocks in force now, in words (their number is a metric)."""
        return {b.describe() for b in self.blocks()}
