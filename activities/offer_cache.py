"""The pricing cache: each provider account's offers, listed once per TTL and shared by every
offer selection (node) and offer check (pool) of this worker process.

Before it, every node listed every provider's offers on its own (one listing per node started),
which a rate-limited API such as Lambda's (about one request per second per account) cannot
afford in a burst. Now:

* An entry per account: `(provider, account)`, where account is the key fingerprint the
  ProviderRegistry gives an adapter built from a class Secret (`ProviderRegistry.account`), or
  `WORKER_ACCOUNT` for the worker's own adapter. Two classes whose Secrets hold the same key
  share one entry; a rotated key of the same account keeps it.
* A lookup younger than `OFFER_CACHE_TTL` is a hit: no provider call. An older one lists, and
  concurrent lookups of one account share that one listing (single flight); the listing runs to
  the end even when the lookup that started it is cancelled, so the others still get it.
* Stale while error: a listing that fails for a passing reason (an outage, a timeout, a 429)
  keeps the last good offers for at most `SERVE_STALE_FOR` past their TTL, marked stale with
  the age and the error (callers log and report it); after that the account's offers are an
  error again, as without a cache. A lasting refusal (a revoked key: AuthError, a ConfigError)
  serves no stale offers: a launch from them would fail the same way. A failed
  listing is not retried for `RETRY_FAILED_AFTER`, so a provider that is down is not asked by
  every node in turn.
* Accounts are independent: one account's slow or failing listing never delays or hides
  another's (each has its own flight; callers gather them with `return_exceptions`).
* Capacity failures still take offers out of rotation: the cache holds this worker's
  `UnavailableOffers` marks, and selection excludes them from the cached offers.
* Refreshed on demand (a lookup of a stale entry) and on a schedule (`refresh_loop`, started
  by the worker): accounts looked up within `KEEP_WARM_FOR` are listed again shortly before
  their TTL ends, so the next nodes find fresh offers and no one waits; accounts not looked up
  for that long are forgotten (listed again on their next lookup).

Why per process and not shared across worker replicas: each replica lists each account at most
once per TTL, so a deployment makes at most (replicas x accounts) listings per TTL, which is
O(accounts) for the few replicas tgp runs; a cross-process cache would need a store tgp does not
have (a workflow per account would write every listing into history). The unavailable-offer
marks were already per worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import structlog
from activities import metrics
from tgp.errors import TgpError
from tgp.offers import UnavailableOffers
from tgp.types import Offer

__all__ = [
    "KEEP_WARM_FOR",
    "OFFER_CACHE_TTL",
    "REFRESH_AHEAD",
    "RETRY_FAILED_AFTER",
    "SERVE_STALE_FOR",
    "WORKER_ACCOUNT",
    "Listing",
    "OfferCache",
]

log = structlog.get_logger("tgp.offers")

# How long one listing serves every selection of its account. GPU clouds reprice over hours and
# sell out over minutes; an offer sold out since the listing costs one refused launch, which
# marks it unavailable and fails over to the next. One listing a minute per account stays far
# below every provider's rate limit (Lambda's ~1/s is the tightest).
OFFER_CACHE_TTL = timedelta(seconds=60)
# How long past its TTL the last good listing still serves while listings fail (an outage, a
# 429 storm): long enough to ride out a provider's short blip, short enough that prices and
# sold-out offers are not trusted for long; after it the account's offers are an error again.
SERVE_STALE_FOR = timedelta(minutes=10)
# After a failed listing, lookups wait this long before asking the provider again (they get the
# stale offers or the same error meanwhile): a provider that is down is not asked per node.
RETRY_FAILED_AFTER = timedelta(seconds=10)
# The scheduled refresh keeps accounts looked up within this long warm...
KEEP_WARM_FOR = timedelta(minutes=10)
# ... listing each this long before its TTL ends (and this often checks for such entries).
REFRESH_AHEAD = timedelta(seconds=10)

# The account of the worker's own adapters (from its environment), beside key fingerprints.
WORKER_ACCOUNT = "worker"

List = Callable[[], Awaitable[list[Offer]]]


@dataclass(frozen=True)
class Listing:
    """An account's offers as a lookup got them. `stale`: older than the TTL, served because the
    latest listing failed (`error` says why)."""

    offers: list[Offer]
    age: float  # seconds since the listing
    stale: bool = False
    error: str = ""


@dataclass
class _Entry:
    provider: str
    offers: list[Offer] | None = None
    listed_at: float = 0.0
    error: BaseException | None = None
    failed_at: float | None = None
    looked_up_at: float = 0.0
    flight: asyncio.Task[list[Offer]] | None = None
    lister: List | None = field(default=None, repr=False)  # the latest adapter's, for the schedule


class OfferCache:
    """Offers per provider account, shared by this process's selections: see the module docstring.
    `clock` (monotonic seconds) is injectable so tests move time without sleeping."""

    def __init__(
        self,
        *,
        ttl: timedelta = OFFER_CACHE_TTL,
        serve_stale_for: timedelta = SERVE_STALE_FOR,
        retry_failed_after: timedelta = RETRY_FAILED_AFTER,
        unavailable: UnavailableOffers | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl.total_seconds()
        self.serve_stale_for = serve_stale_for.total_seconds()
        self.retry_failed_after = retry_failed_after.total_seconds()
        self.clock = clock
        self.unavailable = unavailable or UnavailableOffers(clock)
        self._entries: dict[tuple[str, str], _Entry] = {}
        self.listings = 0  # provider calls made (for tests and the benchmark)
        self.lookups = 0  # offers() calls so far
        metrics.OFFER_CACHE_AGES.caches.add(self)

    async def offers(self, provider: str, account: str | None, list_offers: List) -> Listing:
        """The account's offers: cached while younger than the TTL, else listed now (one listing
        for all concurrent lookups). Raises the listing's error when there is no good listing
        within SERVE_STALE_FOR past its TTL."""
        self.lookups += 1
        entry = self._entries.setdefault((provider, account or WORKER_ACCOUNT), _Entry(provider))
        now = self.clock()
        entry.looked_up_at, entry.lister = now, list_offers
        if entry.offers is not None and now - entry.listed_at < self.ttl:
            metrics.OFFER_CACHE_HITS.labels(provider).inc()
            return Listing(list(entry.offers), now - entry.listed_at)
        if entry.flight is None and entry.failed_at is not None and now - entry.failed_at < self.retry_failed_after:
            metrics.OFFER_CACHE_HITS.labels(provider).inc()  # no provider call: the recent failure stands
            return self._stale_or_raise(entry, now)
        if entry.flight is None:
            metrics.OFFER_CACHE_MISSES.labels(provider).inc()
            self._refresh(entry, list_offers, trigger="demand")
        else:
            metrics.OFFER_CACHE_HITS.labels(provider).inc()  # joins the listing in flight
        assert entry.flight is not None
        try:
            # Shielded: a lookup cancelled while waiting leaves the listing to the others.
            offers = await asyncio.shield(entry.flight)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded on the entry by the flight
            return self._stale_or_raise(entry, self.clock(), exc)
        return Listing(list(offers), self.clock() - entry.listed_at)

    def _stale_or_raise(self, entry: _Entry, now: float, error: BaseException | None = None) -> Listing:
        error = error or entry.error
        assert error is not None
        # Only an outage is ridden out: a refused key or a broken configuration (a non-retryable
        # TgpError) would fail a launch from those offers too, so the account has none now.
        lasting = isinstance(error, TgpError) and not error.retryable
        if entry.offers is not None and not lasting and now - entry.listed_at < self.ttl + self.serve_stale_for:
            stale = now - entry.listed_at >= self.ttl
            if stale:
                metrics.OFFER_CACHE_STALE_SERVED.labels(entry.provider).inc()
            return Listing(list(entry.offers), now - entry.listed_at, stale=stale, error=str(error) if stale else "")
        raise error

    def _refresh(self, entry: _Entry, list_offers: List, *, trigger: str) -> asyncio.Task[list[Offer]]:
        async def listing() -> list[Offer]:
            self.listings += 1
            metrics.OFFER_LISTINGS.labels(entry.provider, trigger).inc()
            try:
                offers = await list_offers()
            except Exception as exc:
                entry.error, entry.failed_at = exc, self.clock()
                metrics.OFFER_CACHE_REFRESH_FAILURES.labels(entry.provider, metrics.failure_reason(exc)).inc()
                log.warning("offer_listing_failed", provider=entry.provider, trigger=trigger, error=str(exc))
                raise
            else:
                entry.offers, entry.listed_at = list(offers), self.clock()
                entry.error = entry.failed_at = None
                return offers
            finally:
                entry.flight = None

        task = asyncio.get_running_loop().create_task(listing())
        # A failure nobody awaited (a scheduled refresh) must not be reported as never retrieved.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        entry.flight = task
        return task

    async def refresh_due(self) -> int:
        """The scheduled refresh: list again every account looked up within KEEP_WARM_FOR whose
        offers end their TTL within REFRESH_AHEAD (and whose last failure is not too recent), and
        forget the accounts not looked up for that long. Returns how many listings it made; their
        failures are recorded like a lookup's."""
        now = self.clock()
        flights = []
        for key, entry in list(self._entries.items()):
            if entry.flight is None and now - entry.looked_up_at >= KEEP_WARM_FOR.total_seconds():
                # Nobody uses the account now (a class gone, a key rotated away): forget it, so
                # its age stops showing and its adapter is not held; a lookup lists it again.
                del self._entries[key]
                continue
            due = entry.offers is None or now - entry.listed_at >= self.ttl - REFRESH_AHEAD.total_seconds()
            warm = now - entry.looked_up_at < KEEP_WARM_FOR.total_seconds()
            backing_off = entry.failed_at is not None and now - entry.failed_at < self.retry_failed_after
            if due and warm and not backing_off and entry.flight is None and entry.lister is not None:
                flights.append(self._refresh(entry, entry.lister, trigger="schedule"))
        await asyncio.gather(*flights, return_exceptions=True)
        return len(flights)

    async def refresh_loop(self, every: timedelta = REFRESH_AHEAD) -> None:
        """`refresh_due` every `every`, until cancelled (the worker runs it in the background)."""
        while True:
            await asyncio.sleep(every.total_seconds())
            try:
                await self.refresh_due()
            except Exception as exc:  # noqa: BLE001 - the next round tries again; lookups list on demand
                log.warning("offer_refresh_failed", error=str(exc))

    def ages(self) -> Iterator[tuple[str, str, float]]:
        """(provider, account, seconds since its last good listing) for each entry that has one."""
        now = self.clock()
        for (provider, account), entry in sorted(self._entries.items()):
            if entry.offers is not None:
                yield provider, account, now - entry.listed_at
