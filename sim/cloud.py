"""A simulated GPU cloud, served over HTTP on loopback, for the demo, the tests and benchmarks.

Like Karpenter's KWOK provider: a launched instance "boots" after a delay, joins the tailnet
with the auth key found in its boot payload (as tailscaled would), and registers a Node in the
cluster (as a kubelet would). Faults are injected from Python: capacity errors per offer, boot
failures, preemption, gates that hold creates, terminates or offer listings in flight, creates that answer slower
than the caller waits or answer 5xx after buying (as real clouds do under load), describes that
answer slowly, and terminates that fail for a while. What a real control plane does under load (list and
describe lag, creates bought after the client gave up or answered 429/5xx/reset after buying,
terminates that lie or act late, instances that vanish) is the shared `ProviderModel`
(sim.provider_model): pass one as `model=`, and read its truth (`model.billing()`).

Names are not unique, as on every real cloud: two creates with the same name buy two
instances. `max_live_per_name` records the most live instances one name ever had at once.

Accounts, as on real clouds: every API key belongs to an account (`api_key` to "default",
more with `add_key`), an instance is billed to the account whose key bought it
(`SimInstance.account`), and a key sees and ends only its own account's instances. A key
can be rotated (`add_key` a new one for the account, `revoke_key` the old one: 401 from then on).

Wire format (tgp's own, documented here because no real cloud speaks it):
    GET    /v1/offers                -> {"offers": [{id, gpu, gpuCount, region, pricePerHour, spot}]}
    POST   /v1/instances {offerId, name, userData}
                                     -> 201 instance | 409 {"error": {"code": "insufficient-capacity", ...}}
    GET    /v1/instances?name=NAME   -> {"instances": [...]}   (live instances only)
    GET    /v1/instances/{id}        -> instance | 404 {"error": {"code": "not-found", ...}}
    DELETE /v1/instances/{id}        -> 200 | 404 {"error": {"code": "not-found", ...}}
An instance is {id, name, offerId, status: pending|running|failed|terminated, pricePerHour,
interrupted}.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import itertools
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from aiohttp import web

from sim.fakeserver import EchoForm, EchoMode, Fault, echo_errors, fault_body_response
from sim.kube_kubelet import kubelet_registration
from sim.provider_model import ProviderModel

# never_runs: the instance fails to boot; never_joins: it runs but never reaches the tailnet;
# gpus_never_register: its Node turns Ready but the GPU driver never loads (allocatable
# nvidia.com/gpu stays 0, as with a driver that does not match the kernel).
BootFailure = Literal["never_runs", "never_joins", "gpus_never_register"]
TailnetRegister = Callable[[str, str], Awaitable[object]]
# The account of the key a request came with (set by the auth middleware).
_ACCOUNT = web.RequestKey("account", str)
# The machine's kubelet: (node name, labels, GPUs, taints). It may run for the machine's whole
# life (sim.kube_kubelet.SimKubelet): the boot task awaits it and is cancelled at termination.
NodeRegister = Callable[[str, dict[str, str], int, list[dict[str, str]]], Awaitable[object]]


@dataclass(frozen=True)
class SimOffer:
    id: str
    gpu: str
    region: str
    price_per_hour: Decimal
    gpu_count: int = 1
    spot: bool = False


DEFAULT_CATALOG: tuple[SimOffer, ...] = (
    SimOffer("rtx4090-us-east", "RTX4090", "us-east", Decimal("0.44")),
    SimOffer("rtx4090-eu-west", "RTX4090", "eu-west", Decimal("0.49")),
    SimOffer("l40s-us-east", "L40S", "us-east", Decimal("0.89")),
    SimOffer("a100-80gb-us-west", "A100-80GB", "us-west", Decimal("1.29")),
    SimOffer("h100-sxm-us-east", "H100-SXM", "us-east", Decimal("2.49")),
    SimOffer("rtx4090-us-east-spot", "RTX4090", "us-east", Decimal("0.29"), spot=True),
)


@dataclass
class SimInstance:
    id: str
    name: str
    offer: SimOffer
    user_data: str
    status: str = "pending"
    interrupted: bool = False
    account: str | None = None  # whose key bought it (None: the cloud checks no key)
    boot: asyncio.Task[None] | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "name": self.name,
            "offerId": self.offer.id,
            "status": self.status,
            "pricePerHour": str(self.offer.price_per_hour),
            "interrupted": self.interrupted,
        }


# Where a boot payload carries the auth key and hostname: env lines (TS_AUTHKEY=...), the Talos
# ExtensionServiceConfig ("TS_AUTHKEY=..."), or cloud-init (the key file's content, hostname:).
_AUTH_KEY = (re.compile(r"TS_AUTHKEY=([^\s\"']+)"), re.compile(r"((?:tskey|hskey)-auth-[A-Za-z0-9_-]+)"))
_HOSTNAME = (re.compile(r"TS_HOSTNAME=([^\s\"']+)"), re.compile(r"^hostname:\s*\"?([^\s\"]+)", re.MULTILINE))


def boot_env(user_data: str) -> dict[str, str]:
    """What the simulated machine finds in its boot payload: TS_AUTHKEY and TS_HOSTNAME, as
    tailscaled would be given them by any of the payload kinds."""
    env = {}
    for name, patterns in (("TS_AUTHKEY", _AUTH_KEY), ("TS_HOSTNAME", _HOSTNAME)):
        for pattern in patterns:
            match = pattern.search(user_data)
            if match:
                env[name] = match.group(1)
                break
    return env


class SimulatedCloud:
    """The simulated cloud: `async with SimulatedCloud(...) as cloud: cloud.url`."""

    def __init__(
        self,
        *,
        catalog: tuple[SimOffer, ...] = DEFAULT_CATALOG,
        boot_delay: float = 1.0,
        tailnet_register: TailnetRegister | None = None,
        node_register: NodeRegister | None = None,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        model: ProviderModel | None = None,
    ) -> None:
        self.model = model or ProviderModel()
        # API key -> account. Empty: no key is checked and every caller sees every instance.
        self.accounts: dict[str, str] = {api_key: "default"} if api_key else {}
        self.requests_by_key: Counter[str] = Counter()  # requests each key made (accepted ones)
        self.offer_lists: Counter[str] = Counter()  # GET /v1/offers by account ("" when no key is checked)
        self.catalog = {o.id: o for o in catalog}
        self.boot_delay = boot_delay
        self.instances: dict[str, SimInstance] = {}
        self.create_requests = 0
        self._tailnet_register = tailnet_register
        self._node_register = node_register
        self._no_capacity: set[str] = set()
        self._refused: set[str] = set()
        self._boot_failures: dict[str, BootFailure] = {}
        self._ids = itertools.count(1)
        self._create_gate: asyncio.Event | None = None
        self.create_arrived = asyncio.Event()
        self._offers_gate: asyncio.Event | None = None
        self.offers_listed = asyncio.Event()
        self._delete_gate: asyncio.Event | None = None
        self.delete_arrived = asyncio.Event()
        self._boot_gate: asyncio.Event | None = None
        self._create_delay = 0.0
        self._describe_delay = 0.0
        self._slow_describes_left: int | None = None
        self._describes_sped_up = asyncio.Event()
        self.describe_requests = 0
        self.instance_lists = 0  # GET /v1/instances without a name (a whole listing: the fleet look, the sweeper)
        self.name_lookups = 0  # GET /v1/instances?name= (a launch looking for what it bought)
        self._creates_failing_after_buy = 0
        self._deletes_failing = 0
        self.delete_requests = 0
        self.max_live_per_name: dict[str, int] = {}
        # What happened to instances, in order: (event, instance name, offer id), event one of
        # bought, running, deleted (a terminate request that took). For tests' order assertions.
        self.log: list[tuple[str, str, str]] = []
        self._host, self._port = host, port
        self._runner: web.AppRunner | None = None
        self.url = ""
        # Quote the request (Authorization, userData) in every error answer, as many real
        # clouds do: "json", "raw" or "base64" (sim.fakeserver.echo_request). None: do not.
        self.echo: EchoMode | EchoForm | None = None
        self._faults: list[Fault] = []

    # --- accounts ----------------------------------------------------------------------

    def add_key(self, api_key: str, account: str) -> None:
        """`api_key` now works and buys for `account` (a new account, or a rotated key)."""
        self.accounts[api_key] = account

    def revoke_key(self, api_key: str) -> None:
        """`api_key` is refused from now on (401), as a deleted key is."""
        self.accounts.pop(api_key, None)

    @property
    def _api_key(self) -> str | None:
        """The "default" account's key (the `api_key` given at start)."""
        return next((k for k, a in self.accounts.items() if a == "default"), None)

    @_api_key.setter
    def _api_key(self, value: str | None) -> None:
        """Rotate the "default" account's key: the old one answers 401 from now on."""
        self.accounts = {k: a for k, a in self.accounts.items() if a != "default"}
        if value:
            self.accounts[value] = "default"

    def _visible(self, request: web.Request, inst: SimInstance) -> bool:
        return not self.accounts or inst.account == request.get(_ACCOUNT)

    # --- fault injection ---------------------------------------------------------------

    def set_price(self, offer_id: str, price: Decimal) -> None:
        """The market moves: the offer is listed (and bought) at `price` from now on."""
        self.catalog[offer_id] = dataclasses.replace(self.catalog[offer_id], price_per_hour=price)

    def set_capacity(self, offer_id: str, available: bool) -> None:
        (self._no_capacity.discard if available else self._no_capacity.add)(offer_id)

    def refuse_offer(self, offer_id: str) -> None:
        """Creates of this offer answer 400 (the offer was withdrawn), as clouds refuse a type
        no longer sold in a region; listing still shows it, as stale price lists do."""
        self._refused.add(offer_id)

    def fail_boot(self, offer_id: str, mode: BootFailure) -> None:
        self._boot_failures[offer_id] = mode

    def hold_creates(self) -> None:
        """Keep create requests in flight (the instance is already bought) until released."""
        self._create_gate = asyncio.Event()
        self.create_arrived.clear()

    def hold_offer_lists(self) -> None:
        """Keep offer listings (GET /v1/offers) waiting until released: `offers_listed` is set
        when one arrives, to catch a node while it chooses its offer."""
        self._offers_gate = asyncio.Event()
        self.offers_listed.clear()

    def release_offer_lists(self) -> None:
        if self._offers_gate is not None:
            self._offers_gate.set()
            self._offers_gate = None

    def hold_deletes(self) -> None:
        """Keep terminate requests waiting (a slow provider API) until released."""
        self._delete_gate = asyncio.Event()
        self.delete_arrived.clear()

    def release_deletes(self) -> None:
        if self._delete_gate is not None:
            self._delete_gate.set()
            self._delete_gate = None

    def hold_boots(self) -> None:
        """Keep instances bought from now on booting (`pending`) until released; the boot
        delay runs after the release. Catches a node while it waits for its instance to run,
        however slowly it gets there."""
        self._boot_gate = asyncio.Event()

    def release_boots(self) -> None:
        if self._boot_gate is not None:
            self._boot_gate.set()
            self._boot_gate = None

    def slow_creates(self, seconds: float) -> None:
        """Creates take this long: the provider works on the request, then buys and answers
        (the answer can come after the caller has given up waiting)."""
        self._create_delay = seconds

    def slow_describes(self, seconds: float, *, count: int | None = None) -> None:
        """Describes (GET /v1/instances/{id}) answer `seconds` late, as a provider's API does
        under load or behind its rate limiter: the next `count` of them, or all of them until
        called with 0, which also answers the describes waiting now."""
        self._describe_delay, self._slow_describes_left = seconds, count
        if not seconds:
            self._describes_sped_up.set()
            self._describes_sped_up = asyncio.Event()

    def fail_creates_after_buying(self, count: int) -> None:
        """The next `count` creates buy the instance and then answer 503."""
        self._creates_failing_after_buy = count

    def fail(
        self, path: str, status: int = 500, *, times: int = 1, method: str | None = None, message: str = "injected failure",
        after_handling: bool = False, body: Any = None,
    ) -> None:
        """The next `times` requests whose path matches the fnmatch `path` (and `method`, if
        given) answer `status` in this cloud's error shape, without taking effect; with
        `after_handling`, after taking effect (a delete that terminates, then answers 503).
        A `body` replaces that error shape: a str is sent as is, as a proxy or a wrong URL
        answers (sim.fakeserver.GATEWAY_404_TEXT), anything else as JSON."""
        fault = Fault(path, method.upper() if method else None, status, times, None, body, after_handling, message)
        self._faults.append(fault)

    def clear_faults(self) -> None:
        """Requests answer normally again (the faults `fail` queued and not yet used are dropped)."""
        self._faults.clear()

    def fail_deletes(self, count: int) -> None:
        """The next `count` terminate requests answer 500 and terminate nothing."""
        self._deletes_failing = count

    def live_named(self, name: str) -> list[SimInstance]:
        return [i for i in self.live_instances() if i.name == name]

    def release_creates(self) -> None:
        if self._create_gate is not None:
            self._create_gate.set()
            self._create_gate = None

    async def preempt(self, instance_id: str) -> None:
        """The provider takes the instance away, as a spot reclaim or host failure would."""
        inst = self.instances[instance_id]
        self._stop_boot(inst)
        inst.status, inst.interrupted = "terminated", True
        self.model.ended(inst.id)

    def live_instances(self) -> list[SimInstance]:
        self.model.settle()
        return [i for i in self.instances.values() if i.status != "terminated"]

    # --- server ------------------------------------------------------------------------

    async def __aenter__(self) -> SimulatedCloud:
        app = web.Application(middlewares=[self._echo, self._auth, self._inject_faults])
        app.add_routes(
            [
                web.get("/v1/offers", self._list_offers),
                web.post("/v1/instances", self._create),
                web.get("/v1/instances", self._list_instances),
                web.get("/v1/instances/{id}", self._get),
                web.delete("/v1/instances/{id}", self._delete),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self._host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release_offer_lists()
        self.release_creates()
        self.release_deletes()
        self.slow_describes(0)
        self.model.held.set()
        for inst in self.instances.values():
            self._stop_boot(inst)
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _echo(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if self.echo is None or exc.status < 400:
                raise
            response = web.Response(status=exc.status, text=exc.text or exc.reason)
        return await echo_errors(request, response, self.echo)

    @web.middleware
    async def _inject_faults(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        for fault in self._faults:
            if fault.remaining > 0 and fnmatch.fnmatchcase(request.path, fault.pattern) and fault.method in (None, request.method):
                fault.remaining -= 1
                if fault.after_handling:
                    await handler(request)
                if fault.body is not None:
                    return fault_body_response(fault.body, fault.status)
                return _error(fault.status, "injected", fault.message)
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        if self.accounts:
            header = request.headers.get("Authorization", "")
            account = self.accounts.get(header.removeprefix("Bearer ")) if header.startswith("Bearer ") else None
            if account is None:
                return _error(401, "unauthorized", "invalid or missing API key")
            request[_ACCOUNT] = account
            self.requests_by_key[header.removeprefix("Bearer ")] += 1
        return await handler(request)

    async def _list_offers(self, request: web.Request) -> web.Response:
        self.offer_lists[request.get(_ACCOUNT) or ""] += 1
        self.offers_listed.set()
        if self._offers_gate is not None:
            await self._offers_gate.wait()
        offers = [
            {
                "id": o.id,
                "gpu": o.gpu,
                "gpuCount": o.gpu_count,
                "region": o.region,
                "pricePerHour": str(o.price_per_hour),
                "spot": o.spot,
            }
            for o in self.catalog.values()
        ]
        return web.json_response({"offers": offers})

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        offer = self.catalog.get(body.get("offerId", ""))
        if offer is None:
            return _error(400, "invalid-offer", f"unknown offer {body.get('offerId')!r}")
        if not body.get("name"):
            return _error(400, "invalid-name", "name is required")
        self.create_requests += 1
        if offer.id in self._refused:
            return _error(400, "offer-unavailable", f"offer {offer.id} is no longer available in {offer.region}")
        if offer.id in self._no_capacity:
            return _error(409, "insufficient-capacity", f"no capacity for offer {offer.id} right now")
        if self._create_delay:
            # The provider is still working on it: nothing is visible by name yet.
            await asyncio.sleep(self._create_delay)
        def buy() -> SimInstance:
            inst = SimInstance(
                id=f"sim-{next(self._ids):04d}", name=body["name"], offer=offer, user_data=body.get("userData", ""), account=request.get(_ACCOUNT)
            )
            self.instances[inst.id] = inst
            self.log.append(("bought", inst.name, offer.id))
            self.model.bought(inst.id, inst.name)
            live = len(self.live_named(inst.name))
            self.max_live_per_name[inst.name] = max(live, self.max_live_per_name.get(inst.name, 0))
            self.create_arrived.set()
            inst.boot = asyncio.create_task(self._boot(inst))
            return inst

        outcome, inst = self.model.create(buy)
        self.create_arrived.set()  # taken: bought now, or (a late create) later
        if self._create_gate is not None:
            # Bought, but the answer is still on its way: the case a cancelled launch must survive.
            await self._create_gate.wait()
        answer = await self.model.answer_create(request, outcome, lambda status: _error(status, "unavailable", "please retry"))
        if answer is not None or inst is None:
            return answer or web.Response(status=499)
        if self._creates_failing_after_buy:
            self._creates_failing_after_buy -= 1
            return _error(503, "service-unavailable", "upstream timeout, please retry")
        return web.json_response(inst.to_json(), status=201)

    async def _list_instances(self, request: web.Request) -> web.Response:
        name = request.query.get("name")
        self.instance_lists += name is None
        self.name_lookups += name is not None
        found = [
            i.to_json()
            for i in self.live_instances()
            if (name is None or i.name == name) and self._visible(request, i) and self.model.listed(i.id)
        ]
        return web.json_response({"instances": found})

    async def _get(self, request: web.Request) -> web.Response:
        self.describe_requests += 1
        if self._describe_delay and self._slow_describes_left != 0:
            if self._slow_describes_left is not None:
                self._slow_describes_left -= 1
            try:
                await asyncio.wait_for(self._describes_sped_up.wait(), self._describe_delay)
            except asyncio.TimeoutError:
                pass
        self.model.settle()
        inst = self.instances.get(request.match_info["id"])
        if inst is None or not self._visible(request, inst) or not self.model.describable(inst.id):
            return _error(404, "not-found", "instance not found")
        return web.json_response(inst.to_json())

    async def _delete(self, request: web.Request) -> web.Response:
        self.model.settle()
        inst = self.instances.get(request.match_info["id"])
        if inst is None or not self._visible(request, inst) or not self.model.describable(inst.id):
            return _error(404, "not-found", "instance not found")
        self.delete_requests += 1
        self.delete_arrived.set()
        if self._delete_gate is not None:
            await self._delete_gate.wait()
        if self._deletes_failing:
            self._deletes_failing -= 1
            return _error(500, "internal", "could not terminate the instance, try again")
        if inst.status != "terminated":
            self.log.append(("deleted", inst.name, inst.offer.id))
            self.model.terminate(inst.id, lambda: self._end(inst))
        return web.json_response(inst.to_json())

    def _end(self, inst: SimInstance) -> None:
        """The instance stops billing (a terminate that took effect)."""
        self._stop_boot(inst)
        inst.status = "terminated"
        self.model.ended(inst.id)

    # --- the simulated machine -----------------------------------------------------------

    async def _boot(self, inst: SimInstance) -> None:
        failure = self._boot_failures.get(inst.offer.id)
        if self._boot_gate is not None:
            await self._boot_gate.wait()
        await asyncio.sleep(self.boot_delay)
        if failure == "never_runs":
            inst.status = "failed"
            return
        inst.status = "running"
        self.log.append(("running", inst.name, inst.offer.id))
        if failure == "never_joins":
            return
        env = boot_env(inst.user_data)
        hostname = env.get("TS_HOSTNAME", inst.name)
        if self._tailnet_register is not None and "TS_AUTHKEY" in env:
            await self._tailnet_register(env["TS_AUTHKEY"], hostname)
        if self._node_register is not None:
            # The kubelet registers with the labels and taints its boot payload gives it.
            extra_labels, taints = kubelet_registration(inst.user_data)
            labels = {**extra_labels, "kubernetes.io/hostname": hostname, "nvidia.com/gpu.present": "true"}
            await self._node_register(hostname, labels, 0 if failure == "gpus_never_register" else inst.offer.gpu_count, taints)

    def _stop_boot(self, inst: SimInstance) -> None:
        if inst.boot is not None and not inst.boot.done():
            inst.boot.cancel()


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)
