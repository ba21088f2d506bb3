"""Offer ranking and the unavailable-offer cache: pure, no I/O."""

from datetime import timedelta
from decimal import Decimal

from tgp.offers import UnavailableOffers, offer_satisfies, rank_offers
from tgp.types import Offer, OfferRequirements


def offer(provider: str, offer_id: str, price: str, gpu: str = "RTX4090", region: str = "us-east", **kw: object) -> Offer:
    return Offer(provider=provider, offer_id=offer_id, gpu_type=gpu, region=region, hourly_price=Decimal(price), **kw)  # type: ignore[arg-type]


def test_cheapest_first_with_provider_priority_breaking_ties() -> None:
    offers = [offer("b", "1", "0.50"), offer("a", "2", "0.50"), offer("c", "3", "0.40")]
    ranked = rank_offers(offers, OfferRequirements(), provider_priority={"a": 1, "b": 2})
    assert [o.offer_id for o in ranked] == ["3", "2", "1"]


def test_requirements_filter_gpu_region_price_count_and_spot() -> None:
    req = OfferRequirements(gpu_types=["A100-80GB"], regions=["us-west"], max_hourly_price=Decimal("1.50"), min_gpu_count=2, allow_spot=False)
    assert offer_satisfies(offer("a", "x", "1.40", gpu="A100-80GB", region="us-west", gpu_count=2), req)
    assert not offer_satisfies(offer("a", "x", "1.60", gpu="A100-80GB", region="us-west", gpu_count=2), req)
    assert not offer_satisfies(offer("a", "x", "1.40", gpu="H100-SXM", region="us-west", gpu_count=2), req)
    assert not offer_satisfies(offer("a", "x", "1.40", gpu="A100-80GB", region="eu-west", gpu_count=2), req)
    assert not offer_satisfies(offer("a", "x", "1.40", gpu="A100-80GB", region="us-west", gpu_count=1), req)
    assert not offer_satisfies(offer("a", "x", "1.40", gpu="A100-80GB", region="us-west", gpu_count=2, spot=True), req)


def test_excluded_offers_are_skipped() -> None:
    cheap, dear = offer("a", "1", "0.3"), offer("a", "2", "0.9")
    assert rank_offers([cheap, dear], OfferRequirements(), exclude=[cheap.key]) == [dear]


def test_unavailable_entries_expire() -> None:
    now = [100.0]
    cache = UnavailableOffers(clock=lambda: now[0])
    cache.mark("a/1/us", timedelta(minutes=3))
    assert cache.keys() == {"a/1/us"}
    now[0] += 179
    assert cache.keys() == {"a/1/us"}
    now[0] += 2
    assert cache.keys() == set()


def test_the_requirements_carry_the_tie_break() -> None:
    # Without an explicit provider_priority, ranking uses the one in the requirements.
    offers = [offer("vastai", "1", "0.50"), offer("runpod", "2", "0.50"), offer("lambdalabs", "3", "0.60")]
    req = OfferRequirements(provider_priority={"runpod": 1, "vastai": 2, "lambdalabs": 1})
    assert [o.offer_id for o in rank_offers(offers, req)] == ["2", "1", "3"]  # price first, then priority
    req = OfferRequirements(provider_priority={"runpod": 2, "vastai": 1})
    assert [o.offer_id for o in rank_offers(offers, req)] == ["1", "2", "3"]


def test_class_provider_priority_reaches_the_ranking() -> None:
    from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec
    from tgp.pools import offer_requirements

    klass = GPUNodeClassSpec.model_validate(
        {"providers": [{"name": "vastai", "priority": 2}, {"name": "runpod", "priority": 1}, {"name": "lambdalabs", "enabled": False}]}
    )
    req = offer_requirements(GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}}), klass)
    assert req.provider_priority == {"runpod": 1, "vastai": 2}
    tied = [offer("vastai", "1", "0.50"), offer("runpod", "2", "0.50")]
    assert [o.provider for o in rank_offers(tied, req)] == ["runpod", "vastai"]


def test_rejection_reasons_say_what_to_change() -> None:
    from decimal import Decimal

    from tgp.offers import rejection_reasons
    from tgp.types import Offer, OfferRequirements

    offer = Offer(provider="vastai", offer_id="1", gpu_type="A100-80GB", region="eu-west", hourly_price=Decimal("1.5"), spot=True)
    req = OfferRequirements(gpu_types=["RTX4090"], regions=["us-east"], providers=["runpod"], min_gpu_count=2, max_hourly_price=Decimal("1.0"), allow_spot=False)
    assert rejection_reasons(offer, req) == [
        "GPU A100-80GB not in RTX4090",
        "region eu-west not in us-east",
        "provider vastai not enabled in the class",
        "1 GPU(s), fewer than 2",
        "$1.5/h above maxHourlyPrice $1.0/h",
        "spot, and the class does not allow spot",
    ]
    assert rejection_reasons(offer, OfferRequirements()) == []
