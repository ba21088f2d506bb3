"""The `paperspace` provider: Paperspace (DigitalOcean) machines behind the `CloudProvider` port.

Paperspace hands out real VMs from an OS template, configured at first boot by a startup
script, so a machine can run a kubelet and join as a node. It has no spot market.

**Prices may be stale.** The current API (`https://api.paperspace.com/v1`) has no price or
capacity endpoint, so offers come from a dated static catalog, `paperspace_catalog.json` next
to this module (`catalog_as_of` says how old it is; a catalog older than `CATALOG_STALE_AFTER`
is logged as stale). Capacity is only discovered at launch. With a `template_id`, offers are
cross-checked against that template's `availableMachineTypes` (`GET /os-templates`), which says
what the template supports, not what is in stock.

Wire format (reference/providers.md section 4), translated once here into Offer/Instance:
    GET    /v1/os-templates                      -> {items: [{id, availableMachineTypes}], hasMore, nextPage}
    GET    /v1/billing/account-standing          -> {isInGoodStanding, hasPaymentMethod, isAdminLocked, messages}
    POST   /v1/startup-scripts {name, script, isRunOnce} -> {id, ...}
    POST   /v1/machines {name, machineType, templateId, region, diskSize, startupScriptId, ...}
                                                 -> {data: <Machine>, event: {...}}
    GET    /v1/machines/{id}                     -> Machine | 404
    GET    /v1/machines?name=NAME&after=CURSOR   -> {items, hasMore, nextPage}
    DELETE /v1/machines/{id}                     -> Machine | 404
Errors are `{code, message}`; the create's refusals are undocumented, so they are sorted by
what they mention: billing -> PermissionDenied, capacity -> CapacityError, the template,
startup script or a required field (what the class configured or tgp built) -> ConfigError,
anything else (a machine type not sold in that region, a per-type limit) -> OfferRefused.
The startup script carries the tailnet auth key, so it is deleted when its machine is (and
when the machine could not be created).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Collection, Mapping
from contextlib import aclosing
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import httpx
import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from activities.clouds import listed
from tgp.capabilities import ProviderCapabilities
from tgp.errors import CapacityError, ConfigError, OfferRefused, PermissionDenied, TgpError, TransientError
from activities.http import CLIENT_ERRORS, HttpAdapter, Sleep
from activities.http_errors import Fixes, Quotable, error_body, error_code, error_detail, mentions
from tgp.normalize import normalize_gpu, normalize_region
from tgp.types import BootPayload, Instance, InstanceState, Offer

__all__ = [
    "CAPABILITIES",
    "CATALOG_PATH",
    "CATALOG_STALE_AFTER",
    "DEFAULT_BASE_URL",
    "CatalogEntry",
    "PaperspaceCatalog",
    "PaperspaceProvider",
    "load_catalog",
    "machine_state",
]

log = structlog.get_logger(__name__)

DEFAULT_BASE_URL = "https://api.paperspace.com/v1"
SYSTEM = "Paperspace"
# Paperspace's error codes (its `{code, message}` envelope, reference/providers.md 4.5; the
# codes its API answers with, as sim/paperspace.py reproduces them): the only text of an error
# answer a message quotes.
QUOTABLE = Quotable(
    codes=frozenset({
        "BAD_REQUEST", "UNAUTHORIZED", "NOT_FOUND", "TOO_MANY_REQUESTS", "INTERNAL_SERVER_ERROR", "SERVICE_UNAVAILABLE",
    })
)  # fmt: skip
CATALOG_PATH = Path(__file__).with_name("paperspace_catalog.json")
# Paperspace changes list prices a few times a year; older than this deserves a look.
CATALOG_STALE_AFTER = timedelta(days=120)
# Boot disk; Paperspace's GPU templates start at 50-100 GB and NVIDIA images need room.
DEFAULT_DISK_GB = 100
# Lists are cursor-paged; ask for big pages to keep the call count down.
LIST_LIMIT = 100

CAPABILITIES = ProviderCapabilities(machine="vm", boot_payload="startup-script", joins_as_node=True, spot=False)

# Machine.state -> state (providers.md section 5); a deleted machine (dtDeleted, 404) is gone.
_STATES: Mapping[str, InstanceState] = {
    "provisioning": InstanceState.PENDING,
    "starting": InstanceState.PENDING,
    "serviceready": InstanceState.PENDING,
    "restarting": InstanceState.PENDING,
    "upgrading": InstanceState.PENDING,
    "ready": InstanceState.RUNNING,
    "stopping": InstanceState.STOPPED,
    "off": InstanceState.STOPPED,
}
# The new API's capacity error text is undocumented; the Gradient-era one said "out of capacity".
_CAPACITY_MARKERS = ("capacity", "out of stock", "sold out", "not available", "unavailable", "no machines available")
_BILLING_MARKERS = ("billing", "payment", "credit", "balance", "standing")
# A refusal naming what the class configured (template) or tgp built (script, fields) fails on
# every offer; any other refusal is about this machine type in this region.
_CLASS_MARKERS = ("template", "startup script", "startupscript", "missing required", "disksize", "disk size")
# The refusals of a create that `launch` sorts (401 and 403 are worded by HttpAdapter).
_CREATE_ANSWERS = CLIENT_ERRORS - {401, 403}


class CatalogEntry(BaseModel):
    """One machine type of the static catalog."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    machine_type: str = Field(description="Paperspace machineType, e.g. A4000 or H100x8.")
    gpu: str = Field(description="GPU model as fed to normalize_gpu.")
    gpu_count: int = 1
    hourly_price: Decimal = Field(description="On-demand US dollars per hour for the whole machine.")
    regions: list[str] = Field(description="Paperspace region names, e.g. 'East Coast (NY2)'.")


class PaperspaceCatalog(BaseModel):
    """The dated price list the offers come from (Paperspace publishes no price API)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    as_of: date = Field(description="When the prices were compiled; they may have changed since.")
    currency: Literal["USD"] = "USD"
    source: str
    note: str = ""
    machine_types: list[CatalogEntry]

    def entry(self, machine_type: str) -> CatalogEntry | None:
        """The entry for `machine_type`, if listed."""
        return next((e for e in self.machine_types if e.machine_type == machine_type), None)


def load_catalog(path: Path = CATALOG_PATH) -> PaperspaceCatalog:
    """Read and validate the static catalog file."""
    try:
        return PaperspaceCatalog.model_validate_json(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the Paperspace price catalog {path}: {exc}") from None


def machine_state(raw: Mapping[str, Any]) -> InstanceState | None:
    """The state of a Paperspace machine, or None when it is deleted."""
    if raw.get("dtDeleted"):
        return None
    return _STATES.get(str(raw.get("state") or ""), InstanceState.PENDING)


class PaperspaceProvider(HttpAdapter):
    """CloudProvider over the Paperspace API. Offers come from the static catalog (prices may
    be stale, see `catalog_as_of`); launches need the id of an OS template (`template_id`).

    `sleep` is a seam for tests (retry waits); `secret_ref` names where the key came from, for
    the message of an AuthError.
    """

    name = "paperspace"
    system = SYSTEM
    quotable = QUOTABLE
    capabilities = CAPABILITIES

    def __init__(
        self,
        api_key: SecretStr,
        *,
        base_url: str = DEFAULT_BASE_URL,
        client: httpx.AsyncClient | None = None,
        template_id: str | None = None,
        disk_size_gb: int = DEFAULT_DISK_GB,
        catalog: PaperspaceCatalog | None = None,
        check_templates: bool = True,
        sleep: Sleep = asyncio.sleep,
        secret_ref: str = "the Paperspace API key Secret",
    ) -> None:
        if not api_key.get_secret_value():
            raise ConfigError(f"the Paperspace API key is empty: set it in {secret_ref}")
        fixes = Fixes(
            auth=f"put a valid Paperspace API key (create one in the Paperspace console under Team settings > API keys) in {secret_ref}",
            denied=f"check in the Paperspace console what the team of the API key in {secret_ref} may do",
        )
        super().__init__(fixes=fixes, base_url=base_url, api_key=api_key, client=client, sleep=sleep)
        self.catalog = catalog or load_catalog()
        self.template_id = template_id
        self.disk_size_gb = disk_size_gb
        self.check_templates = check_templates
        self._stale_warned = False

    def __repr__(self) -> str:
        return f"PaperspaceProvider(base_url={self._base_url!r}, template_id={self.template_id!r})"

    @property
    def catalog_as_of(self) -> date:
        """When the catalog's prices were compiled: offers are only as fresh as this."""
        return self.catalog.as_of

    def catalog_is_stale(self, today: date | None = None) -> bool:
        """True when the catalog is older than CATALOG_STALE_AFTER."""
        today = today or datetime.now(timezone.utc).date()
        return today - self.catalog.as_of > CATALOG_STALE_AFTER

    # --- CloudProvider -----------------------------------------------------------------

    async def list_offers(self) -> list[Offer]:
        """One on-demand Offer per catalog (machine type, region), priced from the catalog;
        with a template, only the machine types the template supports."""
        if self.catalog_is_stale() and not self._stale_warned:
            self._stale_warned = True
            log.warning("paperspace_catalog_stale", as_of=self.catalog.as_of.isoformat(), path=str(CATALOG_PATH))
        supported = await self._template_machine_types() if self.template_id and self.check_templates else None
        offers = []
        for entry in self.catalog.machine_types:
            if supported is not None and entry.machine_type not in supported:
                continue
            for region in entry.regions:
                offers.append(
                    Offer(
                        provider=self.name,
                        offer_id=entry.machine_type,
                        gpu_type=normalize_gpu(entry.gpu),
                        gpu_count=entry.gpu_count,
                        region=normalize_region(region),
                        hourly_price=entry.hourly_price,
                    )
                )
        return offers

    async def launch(self, offer: Offer, *, name: str, boot: BootPayload) -> Instance:
        """Create machine `name` of type `offer.offer_id` in the offer's region, started, with
        `boot` as a run-once startup script.

        CapacityError when Paperspace has no stock, OfferRefused when it refuses this machine
        type in this region otherwise, PermissionDenied when the account is not in good standing. A 5xx or timeout raises TransientError without retrying: the machine may
        exist, and the caller looks it up by name.
        """
        if not self.template_id:
            raise ConfigError("Paperspace needs an OS template id to create machines: set template_id for this provider")
        if boot.kind != "startup-script":
            raise ConfigError(f"Paperspace boots machines with a startup script, not a {boot.kind!r} payload")
        region = self._region_name(offer)
        await self._check_account_standing()
        answer = await self._call("POST", "/startup-scripts", ok=(413,), json={"name": name, "script": boot.content, "isRunOnce": True})
        if answer.status_code == 413:
            raise _too_large(name, boot)
        script = _json(answer)
        script_id = str(script.get("id") or "")
        if not script_id:
            raise TransientError("Paperspace created a startup script but returned no id")
        body = {
            "name": name,
            "machineType": offer.offer_id,
            "templateId": self.template_id,
            "region": region,
            "diskSize": self.disk_size_gb,
            "publicIpType": "dynamic",
            "startOnCreate": True,
            "startupScriptId": script_id,
            "autoShutdownEnabled": False,
            "emailPassword": False,
        }
        response = await self._create("POST", "/machines", what=f"machine {name}", ok=_CREATE_ANSWERS, json=body)
        if response.status_code >= 400:
            # The machine was definitely not created: its script (with the auth key) must not linger.
            await self._delete_script_quietly(script_id)
            # The message sorts the refusal and is never quoted: it may echo the startup script.
            code, said = _error(response)
            shown = self._shown(response)
            if response.status_code == 413:
                raise _too_large(name, boot)
            if response.status_code == 402 or mentions(code, said, _BILLING_MARKERS):
                raise PermissionDenied(f"Paperspace refused to create {offer.offer_id} for billing reasons ({shown}): check the account's billing")
            if mentions(code, said, _CAPACITY_MARKERS):
                raise CapacityError(f"Paperspace has no {offer.offer_id} capacity in {region} ({shown})")
            if mentions(code, said, _CLASS_MARKERS):
                raise ConfigError(
                    f"Paperspace rejected the creation of {offer.offer_id} in {region} ({shown}): check the class's "
                    f"template {self.template_id!r}, disk size {self.disk_size_gb} GB and boot script"
                )
            raise OfferRefused(f"Paperspace refused {offer.offer_id} in {region} ({shown})")
        data = _json(response)
        machine = data.get("data") if isinstance(data.get("data"), dict) else data
        return self._instance(machine) or Instance(
            provider=self.name, instance_id=str(machine.get("id")), name=name, state=InstanceState.PENDING, offer_id=offer.offer_id
        )

    async def find_by_name(self, name: str) -> Instance | None:
        """The live machine called `name` (`GET /machines?name=`, every page)."""
        found = await self.find_all_by_name(name)
        return found[0] if found else None

    async def find_all_by_name(self, name: str) -> list[Instance]:
        """Every live machine called `name` (names are not unique), every page."""
        found: list[Instance] = []
        async with aclosing(self._pages("/machines", {"name": name})) as machines:
            async for raw in machines:
                if raw.get("name") == name:
                    instance = self._instance(raw)
                    if instance is not None:
                        found.append(instance)
        return found

    async def list_instances(self, prefix: str, names: Collection[str] | None = None) -> list[Instance]:
        """Every live machine whose name starts with `prefix` (with `names`, called one of
        them), every page."""
        found: list[Instance] = []
        async with aclosing(self._pages("/machines", {})) as machines:
            async for raw in machines:
                if listed(str(raw.get("name") or ""), prefix, names):
                    instance = self._instance(raw)
                    if instance is not None:
                        found.append(instance)
        return found

    async def describe(self, instance_id: str) -> Instance | None:
        """Current state; None for Paperspace's own 404 or a machine with dtDeleted set."""
        response = await self._call("GET", f"/machines/{instance_id}", ok=(404,))
        if self._gone(response):
            return None
        data = _json(response)
        return self._instance(data.get("data") if isinstance(data.get("data"), dict) else data)

    async def terminate(self, instance_id: str) -> None:
        """Delete the machine (Paperspace's own 404 counts as deleted) and its startup script. A
        machine that cannot be deleted in its current state is stopped and TransientError says
        to retry."""
        response = await self._call("DELETE", f"/machines/{instance_id}", ok=(400, 404, 409, 422))
        if self._gone(response):
            return
        if response.status_code < 300:
            machine = _json(response)
            machine = machine.get("data") if isinstance(machine.get("data"), dict) else machine
            if machine.get("name"):
                await self._delete_scripts_named(str(machine["name"]))
            return
        # The console deletes only stopped machines; "This machine is currently starting." is known.
        await self._call("PATCH", f"/machines/{instance_id}/stop", ok=(400, 404, 409, 422), json={})
        shown = self._shown(response)
        raise TransientError(f"Paperspace could not delete machine {instance_id} yet ({shown}); asked it to stop, retry shortly")

    # --- wire format -------------------------------------------------------------------

    def _says_missing(self, response: httpx.Response) -> bool:
        """Paperspace's own 404 is its `{code, message}` error; any other (a page, a gateway's
        JSON) came from a wrong URL or a proxy."""
        body = error_body(response)
        return isinstance(body.get("code"), str) and bool(body["code"]) and "message" in body

    def _instance(self, raw: Mapping[str, Any]) -> Instance | None:
        state = machine_state(raw)
        if state is None:
            return None
        machine_type = str(raw.get("machineType") or "")
        entry = self.catalog.entry(machine_type)
        return Instance(
            provider=self.name,
            instance_id=str(raw["id"]),
            name=str(raw.get("name") or ""),
            state=state,
            offer_id=machine_type,
            hourly_price=entry.hourly_price if entry else None,
        )

    def _region_name(self, offer: Offer) -> str:
        """The Paperspace region name ('East Coast (NY2)') behind the offer's label value ('ny2')."""
        entry = self.catalog.entry(offer.offer_id)
        for region in entry.regions if entry else []:
            if normalize_region(region) == offer.region:
                return region
        raise ConfigError(f"Paperspace machine type {offer.offer_id} in region {offer.region} is not in the catalog")

    async def _template_machine_types(self) -> set[str]:
        async with aclosing(self._pages("/os-templates", {})) as templates:
            async for template in templates:
                if template.get("id") == self.template_id:
                    return {
                        str(m.get("machineTypeLabel"))
                        for m in template.get("availableMachineTypes") or []
                        if m.get("isAvailable", True)
                    }
        raise ConfigError(f"Paperspace OS template {self.template_id!r} was not found: check template_id")

    async def _check_account_standing(self) -> None:
        standing = _json(await self._call("GET", "/billing/account-standing"))
        if standing.get("isInGoodStanding", True) and not standing.get("isAdminLocked", False):
            return
        # Its `messages` are Paperspace's words, never quoted.
        if standing.get("isAdminLocked", False):
            why = "the account is admin-locked"
        elif standing.get("hasPaymentMethod") is False:
            why = "the account is not in good standing and has no payment method"
        else:
            why = "the account is not in good standing"
        raise PermissionDenied(f"Paperspace will not create machines for this account ({why}): fix its billing in the Paperspace console")

    async def _pages(self, path: str, params: Mapping[str, str]) -> AsyncGenerator[dict[str, Any], None]:
        """Every item of a cursor-paged list ({items, hasMore, nextPage})."""
        query: dict[str, str | int] = {**params, "limit": LIST_LIMIT}
        while True:
            page = _json(await self._call("GET", path, params=query))
            for item in page.get("items") or []:
                yield item
            if not page.get("hasMore") or not page.get("nextPage"):
                return
            query["after"] = str(page["nextPage"])

    async def _delete_scripts_named(self, name: str) -> None:
        try:
            ids = [str(s["id"]) async for s in self._pages("/startup-scripts", {"name": name}) if s.get("name") == name]
        except TgpError as exc:
            log.warning("paperspace_script_cleanup_failed", name=name, error=str(exc))
            return
        for script_id in ids:
            await self._delete_script_quietly(script_id)

    async def _delete_script_quietly(self, script_id: str) -> None:
        try:
            await self._call("DELETE", f"/startup-scripts/{script_id}", ok=(404,))
        except TgpError as exc:
            # Run-once and holding a single-use, expiring key: a leftover script is untidy, not dangerous.
            log.warning("paperspace_script_cleanup_failed", script_id=script_id, error=str(exc))


def _json(response: httpx.Response) -> Any:
    """The body with exact decimals; {} when empty."""
    try:
        body = json.loads(response.content or b"null", parse_float=Decimal)
    except ValueError:
        raise TransientError(f"Paperspace answered {response.status_code} with a body that is not JSON") from None
    return body if body is not None else {}


def _error(response: httpx.Response) -> tuple[str, str]:
    """(code, message) of Paperspace's `{code, message, details?}` errors, with any `issues`,
    both only read to sort the answer: messages quote a documented code (`_shown`)."""
    body = error_body(response)
    issues = "; ".join(str(i.get("message")) for i in body.get("issues") or [] if isinstance(i, dict))
    said = error_detail(response)
    return error_code(response), (f"{said} ({issues})" if issues else said)


def _too_large(name: str, boot: BootPayload) -> ConfigError:
    """A 413: the startup script the class's template made is too large for every offer."""
    return ConfigError(
        f"the startup script for {name} is {len(boot.content.encode())} bytes, more than Paperspace accepts (413): "
        "shorten the class's bootstrapTemplate"
    )
