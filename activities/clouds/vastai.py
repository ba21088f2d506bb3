"""The `vastai` provider: Vast.ai's marketplace behind the `CloudProvider` port.

Vast sells individual machines ("asks"): one Offer per ask, rented with `PUT /asks/{id}/`.
What you get is an unprivileged Docker container by default, or a KVM VM when the class asks
for one (`vm=True`: only VM-capable hosts are searched, the image must be `docker.io/vastai/kvm:*`).
Only VMs can run a kubelet, so only they join as nodes.

Wire format (reference/providers.md section 3), translated once here into Offer/Instance:
    POST   /api/v0/bundles/ {field: {op: value}, type: ondemand|bid, order, limit, allocated_storage}
                                 -> {"offers": [{id, gpu_name, num_gpus, geolocation, dph_total, min_bid, ...}]}
    PUT    /api/v0/asks/{id}/ {client_id, image, disk, label, runtype, env, onstart, vm?, price?}
                                 -> {"success": true, "new_contract": <instance id>}
                                 |  404/410 no_such_ask (rented away) | low bid: an error that still
                                    carries new_contract (the instance exists, stopped)
    GET    /api/v0/instances/{id}/?owner=me -> {"instances": {...}} | {"instances": null} (gone)
    GET    /api/v1/instances/?select_filters={"label": {"eq": name}} -> {instances, next_token}
    DELETE /api/v0/instances/{id}/ -> {"success": true} | 404 `not_found` (already gone; a 404 not in that envelope is not)

A refused rental is sorted by what it says: `no_such_ask` and a low bid -> CapacityError;
billing -> PermissionDenied; `invalid_args` and `no_ssh_key_for_vm` (the body tgp built, the
account's setup) -> ConfigError; a host-only ask (403 "Offer N is not your own") and any other
refusal of this one ask -> OfferRefused, so the node fails over to the next offer.

Vast enforces a minimum interval per endpoint and its 429 carries no Retry-After, so each
endpoint has its own `MinInterval` and a 429 re-enters that pacing before retrying.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Collection, Mapping
from decimal import Decimal
from typing import Any

import httpx
import structlog
from pydantic import SecretStr

from activities.clouds import listed
from tgp.capabilities import ProviderCapabilities
from tgp.errors import CapacityError, ConfigError, OfferRefused, PermissionDenied, TgpError, TransientError
from activities.http import CLIENT_ERRORS, HttpAdapter, Sleep
from activities.http_errors import Fixes, Quotable, error_body, error_code, error_detail, mentions, scrub
from tgp.normalize import normalize_gpu, normalize_region
from activities.clouds.ratelimit import MinInterval, Unlimited
from tgp.types import BootPayload, Instance, InstanceState, Offer

__all__ = [
    "CONTAINER_CAPABILITIES",
    "DEFAULT_BASE_URL",
    "DEFAULT_CONTAINER_IMAGE",
    "DEFAULT_VM_IMAGE",
    "MIN_INTERVALS",
    "VM_CAPABILITIES",
    "VastProvider",
    "instance_state",
]

log = structlog.get_logger(__name__)

DEFAULT_BASE_URL = "https://console.vast.ai/api/v0"
SYSTEM = "Vast.ai"
# Vast.ai's documented error codes (reference/providers.md 3.4-3.5, the CLI's and dstack's
# checks): the only text of an error answer a message quotes.
QUOTABLE = Quotable(
    codes=frozenset({
        "invalid_args", "invalid_price", "no_ssh_key_for_vm", "no_such_ask", "auth_error", "not_found",
        "no_such_instance", "insufficient_bid", "rate_limited", "server_error",
    })
)  # fmt: skip
DEFAULT_CONTAINER_IMAGE = "nvidia/cuda:12.4.1-base-ubuntu22.04"
# Vast VMs boot only from its own KVM images (guides/instances/virtual-machines).
VM_IMAGE_PREFIX = "docker.io/vastai/kvm:"
DEFAULT_VM_IMAGE = VM_IMAGE_PREFIX + "ubuntu_terminal"
# Disk per instance; also sent as `allocated_storage` so dph_total includes its cost.
DEFAULT_DISK_GB = 50
# Enough rows for ranking without paying for Vast's (quota-limited) search rows.
SEARCH_LIMIT = 100
# The v1 instance list serves at most 25 rows per page.
LIST_PAGE_SIZE = 25

# Seconds between calls per endpoint. Vast's spec gives thresholds create 4.5, destroy 3.0,
# show 2.0, manage 1.0 (and 5.5 for changing a bid, which tgp never does) without a unit;
# read as seconds they are the safe side. Search has no published number.
MIN_INTERVALS: Mapping[str, float] = {
    "search": 1.0,
    "create": 4.5,
    "show": 2.0,
    "list": 2.0,
    "destroy": 3.0,
}

# Base filters every search carries (the official CLI adds the same four).
_BASE_FILTERS: dict[str, Any] = {
    "verified": {"eq": True},
    "external": {"eq": False},
    "rentable": {"eq": True},
    "rented": {"eq": False},
    "num_gpus": {"gte": 1},
}

CONTAINER_CAPABILITIES = ProviderCapabilities(
    machine="container-or-vm",
    boot_payload="onstart",
    joins_as_node=False,
    spot=True,
    why_not_node=(
        "Vast.ai instances are unprivileged Docker containers by default (no systemd, no kernel "
        "modules, no nested containers), so they cannot run a kubelet; enable VMs for this class "
        "to rent KVM virtual machines, which can"
    ),
)
VM_CAPABILITIES = ProviderCapabilities(machine="container-or-vm", boot_payload="onstart", joins_as_node=True, spot=True)

# actual_status -> state (providers.md section 5). No DEGRADED in tgp: a host that went
# offline may come back, and the Node's readiness tells the rest.
_STATES: Mapping[str | None, InstanceState] = {
    None: InstanceState.PENDING,
    "loading": InstanceState.PENDING,
    "rebooting": InstanceState.PENDING,
    "scheduling": InstanceState.PENDING,
    "offline": InstanceState.PENDING,
    "unknown": InstanceState.PENDING,
    "running": InstanceState.RUNNING,
    "exited": InstanceState.STOPPED,
    "stopped": InstanceState.STOPPED,
    "frozen": InstanceState.STOPPED,
}
# What Vast says when an ask was rented away or withdrawn.
_GONE_ASK_MARKERS = ("no_such_ask", "not available", "no longer available")
_BILLING_MARKERS = ("credit", "balance", "payment", "billing")
# Refusals of what tgp sent or how the account is set up: wrong for every ask.
_CONFIG_CODES = frozenset({"invalid_args", "no_ssh_key_for_vm"})
# Vast's codes for an instance it does not know (destroyed or never there): 404 `not_found`
# (reference/providers.md 3.4); dstack also accepts `no_such_instance`.
_MISSING_CODES = frozenset({"not_found", "no_such_instance"})
# The refusals of a rental that `launch` sorts (a 401 is worded by HttpAdapter).
_CREATE_ANSWERS = CLIENT_ERRORS - {401}


def instance_state(raw: Mapping[str, Any]) -> tuple[InstanceState, bool]:
    """(state, interrupted) of one Vast instance row.

    An interruptible instance whose cur_state, intended_status and next_state all read
    "stopped" was outbid, or was created stopped because the bid was below the market: it is
    STOPPED and interrupted whatever actual_status says (often still null).
    """
    if raw.get("is_bid") and raw.get("cur_state") == raw.get("intended_status") == raw.get("next_state") == "stopped":
        return InstanceState.STOPPED, True
    actual = raw.get("actual_status")
    if actual == "created":
        # Created but not started: a failure when the container runtime said so (dstack checks the same).
        message = str(raw.get("status_msg") or "").lower()
        return (InstanceState.FAILED if "error" in message or "failed" in message else InstanceState.PENDING), False
    return _STATES.get(actual, InstanceState.PENDING), False


class VastProvider(HttpAdapter):
    """CloudProvider over Vast.ai. Containers by default; `vm=True` rents KVM VMs, which can
    join the cluster. `spot=True` also lists interruptible (bid) offers at each ask's min_bid.

    `sleep`, `clock` and `min_intervals` are seams for tests; `secret_ref` names where the key
    came from, for the message of an AuthError.
    """

    name = "vastai"
    system = SYSTEM
    quotable = QUOTABLE
    found_by = "label"

    def __init__(
        self,
        api_key: SecretStr,
        *,
        base_url: str = DEFAULT_BASE_URL,
        client: httpx.AsyncClient | None = None,
        vm: bool = False,
        image: str | None = None,
        disk_gb: int = DEFAULT_DISK_GB,
        spot: bool = True,
        search_filters: Mapping[str, Any] | None = None,
        min_intervals: Mapping[str, float] = MIN_INTERVALS,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        secret_ref: str = "the Vast.ai API key Secret",
    ) -> None:
        if not api_key.get_secret_value():
            raise ConfigError(f"the Vast.ai API key is empty: set it in {secret_ref}")
        self.vm = vm
        self.image = image or (DEFAULT_VM_IMAGE if vm else DEFAULT_CONTAINER_IMAGE)
        if vm and not self.image.startswith(VM_IMAGE_PREFIX):
            raise ConfigError(f"Vast.ai VMs boot only from {VM_IMAGE_PREFIX}* images, not {self.image!r}")
        self.capabilities = VM_CAPABILITIES if vm else CONTAINER_CAPABILITIES
        self.disk_gb = disk_gb
        self.spot = spot
        self._filters = {**_BASE_FILTERS, **({"vms_enabled": {"eq": True}} if vm else {}), **(search_filters or {})}
        fixes = Fixes(
            auth=f"put a valid Vast.ai API key (create one at https://cloud.vast.ai/manage-keys/) in {secret_ref}",
            denied=f"check the permissions of the API key in {secret_ref} at https://cloud.vast.ai/manage-keys/",
        )
        super().__init__(fixes=fixes, base_url=base_url, api_key=api_key, client=client, sleep=sleep)
        # The instance list moved to /api/v1; everything else stays on /api/v0 (the base URL).
        self._v1 = self._base_url[: -len("/v0")] + "/v1" if self._base_url.endswith("/v0") else self._base_url
        # Each endpoint's pacing, entered before every attempt (a retry after a 429 too: Vast's
        # 429 carries no Retry-After, so the retry waits out the endpoint's interval).
        self._limiters: dict[str, MinInterval | Unlimited] = {
            endpoint: MinInterval(interval, clock=clock, sleep=sleep) if interval > 0 else Unlimited()
            for endpoint, interval in min_intervals.items()
        }

    def __repr__(self) -> str:
        return f"VastProvider(base_url={self._base_url!r}, vm={self.vm})"

    # --- CloudProvider -----------------------------------------------------------------

    async def list_offers(self) -> list[Offer]:
        """Rentable, verified, unrented asks: one on-demand Offer per ask at dph_total (which
        includes the disk), and with `spot` one interruptible Offer per ask at its min_bid, the
        bid launch will place (storage, under a cent per hour at the default disk, is billed
        on top of a bid)."""
        offers = [self._offer(row, spot=False) for row in await self._search("ondemand")]
        if self.spot:
            offers += [self._offer(row, spot=True) for row in await self._search("bid") if row.get("min_bid") is not None]
        return [o for o in offers if o is not None]

    async def launch(self, offer: Offer, *, name: str, boot: BootPayload) -> Instance:
        """Rent ask `offer.offer_id` labelled `name`; a spot offer bids its hourly price.

        CapacityError when the ask was rented away or the bid is below the market (the stopped
        instance Vast creates anyway is destroyed); OfferRefused when Vast refuses this ask
        for another reason (a host-only ask). A 5xx or timeout raises TransientError
        without retrying: the instance may exist, and the caller looks it up by label.
        """
        body: dict[str, Any] = {
            "client_id": "me",
            "image": self.image,
            "disk": self.disk_gb,
            "label": name,
            "cancel_unavail": True,  # fail now instead of queueing on a busy machine
            **self._boot_fields(boot),
        }
        if self.vm:
            body["vm"] = True
        if offer.spot:
            body["price"] = float(offer.hourly_price)
        # On-demand and bid rentals are the same endpoint, so they share its pacing.
        response = await self._create(
            "PUT", f"/asks/{offer.offer_id}/", what=f"instance {name}", ok=_CREATE_ANSWERS, pace=self._limiters.get("create"), json=body
        )
        data = _json(response)
        # Vast's message sorts the answer and is never quoted (it may echo the onstart script);
        # messages name its error code.
        code, said = _vast_error(response)
        shown = self._shown(response)
        contract = data.get("new_contract") if isinstance(data, dict) else None
        if response.status_code < 300 and isinstance(data, dict) and data.get("success") and contract is not None:
            return Instance(
                provider=self.name,
                instance_id=str(contract),
                name=name,
                state=InstanceState.PENDING,
                offer_id=offer.offer_id,
                hourly_price=offer.hourly_price,
            )
        if response.status_code == 413:
            # The onstart script the class's template made: too large for every ask.
            raise ConfigError(
                f"the boot payload for {name} is {len(boot.content.encode())} bytes, more than Vast.ai accepts (413): "
                "shorten the class's bootstrapTemplate"
            )
        if contract is not None:
            # Vast created the instance (stopped) and still reported an error: a bid below the market.
            destroyed = await self._destroy_quietly(str(contract))
            raise CapacityError(
                f"Vast.ai did not start ask {offer.offer_id} at a bid of ${offer.hourly_price}/h ({shown}); "
                f"the stopped instance {contract} "
                + ("was destroyed" if destroyed else f"could not be destroyed yet and is released by label {name!r}")
            )
        if response.status_code in (404, 410) or mentions(code, said, _GONE_ASK_MARKERS):
            raise CapacityError(f"Vast.ai ask {offer.offer_id} is no longer available (rented away; {shown})")
        if offer.spot and code == "invalid_price":
            # The ask's min_bid rose since the offer was listed: this price is gone, try the next offer.
            raise CapacityError(f"Vast.ai refused a bid of ${offer.hourly_price}/h for ask {offer.offer_id} ({shown})")
        if response.status_code == 402 or mentions(code, said, _BILLING_MARKERS):
            raise PermissionDenied(f"Vast.ai refused to rent ask {offer.offer_id} for billing reasons ({shown}): add credit to the Vast.ai account")
        if response.status_code == 403 and "not your own" in said.lower():
            raise OfferRefused(f"Vast.ai ask {offer.offer_id} is not your own: a host-only offer ({shown})")
        if response.status_code == 403:
            # Not the documented host-only answer: the key may not rent at all.
            raise PermissionDenied(f"Vast.ai refused to rent ask {offer.offer_id} ({shown})")
        if code in _CONFIG_CODES:
            raise ConfigError(f"Vast.ai rejected the launch of ask {offer.offer_id} ({shown})")
        raise OfferRefused(f"Vast.ai refused ask {offer.offer_id} ({shown})")

    async def find_by_name(self, name: str) -> Instance | None:
        """The instance labelled `name`, from the v1 instance list filtered by label."""
        found = await self.find_all_by_name(name)
        return found[0] if found else None

    async def find_all_by_name(self, name: str) -> list[Instance]:
        """Every instance labelled `name` (labels are not unique), every page."""
        params: dict[str, str | int] = {"select_filters": json.dumps({"label": {"eq": name}}), "limit": LIST_PAGE_SIZE}
        found: list[Instance] = []
        while True:
            data = _json(await self._call("GET", f"{self._v1}/instances/", pace=self._limiters.get("list"), params=params))
            found += [self._instance(raw) for raw in data.get("instances") or [] if raw.get("label") == name]
            token = data.get("next_token")
            if not token:
                return found
            params["after_token"] = token

    async def list_instances(self, prefix: str, names: Collection[str] | None = None) -> list[Instance]:
        """Every instance whose label starts with `prefix` (with `names`, labelled one of
        them), from the v1 instance list."""
        params: dict[str, str | int] = {"limit": LIST_PAGE_SIZE}
        found: list[Instance] = []
        while True:
            data = _json(await self._call("GET", f"{self._v1}/instances/", pace=self._limiters.get("list"), params=params))
            found += [self._instance(raw) for raw in data.get("instances") or [] if listed(str(raw.get("label") or ""), prefix, names)]
            token = data.get("next_token")
            if not token:
                return found
            params["after_token"] = token

    async def describe(self, instance_id: str) -> Instance | None:
        """Current state; None for `{"instances": null}` or Vast's own 404 (destroyed or unknown)."""
        response = await self._call("GET", f"/instances/{instance_id}/", ok=(404,), pace=self._limiters.get("show"), params={"owner": "me"})
        if self._gone(response):
            return None
        raw = _json(response).get("instances")
        if isinstance(raw, list):  # some answers wrap the one row in a list
            raw = raw[0] if raw else None
        return self._instance(raw) if raw else None

    async def terminate(self, instance_id: str) -> None:
        """Destroy the instance; one already gone (Vast's own 404, no_such_instance) counts as
        destroyed."""
        response = await self._call("DELETE", f"/instances/{instance_id}/", ok=(400, 404), pace=self._limiters.get("destroy"))
        if response.status_code < 300 or self._gone(response):
            return
        code, said = _vast_error(response)
        if mentions(code, said, ("no_such_instance", "not_found", "not found")):
            return
        raise TransientError(f"Vast.ai could not destroy instance {instance_id} ({self._shown(response)})")

    # --- wire format -------------------------------------------------------------------

    def _says_missing(self, response: httpx.Response) -> bool:
        """Vast's own 404 for an instance is its `{success, error, msg}` error with the code
        `not_found` (or `no_such_instance`); any other (a page, a gateway's JSON) came from a
        wrong URL or a proxy."""
        code = error_body(response).get("error")  # a gateway's may be an object, not a code
        return isinstance(code, str) and code in _MISSING_CODES

    async def _search(self, kind: str) -> list[dict[str, Any]]:
        body = {
            **self._filters,
            "type": kind,
            "order": [["dph_total", "asc"]],
            "limit": SEARCH_LIMIT,
            "allocated_storage": self.disk_gb,
        }
        response = await self._call("POST", "/bundles/", ok=(404,), pace=self._limiters.get("search"), json=body)
        if response.status_code == 404:
            # The offer search answers 404 rather than 401 to an invalid key.
            raise self._auth_error(response)
        rows = _json(response).get("offers") or []
        # The filters already say so; a row that slips through would only fail at launch.
        return [r for r in rows if r.get("rentable", True) and not r.get("rented", False)]

    def _offer(self, raw: Mapping[str, Any], *, spot: bool) -> Offer | None:
        price = raw.get("min_bid") if spot else raw.get("dph_total")
        if price is None or raw.get("id") is None:
            return None
        return Offer(
            provider=self.name,
            offer_id=str(raw["id"]),
            gpu_type=normalize_gpu(str(raw.get("gpu_name") or "unknown")),
            gpu_count=int(raw.get("num_gpus") or 1),
            region=normalize_region(str(raw.get("geolocation") or "unknown")),
            hourly_price=_decimal(price),
            spot=spot,
        )

    def _instance(self, raw: Mapping[str, Any]) -> Instance:
        state, interrupted = instance_state(raw)
        price = raw.get("dph_total")
        return Instance(
            provider=self.name,
            instance_id=str(raw["id"]),
            name=str(raw.get("label") or ""),
            state=state,
            hourly_price=_decimal(price) if price is not None else None,
            interrupted=interrupted,
        )

    def _boot_fields(self, boot: BootPayload) -> dict[str, Any]:
        """`onstart` runs a script under Vast's SSH launch mode (the only mode VMs have); `env`
        keeps the image's own entrypoint and hands it KEY=VALUE variables."""
        if boot.kind == "onstart":
            return {"runtype": "ssh", "onstart": boot.content, "env": {}}
        if boot.kind == "env":
            if self.vm:
                raise ConfigError("Vast.ai VMs run only in SSH launch mode: use an onstart boot payload")
            env = {}
            for line in boot.content.splitlines():
                key, sep, value = line.partition("=")
                if sep and key.strip():
                    env[key.strip()] = value.strip()
            return {"runtype": "args", "env": env}
        raise ConfigError(f"Vast.ai takes an onstart or env boot payload, not {boot.kind!r}")

    async def _destroy_quietly(self, instance_id: str) -> bool:
        try:
            await self.terminate(instance_id)
        except TgpError as exc:
            # The workflow's cleanup finds it again by label; say so rather than fail the launch twice.
            log.warning("vast_destroy_failed", instance_id=instance_id, error=str(exc))
            return False
        return True


def _json(response: httpx.Response) -> Any:
    """The body with exact decimals (prices are dollars per hour); {} when it is not JSON."""
    try:
        return json.loads(response.content or b"null", parse_float=Decimal) or {}
    except ValueError:
        if response.status_code < 300:
            raise TransientError(f"Vast.ai answered {response.status_code} with a body that is not JSON") from None
        return {"msg": response.text[:300]}


def _vast_error(response: httpx.Response) -> tuple[str, str]:
    """(code, message) of Vast's loosely shaped errors ({success, error, msg} or just
    msg/message, or text), both only read to sort the answer: messages quote a documented
    code (`_shown`)."""
    body = error_body(response)
    said = body.get("msg") or body.get("message") if body else error_detail(response)
    return error_code(response), scrub(str(said or ""))


def _decimal(value: Any) -> Decimal:
    return value if isinstance(value, Decimal) else Decimal(str(value))
