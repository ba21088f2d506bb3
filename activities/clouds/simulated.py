"""The `simulated` provider: the adapter for sim.cloud's HTTP API.

It is written exactly like a real provider adapter (an `HttpAdapter`, wire format translated
once into Offer/Instance), so the lifecycle exercised by the demo and the tests is the one
real clouds get.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
from pydantic import SecretStr

from activities.clouds import listed
from tgp.capabilities import ProviderCapabilities
from tgp.errors import CapacityError, ConfigError, OfferRefused, TransientError
from activities.http import CLIENT_ERRORS, HttpAdapter
from activities.http_errors import Fixes, Quotable, error_body
from tgp.types import BootPayload, Instance, InstanceState, Offer

_STATES = {
    "pending": InstanceState.PENDING,
    "running": InstanceState.RUNNING,
    "failed": InstanceState.FAILED,
    "terminated": InstanceState.TERMINATED,
}
# The refusals of a create that `launch` sorts, and of a delete that `terminate` retries
# (401 and 403 are worded by HttpAdapter).
_REFUSALS = CLIENT_ERRORS - {401, 403}


class SimulatedProvider(HttpAdapter):
    """CloudProvider over the simulated cloud at `base_url`."""

    name = "simulated"
    system = "simulated cloud"
    # The simulated cloud's error codes (sim/cloud.py): the only text of an error answer quoted.
    quotable = Quotable(
        codes=frozenset({
            "insufficient-capacity", "not-found", "unauthorized", "invalid-offer", "invalid-name", "offer-unavailable",
            "unavailable", "service-unavailable", "internal", "injected",
        })
    )  # fmt: skip
    # Simulated machines read the container-style env payload and always "join".
    capabilities = ProviderCapabilities(machine="vm", boot_payload="env", joins_as_node=True, spot=True)

    def __init__(
        self,
        base_url: str,
        *,
        api_key: SecretStr | None = None,
        client: httpx.AsyncClient | None = None,
        name: str = "simulated",
        consistency_window: timedelta = timedelta(0),
        timeout: httpx.Timeout | None = None,
    ) -> None:
        """`consistency_window`: the simulated cloud is consistent at once unless a test gives
        it a lag (sim.provider_model); such a test sets the window to match."""
        fixes = Fixes(
            auth="set the simulated cloud's API key in TGP_SIMULATED_CLOUD_API_KEY or the class's credentialsRef Secret",
            denied="the simulated cloud answers 403 only to a fault a test injected",
        )
        extra = {"timeout": timeout} if timeout is not None else {}
        super().__init__(fixes=fixes, base_url=base_url, api_key=api_key, client=client, **extra)
        self.name = name
        self.consistency_window = consistency_window  # several simulated clouds can stand in for several providers

    async def list_offers(self) -> list[Offer]:
        body = (await self._call("GET", "/v1/offers")).json()
        return [self._offer(o) for o in body.get("offers") or []]

    async def launch(self, offer: Offer, *, name: str, boot: BootPayload) -> Instance:
        body = {"offerId": offer.offer_id, "name": name, "userData": boot.content}
        response = await self._create("POST", "/v1/instances", what=f"instance {name}", ok=_REFUSALS, json=body)
        if response.status_code == 413:
            # The boot payload the class's template made: too large for every offer.
            raise ConfigError(
                f"the boot payload for {name} is {len(boot.content.encode())} bytes, more than the simulated cloud accepts (413): "
                "shorten the class's bootstrapTemplate"
            )
        if response.status_code == 409:
            raise CapacityError(f"simulated cloud has no capacity for {offer.key} (409: {self._answer(response)})")
        if response.status_code >= 400:
            # The offer id is unknown or was withdrawn: this offer is refused, the next may work.
            raise OfferRefused(f"simulated cloud refused the launch of {offer.key} ({response.status_code}: {self._answer(response)})")
        return self._instance(response.json())

    async def find_by_name(self, name: str) -> Instance | None:
        found = await self.find_all_by_name(name)
        return found[0] if found else None

    async def find_all_by_name(self, name: str) -> list[Instance]:
        response = await self._call("GET", "/v1/instances", params={"name": name})
        return [self._instance(i) for i in response.json().get("instances") or []]

    async def list_instances(self, prefix: str, names: Collection[str] | None = None) -> list[Instance]:
        response = await self._call("GET", "/v1/instances")
        return [self._instance(i) for i in response.json().get("instances") or [] if listed(str(i.get("name", "")), prefix, names)]

    async def describe(self, instance_id: str) -> Instance | None:
        response = await self._call("GET", f"/v1/instances/{instance_id}", ok=(404,))
        return None if self._gone(response) else self._instance(response.json())

    async def terminate(self, instance_id: str) -> None:
        response = await self._call("DELETE", f"/v1/instances/{instance_id}", ok=_REFUSALS)
        if response.status_code >= 400 and not self._gone(response):
            raise TransientError(f"simulated cloud could not terminate {instance_id} ({response.status_code}: {self._answer(response)})")

    def _says_missing(self, response: httpx.Response) -> bool:
        """The simulated cloud's own 404 is `{"error": {"code": "not-found"}}`; any other came
        from a wrong URL or a proxy."""
        error = error_body(response).get("error")
        return isinstance(error, dict) and error.get("code") == "not-found"

    def _offer(self, raw: dict[str, Any]) -> Offer:
        return Offer(
            provider=self.name,
            offer_id=raw["id"],
            gpu_type=raw["gpu"],
            gpu_count=int(raw.get("gpuCount", 1)),
            region=raw["region"],
            hourly_price=Decimal(raw["pricePerHour"]),
            spot=bool(raw.get("spot", False)),
        )

    def _instance(self, raw: dict[str, Any]) -> Instance:
        return Instance(
            provider=self.name,
            instance_id=raw["id"],
            name=raw["name"],
            state=_STATES.get(raw.get("status", ""), InstanceState.PENDING),
            offer_id=raw.get("offerId", ""),
            hourly_price=Decimal(raw["pricePerHour"]) if raw.get("pricePerHour") else None,
            interrupted=bool(raw.get("interrupted", False)),
        )
