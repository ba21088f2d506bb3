"""A local fake of the Lambda Cloud API v1 for the tests, served by aiohttp on loopback so the
`lambdalabs` adapter is exercised over real HTTP.

Shapes and failures follow reference/providers.md section 1:
* every success is `{"data": ...}`, every failure `{"error": {"code", "message", "suggestion"?}}`;
* `GET /api/v1/instance-types` is a map keyed by type name, prices in integer **cents** per
  hour, and `regions_with_capacity_available` from the per-(type, region) capacity;
* `POST /api/v1/instance-operations/launch` checks the body like the 1.8.3 schema, answers
  400 `instance-operations/launch/insufficient-capacity`, 400 `global/quota-exceeded`,
  403 `global/account-inactive`, 400 `global/object-does-not-exist` (unknown region, type,
  SSH key or image family), and throttles launches to one per `launch_interval` seconds of `clock` (429);
* instances go `booting` (no ip) -> `active` (ip) and, once terminated, `terminating` ->
  gone (404 `global/object-does-not-exist`; `GET /instances` lists non-terminated only);
* a wrong or missing key is 401 `global/invalid-api-key` (Bearer, or Basic `key:`).

Assumed, because Lambda does not document it: the 429 body code (`global/too-many-requests`)
and whether a 429 carries Retry-After (off unless `throttle_retry_after=True`).

Python-level knobs (not part of the real API):
* `set_capacity(type_name, region, n)`: launches that can still succeed there.
* `retire(type_name)`: Lambda stops selling a type (launches of it: object-does-not-exist).
* `fail(path, status, times=, retry_after=, method=, code=, message=)`: the next requests fail.
* `quota`, `account_inactive`, `ssh_keys`, `image_families`, `launch_interval`,
  `request_interval`: account state.
* `advance(instance_id=None)` / `set_status(instance_id, status)`: booting -> active,
  terminating -> gone; or unhealthy / preempted. `boot_delay` boots on a timer instead.
* `instances`, `live_instances()`, `create_requests`, `requests`: state and a request log.

    async with FakeLambda(api_key="secret_tgp_test") as lam:
        provider = LambdaProvider(SecretStr("secret_tgp_test"), ssh_key_name="tgp", base_url=lam.url)
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import math
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Unpack

from aiohttp import web
from aiohttp.typedefs import Middleware

from sim.provider_model import ProviderModel
from sim.fakeserver import Fault, FakeServer, FaultOptions, Handler, RecordedRequest

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_CATALOG", "REGIONS", "FakeInstance", "FakeInstanceType", "FakeLambda"]

_PREFIX = "/api/v1"
# Lambda's documented limits on launch fields.
MAX_NAME_LEN = 64
MAX_USER_DATA_BYTES = 1024 * 1024
_HOSTNAME = re.compile(r"^[a-z0-9][0-9a-z-]{0,62}$")

REGIONS = {
    "us-east-1": "Virginia, USA",
    "us-west-1": "California, USA",
    "us-south-1": "Texas, USA",
    "europe-central-1": "Germany",
}


@dataclass(frozen=True)
class FakeInstanceType:
    """An instance type as `GET /instance-types` describes it; price in US cents per hour."""

    name: str
    description: str
    gpu_description: str
    price_cents_per_hour: int
    gpus: int
    vcpus: int = 30
    memory_gib: int = 200
    storage_gib: int = 1400

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "gpu_description": self.gpu_description,
            "price_cents_per_hour": self.price_cents_per_hour,
            "specs": {"vcpus": self.vcpus, "memory_gib": self.memory_gib, "storage_gib": self.storage_gib, "gpus": self.gpus},
        }


DEFAULT_CATALOG: tuple[FakeInstanceType, ...] = (
    FakeInstanceType("gpu_1x_a10", "1x A10 (24 GB PCIe)", "A10 (24 GB PCIe)", 75, 1),
    FakeInstanceType("gpu_1x_h100_pcie", "1x H100 (80 GB PCIe)", "H100 (80 GB PCIe)", 249, 1, 26, 200, 1000),
    FakeInstanceType("gpu_8x_h100_sxm5", "8x H100 (80 GB SXM5)", "H100 (80 GB SXM5)", 2392, 8, 208, 1800, 24780),
    FakeInstanceType("gpu_1x_gh200", "1x GH200 (96 GB)", "GH200 (96 GB)", 149, 1, 64, 432, 4096),
)
# Launches that can still succeed per (type, region); absent means none. GH200 is sold out.
DEFAULT_CAPACITY: dict[tuple[str, str], int] = {
    ("gpu_1x_a10", "us-east-1"): 3,
    ("gpu_1x_a10", "us-west-1"): 1,
    ("gpu_1x_h100_pcie", "us-west-1"): 2,
    ("gpu_8x_h100_sxm5", "us-east-1"): 1,
}


@dataclass
class FakeInstance:
    """An instance as the fake stores it; `to_json` gives the API's Instance shape.
    `user_data` is write-only in the real API and never returned."""

    id: str
    name: str
    type: FakeInstanceType
    region: str
    ssh_key_names: list[str]
    hostname: str
    user_data: str
    number: int
    status: str = "booting"
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        launched = self.status not in ("booting",)
        ip = f"198.51.100.{self.number % 250 + 1}" if self.status in ("active", "unhealthy") else None
        return {
            "id": self.id,
            "name": self.name,
            "ip": ip,
            "private_ip": f"10.19.0.{self.number % 250 + 1}" if ip else None,
            "status": self.status,
            "ssh_key_names": list(self.ssh_key_names),
            "file_system_names": [],
            "file_system_mounts": [],
            "region": {"name": self.region, "description": REGIONS.get(self.region, self.region)},
            "instance_type": self.type.to_json(),
            "hostname": self.hostname,
            "jupyter_token": None,
            "jupyter_url": None,
            "actions": {
                "migrate": {"available": False, "reason_code": "vm-has-not-launched" if not launched else "vm-is-too-old"},
                "rebuild": {"available": launched},
                "restart": {"available": launched},
                "cold_reboot": {"available": launched},
                "terminate": {"available": self.status not in ("terminating", "terminated")},
            },
            "tags": [],
            "firewall_rulesets": [],
            "is_reserved": False,
        }


FakeRequest = RecordedRequest


class FakeLambda(FakeServer):
    """The Lambda Cloud API v1 on 127.0.0.1, port chosen by the OS; `url` is the base URL
    (with /api/v1). `api_key` is the only key accepted; `ssh_keys` are the registered SSH key
    names; `quota` caps live instances; `clock` drives the launch throttle (tests pass a
    controllable one); `request_interval`, when set, answers 429 to requests closer together
    than that; `boot_delay`, when set, makes instances active on a timer.
    """

    base_path = fault_prefix = _PREFIX

    def __init__(
        self,
        *,
        api_key: str,
        catalog: tuple[FakeInstanceType, ...] = DEFAULT_CATALOG,
        capacity: dict[tuple[str, str], int] | None = None,
        ssh_keys: Iterable[str] = ("tgp",),
        image_families: Iterable[str] = ("lambda-stack-22-04", "lambda-stack-24-04", "ubuntu-22-04"),
        quota: int | None = None,
        account_inactive: bool = False,
        launch_interval: float = 12.0,
        request_interval: float | None = None,
        throttle_retry_after: bool = False,
        boot_delay: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        host: str = "127.0.0.1",
        model: ProviderModel | None = None,
    ) -> None:
        super().__init__(host=host)
        # Lag, late creates, answers after buying, lying terminates (sim.provider_model).
        self.model = model or ProviderModel(clock=clock)
        self.api_key = api_key
        self.catalog = {t.name: t for t in catalog}
        self.capacity: dict[tuple[str, str], int] = dict(DEFAULT_CAPACITY if capacity is None else capacity)
        self.ssh_keys = set(ssh_keys)
        self.image_families = set(image_families)
        self.quota = quota
        self.account_inactive = account_inactive
        self.launch_interval = launch_interval
        self.request_interval = request_interval
        self.throttle_retry_after = throttle_retry_after
        self.boot_delay = boot_delay
        self.clock = clock
        self.instances: dict[str, FakeInstance] = {}
        self.create_requests = 0
        self._numbers = itertools.count(1)
        self._last_launch: float | None = None
        self._last_request: float | None = None

    # --- lifecycle --------------------------------------------------------------------

    def _add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get(f"{_PREFIX}/instance-types", self._instance_types)
        r.add_get(f"{_PREFIX}/instances", self._list_instances)
        r.add_get(f"{_PREFIX}/instances/{{instance_id}}", self._get_instance)
        r.add_post(f"{_PREFIX}/instance-operations/launch", self._launch)
        r.add_post(f"{_PREFIX}/instance-operations/terminate", self._terminate)

    def _middlewares(self) -> list[Middleware]:
        return [self._record, self._auth, self._inject_faults]

    # --- test controls ----------------------------------------------------------------

    def set_capacity(self, type_name: str, region: str, n: int) -> None:
        """How many more launches of `type_name` can succeed in `region` (0 = sold out)."""
        self.capacity[(type_name, region)] = n

    def retire(self, type_name: str) -> None:
        """Lambda stops selling `type_name`: it leaves the catalog and launches of it answer
        400 global/object-does-not-exist."""
        self.catalog.pop(type_name, None)

    def fail(  # type: ignore[override]  # Lambda's errors have a code and a message, not a body
        self,
        path: str = "*",
        status: int = 500,
        *,
        code: str | None = None,
        message: str | None = None,
        **options: Unpack[FaultOptions],
    ) -> None:
        """Answer the next `times` requests whose path (without /api/v1) matches the fnmatch
        `path`, and `method` if given, with `status` in Lambda's error envelope, plus
        Retry-After when `retry_after` is given."""
        default_code = {429: "global/too-many-requests", 503: "provider/internal-unavailable"}.get(status, "global/internal-error")
        text = message or ("Try again shortly." if status >= 500 else "Too many requests." if status == 429 else "Injected failure.")
        super().fail(path, status, body=(code or default_code, text), **options)

    def advance(self, instance_id: str | None = None) -> None:
        """Move one instance (or all) one step: booting -> active, terminating -> terminated
        (after which the API answers 404 for it)."""
        for inst in [self.instances[instance_id]] if instance_id else list(self.instances.values()):
            if inst.status == "booting":
                inst.status = "active"
            elif inst.status == "terminating":
                inst.status = "terminated"

    def set_status(self, instance_id: str, status: str) -> None:
        """Force an instance's status (unhealthy, preempted, active, ...)."""
        self.instances[instance_id].status = status

    def live_instances(self) -> list[FakeInstance]:
        """Instances not terminating or terminated (what still bills)."""
        return [i for i in self.instances.values() if i.status not in ("terminating", "terminated")]

    # --- middleware -------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._presented_key(request.headers.get("Authorization", "")) != self.api_key:
            return _error(401, "global/invalid-api-key", "API key was invalid, expired, or deleted.")
        now = self.clock()
        if self.request_interval is not None and self._last_request is not None and now - self._last_request < self.request_interval:
            return self._throttled(self._last_request + self.request_interval - now)
        self._last_request = now
        return await handler(request)

    def _fault_response(self, fault: Fault) -> web.Response:
        code, message = fault.body
        return _error(fault.status, code, message, headers=fault.headers)

    @staticmethod
    def _presented_key(header: str) -> str | None:
        """The key in `Authorization: Bearer <key>` or `Basic base64(<key>:)`."""
        if header.startswith("Bearer "):
            return header.removeprefix("Bearer ")
        if header.startswith("Basic "):
            try:
                return base64.b64decode(header.removeprefix("Basic ")).decode().partition(":")[0]
            except (ValueError, UnicodeDecodeError):
                return None
        return None

    def _throttled(self, wait: float) -> web.Response:
        headers = {"Retry-After": str(max(1, math.ceil(wait)))} if self.throttle_retry_after else None
        return _error(429, "global/too-many-requests", "Too many requests; slow down.", headers=headers)

    # --- handlers ---------------------------------------------------------------------

    async def _instance_types(self, request: web.Request) -> web.Response:
        data = {
            t.name: {
                "instance_type": t.to_json(),
                "regions_with_capacity_available": [
                    {"name": region, "description": REGIONS.get(region, region)}
                    for (name, region), n in self.capacity.items()
                    if name == t.name and n > 0
                ],
            }
            for t in self.catalog.values()
        }
        return web.json_response({"data": data})

    async def _list_instances(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"data": [i.to_json() for i in self.instances.values() if i.status != "terminated" and self.model.listed(i.id)]}
        )

    async def _get_instance(self, request: web.Request) -> web.Response:
        inst = self.instances.get(request.match_info["instance_id"])
        if inst is None or inst.status == "terminated" or not self.model.describable(inst.id):
            return _error(404, "global/object-does-not-exist", "Specified instance does not exist.")
        return web.json_response({"data": inst.to_json()})

    async def _terminate(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        ids = body.get("instance_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            return _error(400, "global/invalid-parameters", "instance_ids must be a non-empty list of instance ids.")
        found = [self.instances.get(i) for i in ids]
        if any(inst is None or inst.status == "terminated" or not self.model.describable(inst.id) for inst in found):
            return _error(404, "global/object-does-not-exist", "Specified instance does not exist.")
        terminated = []
        for inst in found:
            assert inst is not None
            if inst.status != "terminating":
                self.model.terminate(inst.id, lambda inst=inst: self._end(inst))  # type: ignore[misc]
            terminated.append({**inst.to_json(), "status": "terminating"})
        return web.json_response({"data": {"terminated_instances": terminated}})

    def _end(self, inst: FakeInstance) -> None:
        """A terminate that took effect: the instance is terminating and stops billing."""
        if inst.timer is not None:
            inst.timer.cancel()
        if inst.status not in ("terminating", "terminated"):
            inst.status = "terminating"
            key = (inst.type.name, inst.region)
            self.capacity[key] = self.capacity.get(key, 0) + 1
        self.model.ended(inst.id)

    async def _launch(self, request: web.Request) -> web.Response:
        now = self.clock()
        if self._last_launch is not None and now - self._last_launch < self.launch_interval:
            return self._throttled(self._last_launch + self.launch_interval - now)
        self._last_launch = now
        self.create_requests += 1
        body = await _json_body(request)
        if not isinstance(body, dict):
            return _error(400, "global/invalid-parameters", "Request body must be a JSON object.")
        problem = self._launch_problem(body)
        if problem is not None:
            return problem
        itype = self.catalog[body["instance_type_name"]]
        region = body["region_name"]
        if self.account_inactive:
            return _error(403, "global/account-inactive", "Your account is inactive.", "Contact support or update your billing details.")
        if self.quota is not None and len(self.live_instances()) >= self.quota:
            return _error(400, "global/quota-exceeded", "Quota exceeded.", "Your instance quota grows as invoices are paid.")
        if self.capacity.get((itype.name, region), 0) <= 0:
            return _error(
                400, "instance-operations/launch/insufficient-capacity", "Not enough capacity to fulfill launch request."
            )

        def buy() -> FakeInstance:
            self.capacity[(itype.name, region)] -= 1
            inst = FakeInstance(
                id=secrets.token_hex(16),
                name=str(body.get("name") or ""),
                type=itype,
                region=region,
                ssh_key_names=list(body["ssh_key_names"]),
                hostname=str(body.get("hostname") or f"{secrets.token_hex(4)}"),
                user_data=str(body.get("user_data") or ""),
                number=next(self._numbers),
            )
            self.instances[inst.id] = inst
            self.model.bought(inst.id, inst.name)
            if self.boot_delay is not None:
                inst.timer = self._call_later(self.boot_delay, self._boot, inst.id)
            return inst

        outcome, inst = self.model.create(buy)
        answer = await self.model.answer_create(request, outcome, lambda status: _error(status, "provider/internal-unavailable", "Try again shortly."))
        if answer is not None or inst is None:
            return answer  # type: ignore[return-value]
        return web.json_response({"data": {"instance_ids": [inst.id]}})

    def _launch_problem(self, body: dict[str, Any]) -> web.Response | None:
        """The error the real API gives for this launch body, if any (schema 1.8.3)."""
        for required in ("region_name", "instance_type_name", "ssh_key_names"):
            if not body.get(required):
                return _error(400, "global/invalid-parameters", f"Missing required field {required}.")
        keys = body["ssh_key_names"]
        if not isinstance(keys, list) or len(keys) != 1:
            return _error(400, "global/invalid-parameters", "ssh_key_names must contain exactly one SSH key name.")
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_LEN):
            return _error(400, "global/invalid-parameters", f"name must be at most {MAX_NAME_LEN} characters.")
        hostname = body.get("hostname")
        if hostname is not None and not (isinstance(hostname, str) and _HOSTNAME.match(hostname)):
            return _error(400, "global/invalid-parameters", "hostname is not a valid hostname.")
        user_data = body.get("user_data")
        if user_data is not None and (not isinstance(user_data, str) or len(user_data.encode()) > MAX_USER_DATA_BYTES):
            return _error(400, "global/invalid-parameters", "user_data must be a string of at most 1 MB.")
        if body["region_name"] not in REGIONS:
            return _error(400, "global/object-does-not-exist", "Specified region does not exist.")
        if body["instance_type_name"] not in self.catalog:
            return _error(400, "global/object-does-not-exist", "Specified instance type does not exist.")
        if keys[0] not in self.ssh_keys:
            return _error(400, "global/object-does-not-exist", "Specified SSH key does not exist.")
        image = body.get("image")
        if isinstance(image, dict) and "family" in image and image["family"] not in self.image_families:
            return _error(400, "global/object-does-not-exist", "Specified image does not exist.")
        return None

    def _boot(self, instance_id: str) -> None:
        inst = self.instances[instance_id]
        if inst.status == "booting":
            inst.status = "active"


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        return None


def _error(status: int, code: str, message: str, suggestion: str | None = None, *, headers: dict[str, str] | None = None) -> web.Response:
    error: dict[str, str] = {"code": code, "message": message}
    if suggestion:
        error["suggestion"] = suggestion
    return web.json_response({"error": error}, status=status, headers=headers)
