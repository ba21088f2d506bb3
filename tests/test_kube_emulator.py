"""The API-server behaviours a CRD bridge relies on: CustomResourceDefinitions (schema pruning,
defaulting and validation, the status subresource, finalizers), watches (resume from a
resourceVersion, 410 Gone, timeoutSeconds, selectors, cut connections) and Events.

Each test speaks HTTP (httpx, or `kubernetes.aio` for watches) to `kube_api`: the emulator, or a
real cluster when TGP_TEST_KUBECONFIG is set. Expected values come from the API-server contract
in docs/reference/kubernetes-testing.md and the Kubernetes API conventions, not from the
emulator. Knobs a real cluster cannot be made to turn on demand (compaction, cut connections, the
history window) run on the emulator only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import httpx
import pytest
from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config
from kubernetes.aio import watch as k8s_watch
from activities.http_wire import default_tls
from tests.kube_env import KUBECONFIG_ENV, KubeApi

from workers import crdgen
from tgp.crds import DEFAULT_CLASS_MAX_NODES, GPUNodePoolSpec
from sim.kube import KubeEmulator

MERGE = {"Content-Type": "application/merge-patch+json"}
# A client-side bound for reading a stream that should have produced its events long before.
STREAM_READ_TIMEOUT = 10.0

Obj = dict[str, Any]


@pytest.fixture(autouse=True)
def no_server_errors(kube_api: KubeApi) -> Iterator[None]:
    """An emulator request that failed inside (a 500) would otherwise go unnoticed."""
    yield
    if kube_api.emulator is not None:
        assert kube_api.emulator.errors == []


def gpu_pool_crd(group: str, *, scope: str = "Namespaced", plural: str = "gpupools", kind: str = "GpuPool") -> Obj:
    """A CRD shaped like tgp's: a structural schema with defaults, bounds, enums, maps,
    int-or-string, a preserve-unknown-fields island and a status subresource."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": scope,
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
            "versions": [{
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": {
                            "type": "object",
                            "required": ["gpu"],
                            "properties": {
                                "gpu": {"type": "string", "enum": ["a100", "h100", "l4"]},
                                "weight": {"type": "integer", "minimum": 0, "maximum": 100, "default": 10},
                                "pool": {"type": "string", "pattern": "^[a-z][a-z0-9-]*$", "maxLength": 30},
                                "maxNodes": {"x-kubernetes-int-or-string": True},
                                "zones": {"type": "array", "maxItems": 3, "items": {"type": "string"}},
                                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                "provider": {
                                    "type": "object",
                                    "default": {},
                                    "properties": {"name": {"type": "string", "default": "sim"}},
                                },
                                "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                "note": {"type": "string", "nullable": True},
                            },
                        },
                        "status": {
                            "type": "object",
                            "properties": {
                                "phase": {"type": "string"},
                                "observedGeneration": {"type": "integer"},
                            },
                        },
                    },
                }},
            }],
        },
    }


def pool(name: str, group: str, spec: Obj | None = None, **extra: Any) -> Obj:
    return {
        "apiVersion": f"{group}/v1", "kind": "GpuPool", "metadata": {"name": name},
        "spec": {"gpu": "a100"} if spec is None else spec, **extra,
    }


@contextlib.asynccontextmanager
async def installed_crd(kube_api: KubeApi, crd: Obj) -> AsyncIterator[Obj]:
    """POST the CRD, wait until it is Established and served, delete it afterwards."""
    response = await kube_api.http.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd)
    assert response.status_code == 201, response.text
    name = crd["metadata"]["name"]
    group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]

    async def served() -> bool:
        stored = await kube_api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        conditions = {c["type"]: c["status"] for c in (stored or {}).get("status", {}).get("conditions") or []}
        listing = await kube_api.http.get(f"/apis/{group}/v1/{plural}")
        return conditions.get("Established") == "True" and listing.status_code == 200

    await kube_api.eventually(served)
    try:
        yield response.json()
    finally:
        await kube_api.http.delete(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")


def unique_group() -> str:
    return f"t{secrets.token_hex(3)}.tgp-test.dev"


@contextlib.asynccontextmanager
async def official_client(kube_api: KubeApi) -> AsyncIterator[k8s.ApiClient]:
    """`kubernetes.aio` pointed at the same API server as `kube_api`."""
    configuration = k8s.Configuration(host=kube_api.url)
    if kube_api.real:
        configuration = k8s.Configuration()
        await k8s_config.load_kube_config(
            config_file=os.environ[KUBECONFIG_ENV], client_configuration=configuration, persist_config=False,
        )
    async with k8s.ApiClient(configuration) as api:
        yield api


class WatchReader:
    """Watch events from a streaming response, read a few at a time."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()

    async def read(self, count: int) -> list[Obj]:
        events: list[Obj] = []
        async with asyncio.timeout(STREAM_READ_TIMEOUT):
            while len(events) < count:
                line = await anext(self._lines)
                if line.strip():
                    events.append(json.loads(line))
        return events


async def read_events(response: httpx.Response, count: int) -> list[Obj]:
    return await WatchReader(response).read(count)


# --- CustomResourceDefinitions ------------------------------------------------------------


async def test_crd_serves_a_namespaced_custom_resource(kube_api: KubeApi) -> None:
    group = unique_group()
    async with installed_crd(kube_api, gpu_pool_crd(group)):
        discovery = await kube_api.get(f"/apis/{group}/v1")
        assert discovery is not None
        [resource] = [r for r in discovery["resources"] if r["name"] == "gpupools"]
        assert resource["kind"] == "GpuPool" and resource["namespaced"] is True
        assert any(r["name"] == "gpupools/status" for r in discovery["resources"])

        base = f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpupools"
        created = await kube_api.create(base, pool("rtx", group))
        meta = created["metadata"]
        assert meta["namespace"] == kube_api.namespace and meta["generation"] == 1
        assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]

        fetched = await kube_api.get(f"{base}/rtx")
        assert fetched == created
        listing = await kube_api.get(base)
        assert listing is not None
        assert listing["kind"] == "GpuPoolList" and listing["metadata"]["resourceVersion"]
        assert [item["metadata"]["name"] for item in listing["items"]] == ["rtx"]

        patched = await kube_api.merge_patch(f"{base}/rtx", {"spec": {"weight": 50}})
        assert patched.status_code == 200, patched.text
        assert patched.json()["spec"]["weight"] == 50
        assert int(patched.json()["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])

        missing = await kube_api.http.get(f"{base}/absent")
        assert missing.status_code == 404 and missing.json()["reason"] == "NotFound"


async def test_crd_serves_a_cluster_scoped_custom_resource(kube_api: KubeApi) -> None:
    group = unique_group()
    crd = gpu_pool_crd(group, scope="Cluster", plural="gpuclasses", kind="GpuClass")
    async with installed_crd(kube_api, crd):
        base = f"/apis/{group}/v1/gpuclasses"
        name = f"class-{secrets.token_hex(3)}"
        created = await kube_api.create(base, {**pool(name, group), "kind": "GpuClass"})
        assert "namespace" not in created["metadata"]
        assert (await kube_api.get(f"{base}/{name}")) == created
        listing = await kube_api.get(base)
        assert listing is not None and [i["metadata"]["name"] for i in listing["items"]] == [name]
        patched = await kube_api.merge_patch(f"{base}/{name}", {"metadata": {"labels": {"tier": "gold"}}})
        assert patched.status_code == 200 and patched.json()["metadata"]["labels"] == {"tier": "gold"}
        # A cluster-scoped resource has no namespaced path.
        namespaced = await kube_api.http.get(f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpuclasses")
        assert namespaced.status_code == 404


async def test_custom_resource_without_its_crd_is_not_found(kube_api: KubeApi) -> None:
    response = await kube_api.http.get(f"/apis/{unique_group()}/v1/namespaces/{kube_api.namespace}/gpupools")
    assert response.status_code == 404


async def test_schema_violation_is_422_naming_the_field(kube_api: KubeApi) -> None:
    group = unique_group()
    async with installed_crd(kube_api, gpu_pool_crd(group)):
        base = f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpupools"
        response = await kube_api.http.post(base, json=pool("heavy", group, {"gpu": "a100", "weight": 200}))
        assert response.status_code == 422
        status = response.json()
        assert status["kind"] == "Status" and status["reason"] == "Invalid"
        assert "spec.weight: Invalid value: 200: spec.weight in body should be less than or equal to 100" in status["message"]
        causes = status["details"]["causes"]
        assert {"field": "spec.weight", "reason": "FieldValueInvalid"}.items() <= causes[0].items()

        response = await kube_api.http.post(base, json=pool("odd", group, {"gpu": "tpu", "pool": "Bad_Name"}))
        assert response.status_code == 422
        fields = {c["field"] for c in response.json()["details"]["causes"]}
        assert fields == {"spec.gpu", "spec.pool"}
        assert 'spec.gpu: Unsupported value: "tpu"' in response.json()["message"]

        response = await kube_api.http.post(base, json=pool("bare", group, {"weight": 5}))
        assert response.status_code == 422
        assert "spec.gpu: Required value" in response.json()["message"]

        response = await kube_api.http.post(base, json=pool("typed", group, {"gpu": "a100", "weight": "many"}))
        assert response.status_code == 422
        assert response.json()["details"]["causes"][0]["field"] == "spec.weight"

        await kube_api.create(base, pool("fine", group))
        response = await kube_api.merge_patch(f"{base}/fine", {"spec": {"zones": ["a", "b", "c", "d"]}})
        assert response.status_code == 422
        assert response.json()["details"]["causes"][0]["field"] == "spec.zones"
        fine = await kube_api.get(f"{base}/fine")
        assert fine is not None and "zones" not in fine["spec"]  # nothing was written


async def test_a_pattern_takes_no_trailing_newline(kube_api: KubeApi) -> None:
    """The API server's patterns are Go RE2: `$` is the end of the text. (Python's `$` also
    matches before a final newline, which let "abc\n" past `^[a-z]+$` in the emulator.)"""
    group = unique_group()
    async with installed_crd(kube_api, gpu_pool_crd(group)):
        base = f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpupools"
        for bad in ("abc\n", "abc\nExecStartPre=/bin/sh"):
            response = await kube_api.http.post(base, json=pool("nl", group, {"gpu": "a100", "pool": bad}))
            assert response.status_code == 422, response.text
            assert response.json()["details"]["causes"][0]["field"] == "spec.pool"
        await kube_api.create(base, pool("plain", group, {"gpu": "a100", "pool": "abc"}))


async def test_defaults_applied_and_unknown_fields_pruned(kube_api: KubeApi) -> None:
    group = unique_group()
    async with installed_crd(kube_api, gpu_pool_crd(group)):
        base = f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpupools"
        spec = {
            "gpu": "h100", "weight": None, "maxNodes": "50%", "labels": {"team": "ml"},
            "typo": "dropped", "extra": {"anything": {"goes": 1}}, "note": None,
        }
        created = await kube_api.create(base, pool("shaped", group, spec, unknownTopLevel=True))
        assert created["spec"]["weight"] == 10  # a non-nullable null takes the default
        assert created["spec"]["provider"] == {"name": "sim"}  # defaults inside a defaulted object
        assert created["spec"]["maxNodes"] == "50%" and created["spec"]["labels"] == {"team": "ml"}
        assert created["spec"]["extra"] == {"anything": {"goes": 1}}  # x-kubernetes-preserve-unknown-fields
        assert created["spec"]["note"] is None  # nullable keeps its null
        assert "typo" not in created["spec"] and "unknownTopLevel" not in created

        numeric = await kube_api.create(base, pool("numeric", group, {"gpu": "l4", "maxNodes": 4}))
        assert numeric["spec"]["maxNodes"] == 4


def generated_crd(file_name: str, group: str) -> Obj:
    """A CRD as workers.crdgen writes it, under a test-only group (a real cluster keeps tgp.io for
    the bridge tests)."""
    crd = copy.deepcopy(crdgen.manifests()[file_name])
    crd["spec"]["group"] = group
    crd["metadata"]["name"] = f"{crd['spec']['names']['plural']}.{group}"
    return crd


@pytest.mark.parametrize(
    ("field_schema", "expected"),
    [
        ({"type": "string", "pattern": "^[0-9]+m$", "default": "PT10M"}, "Invalid value: \"PT10M\": {field} in body should match '^[0-9]+m$'"),
        ({"type": "integer", "maximum": 100, "default": 200}, "Invalid value: 200: {field} in body should be less than or equal to 100"),
        ({"type": "string", "enum": ["a", "b"], "default": "c"}, 'Unsupported value: "c"'),
        ({"type": "integer", "default": "ten"}, "{field} in body must be of type integer"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "default": {"b": "x"}}, "must not have unknown fields"),
    ],
)
async def test_a_crd_whose_default_breaks_its_own_schema_is_refused(kube_api: KubeApi, field_schema: Obj, expected: str) -> None:
    """apiextensions validates every default against its own field's schema when a CRD is
    created or updated; one bad default refuses the whole CRD (docs/reference)."""
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    crd = gpu_pool_crd(unique_group())
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["odd"] = field_schema
    response = await kube_api.http.post(crds, json=crd)
    assert response.status_code == 422, response.text
    # The server validates its internal form, where a schema every version shares sits in
    # spec.validation; the message names the field relative to the default (here: none).
    field = "spec.validation.openAPIV3Schema.properties[spec].properties[odd].default"
    message = response.json()["message"]
    assert f"{field}: " in message and expected.format(field="") in message
    assert (await kube_api.http.get(f"{crds}/{crd['metadata']['name']}")).status_code == 404


async def test_a_crd_update_to_a_bad_default_is_refused_and_so_are_null_members(kube_api: KubeApi) -> None:
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    group = unique_group()
    crd = gpu_pool_crd(group)
    properties = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    # A null member of an object default, for a non-nullable field, is refused (1.34; the
    # reference measured 1.19 dropping it). tgp's own defaults have nulls only where nullable.
    properties["owner"] = {"type": "object", "default": {"team": None}, "properties": {"team": {"type": "string"}}}
    response = await kube_api.http.post(crds, json=crd)
    assert response.status_code == 422, response.text
    assert ('properties[owner].default.team: Invalid value: "null": team in body must be of type string'
            in response.json()["message"])
    properties["owner"] = {"type": "object", "default": {"team": None}, "properties": {"team": {"type": "string", "nullable": True}}}
    async with installed_crd(kube_api, crd):
        created = await kube_api.create(f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpupools", pool("nulls", group))
        assert created["spec"]["owner"] == {"team": None}

        properties["weight"]["default"] = 1000
        # The current version: a real server's controllers have written the CRD's status since.
        stored = await kube_api.get(f"{crds}/{crd['metadata']['name']}")
        assert stored is not None
        crd["metadata"]["resourceVersion"] = stored["metadata"]["resourceVersion"]
        response = await kube_api.http.put(f"{crds}/{crd['metadata']['name']}", json=crd)
        assert response.status_code == 422, response.text
        assert "properties[weight].default: Invalid value: 1000" in response.json()["message"]


async def test_generated_pool_crd_installs_and_fills_a_partial_disruption_block(kube_api: KubeApi) -> None:
    group = unique_group()
    async with installed_crd(kube_api, generated_crd("gpunodepools.tgp.io.yaml", group)):
        base = f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpunodepools"

        def gpu_pool(name: str, **spec: Any) -> Obj:
            return {"apiVersion": f"{group}/v1", "kind": "GPUNodePool", "metadata": {"name": name}, "spec": {"nodeClassRef": {"name": "c"}, **spec}}

        partial = await kube_api.create(base, gpu_pool("partial", disruption={"idleTimeout": "5m"}))
        assert partial["spec"]["disruption"] == {"idleTimeout": "5m", "drainTimeout": "10m", "budgets": [{"nodes": "10%"}]}
        assert GPUNodePoolSpec.model_validate(partial["spec"]).disruption.drain_timeout == timedelta(minutes=10)
        window = {"nodes": "0", "schedule": "0 9 * * mon-fri", "duration": "8h", "reasons": ["Drifted"]}
        windowed = await kube_api.create(base, gpu_pool("windowed", disruption={"budgets": [window, {"nodes": "2"}], "consolidation": {}}))
        assert windowed["spec"]["disruption"]["budgets"] == [window, {"nodes": "2"}]
        assert windowed["spec"]["disruption"]["consolidation"] == {"cheaperBy": "20%", "after": "30m", "policy": "WhenEmptyOrUnderutilized"}
        bare = await kube_api.create(base, gpu_pool("bare"))
        assert (bare["spec"]["disruption"]["idleTimeout"], bare["spec"]["disruption"]["drainTimeout"]) == ("10m", "10m")
        assert bare["spec"]["minNodes"] == 0 and bare["spec"]["template"]["spec"]["taints"] == []

        for spec, field, detail in [
            ({"minNodes": 1_000_000_000}, "spec.minNodes", "should be less than or equal to 100"),
            ({"maxNodes": 5000}, "spec.maxNodes", "should be less than or equal to 1000"),
            ({"disruption": {"idleTimeout": ""}}, "spec.disruption.idleTimeout", "should match"),
            ({"disruption": {"drainTimeout": "PT10M"}}, "spec.disruption.drainTimeout", "should match"),
            # Disruption budgets (issue 21): CEL rules whose messages say what to fix.
            ({"disruption": {"budgets": [{"nodes": "101%"}]}}, "spec.disruption.budgets[0].nodes", "percentage of the pool's nodes from 0% to 100%"),
            ({"disruption": {"budgets": [{"nodes": "-1"}]}}, "spec.disruption.budgets[0].nodes", "a count of nodes from 0"),
            ({"disruption": {"budgets": [{"nodes": "0", "duration": "8h"}]}}, "spec.disruption.budgets[0]", "schedule and duration go together"),
            (
                {"disruption": {"budgets": [{"nodes": "0", "schedule": "0 25 * * *", "duration": "8h"}]}},
                "spec.disruption.budgets[0].schedule",
                "schedule must be a cron expression in UTC",
            ),
            ({"disruption": {"consolidation": {"cheaperBy": "120%"}}}, "spec.disruption.consolidation.cheaperBy", "from 1% to 99%"),
        ]:
            response = await kube_api.http.post(base, json=gpu_pool("bad", **spec))
            assert response.status_code == 422, spec
            assert [c["field"] for c in response.json()["details"]["causes"]] == [field]
            assert detail in response.json()["message"]


async def test_generated_class_crd_caps_a_class_without_limits(kube_api: KubeApi) -> None:
    group = unique_group()
    async with installed_crd(kube_api, generated_crd("gpunodeclasses.tgp.io.yaml", group)):
        base = f"/apis/{group}/v1/gpunodeclasses"

        def gpu_class(name: str, **limits: Any) -> Obj:
            spec: Obj = {"providers": [{"name": "simulated"}], **({"limits": limits} if limits else {})}
            return {"apiVersion": f"{group}/v1", "kind": "GPUNodeClass", "metadata": {"name": name}, "spec": spec}

        try:
            bare = await kube_api.create(base, gpu_class(f"bare-{secrets.token_hex(3)}"))
            assert bare["spec"]["limits"]["maxNodes"] == DEFAULT_CLASS_MAX_NODES
            cost_only = await kube_api.create(base, gpu_class(f"cost-{secrets.token_hex(3)}", maxHourlyCost="5.0"))
            assert cost_only["spec"]["limits"] == {"maxNodes": DEFAULT_CLASS_MAX_NODES, "maxHourlyCost": "5.0"}
            for limits, field in [({"maxNodes": 5000}, "spec.limits.maxNodes"), ({"maxHourlyCost": "1000000"}, "spec.limits.maxHourlyCost")]:
                response = await kube_api.http.post(base, json=gpu_class("bad", **limits))
                assert response.status_code == 422, limits
                assert [c["field"] for c in response.json()["details"]["causes"]] == [field]
        finally:
            for item in (await kube_api.http.get(base)).json().get("items") or []:
                await kube_api.http.delete(f"{base}/{item['metadata']['name']}")


async def test_status_subresource_is_isolated_and_generation_follows_spec(kube_api: KubeApi) -> None:
    group = unique_group()
    async with installed_crd(kube_api, gpu_pool_crd(group)):
        base = f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpupools"
        created = await kube_api.create(base, pool("iso", group, status={"phase": "Set at create"}))
        assert created["metadata"]["generation"] == 1
        assert "status" not in created  # create cannot set status

        via_status = await kube_api.merge_patch(
            f"{base}/iso/status", {"spec": {"weight": 99}, "status": {"phase": "Ready", "observedGeneration": 1}}
        )
        assert via_status.status_code == 200, via_status.text
        assert via_status.json()["spec"]["weight"] == 10
        assert via_status.json()["status"]["phase"] == "Ready"
        assert via_status.json()["metadata"]["generation"] == 1

        via_main = await kube_api.merge_patch(f"{base}/iso", {"spec": {"weight": 20}, "status": {"phase": "Ignored"}})
        assert via_main.status_code == 200
        assert via_main.json()["status"]["phase"] == "Ready"
        assert via_main.json()["metadata"]["generation"] == 2

        labelled = await kube_api.merge_patch(f"{base}/iso", {"metadata": {"labels": {"a": "b"}}})
        assert labelled.json()["metadata"]["generation"] == 2  # metadata is not spec

        # A controller's PUT of the status, with and without the current resourceVersion.
        current = labelled.json()
        replaced = await kube_api.http.put(f"{base}/iso/status", json={**current, "status": {"phase": "Draining"}})
        assert replaced.status_code == 200 and replaced.json()["status"]["phase"] == "Draining"
        stale = await kube_api.http.put(f"{base}/iso/status", json={**current, "status": {"phase": "Lost"}})
        assert stale.status_code == 409 and stale.json()["reason"] == "Conflict"


async def test_finalizer_blocks_delete_until_removed(kube_api: KubeApi) -> None:
    group = unique_group()
    async with installed_crd(kube_api, gpu_pool_crd(group)):
        base = f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpupools"
        created = await kube_api.create(base, {**pool("held", group), "metadata": {
            "name": "held", "finalizers": ["tgp.dev/nodes-drained"],
        }})
        since = created["metadata"]["resourceVersion"]
        async with kube_api.http.stream(
            "GET", base, params={"watch": "true", "resourceVersion": since}, timeout=STREAM_READ_TIMEOUT
        ) as stream:
            deleting = await kube_api.http.delete(f"{base}/held")
            assert deleting.status_code == 200
            assert deleting.json()["metadata"]["deletionTimestamp"]
            still = await kube_api.get(f"{base}/held")
            assert still is not None and still["metadata"]["deletionTimestamp"]

            refused = await kube_api.merge_patch(f"{base}/held", {"metadata": {"finalizers": ["a", "b"]}})
            assert refused.status_code == 422  # no new finalizers while deleting

            released = await kube_api.merge_patch(f"{base}/held", {"metadata": {"finalizers": None}})
            assert released.status_code == 200
            events = await read_events(stream, 2)
        assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]
        assert events[0]["object"]["metadata"]["deletionTimestamp"]
        assert await kube_api.get(f"{base}/held") is None


# --- watches ---------------------------------------------------------------------------


async def test_watch_from_resource_version_streams_only_later_events(kube_api: KubeApi) -> None:
    group = unique_group()
    async with installed_crd(kube_api, gpu_pool_crd(group)), official_client(kube_api) as api:
        base = f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpupools"
        await kube_api.create(base, pool("before", group))
        listing = await kube_api.get(base)
        assert listing is not None
        since = listing["metadata"]["resourceVersion"]
        await kube_api.create(base, pool("after", group))
        assert (await kube_api.merge_patch(f"{base}/before", {"spec": {"weight": 1}})).status_code == 200
        assert (await kube_api.http.delete(f"{base}/after")).status_code == 200

        custom = k8s.CustomObjectsApi(api)
        seen: list[tuple[str, str, int]] = []
        async with k8s_watch.Watch() as watch:
            stream = watch.stream(
                custom.list_namespaced_custom_object, group, "v1", kube_api.namespace, "gpupools",
                resource_version=since, timeout_seconds=30,
            )
            async with asyncio.timeout(STREAM_READ_TIMEOUT):
                async for event in stream:
                    meta = event["raw_object"]["metadata"]
                    seen.append((event["type"], meta["name"], int(meta["resourceVersion"])))
                    if len(seen) == 3:
                        watch.stop()
                        break
        assert [(kind, name) for kind, name, _ in seen] == [("ADDED", "after"), ("MODIFIED", "before"), ("DELETED", "after")]
        versions = [version for _, _, version in seen]
        assert versions == sorted(versions) and versions[0] > int(since)


async def test_watch_without_resource_version_starts_with_current_state(kube_api: KubeApi) -> None:
    name = kube_api.unique("state")
    await kube_api.create_node(name)
    params = {"watch": "true", "fieldSelector": f"metadata.name={name}"}
    async with kube_api.http.stream("GET", "/api/v1/nodes", params=params, timeout=STREAM_READ_TIMEOUT) as stream:
        [event] = await read_events(stream, 1)
    assert event["type"] == "ADDED" and event["object"]["metadata"]["name"] == name


async def test_a_deleted_nodes_watch_event_carries_its_last_annotations(kube_api: KubeApi) -> None:
    """tgp's node workflow annotates its Node released just before deleting it, and the bridge
    reads the annotation off the DELETED event (crd_bridge.node_facts): the event must carry the
    object as it last was, annotations included, as the real API server's does."""
    name = kube_api.unique("released")
    created = await kube_api.create_node(name)
    params = {"watch": "true", "fieldSelector": f"metadata.name={name}", "resourceVersion": created["metadata"]["resourceVersion"]}
    async with kube_api.http.stream("GET", "/api/v1/nodes", params=params, timeout=STREAM_READ_TIMEOUT) as stream:
        assert (await kube_api.merge_patch(f"/api/v1/nodes/{name}", {"metadata": {"annotations": {"tgp.io/released": "true"}}})).status_code == 200
        assert (await kube_api.http.delete(f"/api/v1/nodes/{name}")).status_code == 200
        # A real control plane's controllers may change the Node in between (the node lifecycle
        # controller taints a Node without status): read until its deletion.
        reader, events = WatchReader(stream), []
        while not events or events[-1]["type"] != "DELETED":
            assert len(events) < 10, [e["type"] for e in events]
            events += await reader.read(1)
    assert {e["type"] for e in events[:-1]} == {"MODIFIED"}
    assert events[-1]["object"]["metadata"]["annotations"]["tgp.io/released"] == "true"


async def test_watch_selector_sees_objects_enter_and_leave(kube_api: KubeApi) -> None:
    group = unique_group()
    async with installed_crd(kube_api, gpu_pool_crd(group)):
        base = f"/apis/{group}/v1/namespaces/{kube_api.namespace}/gpupools"
        created = await kube_api.create(base, pool("moving", group))
        params = {"watch": "true", "labelSelector": "tier=gold", "resourceVersion": created["metadata"]["resourceVersion"]}
        async with kube_api.http.stream("GET", base, params=params, timeout=STREAM_READ_TIMEOUT) as stream:
            await kube_api.merge_patch(f"{base}/moving", {"metadata": {"labels": {"tier": "gold"}}})
            await kube_api.merge_patch(f"{base}/moving", {"spec": {"weight": 3}})
            await kube_api.merge_patch(f"{base}/moving", {"metadata": {"labels": {"tier": "iron"}}})
            events = await read_events(stream, 3)
        # The watch cache reports an object entering the selection as ADDED, leaving as DELETED.
        assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]


async def test_watch_ends_after_timeout_seconds(kube_api: KubeApi) -> None:
    params = {"watch": "true", "timeoutSeconds": "1", "fieldSelector": f"metadata.name={kube_api.unique('none')}"}
    async with asyncio.timeout(STREAM_READ_TIMEOUT):
        async with kube_api.http.stream("GET", "/api/v1/nodes", params=params) as stream:
            assert stream.status_code == 200
            lines = [line async for line in stream.aiter_lines() if line.strip()]
    assert lines == []  # the stream ended cleanly, without an error


async def test_watch_from_compacted_version_is_gone_then_relist_works(kube_api: KubeApi) -> None:
    kube = _emulator(kube_api)
    kube.install_crd(gpu_pool_crd("tgp.dev"))
    base = f"/apis/tgp.dev/v1/namespaces/{kube_api.namespace}/gpupools"
    old = (await kube_api.create(base, pool("one", "tgp.dev")))["metadata"]["resourceVersion"]
    await kube_api.create(base, pool("two", "tgp.dev"))
    kube.compact()

    # In-stream, as a current API server reports it: 200, one ERROR event, end of stream.
    async with kube_api.http.stream("GET", base, params={"watch": "true", "resourceVersion": old}) as stream:
        assert stream.status_code == 200
        lines = [json.loads(line) async for line in stream.aiter_lines() if line.strip()]
    assert len(lines) == 1 and lines[0]["type"] == "ERROR"
    assert {"kind": "Status", "code": 410, "reason": "Expired"}.items() <= lines[0]["object"].items()

    # kubernetes.aio turns it into ApiException(410).
    async with official_client(kube_api) as api, k8s_watch.Watch() as watch:
        custom = k8s.CustomObjectsApi(api)
        stream = watch.stream(
            custom.list_namespaced_custom_object, "tgp.dev", "v1", kube_api.namespace, "gpupools",
            resource_version=old, timeout_seconds=5,
        )
        with pytest.raises(k8s.ApiException) as raised:
            async for _ in stream:
                pass
        assert raised.value.status == 410

    # The client lists again and watches from the list's resourceVersion.
    listing = await kube_api.get(base)
    assert listing is not None and {i["metadata"]["name"] for i in listing["items"]} == {"one", "two"}
    params = {"watch": "true", "resourceVersion": listing["metadata"]["resourceVersion"]}
    async with kube_api.http.stream("GET", base, params=params, timeout=STREAM_READ_TIMEOUT) as stream:
        await kube_api.create(base, pool("three", "tgp.dev"))
        [event] = await read_events(stream, 1)
    assert event["type"] == "ADDED" and event["object"]["metadata"]["name"] == "three"

    # Older servers answer with HTTP 410 instead; clients must handle both.
    kube.expired_watch_as_http = True
    response = await kube_api.http.get(base, params={"watch": "true", "resourceVersion": old})
    assert response.status_code == 410 and response.json()["reason"] == "Expired"


async def test_watch_window_bounds_the_history(kube_api: KubeApi) -> None:
    kube = _emulator(kube_api)
    kube.watch_window = 2
    first = await kube_api.create_node(kube_api.unique("w"))
    for _ in range(3):
        await kube_api.create_node(kube_api.unique("w"))
    response = await kube_api.http.get(
        "/api/v1/nodes", params={"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"]}
    )
    assert json.loads(response.text.splitlines()[0])["object"]["code"] == 410


async def test_a_watch_of_one_nodes_pods_sees_exactly_their_changes(kube_api: KubeApi) -> None:
    """A kubelet's watch (`spec.nodeName=<its Node>`): its pods' creation, changes and deletion,
    and nothing of another Node's pods (the emulator wakes it only for them, as the watch
    cache's trigger index does)."""
    here, there = kube_api.unique("here"), kube_api.unique("there")
    start = (await kube_api.http.get("/api/v1/pods")).json()["metadata"]["resourceVersion"]
    mine = await kube_api.create_pod(kube_api.unique("mine"), node=here)
    await kube_api.create_pod(kube_api.unique("other"), node=there)
    name = mine["metadata"]["name"]
    path = f"/api/v1/namespaces/{mine['metadata']['namespace']}/pods/{name}"
    (await kube_api.merge_patch(path, {"metadata": {"labels": {"seen": "yes"}}})).raise_for_status()
    (await kube_api.http.delete(path, params={"gracePeriodSeconds": "0"})).raise_for_status()
    params = {"watch": "true", "resourceVersion": start, "timeoutSeconds": "1", "fieldSelector": f"spec.nodeName={here}"}
    events = [json.loads(line) for line in (await kube_api.http.get("/api/v1/pods", params=params)).text.splitlines() if line.strip()]
    assert {e["object"]["metadata"]["name"] for e in events} == {name}
    assert [e["type"] for e in events][0] == "ADDED" and events[-1]["type"] == "DELETED"
    assert any(e["type"] == "MODIFIED" and (e["object"]["metadata"].get("labels") or {}).get("seen") == "yes" for e in events)

    # And while it is open: another Node's pod passes it by, its own is there at once.
    now = (await kube_api.http.get("/api/v1/pods")).json()["metadata"]["resourceVersion"]
    live = {"watch": "true", "resourceVersion": now, "fieldSelector": f"spec.nodeName={here}"}
    async with kube_api.http.stream("GET", "/api/v1/pods", params=live, timeout=STREAM_READ_TIMEOUT) as stream:
        await kube_api.create_pod(kube_api.unique("passing"), node=there)
        arrived = await kube_api.create_pod(kube_api.unique("arrived"), node=here)
        [event] = await read_events(stream, 1)
    assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", arrived["metadata"]["name"])


async def test_a_list_of_one_nodes_pods_is_exactly_the_pods_bound_there(kube_api: KubeApi) -> None:
    """A kubelet's list (`spec.nodeName=<its Node>`, which the emulator reads through an index
    by Node, as the watch cache does): the pods bound there, not those of another Node or
    unbound ones; a deleted pod leaves it, and one created again under its name lists where it
    is bound now. On the emulator also a pod bound later (the simulated scheduler binds by
    patching spec.nodeName)."""
    here, there = kube_api.unique("here"), kube_api.unique("there")
    pods = f"/api/v1/namespaces/{kube_api.namespace}/pods"

    async def on(node: str) -> set[str]:
        response = await kube_api.http.get(pods, params={"fieldSelector": f"spec.nodeName={node}"})
        assert response.status_code == 200, response.text
        return {item["metadata"]["name"] for item in response.json()["items"]}

    unbound = kube_api.unique("unbound")
    await kube_api.create(pods, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": unbound},
        "spec": {"nodeSelector": {"tgp.test/fits": "nothing"}, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.9"}]},
    })  # fmt: skip
    first, second, other = kube_api.unique("first"), kube_api.unique("second"), kube_api.unique("other")
    for name, node in ((first, here), (second, here), (other, there)):
        await kube_api.create_pod(name, node=node)
    assert (await on(here), await on(there), await on("")) == ({first, second}, {other}, {unbound})

    (await kube_api.http.delete(f"{pods}/{second}", params={"gracePeriodSeconds": "0"})).raise_for_status()
    assert await on(here) == {first}
    await kube_api.create_pod(second, node=there)
    assert (await on(here), await on(there)) == ({first}, {other, second})

    if not kube_api.real:
        (await kube_api.merge_patch(f"{pods}/{unbound}", {"spec": {"nodeName": here}})).raise_for_status()
        assert (await on(here), await on("")) == ({first, unbound}, set())


async def test_a_custom_resource_of_a_built_in_kinds_name_is_checked_by_its_own_schema(kube_api: KubeApi) -> None:
    """A CRD may call its kind Job or Pod (Volcano's batch.volcano.sh Job): its objects are
    checked against its schema (422), never decoded as the built-in kind (400)."""
    group = unique_group()
    async with installed_crd(kube_api, gpu_pool_crd(group, plural="jobs", kind="Job")):
        base = f"/apis/{group}/v1/namespaces/{kube_api.namespace}/jobs"
        response = await kube_api.http.post(base, json={"apiVersion": f"{group}/v1", "kind": "Job", "metadata": {"name": "odd"}, "spec": "odd"})
        assert response.status_code == 422, response.text
        assert response.json()["reason"] == "Invalid"


async def test_the_watch_window_is_kept_per_resource(kube_api: KubeApi) -> None:
    """As the API server's watch cache: changes of other resources leaving the window do not
    expire a watch of a resource that had none forgotten (an informer of pods in a cluster
    whose Nodes churn resumes from its version, not a 410 and a new list); a forgotten change of
    its own resource does."""
    kube = _emulator(kube_api)
    kube.watch_window = 2
    node = await kube_api.create_node(kube_api.unique("w"))
    pod = await kube_api.create_pod(kube_api.unique("w"), node=node["metadata"]["name"])
    pods_version = pod["metadata"]["resourceVersion"]
    for _ in range(3):
        await kube_api.create_node(kube_api.unique("w"))
    params = {"watch": "true", "resourceVersion": pods_version, "timeoutSeconds": "1"}
    response = await kube_api.http.get("/api/v1/pods", params=params)
    assert response.status_code == 200 and "Expired" not in response.text
    for _ in range(3):
        await kube_api.create_pod(kube_api.unique("w"), node=node["metadata"]["name"])
    response = await kube_api.http.get("/api/v1/pods", params=params)
    assert json.loads(response.text.splitlines()[0])["object"]["code"] == 410


async def test_cut_watches_drops_the_stream_and_the_client_resumes(kube_api: KubeApi) -> None:
    kube = _emulator(kube_api)
    name = kube_api.unique("cut")
    created = await kube_api.create_node(name)
    params = {"watch": "true", "resourceVersion": created["metadata"]["resourceVersion"]}
    async with kube_api.http.stream("GET", "/api/v1/nodes", params=params, timeout=STREAM_READ_TIMEOUT) as stream:
        labelled = await kube_api.merge_patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {"a": "1"}}})
        reader = WatchReader(stream)
        [event] = await reader.read(1)
        assert event["type"] == "MODIFIED"
        assert kube.cut_watches() == 1
        with pytest.raises(httpx.RemoteProtocolError):
            await reader.read(1)
    assert kube.open_watches == 0

    # kubernetes.aio sees the cut as aiohttp.ClientPayloadError.
    async with official_client(kube_api) as api, k8s_watch.Watch() as watch:
        stream = watch.stream(
            k8s.CoreV1Api(api).list_node, field_selector=f"metadata.name={name}",
            resource_version=labelled.json()["metadata"]["resourceVersion"], timeout_seconds=30,
        )
        await kube_api.merge_patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {"a": "2"}}})
        first = await anext(stream)
        assert first["type"] == "MODIFIED"
        kube.cut_watches()
        with pytest.raises(aiohttp.ClientPayloadError):
            await anext(stream)
        resume_from = first["raw_object"]["metadata"]["resourceVersion"]

    # Resuming from the last version seen misses nothing.
    await kube_api.merge_patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {"a": "3"}}})
    params = {"watch": "true", "resourceVersion": resume_from}
    async with kube_api.http.stream("GET", "/api/v1/nodes", params=params, timeout=STREAM_READ_TIMEOUT) as stream:
        [event] = await read_events(stream, 1)
    assert event["object"]["metadata"]["labels"]["a"] == "3"


# --- events ----------------------------------------------------------------------------


async def test_events_can_be_created_and_listed_in_both_apis(kube_api: KubeApi) -> None:
    namespace = kube_api.namespace
    regarding = {"apiVersion": "v1", "kind": "Pod", "name": "trainer", "namespace": namespace}
    core = await kube_api.create(f"/api/v1/namespaces/{namespace}/events", {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": "trainer."},
        "involvedObject": regarding,
        "reason": "NodeRequested", "message": "asked for an h100", "type": "Normal",
        "source": {"component": "tgp-bridge"}, "count": 1,
    })
    assert core["metadata"]["name"].startswith("trainer.")

    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    modern = await kube_api.create(f"/apis/events.k8s.io/v1/namespaces/{namespace}/events", {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": f"trainer.{secrets.token_hex(4)}"},
        "regarding": regarding, "reason": "NodeReady", "note": "node joined", "type": "Normal",
        "action": "Provision", "eventTime": now,
        "reportingController": "tgp.dev/bridge", "reportingInstance": "bridge-0",
    })
    assert modern["note"] == "node joined"

    # One storage: each API lists both, in its own field names.
    core_list = await kube_api.get(f"/api/v1/namespaces/{namespace}/events")
    assert core_list is not None
    by_reason = {e["reason"]: e for e in core_list["items"]}
    assert by_reason["NodeReady"]["message"] == "node joined"
    assert by_reason["NodeRequested"]["involvedObject"]["name"] == "trainer"
    v1_list = await kube_api.get(f"/apis/events.k8s.io/v1/namespaces/{namespace}/events")
    assert v1_list is not None
    notes = {e["reason"]: e.get("note") for e in v1_list["items"]}
    assert {"NodeRequested": "asked for an h100", "NodeReady": "node joined"}.items() <= notes.items()


async def test_event_must_live_in_its_objects_namespace(kube_api: KubeApi) -> None:
    response = await kube_api.http.post(f"/api/v1/namespaces/{kube_api.namespace}/events", json={
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": "misplaced"},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": "elsewhere"},
        "reason": "X", "message": "y", "type": "Normal",
    })
    assert response.status_code == 422
    assert response.json()["details"]["causes"][0]["field"] == "involvedObject.namespace"


# --- helpers -----------------------------------------------------------------------------


def _emulator(kube_api: KubeApi) -> KubeEmulator:
    if kube_api.emulator is None:
        pytest.skip("a test knob of the emulator: a real cluster cannot be made to do this on demand")
    return kube_api.emulator


async def test_the_emulator_remembers_a_bounded_number_of_requests_and_versions() -> None:
    """A demo left up for an hour must not slow down: kmock matches every request against its
    whole request log, and kept every version of every object (issue 19)."""
    async with KubeEmulator(request_log=20) as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        await http.post("/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        for beat in range(60):
            response = await http.patch("/api/v1/nodes/n1", json={"metadata": {"labels": {"beat": str(beat)}}},
                                        headers={"Content-Type": "application/merge-patch+json"})
            assert response.status_code == 200
        requests = list(kube)
        assert 0 < len(requests) <= 20 and str(requests[-1].url).endswith("/api/v1/nodes/n1")
        assert len(kube["patch /api/v1/nodes/n1"]) <= 20
        history = [k for k in kube.objects if k[2] == "n1"]
        assert history and len(kube.objects[history[0]].history) <= 4
        assert (await http.get("/api/v1/nodes/n1")).json()["metadata"]["labels"]["beat"] == "59"


async def test_the_emulator_answers_each_request_with_the_reaction_kmock_would_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulator chooses a reaction without filtering its whole request log per reaction
    (sim.kube._sees: that cost half the CPU of a 100-node test). For each kind of reaction the
    tests inject (method and path, query, callables, slices, unions, intersections, exclusions, priorities) it
    must see exactly what kmock's own `request in view` sees, when each request is served, and
    answer as kmock's semantics say."""
    import sim.kube as emulator_module

    fast = emulator_module._sees
    compared: list[bool] = []

    def both(view: Any, request: Any, root: Any) -> bool:
        seen = fast(view, request, root)
        compared.append(seen == (request in view))
        return seen

    monkeypatch.setattr(emulator_module, "_sees", both)
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        await http.post("/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        kube["get /api/v1/nodes/n1"][:2] << 503  # the first two reads only
        kube["get /api/v1/nodes/n1"][{"pretty": "1"}] << 400
        kube[lambda r: r.params.get("tea") == "1"] << 418
        (kube["get /api/v1/nodes/a"] | kube["get /api/v1/nodes/b"]) << 409
        (kube["get"] & kube["/api/v1/nodes/e"]) << 429
        (kube["get /api/v1/pods"] - kube[{"limit": "1"}]) << 410
        kube["get /api/v1/nodes/c"] << 452
        kube["get /api/v1/nodes/c"].override << 451

        statuses = [
            (await http.get(path, params=params)).status_code
            for path, params in [
                ("/api/v1/nodes/n1", {}), ("/api/v1/nodes/n1", {"pretty": "1"}), ("/api/v1/nodes/n1", {}),
                ("/api/v1/nodes/n1", {"pretty": "1"}), ("/api/v1/nodes/n1", {"tea": "1"}),
                ("/api/v1/nodes/a", {}), ("/api/v1/nodes/b", {}), ("/api/v1/nodes/d", {}),
                ("/api/v1/nodes/e", {}), ("/api/v1/pods", {}), ("/api/v1/pods", {"limit": "1"}),
                ("/api/v1/nodes/c", {}),
            ]
        ]
    # The slice takes the first two reads of n1 (the second with ?pretty=1 too); then the
    # query filter, the callable, the union, the fallback's 404, the intersection, the
    # exclusion (a list with ?limit=1 is answered by the emulator), the override.
    assert statuses == [503, 503, 200, 400, 418, 409, 409, 404, 429, 410, 200, 451]
    assert compared and all(compared), "sim.kube._sees disagreed with kmock's `request in view`"


async def test_a_generated_name_that_is_taken_is_generated_again_as_the_api_server_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A create with generateName whose random suffix names an existing object gets another
    suffix (the API server's RetryGenerateName, GA in 1.32), up to GENERATE_NAME_TRIES names; only
    then 409 AlreadyExists. Emulator only: a real server cannot be made to collide on demand."""
    from sim.kube import KubeEmulator
    from sim.kube_store import GENERATE_NAME_TRIES

    names = iter(["pool.bbbbb", "pool.bbbbb", "pool.ccccc", *["pool.bbbbb"] * GENERATE_NAME_TRIES])
    monkeypatch.setattr("sim.kube_store._generated", lambda prefix: next(names))
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "pool."}, "involvedObject": {"kind": "GPUNodePool", "name": "pool", "namespace": "ml"}, "reason": "NodeLaunched", "message": "m", "type": "Normal"}
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        first = await http.post("/api/v1/namespaces/ml/events", json=event)
        second = await http.post("/api/v1/namespaces/ml/events", json=event)  # pool.bbbbb taken: pool.ccccc
        assert (first.json()["metadata"]["name"], second.json()["metadata"]["name"]) == ("pool.bbbbb", "pool.ccccc")
        third = await http.post("/api/v1/namespaces/ml/events", json=event)  # every try taken
        assert third.status_code == 409 and third.json()["reason"] == "AlreadyExists"


async def test_a_list_reads_its_own_kind_as_it_was_created_deleted_and_created_again() -> None:
    """The store reads one kind through its index (KubeStore.stored): pods among Events and
    Nodes list as exactly themselves in key order; a deleted pod is gone and one created again is
    back; a CRD deleted takes its objects, and the same CRD created again starts empty."""
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        pods = "/api/v1/namespaces/default/pods"
        for name in ("b", "a", "c"):
            assert (await http.post(pods, json={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                                                "spec": {"containers": [{"name": "x", "image": "x"}]}})).status_code == 201  # fmt: skip
            assert (await http.post("/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"n{name}"}})).status_code == 201
            assert (await http.post("/api/v1/namespaces/default/events", json={"apiVersion": "v1", "kind": "Event", "metadata": {"name": f"e{name}"},
                                                                                "involvedObject": {"kind": "Pod", "name": name, "namespace": "default"}})).status_code == 201  # fmt: skip

        async def names(path: str) -> list[str]:
            response = await http.get(path)
            assert response.status_code == 200, response.text
            return [item["metadata"]["name"] for item in response.json()["items"]]

        assert await names(pods) == await names("/api/v1/pods") == ["a", "b", "c"]
        assert await names("/api/v1/nodes") == ["na", "nb", "nc"]
        assert (await http.delete(f"{pods}/b", params={"gracePeriodSeconds": "0"})).status_code == 200
        assert await names(pods) == ["a", "c"]
        assert (await http.post(pods, json={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "b"},
                                            "spec": {"containers": [{"name": "x", "image": "x"}]}})).status_code == 201  # fmt: skip
        assert await names(pods) == ["a", "b", "c"]

        group = unique_group()
        crd, crds = gpu_pool_crd(group), "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        pools = f"/apis/{group}/v1/namespaces/default/gpupools"
        assert (await http.post(crds, json=crd)).status_code == 201
        assert (await http.post(pools, json=pool("rtx", group))).status_code == 201
        assert await names(pools) == ["rtx"]
        assert (await http.delete(f"{crds}/{crd['metadata']['name']}")).status_code == 200
        assert (await http.get(pools)).status_code == 404
        assert (await http.post(crds, json=crd)).status_code == 201
        assert await names(pools) == []
        assert (await http.post(pools, json=pool("a100", group))).status_code == 201
        assert await names(pools) == ["a100"]
