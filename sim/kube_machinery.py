"""The vocabulary every part of the embedded Kubernetes API (`sim.kube`) shares, after
k8s.io/apimachinery: the built-in resources the emulator treats specially, the media types of
patches, `Obj` (an object as decoded JSON), the `kind: Status` failures the API server answers
(`ApiStatus`: 404, 409 Conflict, 422 Invalid with its `FieldError` causes, values in messages
printed as Go prints them), the Go types built-in kinds' fields decode into (`decode_builtin`),
metav1 times, and the few request options read everywhere.

It knows nothing of storage, watches or schemas: kube_schema, kube_events, kube_selection,
kube_store, kube_watch, kube_eviction and kube_kubelet build on it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import attrs
import kmock

NODES = kmock.resource("", "v1", "nodes")
PODS = kmock.resource("", "v1", "pods")
PDBS = kmock.resource("policy", "v1", "poddisruptionbudgets")
EVENTS = kmock.resource("", "v1", "events")
EVENTS_V1 = kmock.resource("events.k8s.io", "v1", "events")
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch"

Obj = dict[str, Any]

# The Go types that built-in kinds' top-level fields decode into: a write whose field holds
# another JSON type is refused before anything else is looked at (`decode_builtin`).
DECODED_FIELDS: dict[str, dict[str, str]] = {
    **{kind: {"spec": f"v1.{kind}Spec", "status": f"v1.{kind}Status"}
       for kind in ("Pod", "Node", "Namespace", "Deployment", "ReplicaSet", "Job", "PodDisruptionBudget")},
    "Secret": {"data": "map[string][]uint8", "stringData": "map[string]string"},
    "ConfigMap": {"data": "map[string]string", "binaryData": "map[string][]uint8"},
}
_JSON_TYPE_NAMES = {str: "string", bool: "bool", int: "number", float: "number", list: "array"}
# Where an object is stored: its storage resource, namespace (None if cluster-scoped) and name.
Key = tuple[kmock.resource, str | None, str]


def key_of(storage: kmock.resource, obj: Obj) -> Key:
    """Where `obj`, stored at `storage`, is kept."""
    meta = obj.get("metadata") or {}
    return (storage, meta.get("namespace") or None, meta.get("name"))


def decode_builtin(kind: str, obj: Obj) -> str | None:
    """A built-in `kind`'s top-level fields decoded as encoding/json decodes them: what it says
    when one holds a JSON type its Go type cannot take (a string spec: `json: cannot unmarshal
    string into Go struct field Pod.spec of type v1.PodSpec`), else None, with `obj`'s null
    fields changed in place to what Go stores for them (an empty struct `{}`, no map). Only the
    top level: a Secret's data values are not checked."""
    for field, go_type in DECODED_FIELDS.get(kind, {}).items():
        value = obj.get(field)
        if value is None and field in obj:
            if go_type.startswith("map["):
                del obj[field]
            else:
                obj[field] = {}
        elif value is not None and not isinstance(value, Mapping):
            return f"json: cannot unmarshal {_JSON_TYPE_NAMES.get(type(value), 'value')} into Go struct field {kind}.{field} of type {go_type}"
    return None


class ApiStatus(Exception):
    """A failure the emulator answers with a `kind: Status` body, as the API server does."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def render(self) -> aiohttp.web.Response:
        return aiohttp.web.json_response(status_body(self.code, self.reason, self.message, self.details), status=self.code)


def status_body(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> Obj:
    payload: Obj = {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    }
    if details:
        payload["details"] = {k: v for k, v in details.items() if v not in (None, "")}
    return payload


def same_resource(a: kmock.resource, b: kmock.resource) -> bool:
    """`a == b`, answered at once for the same object or another plural: kmock's resource
    equality (a `match` over its types) was a seventh of the emulator's CPU in `make bench`'s
    burst of 500, where each list and watch walked the whole store (Events, Leases, Nodes, pods)."""
    return a is b or (a.plural == b.plural and a == b)


def qualified_resource(resource: kmock.resource) -> str:
    """`plural.group` (or `plural` for the core group), as errors name a resource."""
    return f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)


def no_such_resource() -> ApiStatus:
    return ApiStatus(404, "NotFound", "the server could not find the requested resource")


def conflict(resource: kmock.resource, name: str | None, problem: str | None = None) -> ApiStatus:
    problem = problem or "the object has been modified; please apply your changes to the latest version and try again"
    return ApiStatus(
        409, "Conflict", f'Operation cannot be fulfilled on {qualified_resource(resource)} "{name}": {problem}',
        {"name": name, "group": resource.group, "kind": resource.plural},
    )


def invalid(group: str, kind: str, name: str, errors: list[FieldError]) -> ApiStatus:
    """422 Invalid, as apierrors.NewInvalid builds it: one message naming every field."""
    messages = list(dict.fromkeys(str(e) for e in errors))
    aggregate = messages[0] if len(messages) == 1 else f"[{', '.join(messages)}]"
    qualified = f"{kind}.{group}" if group else kind
    return ApiStatus(422, "Invalid", f'{qualified} "{name}" is invalid: {aggregate}', {
        "name": name, "group": group, "kind": kind,
        "causes": [{"reason": e.reason, "message": e.body, "field": e.field} for e in errors],
    })


@attrs.frozen
class FieldError:
    """k8s.io/apimachinery field.Error: a cause of a 422 Invalid."""

    reason: str  # the cause type, e.g. FieldValueInvalid
    field: str
    body: str  # the message without the field, e.g. `Invalid value: 200: ...`

    def __str__(self) -> str:
        return f"{self.field}: {self.body}"

    @classmethod
    def invalid(cls, field: str, value: Any, detail: str) -> FieldError:
        return cls("FieldValueInvalid", field, f"Invalid value: {go_value(value)}: {detail}")

    @classmethod
    def required(cls, field: str, detail: str = "") -> FieldError:
        return cls("FieldValueRequired", field, f"Required value: {detail}" if detail else "Required value")

    @classmethod
    def not_supported(cls, field: str, value: Any, supported: list[str]) -> FieldError:
        quoted = ", ".join(json.dumps(s) for s in supported)
        return cls("FieldValueNotSupported", field, f"Unsupported value: {go_value(value)}: supported values: {quoted}")


def go_number(value: float) -> str:
    """A number as Go's %v prints it."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    return str(value)


def go_value(value: Any) -> str:
    """A bad value as field.Error prints it: strings quoted, numbers and booleans bare."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return go_number(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, separators=(",", ":"))


def now_time() -> str:
    """The current time as metav1.Time is written."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_time(timestamp: float) -> str:
    """RFC 3339 with whole seconds, as metav1.Time is written."""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def api_version(resource: kmock.resource) -> str:
    return f"{resource.group}/{resource.version}" if resource.group else str(resource.version)


def media_type(request: kmock.Request) -> str:
    """The request's Content-Type without its parameters, in lower case."""
    for key, value in request.headers.items():
        if key.lower() == "content-type":
            return value.split(";")[0].strip().lower()
    return ""


def is_true(value: str | None) -> bool:
    """Go's strconv.ParseBool, which the API server uses for `watch`."""
    return value in ("1", "t", "T", "true", "TRUE", "True")
