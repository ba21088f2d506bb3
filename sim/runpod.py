"""A local fake of RunPod's REST v2 API for the tests, served by aiohttp on loopback so the
`runpod` adapter is exercised over real HTTP.

Shapes and failures follow reference/providers.md section 2:
* `GET /v2/catalog/gpus?include=AVAILABILITY&product=POD&count=N` with per-GPU-hour prices,
  `availability` NONE|LOW|MEDIUM|HIGH and per-datacenter stock (scoped to `count`);
* `POST /v2/pods` -> 201 Pod; capacity failure is a **400 problem+json** whose `detail` is the
  observed "There are no longer any instances available ..." (no machine-readable code); a body
  the schema refuses is **422** with `errors: ["$.<field>: <why>"]`, including a `gpu.id` or
  `dataCenterIds` entry outside the spec's enums (a GPU type RunPod has since retired: the
  enum wording is assumed from the documented `"$.action: value must be one of ..."`);
* a new pod reads `RUNNING` at once with `runtime: null` and `ssh.direct: null`; ports appear
  only when the test (or `boot_delay`) says the container is up;
* `DELETE /v2/pods/{id}` -> 204 (404 unknown); errors are `application/problem+json`
  `{title, status, detail}`; a wrong or missing key is 401; every authenticated answer carries
  `RateLimit` / `RateLimit-Policy` headers and a 429 carries `Retry-After`.

Python-level knobs (not part of the real API):
* `set_capacity(gpu_id, dc_id, gpus)`: free GPUs of a type in a datacenter (per (type, region)).
* `retire(gpu_id)`: RunPod stops selling a GPU type (gone from the catalog; creates answer 422).
* `fail(path, status, times=, retry_after=, method=, detail=)`: the next requests answer an error.
* `create_then_fail(times=, status=)`: the next creates buy the pod, then answer 500 (the
  create-then-500 bug RunPod v1 showed in June 2026).
* `advance(pod_id=None)` / `set_status(pod_id, status)`: move pods along PROVISIONING ->
  RUNNING (no ports) -> RUNNING (ports), or to EXITED / ERROR; `boot_delay` does it on a timer.
* `instances`, `live_instances()`, `create_requests`, `requests`: state and a request log.

    async with FakeRunPod(api_key="rpa_test") as rp:
        provider = RunPodProvider(SecretStr("rpa_test"), base_url=rp.url)
"""

from __future__ import annotations

import asyncio
import itertools
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Unpack

from aiohttp import web
from aiohttp.typedefs import Middleware

from sim.provider_model import ProviderModel
from sim.fakeserver import Fault, FakeServer, FaultOptions, Handler, RecordedRequest

__all__ = ["DEFAULT_CATALOG", "DEFAULT_STOCK", "FakeGpu", "FakePod", "FakeRunPod", "CAPACITY_DETAIL"]

# The observed v2 capacity answer, verbatim.
CAPACITY_DETAIL = (
    "There are no longer any instances available with the requested specifications. Please refresh and try again."
)
DATA_CENTERS = {"US-KS-2": "US Kansas 2", "EU-RO-1": "Europe Romania 1", "CA-MTL-1": "Canada Montreal 1"}
# The spec's example quota: 60 requests a minute (plus hour/day windows, reported, not enforced).
POLICY = '"minute";q=60;w=60, "hour";q=3000;w=3600, "day";q=50000;w=86400'
_PREFIX = "/v2"


@dataclass(frozen=True)
class FakeGpu:
    """A catalog GPU type. `price_secure` is USD per GPU-hour, as RunPod lists it."""

    id: str
    name: str
    memory: int
    price_secure: Decimal
    price_community: Decimal | None
    max_count: int
    data_centers: tuple[str, ...]


DEFAULT_CATALOG: tuple[FakeGpu, ...] = (
    FakeGpu("NVIDIA GeForce RTX 4090", "RTX 4090", 24, Decimal("0.44"), Decimal("0.31"), 8, ("US-KS-2", "EU-RO-1")),
    FakeGpu("NVIDIA A100 80GB PCIe", "A100 PCIe", 80, Decimal("1.64"), Decimal("1.19"), 8, ("US-KS-2", "CA-MTL-1")),
    FakeGpu("NVIDIA H100 80GB HBM3", "H100 SXM", 80, Decimal("2.99"), None, 8, ("EU-RO-1",)),
    FakeGpu("NVIDIA L40S", "L40S", 48, Decimal("0.86"), Decimal("0.79"), 8, ("CA-MTL-1",)),
)
# Free GPUs per (type, datacenter); absent means none. L40S is sold out everywhere.
DEFAULT_STOCK: dict[tuple[str, str], int] = {
    ("NVIDIA GeForce RTX 4090", "US-KS-2"): 8,
    ("NVIDIA GeForce RTX 4090", "EU-RO-1"): 2,
    ("NVIDIA A100 80GB PCIe", "CA-MTL-1"): 4,
    ("NVIDIA H100 80GB HBM3", "EU-RO-1"): 16,
}

# Boot stages of a pod: the status it reports and whether its ports are mapped yet.
_STAGES: tuple[tuple[str, bool], ...] = (("PROVISIONING", False), ("RUNNING", False), ("RUNNING", True))
_ACTIONS = {
    "PROVISIONING": ["terminate"],
    "RUNNING": ["stop", "restart", "terminate"],
    "EXITED": ["start", "terminate"],
    "ERROR": ["terminate"],
    "TERMINATED": [],
}


@dataclass
class FakePod:
    """A pod as the fake stores it; `to_json` gives the v2 Pod shape."""

    id: str
    name: str
    image: str
    gpu: FakeGpu
    gpu_count: int
    data_center: str
    env: dict[str, str]
    ports: list[str]
    disk: int
    created_at: str
    status: str = "RUNNING"
    has_ports: bool = False
    stage: int = 1
    public_port: int = 0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def cost(self) -> Decimal:
        return self.gpu.price_secure * self.gpu_count if self.status != "EXITED" else Decimal(0)

    def to_json(self) -> dict[str, Any]:
        running = self.status == "RUNNING" and self.has_ports
        ip = "203.0.113.17"
        return {
            "id": self.id,
            "name": self.name,
            "status": self.status,
            "actions": list(_ACTIONS.get(self.status, [])),
            "image": self.image,
            "args": "",
            "disk": self.disk,
            "ports": list(self.ports),
            "env": dict(self.env),
            "registry": None,
            "mounts": None,
            "gpu": {"id": self.gpu.id, "count": self.gpu_count, "displayName": self.gpu.name},
            "cpu": None,
            "cloud": "SECURE",
            "dataCenterId": self.data_center,
            "cudaVersion": "12.8",
            "ssh": {
                "proxy": f"{self.id}-64410f2a@ssh.runpod.io",
                "direct": {"host": ip, "port": self.public_port, "username": "root"} if running else None,
            },
            "cluster": None,
            "template": None,
            "cost": float(self.cost),
            "locked": False,
            "globalNetworking": False,
            "runtime": (
                {
                    "uptime": 12,
                    "gpus": [{"id": f"gpu-{i}", "gpuUtilPercent": 0, "memoryUtilPercent": 0} for i in range(self.gpu_count)],
                    "ports": [{"private": 22, "public": self.public_port, "type": "tcp", "ip": ip}],
                }
                if running
                else None
            ),
            "createdAt": self.created_at,
            "startedAt": self.created_at if self.status == "RUNNING" else None,
        }


FakeRequest = RecordedRequest


class FakeRunPod(FakeServer):
    """RunPod REST v2 on 127.0.0.1, port chosen by the OS; `url` is the base URL (with /v2).

    `api_key` is the only key accepted. `start_status` is what a new pod reports first: the
    observed "RUNNING" (without ports) by default, or "PROVISIONING". `boot_delay` (seconds),
    when set, brings each new pod to running-with-ports on a timer; tests leave it None and
    call `advance`. `rate_limit_per_minute`, when set, answers 429 past that many requests in
    a minute of `clock`.
    """

    base_path = fault_prefix = _PREFIX

    def __init__(
        self,
        *,
        api_key: str,
        catalog: tuple[FakeGpu, ...] = DEFAULT_CATALOG,
        stock: dict[tuple[str, str], int] | None = None,
        start_status: str = "RUNNING",
        boot_delay: float | None = None,
        rate_limit_per_minute: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        host: str = "127.0.0.1",
        model: ProviderModel | None = None,
    ) -> None:
        # Lag, late creates, answers after buying, lying terminates (sim.provider_model).
        self.model = model or ProviderModel(clock=clock)
        if start_status not in ("RUNNING", "PROVISIONING"):
            raise ValueError("start_status must be RUNNING or PROVISIONING")
        super().__init__(host=host)
        self.api_key = api_key
        self.catalog = {g.id: g for g in catalog}
        self.stock: dict[tuple[str, str], int] = dict(DEFAULT_STOCK if stock is None else stock)
        self.start_status = start_status
        self.boot_delay = boot_delay
        self.rate_limit_per_minute = rate_limit_per_minute
        self.clock = clock
        self.instances: dict[str, FakePod] = {}
        self.create_requests = 0
        self._create_failures: list[int] = []
        self._ids = itertools.count(1)
        self._window: tuple[float, int] = (0.0, 0)

    # --- lifecycle --------------------------------------------------------------------

    def _add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get(f"{_PREFIX}/catalog/gpus", self._catalog)
        r.add_get(f"{_PREFIX}/pods", self._list_pods)
        r.add_post(f"{_PREFIX}/pods", self._create_pod)
        r.add_get(f"{_PREFIX}/pods/{{pod_id}}", self._get_pod)
        r.add_delete(f"{_PREFIX}/pods/{{pod_id}}", self._delete_pod)

    def _middlewares(self) -> list[Middleware]:
        # Faults after authentication: RunPod's limiter is per key.
        return [self._record, self._auth, self._inject_faults]

    # --- test controls ----------------------------------------------------------------

    def set_capacity(self, gpu_id: str, dc_id: str, gpus: int) -> None:
        """Free GPUs of `gpu_id` in `dc_id` (0 = sold out: listed NONE, creates answer 400)."""
        self.stock[(gpu_id, dc_id)] = gpus

    def retire(self, gpu_id: str) -> None:
        """RunPod stops selling `gpu_id`: the catalog drops it and creates naming it answer 422."""
        self.catalog.pop(gpu_id, None)

    def fail(  # type: ignore[override]  # RunPod's errors have a detail, not a body
        self,
        path: str = "*",
        status: int = 500,
        *,
        detail: str | None = None,
        **options: Unpack[FaultOptions],
    ) -> None:
        """Answer the next `times` requests whose path (without /v2) matches the fnmatch
        `path`, and `method` if given, with a `status` problem+json, plus Retry-After when
        `retry_after` is given. Checked after authentication, as RunPod's limiter is per key."""
        text = detail or {429: "rate limit exceeded", 402: "insufficient balance"}.get(status, "injected failure")
        super().fail(path, status, body=text, **options)

    def create_then_fail(self, *, times: int = 1, status: int = 500) -> None:
        """The next `times` creates buy and start the pod, then answer `status` anyway."""
        self._create_failures.extend([status] * times)

    def advance(self, pod_id: str | None = None) -> None:
        """Move one pod (or every booting pod) one boot stage on: PROVISIONING -> RUNNING
        without ports -> RUNNING with ports."""
        for pod in [self.instances[pod_id]] if pod_id else list(self.instances.values()):
            if pod.status in ("PROVISIONING", "RUNNING") and pod.stage < len(_STAGES) - 1:
                pod.stage += 1
                pod.status, pod.has_ports = _STAGES[pod.stage]

    def make_ready(self, pod_id: str | None = None) -> None:
        """Bring one pod (or every booting pod) to RUNNING with ports."""
        for pod in [self.instances[pod_id]] if pod_id else list(self.instances.values()):
            if pod.status in ("PROVISIONING", "RUNNING"):
                pod.stage = len(_STAGES) - 1
                pod.status, pod.has_ports = _STAGES[pod.stage]

    def set_status(self, pod_id: str, status: str) -> None:
        """Force a pod's status (EXITED, ERROR, TERMINATED, ...); ports only survive RUNNING."""
        pod = self.instances[pod_id]
        pod.status = status
        pod.has_ports = pod.has_ports and status == "RUNNING"

    def live_instances(self) -> list[FakePod]:
        """Pods not terminated (what still bills)."""
        return [p for p in self.instances.values() if p.status != "TERMINATED"]

    def availability(self, gpu_id: str, dc_id: str, count: int = 1) -> str:
        """The stock level the catalog reports for `count` GPUs of a type in a datacenter."""
        free = self.stock.get((gpu_id, dc_id), 0)
        if free < count:
            return "NONE"
        return "LOW" if free < 4 else "MEDIUM" if free < 8 else "HIGH"

    # --- middleware -------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            return _problem(401, "missing bearer token")
        if header.removeprefix("Bearer ") != self.api_key:
            return _problem(401, "invalid api key")
        limited = self._count_request()
        if limited is not None:
            return limited
        response = await handler(request)
        response.headers.update(self._rate_headers())
        return response

    def _fault_response(self, fault: Fault) -> web.Response:
        return _problem(fault.status, fault.body, headers=fault.headers)

    def _count_request(self) -> web.Response | None:
        start, used = self._window
        now = self.clock()
        if now - start >= 60:
            start, used = now, 0
        used += 1
        self._window = (start, used)
        if self.rate_limit_per_minute is not None and used > self.rate_limit_per_minute:
            wait = max(1, math.ceil(60 - (now - start)))
            return _problem(429, "rate limit exceeded", headers={"Retry-After": str(wait), **self._rate_headers()})
        return None

    def _rate_headers(self) -> dict[str, str]:
        start, used = self._window
        quota = self.rate_limit_per_minute or 60
        reset = max(0, math.ceil(60 - (self.clock() - start)))
        return {"RateLimit": f'"minute";r={max(0, quota - used)};t={reset}', "RateLimit-Policy": POLICY}

    # --- handlers ---------------------------------------------------------------------

    async def _catalog(self, request: web.Request) -> web.Response:
        include = request.query.get("include", "")
        product = request.query.get("product")
        if "AVAILABILITY" in include and product not in ("POD", "SERVERLESS"):
            return _problem(422, "validation failed", errors=["$.product: required when include=AVAILABILITY"])
        try:
            count = int(request.query.get("count", "1"))
        except ValueError:
            return _problem(422, "validation failed", errors=["$.count: must be an integer"])
        gpus = []
        for gpu in self.catalog.values():
            item: dict[str, Any] = {
                "id": gpu.id,
                "name": gpu.name,
                "pool": gpu.name.replace(" ", "_").upper(),
                "manufacturer": "NVIDIA",
                "memory": gpu.memory,
                "secure": True,
                "community": gpu.price_community is not None,
                "price": {
                    "secure": float(gpu.price_secure),
                    "community": float(gpu.price_community) if gpu.price_community is not None else None,
                    "serverless": None,
                },
                "maxCount": {"secure": gpu.max_count, "community": 4 if gpu.price_community is not None else 0},
            }
            if "AVAILABILITY" in include:
                levels = {dc: self.availability(gpu.id, dc, count) for dc in gpu.data_centers}
                item["availability"] = max(levels.values(), key=_LEVELS.index, default="NONE")
                item["dataCenters"] = [{"id": dc, "name": DATA_CENTERS.get(dc, dc), "availability": lvl} for dc, lvl in levels.items()]
                item["cudaVersions"] = [{"version": "12.8", "available": True}]
            gpus.append(item)
        return web.json_response({"gpus": gpus})

    async def _list_pods(self, request: web.Request) -> web.Response:
        # Terminated pods stay in the list here, so an adapter must skip them when it matches
        # names (whether the real list shows them, and for how long, is unverified).
        return web.json_response({"pods": [p.to_json() for p in self.instances.values() if self.model.listed(p.id)]})

    async def _get_pod(self, request: web.Request) -> web.Response:
        pod = self.instances.get(request.match_info["pod_id"])
        if pod is None or pod.status == "TERMINATED" or not self.model.describable(pod.id):
            return _problem(404, "pod not found")
        return web.json_response(pod.to_json())

    async def _delete_pod(self, request: web.Request) -> web.Response:
        pod = self.instances.get(request.match_info["pod_id"])
        if pod is None or pod.status == "TERMINATED" or not self.model.describable(pod.id):
            return _problem(404, "pod not found")
        self.model.terminate(pod.id, lambda: self._end(pod))
        return web.Response(status=204)

    def _end(self, pod: FakePod) -> None:
        """A terminate that took effect."""
        if pod.status == "TERMINATED":
            return
        if pod.timer is not None:
            pod.timer.cancel()
        pod.status, pod.has_ports = "TERMINATED", False
        key = (pod.gpu.id, pod.data_center)
        self.stock[key] = self.stock.get(key, 0) + pod.gpu_count
        self.model.ended(pod.id)

    async def _create_pod(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _problem(400, "request body is not valid JSON")
        problems = _validate_create(body)
        if not problems and body.get("gpu") and body["gpu"]["id"] not in self.catalog:
            problems = [f"$.gpu.id: value must be one of {', '.join(map(repr, self.catalog))}"]
        if problems:
            return _problem(422, "validation failed", errors=problems)
        self.create_requests += 1
        gpu = self.catalog[body["gpu"]["id"]]
        count = int(body["gpu"].get("count", 1))
        # The endpoint places the one GPU type in the first listed datacenter with stock.
        dc = next((d for d in body.get("dataCenterIds") or gpu.data_centers if self.stock.get((gpu.id, d), 0) >= count), None)
        if dc is None or count > gpu.max_count:
            return _problem(400, CAPACITY_DETAIL)

        def buy() -> FakePod:
            return self._buy(body, gpu, count, dc)

        outcome, pod = self.model.create(buy)
        answer = await self.model.answer_create(request, outcome, lambda status: _problem(status, "create pod: upstream unavailable"))
        if answer is not None or pod is None:
            return answer  # type: ignore[return-value]
        if self._create_failures:
            # Bought and started, but the answer says otherwise.
            return _problem(self._create_failures.pop(0), "create pod: internal error")
        return web.json_response(pod.to_json(), status=201)

    def _buy(self, body: dict[str, Any], gpu: FakeGpu, count: int, dc: str) -> FakePod:
        self.stock[(gpu.id, dc)] -= count
        n = next(self._ids)
        status = self.start_status
        pod = FakePod(
            id=f"{secrets.token_hex(5)}{n:04d}",
            name=body["name"],
            image=body["image"],
            gpu=gpu,
            gpu_count=count,
            data_center=dc,
            env={str(k): str(v) for k, v in (body.get("env") or {}).items()},
            ports=list(body.get("ports") or []),
            disk=int(body.get("disk") or 50),
            created_at=f"2026-09-01T00:{n // 60 % 60:02d}:{n % 60:02d}Z",
            status=status,
            stage=0 if status == "PROVISIONING" else 1,
            public_port=40000 + n,
        )
        self.instances[pod.id] = pod
        self.model.bought(pod.id, pod.name)
        if self.boot_delay is not None:
            pod.timer = self._call_later(self.boot_delay, self.make_ready, pod.id)
        return pod


_LEVELS = ["NONE", "LOW", "MEDIUM", "HIGH"]
_TITLES = {400: "Bad Request", 401: "Unauthorized", 402: "Payment Required", 403: "Forbidden", 404: "Not Found",
           409: "Conflict", 422: "Unprocessable Entity", 429: "Too Many Requests", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


def _validate_create(body: Any) -> list[str]:
    """The 422 `errors` for a create body the real API would refuse."""
    if not isinstance(body, dict):
        return ["$: must be an object"]
    problems = []
    if not body.get("name"):
        problems.append("$.name: required")
    if not body.get("image") and not body.get("templateId"):
        problems.append("$.image: required unless templateId is set")
    if bool(body.get("gpu")) == bool(body.get("cpu")):
        problems.append("$: exactly one of gpu or cpu is required")
    elif body.get("gpu") and not isinstance(body["gpu"].get("id"), str):
        problems.append("$.gpu.id: required")
    if "interruptible" in body:
        problems.append("$.interruptible: unknown field")  # v2 has no spot
    env = body.get("env")
    if env is not None and not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        problems.append("$.env: must be an object of strings")
    for i, dc in enumerate(body.get("dataCenterIds") or []):
        if dc not in DATA_CENTERS:
            problems.append(f"$.dataCenterIds[{i}]: value must be one of {', '.join(map(repr, DATA_CENTERS))}")
    return problems


def _problem(status: int, detail: str, *, errors: list[str] | None = None, headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {"title": _TITLES.get(status, "Error"), "status": status, "detail": detail}
    if errors:
        body["errors"] = errors
    return web.json_response(body, status=status, headers=headers, content_type="application/problem+json")
