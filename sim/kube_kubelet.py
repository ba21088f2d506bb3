"""The simulated kubelet: what the kubelet on one of tgp's GPU instances does, over plain HTTP,
so it works the same against the emulator (`sim.kube`) and a real API server.

* `register_node` and `set_node_ready`: register a Node (with the pool's labels and taints in
  the same create, as `--node-labels` and `registerWithTaints` do) and report its status
  (Ready and pressure conditions, addresses, capacity and allocatable including
  `nvidia.com/gpu`).
* `SimKubelet.run`: a machine's kubelet for as long as the machine lives. It registers, then
  keeps the Node alive the two ways a real kubelet does: it renews its Lease in
  `kube-node-lease` every LEASE_RENEW_INTERVAL and posts Node status every STATUS_INTERVAL (a
  real node lifecycle controller marks a Node whose Lease lapses NotReady after ~40 s, and
  taints it unreachable). It runs the pods bound to it: a pod starts Running, completes
  (`Succeeded`) `tgp.io/sim-run-seconds` after it started when annotated, and a pod being
  deleted stops at the end of its grace period (sooner with `tgp.io/sim-stop-seconds`), when
  the kubelet deletes it for good, as a real kubelet confirms a graceful deletion.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import structlog

from activities.http import send
from activities.http_errors import error_message
from activities.http_wire import new_client
from sim.kube_machinery import MERGE_PATCH, Obj, now_time
from tgp.errors import TransientError
from tgp.types import GPU_RESOURCE

log = structlog.get_logger("sim.kubelet")

RUN_SECONDS_ANNOTATION = "tgp.io/sim-run-seconds"
STOP_SECONDS_ANNOTATION = "tgp.io/sim-stop-seconds"
LEASE_NAMESPACE = "kube-node-lease"
# The kubelet's defaults: a 40 s Lease renewed every quarter of it (10 s).
LEASE_DURATION_SECONDS = 40
LEASE_RENEW_INTERVAL = 10.0
# A real kubelet posts status when it changes and at least every 5 minutes
# (nodeStatusReportFrequency); a minute keeps lastHeartbeatTime fresh for anyone who reads it.
STATUS_INTERVAL = 60.0
# The stand-in looks at its pods when its watch of them reports a change, when a pod's run or
# shutdown is due, and at least this often (a real kubelet also resyncs now and then). Between
# passes it holds one watch open: a kubelet at rest costs the API server almost nothing.
POD_SYNC_INTERVAL = 10.0

# What a kubelet on one of tgp's GPU instances reports; the numbers only need to look plausible.
_KUBELET_CAPACITY = {"cpu": "16", "memory": "128Gi", "pods": "110", "ephemeral-storage": "500Gi"}
_PRESSURE_CONDITIONS = ("MemoryPressure", "DiskPressure", "PIDPressure")
_KUBELET_SYSTEM = "Kubernetes API (simulated kubelet)"
# Read-modify-write attempts when another writer (the node controller) changes the Node.
_KUBELET_CONFLICT_ATTEMPTS = 5
# The API answers a kubelet's call in milliseconds; 10 s catches a hung server without stalling
# the simulated cloud for long.
_KUBELET_TIMEOUT = httpx.Timeout(10.0)


async def register_node(
    api_url: str,
    name: str,
    *,
    labels: dict[str, str] | None = None,
    taints: Sequence[Mapping[str, str]] = (),
    ready: bool = True,
    gpus: int = 1,
    client: httpx.AsyncClient | None = None,
) -> None:
    """Register Node `name` the way a kubelet does: create it with its labels and taints (the
    kubelet's `--node-labels` and `registerWithTaints`, in the same create: a Node without its
    taints, even for a moment, can receive any pod), then report its status (Ready condition,
    addresses, capacity including `nvidia.com/gpu`).

    A Node that already exists is adopted, as a restarted kubelet does. Pass `client` (with
    credentials and TLS settings) to talk to a real API server; `api_url` is its base URL.
    """
    async with _kubelet_client(client) as http:
        base = api_url.rstrip("/")
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    **(labels or {}),
                },
            },
            "spec": {"taints": [dict(t) for t in taints]} if taints else {},
        }
        response = await send(http, "POST", f"{base}/api/v1/nodes", system=_KUBELET_SYSTEM, ok=(409,), json=node)
        _raise_unexpected(response, f"register Node {name}")
        capacity = {**_KUBELET_CAPACITY, GPU_RESOURCE: str(gpus)}
        now = now_time()
        status = {
            "conditions": [_condition(kind, False, now) for kind in _PRESSURE_CONDITIONS]
            + [_condition("Ready", ready, now)],
            "addresses": [
                {"type": "InternalIP", "address": _tailnet_address(name)},
                {"type": "Hostname", "address": name},
            ],
            "capacity": capacity,
            "allocatable": capacity,
            "nodeInfo": {
                "kubeletVersion": "v1.31.0",
                "containerRuntimeVersion": "containerd://1.7.0",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "osImage": "tgp simulated node",
                "kernelVersion": "6.8.0",
                "kubeProxyVersion": "",
                "machineID": hashlib.sha256(name.encode()).hexdigest()[:32],
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, name)),
                "bootID": str(uuid.uuid4()),
            },
        }
        response = await send(
            http, "PATCH", f"{base}/api/v1/nodes/{name}/status", system=_KUBELET_SYSTEM,
            json={"status": status}, headers={"Content-Type": MERGE_PATCH},
        )
        _raise_unexpected(response, f"report the status of Node {name}")


async def set_node_ready(api_url: str, name: str, ready: bool, *, client: httpx.AsyncClient | None = None) -> None:
    """Report Node `name` Ready (or NotReady) as its kubelet would, keeping other conditions."""
    async with _kubelet_client(client) as http:
        url = f"{api_url.rstrip('/')}/api/v1/nodes/{name}"
        for _ in range(_KUBELET_CONFLICT_ATTEMPTS):
            response = await send(http, "GET", url, system=_KUBELET_SYSTEM)
            _raise_unexpected(response, f"read Node {name}")
            node = response.json()
            now = now_time()
            conditions = [c for c in node.get("status", {}).get("conditions") or [] if c.get("type") != "Ready"]
            previous = next((c for c in node.get("status", {}).get("conditions") or [] if c.get("type") == "Ready"), None)
            ready_condition = _condition("Ready", ready, now)
            if previous is not None and previous.get("status") == ready_condition["status"]:
                ready_condition["lastTransitionTime"] = previous.get("lastTransitionTime", now)
            patch = {
                "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                "status": {"conditions": [*conditions, ready_condition]},
            }
            response = await send(
                http, "PATCH", f"{url}/status", system=_KUBELET_SYSTEM, ok=(409,),
                json=patch, headers={"Content-Type": MERGE_PATCH},
            )
            if response.status_code != 409:
                _raise_unexpected(response, f"report the readiness of Node {name}")
                return
        raise RuntimeError(f"Node {name} kept changing while its readiness was reported")


@contextlib.asynccontextmanager
async def _kubelet_client(client: httpx.AsyncClient | None) -> AsyncIterator[httpx.AsyncClient]:
    """The caller's client, or a short-lived one without credentials (for the emulator)."""
    if client is not None:
        yield client
        return
    # tgp's own client (aiohttp under httpx, one shared TLS context): the simulated world's
    # kubelets share a machine with tgp in `make bench`, and httpx's own transport made them
    # the busiest of its processes after the API.
    async with new_client(timeout=_KUBELET_TIMEOUT) as owned:
        yield owned


def _raise_unexpected(response: httpx.Response, what: str) -> None:
    if response.status_code >= 400 and response.status_code != 409:
        raise RuntimeError(f"could not {what}: {response.status_code} {error_message(response)}")


def _condition(kind: str, true: bool, now: str) -> Obj:
    reasons = {
        ("Ready", True): ("KubeletReady", "kubelet is posting ready status"),
        ("Ready", False): ("KubeletNotReady", "container runtime network not ready"),
    }
    reason, message = reasons.get((kind, true), (f"KubeletHasNo{kind}" if not true else f"KubeletHas{kind}", ""))
    return {
        "type": kind,
        "status": "True" if true else "False",
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


def _tailnet_address(name: str) -> str:
    """A stable address in Tailscale's 100.64.0.0/10 range, derived from the node name."""
    digest = hashlib.sha256(name.encode()).digest()
    return f"100.{64 + digest[0] % 64}.{digest[1]}.{1 + digest[2] % 254}"


class NodeGone(Exception):
    """The kubelet's Node was deleted."""


class SimKubelet:
    """The kubelet of one simulated machine: `await SimKubelet(...).run()` registers the Node
    and keeps it alive and its pods running until cancelled (the machine is gone: heartbeats
    stop, and the cluster's node lifecycle controller notices, as with a real machine).

    Pass `client` (credentials, TLS) for a real API server; `api_url` is its base URL. The
    intervals are the kubelet's defaults; tests may shorten them.
    """

    def __init__(
        self,
        api_url: str,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        gpus: int = 1,
        client: httpx.AsyncClient | None = None,
        lease_renew_interval: float = LEASE_RENEW_INTERVAL,
        status_interval: float = STATUS_INTERVAL,
        pod_sync_interval: float = POD_SYNC_INTERVAL,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        self.name = name
        self.labels = dict(labels or {})
        self.taints = [dict(t) for t in taints]
        self.gpus = gpus
        self.lease_renew_interval = lease_renew_interval
        self.status_interval = status_interval
        self.pod_sync_interval = pod_sync_interval
        self._client = client
        self._ready_since = now_time()
        self.passes = 0  # pod sync passes so far (tests wait on it, not on the clock)
        # A hung kubelet (or a machine cut off from the cluster) while its instance runs: no
        # status and no Lease. A test then marks the Node NotReady, as the cluster's
        # node lifecycle controller would after its grace (the emulator has none).
        self.silent = False
        self._deletions_seen: dict[str, datetime] = {}  # pod uid -> when its deletion was first seen
        self.registrations = 0  # times its Node was deleted while it ran, and registered again

    async def run(self) -> None:
        """Register, then heartbeat and run pods until cancelled (the machine is gone). A Node
        deleted while the machine runs is registered again, as a kubelet does once its status
        updates find no Node (kubernetes/kubernetes#123535): deleting the object alone does not
        take the machine out of the cluster."""
        async with _kubelet_client(self._client) as http:
            while True:
                await self._registered(http)
                self.registrations += 1
                log.info("sim_kubelet_node_deleted_registering_again", node=self.name)

    async def _registered(self, http: httpx.AsyncClient) -> None:
        """Register, then keep the Node alive and run its pods until the Node is deleted."""
        await register_node(self.api_url, self.name, labels=self.labels, taints=self.taints, gpus=self.gpus, client=http)
        self._ready_since = now_time()
        try:
            uid = await self._node_uid(http)
            loops = (
                self._every(self.lease_renew_interval, lambda: self._renew_lease(http, uid)),
                self._every(self.status_interval, lambda: self._post_status(http)),
                self._pods(http),
            )
            async with asyncio.TaskGroup() as group:
                for loop in loops:
                    group.create_task(loop)
        except* NodeGone:
            pass

    async def _every(self, interval: float, step: Any) -> None:
        while True:
            try:
                if not self.silent:
                    await step()
            except NodeGone:
                raise
            except (httpx.HTTPError, TransientError, RuntimeError, ValueError, KeyError) as exc:
                # The API server restarting or a test's injected fault: the next beat retries.
                log.info("sim_kubelet_step_failed", node=self.name, error=str(exc)[:200])
            await asyncio.sleep(interval)

    async def _node_uid(self, http: httpx.AsyncClient) -> str:
        response = await send(http, "GET", f"{self.api_url}/api/v1/nodes/{self.name}", system=_KUBELET_SYSTEM, ok=(404,))
        if response.status_code == 404:
            raise NodeGone(self.name)
        _raise_unexpected(response, f"read Node {self.name}")
        return str(response.json()["metadata"]["uid"])

    async def _renew_lease(self, http: httpx.AsyncClient, node_uid: str) -> None:
        """Create or renew the Node's Lease, owned by the Node so that the garbage collector
        removes it with the Node."""
        base = f"{self.api_url}/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases"
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_DURATION_SECONDS, "renewTime": _micro_time()}
        response = await send(http, "PATCH", f"{base}/{self.name}", system=_KUBELET_SYSTEM, ok=(404,),
                              json={"spec": spec}, headers={"Content-Type": MERGE_PATCH})
        if response.status_code != 404:
            _raise_unexpected(response, f"renew the Lease of Node {self.name}")
            return
        await self._node_uid(http)  # NodeGone: no Lease for a deleted Node
        lease = {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": self.name, "namespace": LEASE_NAMESPACE, "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": node_uid},
            ]},
            "spec": spec,
        }
        response = await send(http, "POST", base, system=_KUBELET_SYSTEM, ok=(409,), json=lease)
        _raise_unexpected(response, f"create the Lease of Node {self.name}")

    async def _post_status(self, http: httpx.AsyncClient) -> None:
        now = now_time()
        conditions = [_condition(kind, False, now) for kind in _PRESSURE_CONDITIONS] + [_condition("Ready", True, now)]
        for condition in conditions:
            condition["lastTransitionTime"] = self._ready_since
        capacity = {**_KUBELET_CAPACITY, GPU_RESOURCE: str(self.gpus)}
        response = await send(
            http, "PATCH", f"{self.api_url}/api/v1/nodes/{self.name}/status", system=_KUBELET_SYSTEM, ok=(404,),
            json={"status": {"conditions": conditions, "capacity": capacity, "allocatable": capacity}},
            headers={"Content-Type": MERGE_PATCH},
        )
        if response.status_code == 404:
            raise NodeGone(self.name)
        _raise_unexpected(response, f"report the status of Node {self.name}")

    async def _pods(self, http: httpx.AsyncClient) -> None:
        """Sync the pods, then wait for a change (a watch), the next due run or shutdown, or
        the resync interval, whichever comes first; again."""
        while True:
            version, wait = None, self.pod_sync_interval
            try:
                version, due = await self.sync_pods(http)
                wait = min(wait, max(due, 0.0)) if due is not None else wait
            except (httpx.HTTPError, TransientError, RuntimeError, ValueError, KeyError) as exc:
                log.info("sim_kubelet_step_failed", node=self.name, error=str(exc)[:200])
            if version is None or wait <= 0:
                await asyncio.sleep(max(wait, 0.05) if version is None else 0)
                continue
            await self._pod_change(http, version, wait)

    async def _pod_change(self, http: httpx.AsyncClient, version: str, timeout: float) -> None:
        """Return at the first change to this Node's pods after `version`, or after `timeout`."""
        params = {"watch": "true", "resourceVersion": version, "fieldSelector": f"spec.nodeName={self.name}",
                  "timeoutSeconds": str(max(1, int(timeout + 0.999)))}
        with contextlib.suppress(TimeoutError, httpx.HTTPError):
            async with asyncio.timeout(timeout):
                async with http.stream("GET", f"{self.api_url}/api/v1/pods", params=params,
                                       timeout=httpx.Timeout(10.0, read=timeout + 10.0)) as stream:
                    if stream.status_code != 200:
                        await asyncio.sleep(min(timeout, 1.0))  # 410 Gone and the like: resync
                        return
                    async for line in stream.aiter_lines():
                        if line.strip():
                            return

    async def sync_pods(self, http: httpx.AsyncClient) -> tuple[str, float | None]:
        """One pass over the pods bound to this Node: start, complete and finish deleting.
        Returns the list's resourceVersion and the seconds until the next pod is due (None:
        nothing is)."""
        response = await send(http, "GET", f"{self.api_url}/api/v1/pods", system=_KUBELET_SYSTEM,
                              params={"fieldSelector": f"spec.nodeName={self.name}"})
        _raise_unexpected(response, f"list the pods of Node {self.name}")
        listing = response.json()
        now = datetime.now(UTC)
        pods = [p for p in listing.get("items") or [] if (p.get("spec") or {}).get("nodeName") == self.name]
        dues = [await self._sync_pod(http, pod, now) for pod in pods]
        listed = {p["metadata"]["uid"] for p in pods}
        self._deletions_seen = {uid: at for uid, at in self._deletions_seen.items() if uid in listed}
        self.passes += 1
        pending = [(d - now).total_seconds() for d in dues if d is not None]
        return str((listing.get("metadata") or {}).get("resourceVersion") or ""), min(pending, default=None)

    async def _sync_pod(self, http: httpx.AsyncClient, pod: Obj, now: datetime) -> datetime | None:
        """Act on one pod; when it is next due (its run ends, its shutdown is over), if ever."""
        meta, status = pod["metadata"], pod.get("status") or {}
        path = f"{self.api_url}/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        annotations = meta.get("annotations") or {}
        if meta.get("deletionTimestamp"):
            # The containers get the whole grace period from when the kubelet sees the deletion
            # (the deletionTimestamp, in whole seconds, may read up to a second early).
            seen = self._deletions_seen.setdefault(meta["uid"], now)
            stopped = seen + _stop_after(meta, annotations)
            if now < stopped:
                return stopped
            # The containers stopped: confirm the deletion, as the kubelet's status manager does.
            response = await send(http, "DELETE", path, system=_KUBELET_SYSTEM, ok=(404, 409),
                                  json={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
            _raise_unexpected(response, f"delete pod {meta['name']}")
            log.info("sim_kubelet_pod_stopped", node=self.name, pod=f"{meta['namespace']}/{meta['name']}")
            return None
        phase = status.get("phase") or "Pending"
        if phase == "Pending":
            started = _time(now)
            new = {
                "phase": "Running", "startTime": started,
                "conditions": [
                    {"type": kind, "status": "True", "lastTransitionTime": started}
                    for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
                ],
                "containerStatuses": [
                    {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": True, "restartCount": 0,
                     "started": True, "state": {"running": {"startedAt": started}}}
                    for c in (pod.get("spec") or {}).get("containers") or []
                ],
            }
            await self._patch_status(http, path, new)
            log.info("sim_kubelet_pod_started", node=self.name, pod=f"{meta['namespace']}/{meta['name']}")
            return None  # its own status write wakes the next pass
        seconds = _seconds(annotations.get(RUN_SECONDS_ANNOTATION))
        started_at = _parse_time(status.get("startTime"))
        if phase != "Running" or seconds is None or started_at is None:
            return None
        ends = datetime.fromtimestamp(started_at + seconds, UTC)
        if now < ends:
            return ends
        done = _time(now)
        finished = {
            "phase": "Succeeded",
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": done},
                {"type": "Initialized", "status": "True", "lastTransitionTime": done},
                {"type": "ContainersReady", "status": "False", "reason": "PodCompleted", "lastTransitionTime": done},
                {"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": done},
            ],
            "containerStatuses": [
                {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False, "restartCount": 0,
                 "started": False, "state": {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": done}}}
                for c in (pod.get("spec") or {}).get("containers") or []
            ],
        }
        await self._patch_status(http, path, finished)
        log.info("sim_kubelet_pod_completed", node=self.name, pod=f"{meta['namespace']}/{meta['name']}")
        return None

    async def _patch_status(self, http: httpx.AsyncClient, path: str, status: Obj) -> None:
        response = await send(http, "PATCH", f"{path}/status", system=_KUBELET_SYSTEM, ok=(404,),
                              json={"status": status}, headers={"Content-Type": MERGE_PATCH})
        _raise_unexpected(response, f"report the status of pod {path.rsplit('/', 1)[-1]}")


def _stop_after(meta: Obj, annotations: Mapping[str, str]) -> timedelta:
    """How long a deleted pod's containers take to stop: its whole grace period (a container
    that ignores SIGTERM), or `tgp.io/sim-stop-seconds` if that is sooner."""
    grace = float(meta.get("deletionGracePeriodSeconds") or 0)
    stop = _seconds(annotations.get(STOP_SECONDS_ANNOTATION))
    return timedelta(seconds=grace if stop is None else min(grace, stop))


def _seconds(value: object) -> float | None:
    try:
        return float(str(value)) if value is not None else None
    except ValueError:
        return None


def _parse_time(value: object) -> float | None:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp() if value else None
    except ValueError:
        return None


def _time(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_time() -> str:
    """metav1.MicroTime, as a Lease's renewTime is written."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# What the shipped boot templates tell the kubelet (activities/boot/templates): the labels as a
# JSON mapping (Talos `nodeLabels`) or `--node-labels=k=v,...` (cloud-init), and the taints as a
# JSON list (`registerWithTaints`). Each sits on one line; values in Kubernetes label syntax.
_NODE_LABELS_JSON = re.compile(r"^\s*nodeLabels:\s*(\{.*\})\s*$", re.MULTILINE)
_NODE_LABELS_FLAG = re.compile(r"--node-labels=([^\s\"']+)")
_REGISTER_WITH_TAINTS = re.compile(r"^\s*registerWithTaints:\s*(\[.*\])\s*$", re.MULTILINE)
_REGISTER_WITH_TAINTS_FLAG = re.compile(r"--register-with-taints=([^\s\"']+)")


def kubelet_registration(user_data: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The labels and taints a machine's kubelet registers with, read from its boot payload as
    the kubelet reads its configuration: a Talos config, cloud-init's kubelet flags, or the `env`
    payload's KUBELET_EXTRA_ARGS."""
    labels: dict[str, str] = {}
    taints: list[dict[str, str]] = []
    with contextlib.suppress(ValueError):
        if match := _NODE_LABELS_JSON.search(user_data):
            labels = {str(k): str(v) for k, v in json.loads(match.group(1)).items()}
        elif match := _NODE_LABELS_FLAG.search(user_data):
            labels = dict(pair.split("=", 1) for pair in match.group(1).split(",") if "=" in pair)
    with contextlib.suppress(ValueError, AttributeError):
        if match := _REGISTER_WITH_TAINTS.search(user_data):
            taints = [{str(k): str(v) for k, v in t.items() if v is not None} for t in json.loads(match.group(1))]
        elif match := _REGISTER_WITH_TAINTS_FLAG.search(user_data):  # key=value:Effect,...
            for item in match.group(1).split(","):
                key_value, effect = item.rsplit(":", 1)
                key, _, value = key_value.partition("=")
                taints.append({"key": key, "effect": effect, **({"value": value} if value else {})})
    return labels, taints
