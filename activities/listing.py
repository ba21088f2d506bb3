"""One way to list a provider account's instances, for the fleet look (activities.fleet, every
minute) and the sweeper (activities.sweeper, every 15 minutes), with the list's age and
failures per account as metrics (docs/metrics.md). The adapters' own rate limiting applies
(activities/http.py's bounded retry on 429/5xx honouring Retry-After, and the pacers in
activities/clouds/): a failure reaches the caller as a TgpError after those.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from activities.ports import CloudProvider
from tgp.types import Instance

INSTANCE_LISTS = Counter(
    "tgp_instance_lists",
    "Instance listings of a provider account (the fleet look's and the sweeper's), by outcome: ok, or the error type.",
    ["provider", "account", "outcome"],
)
SIGHTINGS_SENT = Counter(
    "tgp_instance_sightings_sent",
    "instance_seen signals the fleet look sent to node workflows, by what the listing showed of the node's instance "
    "(interrupted, stopped, failed, terminated, pending, running or missing).",
    ["provider", "seen"],
)


class InstanceListAges(Collector):
    """`tgp_instance_list_age_seconds{provider, account}` at scrape time: seconds since this
    process last listed the account's instances successfully. Grows past the fleet look's
    interval only while its listings fail (or another worker does the looking)."""

    def __init__(self) -> None:
        self.listed_at: dict[tuple[str, str], float] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "tgp_instance_list_age_seconds",
            "Seconds since this worker last listed a provider account's instances successfully (the fleet look, the sweeper).",
            labels=["provider", "account"],
        )
        now = time.monotonic()
        for (provider, account), at in sorted(self.listed_at.items()):
            family.add_metric([provider, account], now - at)
        yield family


LIST_AGES = InstanceListAges()
REGISTRY.register(LIST_AGES)


async def list_account(provider: CloudProvider, prefix: str, *, account: str) -> list[Instance]:
    """Every live instance of the account `provider` reaches whose name starts with `prefix`:
    one listing (paged where the API pages). Counts the outcome and keeps the list's age."""
    try:
        found = await provider.list_instances(prefix)
    except Exception as exc:
        INSTANCE_LISTS.labels(provider.name, account, type(exc).__name__).inc()
        raise
    INSTANCE_LISTS.labels(provider.name, account, "ok").inc()
    LIST_AGES.listed_at[(provider.name, account)] = time.monotonic()
    return found
