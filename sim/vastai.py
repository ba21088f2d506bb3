"""A local fake of the Vast.ai API for the adapter's contract tests, served by aiohttp on
loopback so `VastProvider` is exercised over real HTTP.

Shapes and failures follow reference/providers.md section 3:
* `POST /api/v0/bundles/` evaluates the `{field: {op: value}}` filters (eq, neq, gt, gte, lt,
  lte, in, notin) over the asks it serves and answers `{"offers": [...]}` ordered by dph_total,
  with dph_total including storage at `allocated_storage`.
* `PUT /api/v0/asks/{id}/` rents an ask: `{"success": true, "new_contract": id}`; an ask that
  does not exist answers 404 and one rented away 410, both `no_such_ask`. A bid (`price`) below
  the ask's market price creates the instance **stopped** (cur_state, intended_status and
  next_state all "stopped") and, by default, answers an error that still carries
  `new_contract` (`low_bid_reply="error"`), or a plain success (`"success"`). A host-only ask
  (`FakeAsk.host_only`) answers 403 "Offer N is not your own…" (the tail of that text is
  assumed); `vm: true` without an SSH key on the account answers 400 `no_ssh_key_for_vm`.
* `GET /api/v0/instances/{id}/` answers `{"instances": {...}}`, or `{"instances": null}` for an
  unknown or destroyed id.
* `GET /api/v1/instances/?select_filters=...&limit=&after_token=` pages `{instances, next_token}`.
* `DELETE /api/v0/instances/{id}/` -> `{"success": true}`, unknown id -> 404
  `{"success": false, "error": "not_found", "msg": "Instance not found"}` (the message is assumed).
  A 404 that is not Vast's (a proxy's or a wrong URL's page) is injected with a str `body` to
  `fail`, see sim.fakeserver.GATEWAY_404_TEXT.
* A bad key -> 401 `auth_error` "Invalid user key" (`bad_key_search_status=404` makes the offer
  search answer 404 instead, as Vast sometimes does). Rate limits: 429 with the plain-text
  "API requests too frequent" body and no Retry-After, injected with `fail` or enforced per
  endpoint with `min_intervals` on the fake's `clock`.

Not part of the real API: the Python knobs (`add_ask`, `rent_away`, `withdraw`, `raise_market`,
`set_status`, `start_instance`, `outbid`, `forget`, `fail`, `mark_called`, the attributes
`low_bid_reply`, `bad_key_search_status`, `page_size`, `min_intervals`, `account_ssh_key`) and the introspection
(`asks`, `instances`, `live_instances()`, `creates`, `rate_limited`, `requests`).

    async with FakeVast(api_key="k") as vast:
        vast.add_ask(FakeAsk(id=101, gpu_name="RTX 4090", geolocation="Helsinki, FI", dph_base=Decimal("0.30")))
        provider = VastProvider(SecretStr("k"), base_url=vast.url)
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from aiohttp import web
from aiohttp.typedefs import Middleware

from sim.provider_model import ProviderModel
from sim.fakeserver import Fault, FakeServer, Handler, RecordedRequest, fault_body_response

__all__ = ["FakeAsk", "FakeVast", "FakeVastInstance", "VastRequest"]

RATE_LIMIT_TEXT = "API requests too frequent endpoint threshold={threshold}"
# Hours in Vast's storage month: storage_cost is $/GB/month.
HOURS_PER_MONTH = Decimal(720)


@dataclass
class FakeAsk:
    """One rentable machine. Money in Decimal dollars; storage_cost is $/GB/month."""

    id: int
    gpu_name: str
    geolocation: str | None
    dph_base: Decimal
    num_gpus: int = 1
    min_bid: Decimal | None = None
    storage_cost: Decimal = Decimal("0.144")
    machine_id: int = 0
    verified: bool = True
    external: bool = False
    rentable: bool = True
    rented: bool = False
    vms_enabled: bool = False
    reliability2: float = 0.99
    gpu_ram: int = 24564
    # A bid below this starts the instance stopped; defaults to min_bid.
    market_bid: Decimal | None = None
    # Listed, but only its host may rent it (Vast answers 403 to anyone else).
    host_only: bool = False

    def dph_total(self, storage_gb: int) -> Decimal:
        """$/h including `storage_gb` of disk, as Vast computes it."""
        return self.dph_base + self.storage_cost * storage_gb / HOURS_PER_MONTH

    def to_json(self, storage_gb: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "ask_contract_id": self.id,
            "machine_id": self.machine_id or self.id + 10_000,
            "host_id": 900 + self.id % 7,
            "gpu_name": self.gpu_name,
            "num_gpus": self.num_gpus,
            "gpu_ram": self.gpu_ram,
            "gpu_total_ram": self.gpu_ram * self.num_gpus,
            "cpu_cores": 16,
            "cpu_cores_effective": 8.0,
            "cpu_ram": 64000,
            "disk_space": 500.0,
            "dph_base": float(self.dph_base),
            "dph_total": float(self.dph_total(storage_gb)),
            "min_bid": float(self.min_bid) if self.min_bid is not None else None,
            "storage_cost": float(self.storage_cost),
            "geolocation": self.geolocation,
            "reliability2": self.reliability2,
            "verified": self.verified,
            "verification": "verified" if self.verified else "unverified",
            "external": self.external,
            "rentable": self.rentable,
            "rented": self.rented,
            "vms_enabled": self.vms_enabled,
            "is_bid": False,
            "direct_port_count": 4,
            "cuda_max_good": 12.8,
        }


@dataclass
class FakeVastInstance:
    """A rented instance as the fake stores it; `to_json` gives Vast's field names."""

    id: int
    ask: FakeAsk
    label: str
    image: str
    body: dict[str, Any]
    is_bid: bool
    dph_total: Decimal
    actual_status: str | None = None
    intended_status: str = "running"
    cur_state: str = "running"
    next_state: str = "running"
    status_msg: str = ""
    public_ipaddr: str | None = None
    destroyed: bool = False

    def to_json(self) -> dict[str, Any]:
        ports: dict[str, Any] = {}
        if self.actual_status == "running":
            ports = {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(41000 + self.id % 1000)}]}
        return {
            "id": self.id,
            "label": self.label,
            "actual_status": self.actual_status,
            "intended_status": self.intended_status,
            "cur_state": self.cur_state,
            "next_state": self.next_state,
            "status_msg": self.status_msg,
            "image_uuid": self.image,
            "public_ipaddr": self.public_ipaddr,
            "ssh_host": f"ssh{self.id % 9 + 1}.vast.ai",
            "ssh_port": 20000 + self.id % 1000,
            "ports": ports,
            "machine_id": self.ask.machine_id or self.ask.id + 10_000,
            "gpu_name": self.ask.gpu_name,
            "num_gpus": self.ask.num_gpus,
            "geolocation": self.ask.geolocation,
            "dph_total": float(self.dph_total),
            "is_bid": self.is_bid,
            "min_bid": float(self.ask.min_bid) if self.ask.min_bid is not None else None,
            "vm": bool(self.body.get("vm")),
        }


VastRequest = RecordedRequest

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": lambda a, b: a == b,
    "neq": lambda a, b: a != b,
    "gt": lambda a, b: a is not None and a > b,
    "gte": lambda a, b: a is not None and a >= b,
    "lt": lambda a, b: a is not None and a < b,
    "lte": lambda a, b: a is not None and a <= b,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
}
# Body keys of a search that are not field filters.
_SEARCH_OPTIONS = {"type", "order", "limit", "allocated_storage", "disable_bundling", "extra_ids"}


class FakeVast(FakeServer):
    """The Vast.ai API on 127.0.0.1 (port chosen by the OS); `url` is the `/api/v0` base URL
    to give the adapter. Requests must carry `Authorization: Bearer <api_key>`.

    `fail(path, status=429, ...)` matches the full path (e.g. "/api/v0/asks/*"); its default
    body is Vast's plain-text 429 or a JSON `{success: false, error, msg}`, and a Retry-After
    header is sent only when `retry_after` is given."""

    base_path = "/api/v0"

    def __init__(
        self,
        *,
        api_key: str,
        asks: list[FakeAsk] | None = None,
        low_bid_reply: Literal["error", "success"] = "error",
        bad_key_search_status: int = 401,
        account_ssh_key: bool = True,
        page_size: int = 25,
        min_intervals: dict[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        host: str = "127.0.0.1",
        model: ProviderModel | None = None,
    ) -> None:
        super().__init__(host=host)
        # Lag, late creates, answers after buying, lying terminates (sim.provider_model).
        self.model = model or ProviderModel(clock=clock)
        self.api_key = api_key
        self.asks: dict[int, FakeAsk] = {a.id: a for a in asks or []}
        self.instances: dict[int, FakeVastInstance] = {}
        self.low_bid_reply = low_bid_reply
        self.bad_key_search_status = bad_key_search_status
        # VMs take their SSH key from the account; without one, renting a VM is refused.
        self.account_ssh_key = account_ssh_key
        self.page_size = page_size
        # Endpoint name (search, create, show, list, destroy) -> minimum seconds between calls.
        self.min_intervals = dict(min_intervals or {})
        self.clock = clock
        self.creates = 0
        self.rate_limited = 0
        self._last_call: dict[str, float] = {}
        self._ids = itertools.count(7_000_001)

    # --- lifecycle --------------------------------------------------------------------

    def _add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/api/v0/bundles/", self._search)
        r.add_put("/api/v0/asks/{id}/", self._rent)
        r.add_get("/api/v0/instances/{id}/", self._show)
        r.add_delete("/api/v0/instances/{id}/", self._destroy)
        r.add_get("/api/v1/instances/", self._list)

    def _middlewares(self) -> list[Middleware]:
        return [self._record, self._inject_faults, self._auth, self._pace]

    # --- knobs ------------------------------------------------------------------------

    def add_ask(self, ask: FakeAsk) -> FakeAsk:
        """Serve `ask` (replacing one with the same id)."""
        self.asks[ask.id] = ask
        return ask

    def rent_away(self, ask_id: int) -> None:
        """Someone else rents the ask: searches stop listing it and renting it answers 410."""
        self.asks[ask_id].rented = True

    def withdraw(self, ask_id: int) -> None:
        """The host withdraws the ask: renting it answers 404 no_such_ask."""
        self.asks.pop(ask_id, None)

    def raise_market(self, ask_id: int, price: Decimal) -> None:
        """Other bidders push the going rate for the ask to `price`: a lower bid starts stopped."""
        self.asks[ask_id].market_bid = price

    def set_status(self, instance_id: int | str, actual_status: str | None, *, status_msg: str = "") -> None:
        """Set an instance's actual_status (null, loading, running, created, exited, offline, ...)."""
        inst = self.instances[int(instance_id)]
        inst.actual_status, inst.status_msg = actual_status, status_msg

    def start_instance(self, instance_id: int | str) -> None:
        """The container is up: running, with a public address and mapped ports."""
        inst = self.instances[int(instance_id)]
        inst.actual_status = "running"
        inst.cur_state = inst.intended_status = inst.next_state = "running"
        inst.public_ipaddr = f"203.0.113.{inst.id % 250 + 1}"

    def outbid(self, instance_id: int | str) -> None:
        """A higher bid takes the machine: every state field reads stopped."""
        inst = self.instances[int(instance_id)]
        inst.actual_status = "stopped"
        inst.cur_state = inst.intended_status = inst.next_state = "stopped"

    def forget(self, instance_id: int | str) -> None:
        """Vast no longer knows the instance (host gone): describe answers {"instances": null}."""
        self.instances[int(instance_id)].destroyed = True

    def mark_called(self, endpoint: str) -> None:
        """Another client of the same key just called `endpoint` (see `min_intervals`)."""
        self._last_call[endpoint] = self.clock()

    def live_instances(self) -> list[FakeVastInstance]:
        """Instances not destroyed."""
        return [i for i in self.instances.values() if not i.destroyed]

    # --- middleware -------------------------------------------------------------------

    def _fault_response(self, fault: Fault) -> web.Response:
        headers = fault.headers
        if fault.body is not None:  # a str as is: a 429's text, or a proxy's or wrong URL's 404 page
            return fault_body_response(fault.body, fault.status, headers)
        if fault.status == 429:
            return web.Response(text=RATE_LIMIT_TEXT.format(threshold="4.5"), status=429, headers=headers)
        return web.json_response(
            {"success": False, "error": "server_error", "msg": "injected failure"}, status=fault.status, headers=headers
        )

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            status = self.bad_key_search_status if request.path.endswith("/bundles/") else 401
            return web.json_response({"success": False, "error": "auth_error", "msg": "Invalid user key"}, status=status)
        return await handler(request)

    @web.middleware
    async def _pace(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        endpoint = _endpoint(request)
        interval = self.min_intervals.get(endpoint)
        if interval:
            now = self.clock()
            last = self._last_call.get(endpoint)
            if last is not None and now - last < interval - 1e-9:  # float slack for shared test clocks
                self.rate_limited += 1
                return web.Response(text=RATE_LIMIT_TEXT.format(threshold=interval), status=429)
            self._last_call[endpoint] = now
        return await handler(request)

    # --- handlers ---------------------------------------------------------------------

    async def _search(self, request: web.Request) -> web.Response:
        try:
            query = await request.json()
        except ValueError:
            return _error(400, "invalid_args", "search body must be JSON")
        if not isinstance(query, dict) or query.get("type", "ondemand") not in ("ondemand", "on-demand", "bid", "reserved"):
            return _error(400, "invalid_args", "unknown search type")
        storage = int(query.get("allocated_storage") or 5)
        rows = []
        for ask in self.asks.values():
            row = ask.to_json(storage)
            if all(_matches(row.get(name), cond) for name, cond in query.items() if name not in _SEARCH_OPTIONS):
                rows.append(row)
        rows.sort(key=lambda r: r["dph_total"])
        return web.json_response({"offers": rows[: int(query.get("limit") or 64)]})

    async def _rent(self, request: web.Request) -> web.Response:
        ask_id = int(request.match_info["id"])
        body = await request.json()
        ask = self.asks.get(ask_id)
        if ask is None:
            return _error(404, "no_such_ask", f"error 404/3603: no_such_ask Instance type by id {ask_id} is not available.")
        if ask.rented or not ask.rentable:
            return _error(410, "no_such_ask", f"no_such_ask Instance type by id {ask_id} is no longer available.")
        if ask.host_only:
            return web.json_response({"success": False, "msg": f"Offer {ask_id} is not your own; only its host can rent it."}, status=403)
        if not body.get("image"):
            return _error(400, "invalid_args", "image is required")
        if body.get("vm") and not self.account_ssh_key:
            return _error(400, "no_ssh_key_for_vm", "You must add an SSH key to your account before creating a VM.")
        if body.get("vm") and not ask.vms_enabled:
            return _error(400, "invalid_args", f"machine for ask {ask_id} does not support VMs")
        self.creates += 1
        price = body.get("price")
        is_bid = price is not None
        if is_bid and ask.min_bid is not None and Decimal(str(price)) < ask.min_bid:
            return _error(400, "invalid_price", f"bid {price} is below the minimum bid {ask.min_bid}")

        def buy() -> FakeVastInstance:
            inst = FakeVastInstance(
                id=next(self._ids),
                ask=ask,
                label=str(body.get("label") or ""),
                image=str(body["image"]),
                body=body,
                is_bid=is_bid,
                dph_total=Decimal(str(price)) if is_bid else ask.dph_total(int(body.get("disk") or 10)),
            )
            self.instances[inst.id] = inst
            ask.rented = True
            self.model.bought(str(inst.id), inst.label)
            return inst

        outcome, bought = self.model.create(buy)
        answer = await self.model.answer_create(
            request, outcome, lambda status: _error(status, "rate_limited" if status == 429 else "server_error", "API requests too frequent")
        )
        if answer is not None or bought is None:
            return answer  # type: ignore[return-value]
        inst = bought
        market = ask.market_bid if ask.market_bid is not None else ask.min_bid
        if is_bid and market is not None and Decimal(str(price)) < market:
            # Vast still creates the contract, stopped, and reports the bid as the problem.
            inst.cur_state = inst.intended_status = inst.next_state = "stopped"
            if self.low_bid_reply == "error":
                return web.json_response(
                    {
                        "success": False,
                        "error": "insufficient_bid",
                        "msg": f"Your bid of {price} is below the current market price {market}; the instance was created stopped.",
                        "new_contract": inst.id,
                    }
                )
        return web.json_response({"success": True, "new_contract": inst.id})

    async def _show(self, request: web.Request) -> web.Response:
        inst = self.instances.get(_int(request.match_info["id"]))
        if inst is None or inst.destroyed or not self.model.describable(str(inst.id)):
            return web.json_response({"instances": None})
        return web.json_response({"instances": inst.to_json()})

    async def _list(self, request: web.Request) -> web.Response:
        filters = json.loads(request.query.get("select_filters") or "{}")
        limit = min(int(request.query.get("limit") or self.page_size), self.page_size)
        start = int(request.query.get("after_token") or 0)
        rows = [
            i.to_json()
            for i in sorted(self.live_instances(), key=lambda i: i.id)
            if self.model.listed(str(i.id)) and all(_matches(i.to_json().get(name), cond) for name, cond in filters.items())
        ]
        page = rows[start : start + limit]
        more = start + limit < len(rows)
        return web.json_response(
            {"instances": page, "next_token": str(start + limit) if more else None, "total_instances": len(rows)}
        )

    async def _destroy(self, request: web.Request) -> web.Response:
        inst = self.instances.get(_int(request.match_info["id"]))
        if inst is None or inst.destroyed or not self.model.describable(str(inst.id)):
            return _error(404, "not_found", "Instance not found")
        self.model.terminate(str(inst.id), lambda: self._end(inst))
        return web.json_response({"success": True})

    def _end(self, inst: FakeVastInstance) -> None:
        """A destroy that took effect."""
        if not inst.destroyed:
            inst.destroyed = True
            inst.ask.rented = False  # the machine is back on the market
        self.model.ended(str(inst.id))


def _endpoint(request: web.Request) -> str:
    path, method = request.path, request.method
    if path.endswith("/bundles/"):
        return "search"
    if "/asks/" in path:
        return "create"
    if path.startswith("/api/v1/instances"):
        return "list"
    return "destroy" if method == "DELETE" else "show"


def _matches(value: Any, cond: Any) -> bool:
    if not isinstance(cond, dict):
        return bool(value == cond)
    return all(_OPS[op](value, arg) for op, arg in cond.items() if op in _OPS)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return -1


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"success": False, "error": code, "msg": message}, status=status)
