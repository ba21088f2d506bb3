"""The `lambdalabs` provider: Lambda Cloud GPU VMs over the Lambda Cloud API v1
(`https://cloud.lambda.ai/api/v1`).

Lambda sells real VMs (Ubuntu / Lambda Stack) configured at first boot by cloud-init
`user_data`, so a Lambda machine can run a kubelet and join as a node. There is no spot
market in the API (the `preempted` status exists but nothing sells interruptible capacity).

Wire format, translated once here (reference/providers.md section 1). Every success body is
`{"data": ...}`, every failure `{"error": {"code", "message", "suggestion"?}}`; Lambda says to
branch on `code` only.
    GET  /instance-types -> {"data": {<type>: {"instance_type": {name, gpu_description,
                              price_cents_per_hour, specs: {gpus, ...}},
                              "regions_with_capacity_available": [{name, description}]}}}
    POST /instance-operations/launch {region_name, instance_type_name, ssh_key_names: [one],
                              name, hostname?, user_data, image?} -> {"data": {"instance_ids": [id]}}
    GET  /instances -> {"data": [Instance]} (non-terminated only)
    GET  /instances/{id} -> {"data": Instance} | 404 global/object-does-not-exist
    POST /instance-operations/terminate {"instance_ids": [id]} -> {"data": {"terminated_instances": [...]}}
Prices are integer **US cents per hour** for the whole instance.

Limits: about 1 request/s in general and 1 launch per 12 s, so requests are paced with
`MinInterval` rather than discovered through 429s. Errors: 401 -> AuthError naming the Secret;
400 `instance-operations/launch/insufficient-capacity` -> CapacityError; `global/quota-exceeded`
and 403 `global/account-inactive` / `global/invalid-address` -> PermissionDenied (stop using
the provider until the account is fixed); on launch, `global/invalid-parameters` and
`global/object-does-not-exist` naming the SSH key or image (what the class configured) ->
ConfigError, while `global/object-does-not-exist` for the offer's region or instance type and
any other refusal -> OfferRefused (fail over to the next offer); 429/5xx -> retried in
`activities.http.send`, then TransientError. A launch is never retried in-call on a 5xx or timeout (no idempotency key):
the caller looks the instance up by name first.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Callable, Collection
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import httpx
import structlog
from pydantic import SecretStr

from activities.clouds import listed
from tgp.capabilities import ProviderCapabilities
from tgp.errors import CapacityError, ConfigError, OfferRefused, PermissionDenied, TgpError, TransientError
from activities.http import CLIENT_ERRORS, HttpAdapter, Sleep, request_line
from activities.http_errors import Fixes, Quotable, error_code, error_detail
from tgp.normalize import normalize_gpu, normalize_region
from activities.clouds.ratelimit import MinInterval
from tgp.types import BootPayload, Instance, InstanceState, Offer

__all__ = ["DEFAULT_BASE_URL", "LambdaProvider", "wire_name"]

log = structlog.get_logger(__name__)

DEFAULT_BASE_URL = "https://cloud.lambda.ai/api/v1"
SYSTEM = "Lambda Cloud API"
# Lambda's documented error codes (reference/providers.md 1.5; `provider/internal-unavailable`
# is its example of an upstream one): the only text of an error answer a message quotes.
QUOTABLE = Quotable(
    codes=frozenset({
        "instance-operations/launch/insufficient-capacity", "instance-operations/launch/file-system-in-wrong-region",
        "global/quota-exceeded", "global/invalid-parameters", "global/object-does-not-exist", "global/invalid-api-key",
        "global/account-inactive", "global/invalid-address", "global/duplicate", "global/internal-error",
        "global/too-many-requests", "filesystems/filesystem-in-use", "provider/internal-unavailable",
    })
)  # fmt: skip
# Lambda's published limits: about one request per second, one launch per 12 s (5 per minute).
REQUEST_INTERVAL = 1.0
LAUNCH_INTERVAL = 12.0
# Lambda's limits on launch fields.
MAX_NAME_LEN = 64
MAX_USER_DATA_BYTES = 1024 * 1024
_HOSTNAME = re.compile(r"^[a-z0-9][0-9a-z-]{0,62}$")
# "8x H100 (80 GB SXM5)" -> "H100 (80 GB SXM5)" when gpu_description is missing.
_COUNT_PREFIX = re.compile(r"^\s*\d+\s*x\s*", re.IGNORECASE)
# The refusals of a launch that `_launch_refused` sorts (401 and 403 are worded by HttpAdapter).
_CREATE_ANSWERS = CLIENT_ERRORS - {401, 403}
# A launch names four objects; `global/object-does-not-exist` does not say which is missing
# except in its message. These words mean one the class configured, not the offer's.
_CLASS_OBJECTS = ("ssh", "image", "file system", "filesystem", "firewall")

_STATES = {
    "booting": InstanceState.PENDING,
    "active": InstanceState.RUNNING,
    "unhealthy": InstanceState.FAILED,
    "preempted": InstanceState.STOPPED,
    "terminating": InstanceState.TERMINATED,
    "terminated": InstanceState.TERMINATED,
}
_GONE = frozenset({"terminating", "terminated"})


def wire_name(name: str) -> str:
    """The instance name sent to Lambda: `name` itself when it fits Lambda's 64 characters,
    else a prefix plus a hash of the whole name, so launch and find_by_name always agree."""
    if len(name) <= MAX_NAME_LEN:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: MAX_NAME_LEN - 9]}-{digest}"


class LambdaProvider(HttpAdapter):
    """CloudProvider over the Lambda Cloud API v1.

    `ssh_key_name` is the name of an SSH key already registered with Lambda (launch requires
    exactly one). `image_family` picks the OS image (default: latest Lambda Stack).
    `request_interval` / `launch_interval` pace requests (Lambda's limits); `sleep` and
    `clock` are their seams, and `sleep` also waits between in-call retries. `secret_ref`
    names where the API key came from, for error messages. A client passed in is used as is
    and not closed here.
    """

    name = "lambdalabs"
    system = SYSTEM
    quotable = QUOTABLE
    capabilities = ProviderCapabilities(machine="vm", boot_payload="cloud-init", joins_as_node=True, spot=False)

    def __init__(
        self,
        api_key: SecretStr,
        *,
        ssh_key_name: str,
        base_url: str = DEFAULT_BASE_URL,
        client: httpx.AsyncClient | None = None,
        image_family: str | None = None,
        request_interval: float = REQUEST_INTERVAL,
        launch_interval: float = LAUNCH_INTERVAL,
        secret_ref: str = "the Lambda Cloud API key Secret",
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Raises ConfigError for an empty key or SSH key name."""
        if not api_key.get_secret_value():
            raise ConfigError(f"the Lambda Cloud API key is empty: set it in {secret_ref}")
        if not ssh_key_name:
            raise ConfigError("Lambda launches need the name of an SSH key registered with Lambda (ssh_key_name)")
        fixes = Fixes(
            auth=f"put a valid Lambda Cloud API key (cloud.lambda.ai > API keys) in {secret_ref}",
            denied="the Lambda account needs attention (billing, payment method or address verification) in the Lambda console",
        )
        # Every request (and each retry of one) waits its turn under Lambda's general limit.
        requests = MinInterval(request_interval, clock=clock, sleep=sleep)
        super().__init__(fixes=fixes, base_url=base_url, api_key=api_key, client=client, sleep=sleep, pace=requests)
        self._ssh_key_name = ssh_key_name
        self._image_family = image_family
        self._launches = MinInterval(launch_interval, clock=clock, sleep=sleep)

    def __repr__(self) -> str:
        return f"LambdaProvider(base_url={self._base_url!r}, ssh_key_name={self._ssh_key_name!r})"

    # --- the CloudProvider port -------------------------------------------------------

    async def list_offers(self) -> list[Offer]:
        """One Offer per (instance type, region with capacity); sold-out types give none."""
        data = self._data(await self._call("GET", "/instance-types"))
        if not isinstance(data, dict):
            raise TransientError(f"{SYSTEM}: /instance-types answered without a data map")
        offers: list[Offer] = []
        for entry in data.values():
            if isinstance(entry, dict):
                offers.extend(self._offers(entry))
        return offers

    async def launch(self, offer: Offer, *, name: str, boot: BootPayload) -> Instance:
        """Launch one VM of `offer` named `name` with `boot` as cloud-init user_data.
        CapacityError when the region is sold out; TransientError after a 5xx or timeout,
        when the VM may exist anyway (the caller finds it by name)."""
        if boot.kind != "cloud-init":
            raise ConfigError(f"Lambda instances take a `cloud-init` boot payload (user_data), not {boot.kind!r}")
        if len(boot.content.encode()) > MAX_USER_DATA_BYTES:
            raise ConfigError(f"the cloud-init payload for {name} exceeds Lambda's 1 MB user_data limit")
        body: dict[str, Any] = {
            # Lambda region codes are already label-safe, so the Offer's region is the wire value.
            "region_name": offer.region,
            "instance_type_name": offer.offer_id,
            "ssh_key_names": [self._ssh_key_name],
            "name": wire_name(name),
            "user_data": boot.content,
        }
        if _HOSTNAME.match(boot.hostname):
            body["hostname"] = boot.hostname
        if self._image_family:
            body["image"] = {"family": self._image_family}
        async with self._launches:
            # A 429 without Retry-After waits out the 12 s Lambda documents between launches,
            # whatever this adapter's own pacing is set to.
            response = await self._create(
                "POST",
                "/instance-operations/launch",
                what=f"instance {body['name']}",
                ok=_CREATE_ANSWERS,
                rate_limit_wait=LAUNCH_INTERVAL,
                json=body,
            )
        if response.status_code < 300:
            data = self._data(response)
            ids = data.get("instance_ids") if isinstance(data, dict) else None
            if not ids:
                raise TransientError(f"{SYSTEM}: launch of {body['name']} answered without an instance id; look it up by name")
            log.info("lambdalabs.instance_launched", instance_id=ids[0], name=body["name"], offer=offer.key)
            return Instance(
                provider=self.name,
                instance_id=str(ids[0]),
                name=body["name"],
                state=InstanceState.PENDING,
                offer_id=offer.offer_id,
                hourly_price=offer.hourly_price,
            )
        raise self._launch_refused(response, offer)

    def listed_name(self, name: str) -> str:
        """The name an instance launched as `name` carries in listings (activities.name_lists)."""
        return wire_name(name)

    async def find_all_by_name(self, name: str) -> list[Instance]:
        """Every live instance called `name` (Lambda names are not unique)."""
        wanted = wire_name(name)
        data = self._data(await self._call("GET", "/instances"))
        items = data if isinstance(data, list) else []
        return [self._instance(i) for i in items if isinstance(i, dict) and i.get("name") == wanted and i.get("status") not in _GONE]

    async def find_by_name(self, name: str) -> Instance | None:
        """The live instance called `name` (terminating ones are skipped); if several share
        the name, an active one wins."""
        wanted = wire_name(name)
        data = self._data(await self._call("GET", "/instances"))
        items = data if isinstance(data, list) else []
        live = [i for i in items if isinstance(i, dict) and i.get("name") == wanted and i.get("status") not in _GONE]
        if not live:
            return None
        if len(live) > 1:
            log.warning("lambdalabs.duplicate_instance_name", name=wanted, instance_ids=[i.get("id") for i in live])
        return self._instance(max(live, key=lambda i: i.get("status") == "active"))

    async def list_instances(self, prefix: str, names: Collection[str] | None = None) -> list[Instance]:
        """Every live instance whose name starts with `prefix` (with `names`, called one of
        them as listed: `listed_name`)."""
        data = self._data(await self._call("GET", "/instances"))
        items = data if isinstance(data, list) else []
        return [
            self._instance(i)
            for i in items
            if isinstance(i, dict) and listed(str(i.get("name") or ""), prefix, names) and i.get("status") not in _GONE
        ]

    async def describe(self, instance_id: str) -> Instance | None:
        """The instance's state; None once Lambda no longer knows it (404)."""
        response = await self._call("GET", f"/instances/{quote(instance_id, safe='')}", ok=(404,))
        if self._gone(response):
            return None
        data = self._data(response)
        if not isinstance(data, dict):
            raise TransientError(f"{SYSTEM}: instance {instance_id} answered without data")
        return self._instance(data)

    async def terminate(self, instance_id: str) -> None:
        """Terminate the instance; one already gone (404) counts as terminated."""
        response = await self._call("POST", "/instance-operations/terminate", json={"instance_ids": [instance_id]}, ok=(404,))
        log.info("lambdalabs.instance_terminated", instance_id=instance_id, already_gone=self._gone(response))

    # --- translation ------------------------------------------------------------------

    def _offers(self, entry: dict[str, Any]) -> list[Offer]:
        itype = entry.get("instance_type") or {}
        type_name = itype.get("name")
        cents = itype.get("price_cents_per_hour")
        count = int((itype.get("specs") or {}).get("gpus") or 0)
        if not isinstance(type_name, str) or not isinstance(cents, int) or count < 1:
            return []  # CPU-only types and malformed entries are not GPU offers
        description = itype.get("gpu_description") or _COUNT_PREFIX.sub("", str(itype.get("description") or type_name))
        gpu_type = normalize_gpu(description)
        price = _dollars(cents)
        return [
            Offer(
                provider=self.name,
                offer_id=type_name,
                gpu_type=gpu_type,
                gpu_count=count,
                region=normalize_region(region["name"]),
                hourly_price=price,
                spot=False,
            )
            for region in entry.get("regions_with_capacity_available") or []
            if isinstance(region, dict) and isinstance(region.get("name"), str)
        ]

    def _instance(self, raw: dict[str, Any]) -> Instance:
        status = str(raw.get("status") or "")
        state = _STATES.get(status, InstanceState.PENDING)
        if state is InstanceState.RUNNING and not raw.get("ip"):
            state = InstanceState.PENDING  # usable only once it has its public IPv4
        itype = raw.get("instance_type") or {}
        cents = itype.get("price_cents_per_hour")
        return Instance(
            provider=self.name,
            instance_id=str(raw["id"]),
            name=str(raw.get("name") or ""),
            state=state,
            offer_id=str(itype.get("name") or ""),
            hourly_price=_dollars(cents) if isinstance(cents, int) else None,
            interrupted=status == "preempted",
        )

    def _launch_refused(self, response: httpx.Response, offer: Offer) -> TgpError:
        # Lambda's message is read to sort the answer, never quoted: it may echo the request
        # (the user-data); messages name the code, which Lambda says to branch on.
        code, said = _code(response), error_detail(response)
        where = f"{offer.offer_id} in {offer.region}"
        if code == "instance-operations/launch/insufficient-capacity":
            return CapacityError(f"Lambda has no capacity for {where} ({code})")
        if code == "global/quota-exceeded":
            return PermissionDenied(
                f"Lambda refused to launch {where}: the account's instance quota is used up ({code}); "
                "the quota grows as invoices are paid, or ask Lambda support to raise it"
            )
        if code.startswith("provider/"):
            return TransientError(f"Lambda's upstream failed the launch of {where} ({self._shown(response)}); try again shortly")
        if code == "global/object-does-not-exist" and any(word in said.lower() for word in _CLASS_OBJECTS):
            return ConfigError(
                f"Lambda does not know something the launch of {where} names ({code}): check that the SSH key "
                f"{self._ssh_key_name!r} is registered with Lambda"
                + (f" and that image family {self._image_family!r} exists (GET /images)" if self._image_family else "")
            )
        if code == "global/invalid-parameters" or not code:
            # A body tgp built, or no Lambda envelope at all (a wrong base URL): wrong for every offer.
            return ConfigError(f"Lambda rejected the launch of {where} ({self._shown(response)})")
        if code == "global/object-does-not-exist":
            return OfferRefused(f"Lambda refused {where} ({self._shown(response)}): the instance type or region no longer exists")
        # Another refusal of this one offer.
        return OfferRefused(f"Lambda refused {where} ({self._shown(response)})")

    # --- requests ---------------------------------------------------------------------

    def _refusal(self, response: httpx.Response) -> TgpError:
        """A `provider/...` code is Lambda's upstream failing, which passes; the rest as every API."""
        if _code(response).startswith("provider/"):
            return TransientError(f"{SYSTEM}: {request_line(response)} failed upstream ({self._answer(response)})")
        return super()._refusal(response)

    def _says_missing(self, response: httpx.Response) -> bool:
        """Lambda's own 404 carries `global/object-does-not-exist`; any other came from a wrong
        URL or a proxy."""
        return _code(response) == "global/object-does-not-exist"

    def _data(self, response: httpx.Response) -> Any:
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or "data" not in body:
            raise TransientError(f"{SYSTEM}: {request_line(response)} answered without a data envelope")
        return body["data"]


def _dollars(cents: int) -> Decimal:
    """Lambda's integer US cents per hour as Decimal dollars per hour."""
    return Decimal(cents) / 100


def _code(response: httpx.Response) -> str:
    """The `error.code` of a Lambda error envelope (when shaped like a code), or '': for sorting
    the answer; messages quote only a documented one (QUOTABLE)."""
    return error_code(response)
