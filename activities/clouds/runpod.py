"""The `runpod` provider: RunPod pods over REST **v2** (`https://api.runpod.io/v2`).

Why v2 only: RunPod has three APIs and is retiring two of them. REST v1 (`rest.runpod.io/v1`)
goes away on 2026-11-15 and GraphQL in early 2027; v2 went GA on 2026-08-18. v1 and GraphQL
are also the only APIs that can buy interruptible capacity (`interruptible: true`,
`podRentInterruptable{bidPerGpu}`): **v2 has no spot field at all**, so this adapter sells
on-demand pods only and says so with `capabilities.spot = False`. If RunPod adds spot to v2,
it belongs here; a GraphQL path would have to be removed again within months.

What a RunPod pod is: a Docker container on a shared host (no systemd, no kernel modules, no
nested containers). It cannot run a kubelet, so `capabilities.joins_as_node` is False and a
GPUNodeClass that asks for RunPod nodes is rejected with `why_not_node`. The boot payload is
the container-style `env` kind (KEY=VALUE lines -> the pod's `env`), which the image reads
(the default image is Tailscale's, which reads TS_AUTHKEY / TS_HOSTNAME / TS_EXTRA_ARGS).

Wire format, translated once here (reference/providers.md section 2):
    GET    /catalog/gpus?include=AVAILABILITY&product=POD&cloud=SECURE&count=N
           -> {"gpus": [{id, name, price: {secure}, maxCount: {secure}, availability,
                         dataCenters: [{id, name, availability}]}]}   price: USD per GPU-hour
    POST   /pods {name, image, gpu: {id, count}, cloud, dataCenterIds, disk, ports, env}
           -> 201 Pod | 400 problem+json (capacity: no machine-readable code) | 402 balance
    GET    /pods -> {"pods": [...]} (no name filter; names are not unique)
    GET    /pods/{id} -> Pod | 404
    DELETE /pods/{id} -> 204 | 404
A pod reads `RUNNING` before its container has ports (`runtime` and `ssh.direct` null); it is
running for tgp only once a public port mapping exists.

Errors: 401 -> AuthError naming the Secret; 402 -> PermissionDenied (add funds). On create,
RunPod's guidance is "400: try the next candidate, 403: skip that pool, 422: fix the request":
400 with the capacity text -> CapacityError, any other 400 and 403 -> OfferRefused, 422 whose
`errors` are all about the offer's own fields (`$.gpu.*`, `$.dataCenterIds`, e.g. a GPU type
since retired) -> OfferRefused, any other 422 (image, name, env: what the class built) ->
ConfigError. 429/5xx -> retried in `activities.http.send`, then TransientError. A create is never retried in-call on a 5xx or timeout:
RunPod is known to create the pod and still answer 500, so the caller looks it up by name.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Collection, Sequence
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import httpx
import structlog
from pydantic import SecretStr

from activities.clouds import listed
from tgp.capabilities import ProviderCapabilities
from tgp.errors import CapacityError, ConfigError, OfferRefused, PermissionDenied, TgpError
from activities.http import CLIENT_ERRORS, HttpAdapter, Sleep, json_items, json_object
from activities.http_errors import Fixes, Quotable, error_body, error_detail, error_message
from tgp.normalize import normalize_gpu, normalize_region
from tgp.types import BootPayload, Instance, InstanceState, Offer

__all__ = ["DEFAULT_BASE_URL", "DEFAULT_IMAGE", "RunPodProvider", "offer_id", "parse_offer_id"]

log = structlog.get_logger(__name__)

DEFAULT_BASE_URL = "https://api.runpod.io/v2"
SYSTEM = "RunPod API"
# RunPod v2 answers problem+json with no error code: a message quotes its title when it is a
# standard HTTP phrase, and (see `_problem_summary`) the JSON paths of fields the request sent.
QUOTABLE = Quotable(titles=True)
# The image must read the env payload; Tailscale's reads TS_AUTHKEY, TS_HOSTNAME, TS_EXTRA_ARGS.
DEFAULT_IMAGE = "docker.io/tailscale/tailscale:stable"
# RunPod's own default container disk.
DEFAULT_DISK_GB = 50
# A public TCP port is what tells a running container from one still being set up.
DEFAULT_PORTS: tuple[str, ...] = ("22/tcp",)
# Secure cloud is addressed by datacenter id (which maps to a region label); community cloud
# only by country code and unverified hosts, so tgp does not buy from it.
CLOUD = "SECURE"

_STATES = {
    "PROVISIONING": InstanceState.PENDING,
    "STARTING": InstanceState.PENDING,
    "RUNNING": InstanceState.RUNNING,
    "EXITED": InstanceState.STOPPED,
    "ERROR": InstanceState.FAILED,
    "TERMINATED": InstanceState.TERMINATED,
}
# Substrings of RunPod's capacity messages (v2 400 detail, v1 500 error, GraphQL errors[]).
_CAPACITY_TEXT = ("no longer any instances available", "no instances currently available", "does not have the resources")
# Env variables whose values are kept out of error messages.
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASS", re.IGNORECASE)
# The refusals of a create that `_create_refused` sorts (a 401 is worded by HttpAdapter).
_CREATE_ANSWERS = CLIENT_ERRORS - {401}
# Create-body fields that come from the offer, not the class: a 422 naming only these refuses
# this offer (RunPod's 422 `errors` read "$.<field>: <why>").
_OFFER_FIELDS = ("$.gpu", "$.dataCenterIds")
_OFFER_SEP = "|"


def offer_id(gpu_id: str, gpu_count: int, data_center_id: str) -> str:
    """The Offer id of `gpu_count` x `gpu_id` in `data_center_id`: everything `launch` needs,
    since RunPod places one GPU type in the datacenters it is given and never falls back."""
    return _OFFER_SEP.join((gpu_id, str(gpu_count), data_center_id))


def parse_offer_id(value: str) -> tuple[str, int, str]:
    """(gpu id, gpu count, datacenter id) of an `offer_id`; ConfigError when malformed."""
    parts = value.rsplit(_OFFER_SEP, 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[0] or not parts[2]:
        raise ConfigError(f"{value!r} is not a RunPod offer id (expected '<gpu id>|<count>|<datacenter id>')")
    return parts[0], int(parts[1]), parts[2]


class RunPodProvider(HttpAdapter):
    """CloudProvider over RunPod REST v2, secure cloud, on-demand pods.

    `gpu_counts` are the pod sizes offered (one catalog request each: RunPod scopes stock to a
    count). `secret_ref` names where the API key came from, for error messages. `sleep` is the
    seam for retry waits in tests. A client passed in is used as is and not closed here.
    """

    name = "runpod"
    system = SYSTEM
    quotable = QUOTABLE
    capabilities = ProviderCapabilities(
        machine="container",
        boot_payload="env",
        joins_as_node=False,
        spot=False,
        why_not_node=(
            "RunPod pods are Docker containers on a shared host (no systemd, no kernel modules, no nested "
            "containers), so they cannot run a kubelet; use RunPod only for workloads that phone home"
        ),
    )

    def __init__(
        self,
        api_key: SecretStr,
        *,
        base_url: str = DEFAULT_BASE_URL,
        client: httpx.AsyncClient | None = None,
        image: str = DEFAULT_IMAGE,
        disk_gb: int = DEFAULT_DISK_GB,
        ports: Sequence[str] = DEFAULT_PORTS,
        gpu_counts: Sequence[int] = (1,),
        secret_ref: str = "the RunPod API key Secret",
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        """Raises ConfigError for an empty key or a nonsensical pod size."""
        if not api_key.get_secret_value():
            raise ConfigError(f"the RunPod API key is empty: set it in {secret_ref}")
        if not gpu_counts or any(n < 1 for n in gpu_counts):
            raise ConfigError(f"RunPod gpu_counts must be positive integers, got {list(gpu_counts)}")
        fixes = Fixes(
            auth=f"put a valid RunPod API key (console.runpod.io > Settings > API Keys, read/write) in {secret_ref}",
            denied=f"the API key in {secret_ref} needs read/write access to pods",
        )
        super().__init__(fixes=fixes, base_url=base_url, api_key=api_key, client=client, sleep=sleep)
        self._image = image
        self._disk_gb = disk_gb
        self._ports = list(ports)
        self._gpu_counts = sorted(set(gpu_counts))
        self._secret_ref = secret_ref

    def __repr__(self) -> str:
        return f"RunPodProvider(base_url={self._base_url!r})"

    # --- the CloudProvider port -------------------------------------------------------

    async def list_offers(self) -> list[Offer]:
        """One Offer per (GPU type, pod size, datacenter) that RunPod reports in stock.

        Stock is a hint, not a reservation: a listed offer can still fail with CapacityError.
        """
        offers: list[Offer] = []
        for count in self._gpu_counts:
            params = {"include": "AVAILABILITY", "product": "POD", "cloud": CLOUD, "count": str(count)}
            response = await self._call("GET", "/catalog/gpus", params=params)
            for gpu in json_items(response, "gpus", system=SYSTEM):
                offers.extend(self._offers(gpu, count))
        return offers

    async def launch(self, offer: Offer, *, name: str, boot: BootPayload) -> Instance:
        """Create the pod `name` for `offer` with `boot`'s env. CapacityError when RunPod
        has no such machine free, OfferRefused when it refuses this offer otherwise;
        TransientError after a 5xx or timeout, when the pod may exist anyway (the caller
        finds it by name)."""
        gpu_id, count, data_center = parse_offer_id(offer.offer_id)
        env = _env_of(boot)
        body = {
            "name": name,
            "image": self._image,
            "gpu": {"id": gpu_id, "count": count},
            "cloud": CLOUD,
            "dataCenterIds": [data_center],
            "disk": self._disk_gb,
            "ports": self._ports,
            "env": env,
        }
        secrets = [v for k, v in env.items() if _SECRET_NAME.search(k)]
        response = await self._create("POST", "/pods", what=f"pod {name}", ok=_CREATE_ANSWERS, secrets=secrets, json=body)
        status = response.status_code
        if status < 300:
            instance = self._instance(json_object(response, system=SYSTEM))
            log.info("runpod.pod_created", pod_id=instance.instance_id, name=name, offer=offer.key)
            return instance
        raise self._create_refused(response, f"{count}x {gpu_id} in {data_center}", name, secrets)

    async def find_all_by_name(self, name: str) -> list[Instance]:
        """Every live pod called `name` (RunPod names are not unique)."""
        response = await self._call("GET", "/pods")
        pods = json_items(response, "pods", system=SYSTEM)
        return [self._instance(p) for p in pods if p.get("name") == name and p.get("status") != "TERMINATED"]

    async def find_by_name(self, name: str) -> Instance | None:
        """The live pod called `name`. Names are not unique on RunPod: terminated pods are
        skipped, and if several live pods share the name the running, newest one wins."""
        response = await self._call("GET", "/pods")
        pods = json_items(response, "pods", system=SYSTEM)
        live = [p for p in pods if p.get("name") == name and p.get("status") != "TERMINATED"]
        if not live:
            return None
        if len(live) > 1:
            log.warning("runpod.duplicate_pod_name", name=name, pod_ids=[p.get("id") for p in live])
        best = max(live, key=lambda p: (_has_public_port(p), str(p.get("createdAt") or "")))
        return self._instance(best)

    async def list_instances(self, prefix: str, names: Collection[str] | None = None) -> list[Instance]:
        """Every live pod whose name starts with `prefix` (with `names`, called one of them)."""
        pods = json_items(await self._call("GET", "/pods"), "pods", system=SYSTEM)
        return [self._instance(p) for p in pods if listed(str(p.get("name") or ""), prefix, names) and p.get("status") != "TERMINATED"]

    async def describe(self, instance_id: str) -> Instance | None:
        """The pod's state; None once RunPod no longer knows it (404)."""
        response = await self._call("GET", f"/pods/{quote(instance_id, safe='')}", ok=(404,))
        if self._gone(response):
            return None
        return self._instance(json_object(response, system=SYSTEM))

    async def terminate(self, instance_id: str) -> None:
        """Delete the pod (204); one already gone (404) counts as terminated."""
        response = await self._call("DELETE", f"/pods/{quote(instance_id, safe='')}", ok=(404, 409))
        if response.status_code == 409:
            raise ConfigError(
                f"RunPod will not delete pod {instance_id} (409: {self._answer(response)}); it belongs to a cluster, "
                "delete it in the RunPod console"
            )
        log.info("runpod.pod_terminated", pod_id=instance_id, already_gone=self._gone(response))

    # --- translation ------------------------------------------------------------------

    def _offers(self, gpu: dict[str, Any], count: int) -> list[Offer]:
        gpu_id = gpu.get("id")
        price = (gpu.get("price") or {}).get("secure")
        max_count = (gpu.get("maxCount") or {}).get("secure") or 0
        if not isinstance(gpu_id, str) or price is None or gpu.get("secure") is False:
            return []
        if gpu.get("availability") == "NONE" or count > int(max_count):
            return []
        # Catalog prices are USD per GPU-hour; an Offer's price is for the whole pod.
        hourly = Decimal(str(price)) * count
        gpu_type = normalize_gpu(gpu_id)
        return [
            Offer(
                provider=self.name,
                offer_id=offer_id(gpu_id, count, dc["id"]),
                gpu_type=gpu_type,
                gpu_count=count,
                region=normalize_region(dc["id"]),
                hourly_price=hourly,
                spot=False,
            )
            for dc in gpu.get("dataCenters") or []
            if isinstance(dc, dict) and isinstance(dc.get("id"), str) and dc.get("availability", "NONE") != "NONE"
        ]

    def _instance(self, pod: dict[str, Any]) -> Instance:
        status = str(pod.get("status") or "")
        state = _STATES.get(status, InstanceState.PENDING)
        if state is InstanceState.RUNNING and not _has_public_port(pod):
            state = InstanceState.PENDING  # RUNNING is reported before the container has ports
        gpu = pod.get("gpu") or {}
        cost = pod.get("cost")
        offer = ""
        if gpu.get("id") and pod.get("dataCenterId"):
            offer = offer_id(str(gpu["id"]), int(gpu.get("count") or 1), str(pod["dataCenterId"]))
        return Instance(
            provider=self.name,
            instance_id=str(pod["id"]),
            name=str(pod.get("name") or ""),
            state=state,
            offer_id=offer,
            hourly_price=Decimal(str(cost)) if cost else None,
            # tgp never stops pods, it terminates them: an EXITED pod was ended by the host.
            interrupted=status == "EXITED",
        )

    def _create_refused(self, response: httpx.Response, what: str, name: str, secrets: list[str]) -> TgpError:
        """The error for a create RunPod answered 4xx. Only a problem with what the class built
        is a ConfigError (it would fail on every offer); a refusal of this offer fails over."""
        # RunPod's detail sorts the refusal and is never quoted (it may echo the pod's env):
        # messages quote the problem's title and the JSON paths of the fields it names.
        status, said = response.status_code, _problem_text(response)
        message = self._scrub(_problem_summary(response), *secrets)
        if status == 400 and _is_capacity(said):
            return CapacityError(f"RunPod has no capacity for {what}: {message}")
        if status == 400:
            # No machine-readable code exists; RunPod's guidance is that a 400 means "try the next candidate".
            return OfferRefused(f"RunPod refused {what} (400): {message}")
        if status == 402:
            return PermissionDenied(
                f"RunPod refused to create pod {name}: insufficient balance (402: {message}); add funds or "
                "enable auto-pay on the RunPod account that owns the API key, then retry"
            )
        if status == 403:
            # No access to that pool: skip this candidate rather than stop the provider.
            return OfferRefused(
                f"RunPod denies this account {what} (403: {message}); if every offer says so, the API key in "
                f"{self._secret_ref} needs read/write access to pods"
            )
        if status == 422 and _only_offer_fields(response):
            return OfferRefused(f"RunPod refused {what} (422): {message}")
        return ConfigError(f"RunPod rejected the create of pod {name} ({status}): {message}")

    # --- requests ---------------------------------------------------------------------

    def _says_missing(self, response: httpx.Response) -> bool:
        """RunPod's own 404 is problem+json; without one it came from a wrong URL or a proxy."""
        return error_body(response).get("status") == 404


def _env_of(boot: BootPayload) -> dict[str, str]:
    """The pod env of an `env` boot payload (KEY=VALUE lines; blank lines and # comments skipped)."""
    if boot.kind != "env":
        raise ConfigError(f"RunPod pods take an `env` boot payload (KEY=VALUE lines), not {boot.kind!r}")
    env: dict[str, str] = {}
    for number, line in enumerate(boot.content.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            # The line may hold a secret: name it by number only.
            raise ConfigError(f"line {number} of the env boot payload is not KEY=VALUE")
        env[key.strip()] = value.strip()
    return env


def _has_public_port(pod: dict[str, Any]) -> bool:
    """A public port mapping exists: `ssh.direct` or a `runtime.ports` entry with a public port."""
    if (pod.get("ssh") or {}).get("direct"):
        return True
    ports = (pod.get("runtime") or {}).get("ports") or []
    return any(isinstance(p, dict) and p.get("public") for p in ports)


def _problem_errors(response: httpx.Response) -> list[str]:
    """The `errors` list of a problem+json body ("$.<field>: <why>" strings), if any."""
    try:
        body = response.json()
    except ValueError:
        return []
    errors = body.get("errors") if isinstance(body, dict) else None
    return [str(e) for e in errors] if isinstance(errors, list) else []


def _problem_text(response: httpx.Response) -> str:
    """`detail` plus the field `errors` (a 422's detail alone just says "validation failed"):
    RunPod's own words, for sorting an answer, never for quoting."""
    errors = _problem_errors(response)
    detail = error_detail(response) if not errors else str((response.json() or {}).get("detail") or "")
    return "; ".join(x for x in [detail, *errors] if x)


# The JSON path a problem+json `errors` entry starts with ("$.gpu.id: ..."): the field, not its value.
_FIELD_PATH = re.compile(r"\$(?:\.[A-Za-z_][A-Za-z0-9_]{0,40}|\[[0-9]{1,4}\]){1,8}")


def _problem_summary(response: httpx.Response) -> str:
    """What a message quotes of a problem+json answer: its title (a standard HTTP phrase, see
    `error_message`) and the JSON paths its `errors` name that are paths of the request tgp
    sent (`$.gpu.id`, `$.env`), never their text nor a path the request did not hold: an
    answer can put anything after `$.`, the API key included."""
    sent = _sent_paths(response.request)
    paths = [p for e in _problem_errors(response) if (m := _FIELD_PATH.match(e)) and (p := m.group(0)) in sent]
    fields = f" (fields {', '.join(dict.fromkeys(paths))})" if paths else ""
    return f"{error_message(response, QUOTABLE)}{fields}"[:200]


def _sent_paths(request: httpx.Request) -> set[str]:
    """The JSON paths of the request's body ($.a, $.a.b, $.a[0]) down to the fields tgp names:
    under `env` only `$.env` itself (its keys are the boot payload's, not RunPod's fields)."""
    try:
        body = json.loads(request.content or b"null")
    except ValueError:
        return set()
    paths: set[str] = set()

    def walk(value: object, path: str) -> None:
        paths.add(path)
        if path == "$.env":
            return
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")

    walk(body, "$")
    paths.discard("$")
    return paths


def _only_offer_fields(response: httpx.Response) -> bool:
    """True when a 422's `errors` all name fields that come from the offer (see _OFFER_FIELDS)."""
    errors = _problem_errors(response)
    return bool(errors) and all(e.startswith(_OFFER_FIELDS) for e in errors)


def _is_capacity(message: str) -> bool:
    text = message.lower()
    return any(phrase in text for phrase in _CAPACITY_TEXT)
