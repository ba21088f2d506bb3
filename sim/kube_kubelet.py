"""The simulated kubelet: `register_node` and `set_node_ready` register a Node and report its
status (Ready and pressure conditions, addresses, capacity including `nvidia.com/gpu`) as the
kubelet on one of tgp's GPU instances would, for a simulated cloud. They use plain HTTP, so they
work the same against the emulator (`sim.kube`) and a real API server.
"""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterator

import httpx

from activities.http import error_message, send
from sim.kube_machinery import MERGE_PATCH, Obj, now_time
from tgp.types import GPU_RESOURCE

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
    ready: bool = True,
    gpus: int = 1,
    client: httpx.AsyncClient | None = None,
) -> None:
    """Register Node `name` the way a kubelet does: create it, then report its status (Ready
    condition, addresses, capacity including `nvidia.com/gpu`).

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
            "spec": {},
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
    async with httpx.AsyncClient(timeout=_KUBELET_TIMEOUT) as owned:
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
