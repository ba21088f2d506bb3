"""The emulator against a real API server on hostile GPUNodePool and GPUNodeClass bodies (issue
19): each body gets the same verdict (HTTP status) from both, and a body both store is stored
the same (spec and labels, after defaulting and pruning), or the difference is listed in
KNOWN_DIFFERENCES with its reason.

Runs in the real-cluster lane (`make test-real-cluster`): it needs `kube_api` to be a real
cluster and starts an emulator beside it. On the emulator alone there is nothing to compare.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import pytest

from activities.http_wire import default_tls
from sim.kube import KubeEmulator
from tests.hostile import HOSTILE_KEYS, HOSTILE_VALUES
from tests.kube_env import KubeApi, load_crd

CRDS = Path(__file__).parent.parent / "deploy" / "crds"
POOLS = "/apis/tgp.io/v1/namespaces/{ns}/gpunodepools"
CLASSES = "/apis/tgp.io/v1/gpunodeclasses"

POOL: dict[str, Any] = {
    "apiVersion": "tgp.io/v1", "kind": "GPUNodePool", "metadata": {"name": "p"},
    "spec": {"nodeClassRef": {"name": "c"}, "template": {"metadata": {"labels": {}}, "spec": {"taints": []}}},
}
CLASS: dict[str, Any] = {
    "apiVersion": "tgp.io/v1", "kind": "GPUNodeClass", "metadata": {"name": "c"},
    "spec": {"providers": [{"name": "runpod", "credentialsRef": {"name": "s", "key": "k"}}]},
}
# Values of the wrong type or out of range for any field.
CONFUSED = [None, -1, 0, "x", "", {}, [], 10**20, True, 1.5, "PT10M", {"x": 1}, ["x"]]
# Bodies whose verdict or stored object differs on this control plane's version, and why.
KNOWN_DIFFERENCES: dict[str, str] = {}


def _set(body: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    body = copy.deepcopy(body)
    target = body
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    return body


def hostile_bodies() -> list[tuple[str, str, dict[str, Any]]]:
    """(id, kind, body): every hostile label key and value and taint key, value and effect on
    a pool, and every confused value in each top-level spec field of a pool and a class."""
    bodies: list[tuple[str, str, dict[str, Any]]] = []
    labels = ("spec", "template", "metadata", "labels")
    taints = ("spec", "template", "spec", "taints")
    for i, value in enumerate(HOSTILE_VALUES):
        bodies.append((f"label-value-{i}", "pool", _set(POOL, labels, {"example.com/k": value})))
        bodies.append((f"taint-value-{i}", "pool", _set(POOL, taints, [{"key": "k", "value": value, "effect": "NoSchedule"}])))
    for i, key in enumerate(HOSTILE_KEYS):
        bodies.append((f"label-key-{i}", "pool", _set(POOL, labels, {key: "v"})))
        bodies.append((f"taint-key-{i}", "pool", _set(POOL, taints, [{"key": key, "effect": "NoSchedule"}])))
    for i, effect in enumerate(["", "Bogus", "NoSchedule\nx", "noschedule", None]):
        bodies.append((f"taint-effect-{i}", "pool", _set(POOL, taints, [{"key": "k", "effect": effect}])))
    pool_fields = ["nodeClassRef", "template", "maxHourlyPrice", "weight", "minNodes", "maxNodes", "disruption"]
    class_fields = ["providers", "kubernetesVersion", "talosConfig", "bootstrapTemplate", "joinSecretRef",
                    "tailscaleConfig", "instanceRequirements", "limits"]
    for kind, base, fields in (("pool", POOL, pool_fields), ("class", CLASS, class_fields)):
        for field in fields:
            for j, value in enumerate(CONFUSED):
                bodies.append((f"{kind}-{field}-{j}", kind, _set(base, ("spec", field), value)))
    bodies.append(("pool-unknown-field", "pool", _set(POOL, ("spec", "surprise"), {"a": 1})))
    bodies.append(("class-provider-unknown", "class", _set(CLASS, ("spec", "providers"), [{"name": "evilcloud"}])))
    return bodies


def _outcome(response: httpx.Response) -> tuple[int, Any]:
    if response.status_code != 201:
        return response.status_code, None
    stored = response.json()
    return 201, {"spec": stored.get("spec"), "labels": stored["metadata"].get("labels")}


async def _submit(http: httpx.AsyncClient, kind: str, body: dict[str, Any], namespace: str, name: str) -> tuple[int, Any]:
    body = _set(body, ("metadata", "name"), name)
    url = POOLS.format(ns=namespace) if kind == "pool" else CLASSES
    response = await http.post(url, json=body)
    outcome = _outcome(response)
    if response.status_code == 201:
        await http.delete(f"{url}/{name}")
    return outcome


async def test_hostile_bodies_get_the_same_verdict_and_stored_object_on_the_emulator_and_a_real_server(
    kube_api: KubeApi,
) -> None:
    if not kube_api.real:
        pytest.skip("compares the emulator with a real API server: runs in `make test-real-cluster`")
    bodies = hostile_bodies()
    differences: dict[str, str] = {}
    async with KubeEmulator() as emulator, httpx.AsyncClient(verify=default_tls(), base_url=emulator.url, timeout=10.0) as fake:
        for path in sorted(CRDS.glob("*.yaml")):
            emulator.install_crd(load_crd(path))
        for index, (case, kind, body) in enumerate(bodies):
            name = f"tgp-test-hostile-{index}"
            real = await _submit(kube_api.http, kind, body, kube_api.namespace, name)
            emulated = await _submit(fake, kind, body, kube_api.namespace, name)
            if real != emulated:
                differences[case] = f"real {real!r} vs emulator {emulated!r}"
    unexplained = {case: why for case, why in differences.items() if case not in KNOWN_DIFFERENCES}
    assert not unexplained, f"{len(unexplained)} of {len(bodies)} bodies differ: {unexplained}"
    assert len(bodies) > 250
