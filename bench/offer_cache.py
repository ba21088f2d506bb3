"""Offer listings per node started, with the pricing cache (issue 20's figure; main before the
cache: 1, i.e. 475 listings for 473 nodes).

    PYTHONPATH=. .venv/bin/python bench/offer_cache.py [N]

Two simulated clouds (two provider accounts) over HTTP on loopback; N node selections
(`NodeActivities.select_offer`, the activity each node attempt runs) in two shapes:
* a burst: all N at once;
* a trickle: N one after another, 3 s apart on the cache's clock (moved by hand, no sleeping),
  with the worker's scheduled refresh running between them as it does in a worker.
Prints the listings each cloud saw (counted at the fake) per node started. Target: about 0.
"""

from __future__ import annotations

import asyncio
import sys
import time
from decimal import Decimal

from activities.accounts import ProviderRegistry
from activities.clouds.simulated import SimulatedProvider
from activities.node import NodeActivities
from activities.offer_cache import OfferCache
from sim.cloud import SimOffer, SimulatedCloud
from tgp.types import OfferRequirements, SelectOfferInput

TRICKLE_EVERY = 3.0  # seconds between node starts in the trickle (simulated)


async def run(n: int) -> dict[str, float]:
    now = [1000.0]
    async with (
        SimulatedCloud(catalog=(SimOffer("a-4090", "RTX4090", "us-east", Decimal("0.40")),)) as alpha,
        SimulatedCloud(catalog=(SimOffer("b-4090", "RTX4090", "eu-west", Decimal("0.45")),)) as beta,
    ):
        providers = {"alpha": SimulatedProvider(alpha.url, name="alpha"), "beta": SimulatedProvider(beta.url, name="beta")}
        cache = OfferCache(clock=lambda: now[0])
        node = NodeActivities(
            providers=providers, tailnets={}, cluster=None,  # type: ignore[arg-type]
            registry=ProviderRegistry(cluster=None, fallback=providers, offers=cache),  # type: ignore[arg-type]
        )  # fmt: skip
        req = SelectOfferInput(requirements=OfferRequirements(gpu_types=["RTX4090"]), exclude=[])

        def listings() -> int:
            return sum(alpha.offer_lists.values()) + sum(beta.offer_lists.values())

        t0 = time.perf_counter()
        choices = await asyncio.gather(*(node.select_offer(req) for _ in range(n)))
        burst_s = time.perf_counter() - t0
        assert all(c.offer is not None for c in choices)
        burst = listings()

        now[0] += 3600  # a quiet hour later: the cache is cold again
        before = listings()
        t0 = time.perf_counter()
        for _ in range(n):
            await node.select_offer(req)
            now[0] += TRICKLE_EVERY
            await cache.refresh_due()
        trickle_s = time.perf_counter() - t0
        trickle = listings() - before
        minutes = n * TRICKLE_EVERY / 60
        for p in providers.values():
            await p.aclose()
    print(f"offer listings per node started (2 provider accounts, {n} nodes):")
    print(f"  burst, all at once:          {burst:4d} listings -> {burst / n:.3f} per node   ({burst_s * 1000:.0f} ms wall)   main: 2 per node")
    print(
        f"  trickle, one per {TRICKLE_EVERY:.0f} s ({minutes:.0f} min): {trickle:4d} listings -> {trickle / n:.3f} per node   "
        f"({trickle_s * 1000:.0f} ms wall; at most 2 accounts x one per TTL, scheduled refresh included)"
    )
    print(f"goal: about 0 per node -> {'met' if max(burst, trickle) / n < 0.2 else 'MISSED'}")
    return {"nodes": n, "burst_listings": burst, "burst_per_node": burst / n, "trickle_listings": trickle, "trickle_per_node": trickle / n}


if __name__ == "__main__":
    asyncio.run(run(int(sys.argv[1]) if len(sys.argv) > 1 else 100))
