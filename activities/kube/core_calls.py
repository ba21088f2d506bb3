"""The core/v1 calls tgp makes, and its status writes, on kubernetes.aio's ApiClient without its
CoreV1Api and CustomObjectsApi.

kubernetes.aio's CoreV1Api is one generated class of 618 methods whose signatures build pydantic
fields as the module loads: 1.3 s of CPU (and ~2 s on a loaded machine) in every process that
talks to Kubernetes: the worker and the bridge at start, every `tgp plan`. Each call here makes
the request its generated method makes (path, query names, JSON Accept and Content-Type,
BearerToken auth) through the same client, so it is authenticated, proxied and timed out the
same way, and a status outside 2xx raises the same ApiException. Node, pod and Event answers come
back as the API's JSON (WIRE); Secrets as the generated models. Only the per-call argument
validation is gone, which tgp's own typed callers in activities/kube/cluster.py make unnecessary."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.aio.client.api_client import ApiClient

JSON = "application/json"
# The answer of a Node or pod call as the API serves it (camelCase JSON, the form the informers
# hold), not decoded into kubernetes' models: one reading of each (activities.kube.summaries'
# node_summary_of, pod_summary_of), and no model construction per pod listed.
WIRE = {"200": "object", "201": "object", "202": "object"}
# An answer whose body tgp does not use (an Event created, a status written): its status is
# checked (outside 2xx raises ApiException, with the API's message), its body not decoded. A
# pool's status write at 500 nodes answers the whole object (~130 KB): decoding it was 3% of
# the worker's CPU in a burst.
STATUS_ONLY = {"200": "bytearray", "201": "bytearray", "202": "bytearray"}


class CoreCalls:
    """The core/v1 calls of activities/kube/cluster.py, named and shaped as CoreV1Api's."""

    def __init__(self, api: ApiClient) -> None:
        self._api = api

    async def _request(
        self,
        method: str,
        path: str,
        returns: Mapping[str, str],
        *,
        timeout: float | None,
        path_params: Mapping[str, str] | None = None,
        query: Mapping[str, object | None] | None = None,
        body: object = None,
        content_type: str | None = None,
    ) -> Any:
        headers = {"Accept": JSON}
        if body is not None:
            headers["Content-Type"] = content_type or JSON
        request = await self._api.param_serialize(
            method=method,
            resource_path=path,
            path_params=dict(path_params or {}),
            query_params=[(k, v) for k, v in (query or {}).items() if v is not None],
            header_params=headers,
            body=body,
            post_params=[],
            files={},
            auth_settings=["BearerToken"],
            collection_formats={},
        )
        if not returns:  # a watch or list read as it streams (the bridge's informers)
            return (await self._api.call_api(*request, _preload_content=False, _request_timeout=timeout)).response
        response = await self._api.call_api(*request, _request_timeout=timeout)
        await response.read()
        return self._api.response_deserialize(response_data=response, response_types_map=dict(returns)).data

    # --- Nodes ---------------------------------------------------------------------------

    async def read_node(self, name: str, *, _request_timeout: float | None = None) -> Any:
        return await self._request("GET", "/api/v1/nodes/{name}", WIRE, path_params={"name": name}, timeout=_request_timeout)

    async def patch_node(self, name: str, body: object, *, _content_type: str, _request_timeout: float | None = None) -> Any:
        return await self._request(
            "PATCH", "/api/v1/nodes/{name}", WIRE,
            path_params={"name": name}, body=body, content_type=_content_type, timeout=_request_timeout,
        )

    async def delete_node(self, name: str, *, _request_timeout: float | None = None) -> Any:
        return await self._request("DELETE", "/api/v1/nodes/{name}", WIRE, path_params={"name": name}, timeout=_request_timeout)

    async def list_node(self, **params: Any) -> Any:
        """A page of Nodes (`_list_query` names the parameters)."""
        return await self._request("GET", "/api/v1/nodes", WIRE, query=_list_query(params), timeout=params.get("_request_timeout"))

    async def list_node_without_preload_content(self, **params: Any) -> Any:
        """The raw aiohttp response of a Node list or watch (`_list_query` names the parameters)."""
        return await self._request("GET", "/api/v1/nodes", {}, query=_list_query(params), timeout=params.get("_request_timeout"))

    # --- Pods ----------------------------------------------------------------------------

    async def list_pod_for_all_namespaces(self, **params: Any) -> Any:
        """A page of pods, all namespaces."""
        return await self._request("GET", "/api/v1/pods", WIRE, query=_list_query(params), timeout=params.get("_request_timeout"))

    async def list_pod_for_all_namespaces_without_preload_content(self, **params: Any) -> Any:
        """The raw aiohttp response of a pod list or watch, all namespaces."""
        return await self._request("GET", "/api/v1/pods", {}, query=_list_query(params), timeout=params.get("_request_timeout"))

    async def create_namespaced_pod_eviction(self, name: str, namespace: str, body: object, *, _request_timeout: float | None = None) -> Any:
        return await self._request(
            "POST", "/api/v1/namespaces/{namespace}/pods/{name}/eviction", WIRE,
            path_params={"name": name, "namespace": namespace}, body=body, timeout=_request_timeout,
        )

    async def delete_namespaced_pod(self, name: str, namespace: str, *, body: object = None, _request_timeout: float | None = None) -> Any:
        return await self._request(
            "DELETE", "/api/v1/namespaces/{namespace}/pods/{name}", WIRE,
            path_params={"name": name, "namespace": namespace}, body=body, timeout=_request_timeout,
        )

    # --- Secrets -------------------------------------------------------------------------

    async def read_namespaced_secret(self, name: str, namespace: str, *, _request_timeout: float | None = None) -> Any:
        return await self._request(
            "GET", "/api/v1/namespaces/{namespace}/secrets/{name}", {"200": "V1Secret"}, path_params={"name": name, "namespace": namespace}, timeout=_request_timeout
        )

    async def create_namespaced_secret(self, namespace: str, body: object, *, _request_timeout: float | None = None) -> Any:
        return await self._request(
            "POST", "/api/v1/namespaces/{namespace}/secrets", {"200": "V1Secret", "201": "V1Secret", "202": "V1Secret"},
            path_params={"namespace": namespace}, body=body, timeout=_request_timeout,
        )

    async def patch_namespaced_secret(self, name: str, namespace: str, body: object, *, _content_type: str, _request_timeout: float | None = None) -> Any:
        return await self._request(
            "PATCH", "/api/v1/namespaces/{namespace}/secrets/{name}", {"200": "V1Secret", "201": "V1Secret"},
            path_params={"name": name, "namespace": namespace}, body=body, content_type=_content_type, timeout=_request_timeout,
        )

    async def list_namespaced_secret(self, namespace: str, **params: Any) -> Any:
        """A page of `namespace`'s Secrets (`_list_query` names the parameters)."""
        return await self._request(
            "GET", "/api/v1/namespaces/{namespace}/secrets", {"200": "V1SecretList"},
            path_params={"namespace": namespace}, query=_list_query(params), timeout=params.get("_request_timeout"),
        )

    async def delete_namespaced_secret(self, name: str, namespace: str, *, body: object = None, _request_timeout: float | None = None) -> Any:
        return await self._request(
            "DELETE", "/api/v1/namespaces/{namespace}/secrets/{name}", {"200": "object", "202": "object"},
            path_params={"name": name, "namespace": namespace}, body=body, timeout=_request_timeout,
        )

    # --- Events --------------------------------------------------------------------------

    async def create_namespaced_event(self, namespace: str, body: object, *, _request_timeout: float | None = None) -> None:
        await self._request(
            "POST", "/api/v1/namespaces/{namespace}/events", STATUS_ONLY,
            path_params={"namespace": namespace}, body=body, timeout=_request_timeout,
        )

    # --- custom resources' status ----------------------------------------------------------

    async def patch_custom_object_status(
        self, group: str, version: str, namespace: str | None, plural: str, name: str, body: object, *, _content_type: str, _request_timeout: float | None = None
    ) -> None:
        """CustomObjectsApi's patch_namespaced_custom_object_status (a `namespace`) or
        patch_cluster_custom_object_status (None); the answer's body is not read."""
        where = "/namespaces/{namespace}" if namespace else ""
        params = {"group": group, "version": version, "plural": plural, "name": name, **({"namespace": namespace} if namespace else {})}
        await self._request(
            "PATCH", f"/apis/{{group}}/{{version}}{where}/{{plural}}/{{name}}/status", STATUS_ONLY,
            path_params=params, body=body, content_type=_content_type, timeout=_request_timeout,
        )


# A list or watch call's keyword arguments as kubernetes.aio names them, and their query names.
_LIST_QUERY = {
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "_continue": "continue",
    "field_selector": "fieldSelector",
    "label_selector": "labelSelector",
    "limit": "limit",
    "resource_version": "resourceVersion",
    "timeout_seconds": "timeoutSeconds",
    "watch": "watch",
}


def _list_query(params: Mapping[str, Any]) -> dict[str, object | None]:
    unknown = set(params) - set(_LIST_QUERY) - {"_request_timeout"}
    if unknown:
        raise TypeError(f"unsupported list parameters: {', '.join(sorted(unknown))}")
    return {_LIST_QUERY[k]: v for k, v in params.items() if k in _LIST_QUERY}
