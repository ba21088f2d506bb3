"""A local fake of the Paperspace API (`https://api.paperspace.com/v1`, the DigitalOcean-era
one) for the adapter's contract tests, served by aiohttp on loopback so `PaperspaceProvider` is
exercised over real HTTP.

Shapes and failures follow reference/providers.md section 4:
* `POST /v1/machines` answers `{"data": <Machine>, "event": {id, name: "create", state, ...}}`;
  a new machine is `provisioning`, and its state moves only when a test says so.
* Lists (`GET /v1/machines?name=`, `/v1/os-templates`, `/v1/startup-scripts?name=`) are
  `{items, hasMore, nextPage}`, cursor-paged with `limit` and `after` (page size capped by the
  `page_size` knob so paging is testable).
* `GET /v1/machines/{id}` is the Machine, 404 once deleted (or, with `deleted_visible`, the
  Machine with `dtDeleted` set). `DELETE /v1/machines/{id}` answers the Machine.
* Errors are `{"code", "message"}`: 404 `NOT_FOUND` "Machine not found" for an unknown or
  deleted machine (the code is assumed: the API's codes look like tRPC's, the 404 is not
  documented), 401 for a bad key, a 400 "out of capacity" when a
  (machine type, region) has none left, a 400 refusal for a machine type not sold in that
  region at all (DigitalOcean's Machines availability table: A5000/A6000 only NY2 and CA1,
  H100/A100/V100-32G only NY2; the wording is assumed, the API does not document it) or not
  sold at all, 429/5xx injected with `fail` (with a str `body`, a 404 that is not Paperspace's:
  a proxy's or a wrong URL's page, see sim.fakeserver.GATEWAY_404_TEXT).
* `GET /v1/billing/account-standing` reports the `standing` knob.

Not part of the real API: the Python knobs (`set_capacity`, `set_state`, `make_ready`,
`fail`, the attributes `standing`, `page_size`, `deleted_visible`, `delete_requires_off`,
`honour_name_filter`, `templates`, `capacity`, `sold_in`) and the introspection (`machines`,
`live_machines()`, `scripts`, `creates`, `requests`).

    async with FakePaperspace(api_key="k") as ps:
        provider = PaperspaceProvider(SecretStr("k"), base_url=ps.url, template_id=ps.template_id)
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from sim.provider_model import ProviderModel
from sim.fakeserver import Fault, FakeServer, Handler, RecordedRequest, fault_body_response

__all__ = ["DEFAULT_TEMPLATE_ID", "SOLD_IN", "FakeMachine", "FakePaperspace", "PaperspaceRequest"]

DEFAULT_TEMPLATE_ID = "tkni3aa4"
DEFAULT_MACHINE_TYPES = ("H100", "H100x8", "A100-80G", "A6000", "A5000", "A4000", "RTX4000", "P4000", "V100-32G")
NY2, CA1, AMS1 = "East Coast (NY2)", "West Coast (CA1)", "Europe (AMS1)"
# Where each GPU machine type is sold: DigitalOcean's Paperspace Machines availability table
# (docs.digitalocean.com/products/paperspace/machines/details/availability). H100x8 is not in
# the table; it follows H100.
SOLD_IN: dict[str, tuple[str, ...]] = {
    "H100": (NY2,),
    "H100x8": (NY2,),
    "A100-80G": (NY2,),
    "V100-32G": (NY2,),
    "A6000": (NY2, CA1),
    "A5000": (NY2, CA1),
    "A4000": (NY2, AMS1, CA1),
    "RTX4000": (NY2, AMS1, CA1),
    "P4000": (NY2, AMS1, CA1),
}
# Machine states a test may set (providers.md 4.4).
STATES = ("provisioning", "starting", "serviceready", "ready", "stopping", "off", "restarting", "upgrading")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


@dataclass
class FakeMachine:
    """A machine as the fake stores it; `to_json` gives the real API's field names."""

    id: str
    name: str
    machine_type: str
    region: str
    template_id: str
    disk_size: int
    startup_script_id: str | None
    body: dict[str, Any]
    state: str = "provisioning"
    public_ip: str | None = None
    dt_created: str = field(default_factory=_now)
    dt_deleted: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "state": self.state,
            "machineType": self.machine_type,
            "region": self.region,
            "os": "Ubuntu 22.04",
            "agentType": "LinuxHeadless",
            "publicIp": self.public_ip,
            "privateIp": "10.0.0.2",
            "publicIpType": self.body.get("publicIpType", "dynamic"),
            "networkId": None,
            "cpus": 8,
            "ram": 48_318_382_080,
            "accelerators": [{"name": self.machine_type, "count": 1, "memory": 16}],
            "storageTotal": self.disk_size * 1024**3,
            "storageUsed": 0,
            "usageRate": f"{self.machine_type} hourly",
            "storageRate": f"{self.disk_size}GB storage",
            "updatesPending": False,
            "autoShutdownEnabled": bool(self.body.get("autoShutdownEnabled", False)),
            "reservation": None,
            "dtCreated": self.dt_created,
            "dtModified": self.dt_created,
            "dtDeleted": self.dt_deleted,
        }


PaperspaceRequest = RecordedRequest


class FakePaperspace(FakeServer):
    """The Paperspace API on 127.0.0.1 (port chosen by the OS); `url` is the `/v1` base URL to
    give the adapter. Requests must carry `Authorization: Bearer <api_key>`.

    `capacity` maps (machineType, region name) to how many more machines may be created
    there; a pair not listed is unlimited. `sold_in` maps each machine type to the regions
    that sell it at all (default SOLD_IN); creating one elsewhere is refused. `fail(path, status=429, ...)` matches the full path
    (e.g. "/v1/machines*"); its default body is `{code, message}`.
    """

    base_path = "/v1"

    def __init__(
        self,
        *,
        api_key: str,
        templates: list[dict[str, Any]] | None = None,
        capacity: dict[tuple[str, str], int] | None = None,
        sold_in: dict[str, tuple[str, ...]] | None = None,
        page_size: int = 20,
        host: str = "127.0.0.1",
        model: ProviderModel | None = None,
    ) -> None:
        super().__init__(host=host)
        # Lag, late creates, answers after buying, lying terminates (sim.provider_model).
        self.model = model or ProviderModel()
        self.api_key = api_key
        self.template_id = DEFAULT_TEMPLATE_ID
        self.templates: list[dict[str, Any]] = templates if templates is not None else [
            {
                "id": DEFAULT_TEMPLATE_ID,
                "name": "Ubuntu 22.04 Server",
                "agentType": "LinuxHeadless",
                "operatingSystemLabel": "Ubuntu 22.04",
                "defaultSizeGb": 50,
                "dtCreated": "2024-03-01T00:00:00.000Z",
                "availableMachineTypes": [{"machineTypeLabel": t, "isAvailable": True} for t in DEFAULT_MACHINE_TYPES],
            }
        ]
        self.capacity: dict[tuple[str, str], int] = dict(capacity or {})
        self.sold_in: dict[str, tuple[str, ...]] = dict(SOLD_IN if sold_in is None else sold_in)
        self.page_size = page_size
        self.standing: dict[str, Any] = {"isInGoodStanding": True, "hasPaymentMethod": True, "isAdminLocked": False, "messages": []}
        # Answer GET of a deleted machine with dtDeleted set instead of 404.
        self.deleted_visible = False
        # False: answer GET /machines?name= with every machine, as a server ignoring the filter would.
        self.honour_name_filter = True
        # Refuse DELETE of a machine that is not off, as the console does.
        self.delete_requires_off = False
        self.machines: dict[str, FakeMachine] = {}
        self.scripts: dict[str, dict[str, Any]] = {}
        self.creates = 0
        self._ids = itertools.count(1)

    # --- lifecycle --------------------------------------------------------------------

    def _add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/v1/os-templates", self._list_templates)
        r.add_get("/v1/billing/account-standing", self._standing)
        r.add_post("/v1/startup-scripts", self._create_script)
        r.add_get("/v1/startup-scripts", self._list_scripts)
        r.add_delete("/v1/startup-scripts/{id}", self._delete_script)
        r.add_post("/v1/machines", self._create_machine)
        r.add_get("/v1/machines", self._list_machines)
        r.add_get("/v1/machines/{id}", self._get_machine)
        r.add_delete("/v1/machines/{id}", self._delete_machine)
        r.add_patch("/v1/machines/{id}/stop", self._stop_machine)

    def _middlewares(self) -> list[Middleware]:
        return [self._record, self._inject_faults, self._auth]

    # --- knobs ------------------------------------------------------------------------

    def set_capacity(self, machine_type: str, region: str, available: int | None) -> None:
        """How many more `machine_type` machines `region` can create; None = unlimited."""
        if available is None:
            self.capacity.pop((machine_type, region), None)
        else:
            self.capacity[(machine_type, region)] = available

    def set_state(self, machine_id: str, state: str) -> None:
        """Move a machine to `state` (one of STATES)."""
        if state not in STATES:
            raise ValueError(f"unknown Paperspace machine state {state!r}")
        self.machines[machine_id].state = state

    def make_ready(self, machine_id: str) -> None:
        """The machine booted: ready, with a public IP."""
        m = self.machines[machine_id]
        m.state, m.public_ip = "ready", f"198.51.100.{len(self.machines) % 250 + 1}"

    def live_machines(self) -> list[FakeMachine]:
        """Machines not deleted."""
        return [m for m in self.machines.values() if m.dt_deleted is None]

    # --- middleware -------------------------------------------------------------------

    def _fault_response(self, fault: Fault) -> web.Response:
        body = fault.body
        if body is None:
            body = (
                {"code": "TOO_MANY_REQUESTS", "message": "Too many requests"}
                if fault.status == 429
                else {"code": "INTERNAL_SERVER_ERROR", "message": "injected failure"}
            )
        return fault_body_response(body, fault.status, fault.headers)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(401, "UNAUTHORIZED", "You must be logged in to access this resource")
        return await handler(request)

    # --- handlers ---------------------------------------------------------------------

    def _page(self, request: web.Request, items: list[dict[str, Any]]) -> web.Response:
        limit = min(int(request.query.get("limit") or self.page_size), self.page_size)
        start = int(request.query.get("after") or 0)
        page = items[start : start + limit]
        more = start + limit < len(items)
        return web.json_response({"items": page, "hasMore": more, "nextPage": str(start + limit) if more else None})

    async def _list_templates(self, request: web.Request) -> web.Response:
        return self._page(request, self.templates)

    async def _standing(self, request: web.Request) -> web.Response:
        return web.json_response(self.standing)

    async def _create_script(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not body.get("name") or not body.get("script"):
            return _error(400, "BAD_REQUEST", "name and script are required")
        script = {
            "id": f"sc{secrets.token_hex(4)}",
            "name": body["name"],
            "script": body["script"],
            "isRunOnce": bool(body.get("isRunOnce", False)),
            "isEnabled": True,
            "dtCreated": _now(),
        }
        self.scripts[script["id"]] = script
        return web.json_response(script)

    async def _list_scripts(self, request: web.Request) -> web.Response:
        name = request.query.get("name")
        items = [s for s in self.scripts.values() if name is None or s["name"] == name]
        return self._page(request, items)

    async def _delete_script(self, request: web.Request) -> web.Response:
        script = self.scripts.pop(request.match_info["id"], None)
        if script is None:
            return _error(404, "NOT_FOUND", "Startup script not found")
        return web.json_response(script)

    async def _create_machine(self, request: web.Request) -> web.Response:
        body = await request.json()
        missing = [k for k in ("name", "machineType", "templateId", "diskSize", "region") if not body.get(k)]
        if missing:
            return _error(400, "BAD_REQUEST", f"missing required fields: {', '.join(missing)}")
        template = next((t for t in self.templates if t["id"] == body["templateId"]), None)
        if template is None:
            return _error(404, "NOT_FOUND", f"Template {body['templateId']} not found")
        if body.get("startupScriptId") and body["startupScriptId"] not in self.scripts:
            return _error(404, "NOT_FOUND", f"Startup script {body['startupScriptId']} not found")
        if body["machineType"] not in self.sold_in:
            return _error(400, "BAD_REQUEST", f"Invalid machine type {body['machineType']}")
        if body["region"] not in self.sold_in[body["machineType"]]:
            return _error(400, "BAD_REQUEST", f"Machine type {body['machineType']} is not offered in region {body['region']}")
        key = (body["machineType"], body["region"])
        left = self.capacity.get(key)
        if left is not None and left <= 0:
            return _error(
                400,
                "BAD_REQUEST",
                f"We are currently out of capacity for {body['machineType']} in {body['region']}. "
                "Please try again later or select a different region.",
            )
        self.creates += 1

        def buy() -> FakeMachine:
            if left is not None:
                self.capacity[key] = left - 1
            machine = FakeMachine(
                id=f"ps{next(self._ids):06d}",
                name=body["name"],
                machine_type=body["machineType"],
                region=body["region"],
                template_id=body["templateId"],
                disk_size=int(body["diskSize"]),
                startup_script_id=body.get("startupScriptId"),
                body=body,
            )
            self.machines[machine.id] = machine
            self.model.bought(machine.id, machine.name)
            return machine

        outcome, bought = self.model.create(buy)
        answer = await self.model.answer_create(request, outcome, lambda status: _error(status, "SERVICE_UNAVAILABLE", "Please try again later."))
        if answer is not None or bought is None:
            return answer  # type: ignore[return-value]
        machine = bought
        event = {
            "id": f"ev{secrets.token_hex(4)}",
            "name": "create",
            "state": "in progress",
            "error": None,
            "machineId": machine.id,
            "dtCreated": _now(),
            "dtStarted": _now(),
            "dtFinished": None,
        }
        return web.json_response({"data": machine.to_json(), "event": event})

    async def _list_machines(self, request: web.Request) -> web.Response:
        name = request.query.get("name")
        items = [
            m.to_json()
            for m in self.live_machines()
            if (name is None or not self.honour_name_filter or m.name == name) and self.model.listed(m.id)
        ]
        return self._page(request, items)

    async def _get_machine(self, request: web.Request) -> web.Response:
        machine = self.machines.get(request.match_info["id"])
        if machine is None or (machine.dt_deleted and not self.deleted_visible) or not self.model.describable(machine.id):
            return _error(404, "NOT_FOUND", "Machine not found")
        return web.json_response(machine.to_json())

    async def _delete_machine(self, request: web.Request) -> web.Response:
        machine = self.machines.get(request.match_info["id"])
        if machine is None or machine.dt_deleted or not self.model.describable(machine.id):
            return _error(404, "NOT_FOUND", "Machine not found")
        if self.delete_requires_off and machine.state != "off":
            return _error(400, "BAD_REQUEST", "This machine is currently starting.")
        self.model.terminate(machine.id, lambda: self._end(machine))
        return web.json_response(machine.to_json())

    def _end(self, machine: FakeMachine) -> None:
        """A delete that took effect."""
        if not machine.dt_deleted:
            machine.dt_deleted = _now()
        self.model.ended(machine.id)

    async def _stop_machine(self, request: web.Request) -> web.Response:
        machine = self.machines.get(request.match_info["id"])
        if machine is None or machine.dt_deleted:
            return _error(404, "NOT_FOUND", "Machine not found")
        machine.state = "stopping"
        return web.json_response(machine.to_json())


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"code": code, "message": message}, status=status)
