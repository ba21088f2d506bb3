"""Offer ranking and the unavailable-offer cache: pure, no I/O."""

from datetime import timedelta
from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from tgp.offers import UnavailableOffers, block_for, choose_offer, offer_satisfies, rank_offers, rejection_reasons
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
    block = block_for("CapacityError", offer("a", "1", "0.3", region="us"), None)
    assert cache.mark(block, timedelta(minutes=3))
    assert cache.blocks() == [block] and cache.keys() == {"offer a/1/us (the worker's own account)"}
    now[0] += 179
    assert not cache.mark(block, timedelta(seconds=1)), "still blocked: not new, and not shortened"
    assert cache.blocks() == [block]
    now[0] += 2
    assert cache.blocks() == [] and cache.keys() == set()


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


# --- the ranking tests requirements without building rejection sentences -------------------
# Issue 20 ("smaller costs"): offer_satisfies no longer builds rejection_reasons' strings to
# test for emptiness. The two must agree on every offer and requirement, and the ranking must
# be exactly the one written from the reasons (what the `tgp offers` listing explains).

_GPUS, _REGIONS, _PROVIDERS = ["RTX4090", "A100", "H100"], ["us-east", "eu-west", "ap-tokyo"], ["vastai", "runpod", "sim"]
_prices = st.decimals(min_value=Decimal("0.05"), max_value=Decimal("4.00"), places=2)
_offers = st.builds(
    Offer,
    provider=st.sampled_from(_PROVIDERS),
    offer_id=st.sampled_from(["1", "2", "3", "4"]),
    gpu_type=st.sampled_from(_GPUS),
    gpu_count=st.integers(1, 8),
    region=st.sampled_from(_REGIONS),
    hourly_price=_prices,
    spot=st.booleans(),
)
_requirements = st.builds(
    OfferRequirements,
    gpu_types=st.lists(st.sampled_from(_GPUS), max_size=2, unique=True),
    regions=st.lists(st.sampled_from(_REGIONS), max_size=2, unique=True),
    providers=st.lists(st.sampled_from(_PROVIDERS), max_size=2, unique=True),
    min_gpu_count=st.integers(1, 8),
    max_hourly_price=st.none() | _prices,
    allow_spot=st.booleans(),
    provider_priority=st.dictionaries(st.sampled_from(_PROVIDERS), st.integers(1, 3)),
)


@given(offer=_offers, req=_requirements)
def test_an_offer_satisfies_exactly_when_it_has_no_rejection_reason(offer: Offer, req: OfferRequirements) -> None:
    assert offer_satisfies(offer, req) == (rejection_reasons(offer, req) == [])


@given(offers=st.lists(_offers, max_size=30), req=_requirements, excluded=st.sets(st.sampled_from([f"{p}/{i}/{r}" for p in _PROVIDERS for i in "1234" for r in _REGIONS])))
def test_the_ranking_is_the_one_the_rejection_reasons_explain(offers: list[Offer], req: OfferRequirements, excluded: set[str]) -> None:
    explained = [o for o in offers if o.key not in excluded and not rejection_reasons(o, req)]
    expected = sorted(explained, key=lambda o: (o.hourly_price, req.provider_priority.get(o.provider, 1_000), o.key))
    assert rank_offers(offers, req, exclude=excluded) == expected


@given(offers=st.lists(_offers, max_size=30), req=_requirements, excluded=st.sets(st.sampled_from([f"{p}/{i}/{r}" for p in _PROVIDERS for i in "1234" for r in _REGIONS])))
def test_the_choice_is_the_rankings_first_and_counts_what_it_would_list(offers: list[Offer], req: OfferRequirements, excluded: set[str]) -> None:
    """A node's one-pass choice (`choose_offer`) is the ranking's first offer, ties included;
    `eligible` is the ranking's length and `matching` counts the excluded ones too."""
    ranked = rank_offers(offers, req, exclude=excluded)
    choice = choose_offer(offers, req, exclude=excluded)
    assert choice.offer == (ranked[0] if ranked else None)
    assert choice.eligible == len(ranked)
    assert choice.matching == sum(1 for o in offers if not rejection_reasons(o, req))
