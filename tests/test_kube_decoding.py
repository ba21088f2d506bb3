"""A write of a built-in kind is decoded into its Go type before anything else looks at it, as the
API server does: a field that holds a JSON type its type cannot take (a spec that is a string) is
refused, and nothing is stored or seen by a watch. Both lanes: the emulator and the real control
plane (measured on 1.34: 400 for a create or a PUT, 422 naming the patch for a patch)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sim.kube_machinery import DECODED_FIELDS, decode_builtin
from tests.kube_env import KubeApi

MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}


def refused(response: httpx.Response, code: int, reason: str) -> dict[str, Any]:
    assert response.status_code == code, response.text
    status: dict[str, Any] = response.json()
    assert (status["kind"], status["reason"], status["code"]) == ("Status", reason, code)
    return status


@pytest.mark.parametrize(("spec", "json_type"), [("odd", "string"), (3, "number"), ([1], "array"), (True, "bool")])
async def test_a_pod_whose_spec_is_not_an_object_is_refused_and_never_stored(kube_api: KubeApi, spec: Any, json_type: str) -> None:
    pods = f"/api/v1/namespaces/{kube_api.namespace}/pods"
    start = (await kube_api.http.get(pods)).json()["metadata"]["resourceVersion"]
    name = kube_api.unique("odd")
    created = await kube_api.http.post(pods, json={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})
    status = refused(created, 400, "BadRequest")
    assert status["message"] == (
        f'Pod in version "v1" cannot be handled as a Pod: json: cannot unmarshal {json_type} into Go struct field Pod.spec of type v1.PodSpec'
    )
    assert (await kube_api.http.get(f"{pods}/{name}")).status_code == 404
    watched = await kube_api.http.get(pods, params={"watch": "true", "resourceVersion": start, "timeoutSeconds": "1"})
    assert [json.loads(line)["object"]["metadata"]["name"] for line in watched.text.splitlines() if line.strip()] == []


async def test_a_replace_or_a_patch_that_makes_a_field_undecodable_changes_nothing(kube_api: KubeApi) -> None:
    """A PUT of the object or its status is 400; a merge or JSON patch is 422 with the patch as
    its one cause; the pod keeps its spec and its resourceVersion."""
    node = (await kube_api.create_node(kube_api.unique("dec")))["metadata"]["name"]
    pod = await kube_api.create_pod(kube_api.unique("dec"), node=node)
    url = f"/api/v1/namespaces/{kube_api.namespace}/pods/{pod['metadata']['name']}"
    current = (await kube_api.http.get(url)).json()
    status = refused(await kube_api.http.put(url, json={**current, "spec": "odd"}), 400, "BadRequest")
    assert "Go struct field Pod.spec of type v1.PodSpec" in status["message"]
    status = refused(await kube_api.http.put(f"{url}/status", json={**current, "status": 7}), 400, "BadRequest")
    assert "cannot unmarshal number into Go struct field Pod.status of type v1.PodStatus" in status["message"]
    for body, headers in ((json.dumps({"spec": "odd"}), MERGE), (json.dumps([{"op": "replace", "path": "/spec", "value": "odd"}]), JSON_PATCH)):
        status = refused(await kube_api.http.patch(url, content=body, headers=headers), 422, "Invalid")
        assert [c["field"] for c in status["details"]["causes"]] == ["patch"]
    after = (await kube_api.http.get(url)).json()
    assert after["spec"] == current["spec"] and after["metadata"]["resourceVersion"] == current["metadata"]["resourceVersion"]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "spec": "odd"}, "Node.spec of type v1.NodeSpec"),
    ("/apis/apps/v1/namespaces/{ns}/deployments", {"apiVersion": "apps/v1", "kind": "Deployment", "spec": "odd"}, "Deployment.spec of type v1.DeploymentSpec"),
    ("/api/v1/namespaces/{ns}/secrets", {"apiVersion": "v1", "kind": "Secret", "data": "x"}, "Secret.data of type map[string][]uint8"),
])  # fmt: skip
async def test_other_built_in_kinds_are_decoded_alike(kube_api: KubeApi, path: str, body: dict[str, Any], field: str) -> None:
    name = kube_api.unique("dec")
    response = await kube_api.http.post(path.format(ns=kube_api.namespace), json={**body, "metadata": {"name": name}})
    kind = body["kind"]
    status = refused(response, 400, "BadRequest")
    assert status["message"].startswith(f'{kind} in version "v1" cannot be handled as a {kind}: json: cannot unmarshal string into Go struct field {field}')


async def test_a_put_that_cannot_be_decoded_is_refused_before_the_object_is_looked_up(kube_api: KubeApi) -> None:
    """The API server decodes the body first: 400 for an undecodable spec even where the pod is
    missing (not 404) or the resourceVersion is stale (not 409)."""
    pods = f"/api/v1/namespaces/{kube_api.namespace}/pods"
    name = kube_api.unique("absent")
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "resourceVersion": "1"}, "spec": "odd"}
    refused(await kube_api.http.put(f"{pods}/{name}", json=body), 400, "BadRequest")


async def test_a_null_field_is_stored_as_go_leaves_it(kube_api: KubeApi) -> None:
    """null decodes into any field: a Node created or replaced with `spec: null` is stored with
    an empty spec (and the not-ready taint the API server's admission adds), a Secret with
    `data: null` without data."""
    name = kube_api.unique("nullspec")
    created = await kube_api.http.post("/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": None})
    assert created.status_code == 201, created.text
    assert isinstance(created.json()["spec"], dict)
    # Without a resourceVersion (a Node may be replaced unconditionally): a real cluster's node
    # controller writes the Node between the create and this PUT.
    meta = {k: v for k, v in created.json()["metadata"].items() if k != "resourceVersion"}
    replaced = await kube_api.http.put(f"/api/v1/nodes/{name}", json={**created.json(), "metadata": meta, "spec": None})
    assert replaced.status_code == 200, replaced.text
    assert isinstance(replaced.json()["spec"], dict)
    await kube_api.http.delete(f"/api/v1/nodes/{name}")
    secret = kube_api.unique("nulldata")
    url = f"/api/v1/namespaces/{kube_api.namespace}/secrets"
    created = await kube_api.http.post(url, json={"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}, "data": None})
    assert created.status_code == 201, created.text
    assert "data" not in created.json()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


FIELDS = st.sampled_from(["spec", "status", "data", "stringData", "binaryData", "other"])


@given(kind=st.sampled_from(sorted(DECODED_FIELDS)), values=st.dictionaries(FIELDS, st.none() | JSON_VALUES, min_size=1))
@example(kind="Node", values={"spec": None}).via("a Node created with spec null")
@example(kind="Secret", values={"data": None, "stringData": {"a": "b"}}).via("a Secret without data")
def test_a_built_in_field_decodes_exactly_when_it_is_an_object_or_null(kind: str, values: dict[str, Any]) -> None:
    """Any JSON in any top-level field: refused iff a field the kind decodes holds something
    other than an object or null, the message naming the first such field and its Go type; else
    a null struct field is stored as {}, a null map field not at all, every other field as it was."""
    obj = {"kind": kind, **values}
    problem = decode_builtin(kind, obj)
    fields = DECODED_FIELDS[kind]
    bad = [f for f in fields if f in values and values[f] is not None and not isinstance(values[f], dict)]
    if bad:
        assert problem is not None and f"Go struct field {kind}.{bad[0]} of type {fields[bad[0]]}" in problem
        return
    assert problem is None
    for field, value in values.items():
        if field in fields and value is None:
            assert obj.get(field, "absent") == ("absent" if fields[field].startswith("map[") else {})
        else:
            assert obj[field] == value
