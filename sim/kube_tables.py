"""Server-side printing for the embedded Kubernetes API: `meta.k8s.io/v1` Table responses.

`kubectl get` asks for `Accept: application/json;as=Table;v=v1;g=meta.k8s.io` and prints the
columns the server chooses; a server that answers with a plain list gets only NAME and AGE. The
real API server fills Tables from:

* a custom resource's `additionalPrinterColumns` (JSONPath per column; NAME first; AGE alone
  when the CRD declares none), k8s.io/apiextensions-apiserver/pkg/registry/customresource/
  tableconvertor;
* a printer per built-in kind (k8s.io/kubernetes/pkg/printers/internalversion); the ones here
  are Pods, Nodes, Events, Namespaces and Jobs, with the same columns and cell rules;
* `Name` and `Created At` for every other kind (k8s.io/apiserver/pkg/registry/rest/table.go).

Rows carry the object as `PartialObjectMetadata` (`includeObject=Metadata`, the default, which
kubectl uses for `-L` and `--show-labels`), the whole object (`Object`) or nothing (`None`).
The server generates the wide columns too (priority 1); kubectl shows them with `-o wide`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import attrs

Obj = dict[str, Any]

_NAME_DOC = (
    "Name must be unique within a namespace. Is required when creating resources, although some resources may "
    "allow a client to request the generation of an appropriate name automatically. Name is primarily intended "
    "for creation idempotence and configuration definition. Cannot be updated."
)
_CREATED_DOC = (
    "CreationTimestamp is a timestamp representing the server time when this object was created. It is not "
    "guaranteed to be set in happens-before order across separate operations. Clients may not set this value. "
    "It is represented in RFC3339 form and is in UTC."
)


def wants_table(accept: str) -> bool:
    """Whether an Accept header asks for a meta.k8s.io Table (v1 or v1beta1)."""
    for media in accept.split(","):
        parts = [p.strip() for p in media.split(";")]
        params = {k.strip(): v.strip() for k, _, v in (p.partition("=") for p in parts[1:])}
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io" and params.get("v") in ("v1", "v1beta1"):
            return True
    return False


def _column(name: str, type_: str = "string", *, description: str = "", priority: int = 0, format_: str = "") -> Obj:
    return {"name": name, "type": type_, "format": format_, "description": description, "priority": priority}


_NAME_COLUMN = _column("Name", format_="name", description=_NAME_DOC)


@attrs.frozen
class Convertor:
    """The columns of one kind and how to fill a row's cells from an object."""

    columns: tuple[Obj, ...]
    cells: Callable[[Obj], list[Any]]


# --- time --------------------------------------------------------------------------------


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def human_duration(seconds: float) -> str:
    """k8s.io/apimachinery/pkg/util/duration.HumanDuration."""
    whole = int(seconds)
    if whole < -1:
        return "<invalid>"
    if whole < 0:
        return "0s"
    if whole < 120:
        return f"{whole}s"
    minutes = whole // 60
    if minutes < 10:
        rest = whole % 60
        return f"{minutes}m" if rest == 0 else f"{minutes}m{rest}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = whole // 3600
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h" if rest == 0 else f"{hours}h{rest}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rest = hours % 24
        return f"{hours // 24}d" if rest == 0 else f"{hours // 24}d{rest}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def since(value: Any) -> str:
    """translateTimestampSince: the age of a timestamp, `<unknown>` when there is none."""
    moment = _parse_time(value)
    if moment is None:
        return "<unknown>"
    return human_duration((datetime.now(UTC) - moment).total_seconds())


# --- JSONPath (the subset CRD printer columns use) ---------------------------------------

_TOKEN = re.compile(
    r"""\.\.(?P<recursive>[A-Za-z0-9_$-]+|\*)?"""
    r"""|\.(?P<field>[A-Za-z0-9_$/-]+|\*)"""
    r"""|\[(?P<bracket>(?:'[^']*'|"[^"]*"|[^\]])*)\]"""
)
_FILTER = re.compile(r"""^\?\(\s*@(?P<path>(?:\.[A-Za-z0-9_$/-]+|\[[^\]]*\])*)\s*(?:(?P<op>==|!=|<=|>=|<|>)\s*(?P<value>.+?))?\s*\)$""")


class JSONPathError(ValueError):
    pass


def _steps(path: str) -> list[tuple[str, Any]]:
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1].strip()
    if text.startswith("$"):
        text = text[1:]
    if text and not text.startswith((".", "[")):
        text = "." + text
    steps: list[tuple[str, Any]] = []
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise JSONPathError(f"unrecognized JSONPath at {text[position:]!r}")
        position = match.end()
        if match.group("recursive") is not None or text[match.start():match.start() + 2] == "..":
            steps.append(("recursive", match.group("recursive") or "*"))
        elif match.group("field") is not None:
            field = match.group("field")
            steps.append(("all", None) if field == "*" else ("field", field))
        else:
            steps.append(_bracket(match.group("bracket").strip()))
    return steps


def _bracket(inner: str) -> tuple[str, Any]:
    if inner == "*":
        return ("all", None)
    if inner[:1] in ("'", '"') and inner[-1:] == inner[:1]:
        return ("field", inner[1:-1])
    if inner.startswith("?"):
        match = _FILTER.match(inner)
        if match is None:
            raise JSONPathError(f"unsupported filter {inner!r}")
        value = match.group("value")
        literal: Any = None
        if value is not None:
            value = value.strip()
            if value[:1] in ("'", '"'):
                literal = value[1:-1]
            elif value in ("true", "false"):
                literal = value == "true"
            else:
                try:
                    literal = json.loads(value)
                except ValueError:
                    raise JSONPathError(f"unsupported filter value {value!r}") from None
        return ("filter", (_steps(match.group("path") or ""), match.group("op"), literal))
    if ":" in inner:
        parts = [int(p) if p.strip() else None for p in inner.split(":")]
        return ("slice", slice(*parts))
    try:
        return ("index", int(inner))
    except ValueError:
        raise JSONPathError(f"unsupported subscript [{inner}]") from None


def _apply(values: list[Any], step: tuple[str, Any]) -> list[Any]:
    kind, arg = step
    out: list[Any] = []
    for value in values:
        if kind == "field":
            if isinstance(value, Mapping) and arg in value:
                out.append(value[arg])
        elif kind == "all":
            out.extend(value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else [])
        elif kind == "index":
            if isinstance(value, list) and -len(value) <= arg < len(value):
                out.append(value[arg])
        elif kind == "slice":
            if isinstance(value, list):
                out.extend(value[arg])
        elif kind == "filter":
            path, op, literal = arg
            for item in value if isinstance(value, list) else value.values() if isinstance(value, Mapping) else []:
                found = _evaluate(item, path)
                if op is None:
                    if found:
                        out.append(item)
                elif found and _compare(found[0], op, literal):
                    out.append(item)
        elif kind == "recursive":
            out.extend(_apply(list(_descendants(value)), ("all", None) if arg == "*" else ("field", arg)))
    return out


def _descendants(value: Any) -> Iterable[Any]:
    yield value
    children = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else []
    for child in children:
        yield from _descendants(child)


def _compare(left: Any, op: str, right: Any) -> bool:
    if op == "==":
        return bool(left == right)
    if op == "!=":
        return bool(left != right)
    try:
        return bool({"<": left < right, ">": left > right, "<=": left <= right, ">=": left >= right}[op])
    except TypeError:
        return False


def _evaluate(value: Any, steps: Sequence[tuple[str, Any]]) -> list[Any]:
    values = [value]
    for step in steps:
        values = _apply(values, step)
    return values


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Every value `path` (k8s.io/client-go/util/jsonpath syntax, with or without braces)
    selects in `obj`."""
    return _evaluate(obj, _steps(path))


# --- cells -------------------------------------------------------------------------------


def _go_print(value: Any) -> str:
    """A value as the JSONPath printer writes it (strings bare, the rest as JSON)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def _typed_cell(type_: str, value: Any) -> Any:
    """cellForJSONValue of the CRD table convertor."""
    if value is None:
        return None
    if type_ == "string":
        return _go_print(value)
    if type_ == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    if type_ == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if type_ == "boolean" and isinstance(value, bool):
        return value
    if type_ == "date" and isinstance(value, str):
        return since(value) if _parse_time(value) is not None else "<invalid>"
    return None


def custom_resource(printer_columns: Sequence[Mapping[str, Any]]) -> Convertor:
    """The Table convertor of a CRD version with these additionalPrinterColumns."""
    declared = list(printer_columns) or [{
        "name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp", "description": _CREATED_DOC,
    }]
    columns = [_NAME_COLUMN] + [
        _column(
            str(c.get("name")), str(c.get("type") or "string"), description=str(c.get("description") or ""),
            priority=int(c.get("priority") or 0), format_=str(c.get("format") or ""),
        )
        for c in declared
    ]
    paths = []
    for column in declared:
        try:
            paths.append(_steps(str(column.get("jsonPath") or "")))
        except JSONPathError:
            paths.append(None)  # the API server refuses such a CRD; here the cell stays empty

    def cells(obj: Obj) -> list[Any]:
        row: list[Any] = [(obj.get("metadata") or {}).get("name")]
        for column, steps in zip(declared, paths, strict=True):
            found = _evaluate(obj, steps) if steps is not None else []
            row.append(_typed_cell(str(column.get("type") or "string"), found[0]) if found else None)
        return row

    return Convertor(tuple(columns), cells)


def _default_cells(obj: Obj) -> list[Any]:
    meta = obj.get("metadata") or {}
    created = _parse_time(meta.get("creationTimestamp"))
    return [meta.get("name"), created.strftime("%Y-%m-%dT%H:%M:%SZ") if created else None]


DEFAULT = Convertor((_NAME_COLUMN, _column("Created At", "date", description=_CREATED_DOC)), _default_cells)


# --- built-in printers (pkg/printers/internalversion/printers.go) -------------------------


def _pod_cells(pod: Obj) -> list[Any]:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    reason = status.get("reason") or status.get("phase") or ""
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "SchedulingGated":
            reason = "SchedulingGated"
    restarts, ready, running = 0, 0, False
    last_restart: datetime | None = None
    for container in reversed(status.get("containerStatuses") or []):
        restarts += int(container.get("restartCount") or 0)
        finished = _parse_time(((container.get("lastState") or {}).get("terminated") or {}).get("finishedAt"))
        if finished is not None and (last_restart is None or finished > last_restart):
            last_restart = finished
        state = container.get("state") or {}
        waiting, terminated = state.get("waiting"), state.get("terminated")
        if waiting and waiting.get("reason"):
            reason = waiting["reason"]
        elif terminated and terminated.get("reason"):
            reason = terminated["reason"]
        elif terminated:
            reason = f"Signal:{terminated['signal']}" if terminated.get("signal") else f"ExitCode:{terminated.get('exitCode', 0)}"
        elif container.get("ready") and state.get("running") is not None:
            running = True
            ready += 1
    if reason == "Completed" and running:
        has_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        reason = "Running" if has_ready else "NotReady"
    if meta.get("deletionTimestamp") and status.get("reason") == "NodeLost":
        reason = "Unknown"
    elif meta.get("deletionTimestamp") and status.get("phase") not in ("Succeeded", "Failed"):
        reason = "Terminating"
    shown_restarts = str(restarts)
    if restarts and last_restart is not None:
        shown_restarts = f"{restarts} ({human_duration((datetime.now(UTC) - last_restart).total_seconds())} ago)"
    ips = status.get("podIPs") or []
    ip = (ips[0].get("ip") if ips else None) or status.get("podIP") or "<none>"
    gates = spec.get("readinessGates") or []
    if gates:
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        met = sum(1 for g in gates if conditions.get(g.get("conditionType")) == "True")
        shown_gates = f"{met}/{len(gates)}"
    else:
        shown_gates = "<none>"
    return [
        meta.get("name"), f"{ready}/{len(spec.get('containers') or [])}", reason, shown_restarts,
        since(meta.get("creationTimestamp")),
        ip, spec.get("nodeName") or "<none>", status.get("nominatedNodeName") or "<none>", shown_gates,
    ]


PODS = Convertor((
    _NAME_COLUMN,
    _column("Ready", description="The aggregate readiness state of this pod for accepting traffic."),
    _column("Status", description="The aggregate status of the containers in this pod."),
    _column("Restarts", description=(
        "The number of times the containers in this pod have been restarted and when the last container in "
        "this pod has restarted."
    )),
    _column("Age", description=_CREATED_DOC),
    _column("IP", priority=1, description="podIP address allocated to the pod. Routable at least within the cluster."),
    _column("Node", priority=1, description="NodeName indicates in which node this pod is scheduled."),
    _column("Nominated Node", priority=1, description="nominatedNodeName is set when this pod preempts other pods on the node."),
    _column("Readiness Gates", priority=1, description="If specified, all readiness gates will be evaluated for pod readiness."),
), _pod_cells)


def _node_address(node: Obj, kind: str) -> str:
    for address in (node.get("status") or {}).get("addresses") or []:
        if address.get("type") == kind:
            return str(address.get("address"))
    return "<none>"


def _node_cells(node: Obj) -> list[Any]:
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    shown = []
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            shown = ["Ready" if condition.get("status") == "True" else "NotReady"]
    if not shown:
        shown = ["Unknown"]
    if spec.get("unschedulable"):
        shown.append("SchedulingDisabled")
    roles = set()
    for key, value in (meta.get("labels") or {}).items():
        if key.startswith("node-role.kubernetes.io/") and key.removeprefix("node-role.kubernetes.io/"):
            roles.add(key.removeprefix("node-role.kubernetes.io/"))
        elif key == "kubernetes.io/role" and value:
            roles.add(value)
    info = status.get("nodeInfo") or {}
    return [
        meta.get("name"), ",".join(shown), ",".join(sorted(roles)) or "<none>", since(meta.get("creationTimestamp")),
        info.get("kubeletVersion") or "",
        _node_address(node, "InternalIP"), _node_address(node, "ExternalIP"),
        info.get("osImage") or "<unknown>", info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]


NODES = Convertor((
    _NAME_COLUMN,
    _column("Status", description="The status of the node"),
    _column("Roles", description="The roles of the node"),
    _column("Age", description=_CREATED_DOC),
    _column("Version", description="Kubelet Version reported by the node."),
    _column("Internal-IP", priority=1, description="List of addresses reachable to the node."),
    _column("External-IP", priority=1, description="List of addresses reachable to the node."),
    _column("OS-Image", priority=1, description="OS Image reported by the node from /etc/os-release (e.g. Debian GNU/Linux 7 (wheezy))."),
    _column("Kernel-Version", priority=1, description="Kernel Version reported by the node from 'uname -r' (e.g. 3.16.0-0.bpo.4-amd64)."),
    _column("Container-Runtime", priority=1, description="ContainerRuntime Version reported by the node through runtime remote API (e.g. containerd://1.4.2)."),
), _node_cells)


def _event_cells(event: Obj) -> list[Any]:
    def field(core: str, v1: str) -> Any:
        return event.get(core) if event.get(core) not in (None, "") else event.get(v1)

    meta = event.get("metadata") or {}
    first = field("firstTimestamp", "deprecatedFirstTimestamp")
    first_seen = since(first) if first else since(event.get("eventTime"))
    last = field("lastTimestamp", "deprecatedLastTimestamp")
    last_seen = since(last) if last else first_seen
    count = field("count", "deprecatedCount") or 0
    series = event.get("series")
    if series:
        last_seen = since(series.get("lastObservedTime"))
        count = series.get("count") or 0
    elif not count:
        count = 1
    involved = field("involvedObject", "regarding") or {}
    kind = str(involved.get("kind") or "").lower()
    target = f"{kind}/{involved['name']}" if involved.get("name") else kind
    source = field("source", "deprecatedSource") or {}
    component = source.get("component") or field("reportingComponent", "reportingController") or ""
    host = source.get("host") or event.get("reportingInstance") or ""
    shown_source = f"{component}, {host}" if host and component else component or host
    return [
        last_seen, event.get("type") or "", event.get("reason") or "", target, involved.get("fieldPath") or "",
        shown_source, str(field("message", "note") or "").strip(), first_seen, int(count), meta.get("name"),
    ]


EVENTS = Convertor((
    _column("Last Seen", description="The time at which the most recent occurrence of this event was recorded."),
    _column("Type", description="Type of this event (Normal, Warning), new types could be added in the future"),
    _column("Reason", description="This should be a short, machine understandable string that gives the reason for the transition into the object's current status."),
    _column("Object", description="The object that this event is about."),
    _column("Subobject", priority=1, description="If referring to a piece of an object instead of an entire object, this string should contain a valid JSON/Go field access statement."),
    _column("Source", priority=1, description="The component reporting this event. Should be a short machine understandable string."),
    _column("Message", description="A human-readable description of the status of this operation."),
    _column("First Seen", priority=1, description="The time at which the event was first recorded. (Time of server receipt is in TypeMeta.)"),
    _column("Count", priority=1, description="The number of times this event has occurred."),
    _column("Name", priority=1, format_="name", description=_NAME_DOC),
), _event_cells)


def _namespace_cells(namespace: Obj) -> list[Any]:
    meta = namespace.get("metadata") or {}
    return [meta.get("name"), (namespace.get("status") or {}).get("phase") or "Active", since(meta.get("creationTimestamp"))]


NAMESPACES = Convertor((
    _NAME_COLUMN,
    _column("Status", description="The status of the namespace"),
    _column("Age", description=_CREATED_DOC),
), _namespace_cells)


def _label_selector(selector: Mapping[str, Any] | None) -> str:
    """metav1.FormatLabelSelector."""
    if selector is None:
        return ""
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In":
            terms.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            terms.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            terms.append(str(key))
        elif op == "DoesNotExist":
            terms.append(f"!{key}")
    return ",".join(terms) or "<none>"


def _job_cells(job: Obj) -> list[Any]:
    meta, spec, status = job.get("metadata") or {}, job.get("spec") or {}, job.get("status") or {}
    succeeded = int(status.get("succeeded") or 0)
    if spec.get("completions") is not None:
        completions = f"{succeeded}/{spec['completions']}"
    elif int(spec.get("parallelism") or 0) > 1:
        completions = f"{succeeded}/1 of {spec['parallelism']}"
    else:
        completions = f"{succeeded}/1"
    started, finished = _parse_time(status.get("startTime")), _parse_time(status.get("completionTime"))
    if started is None:
        duration = ""
    elif finished is None:
        duration = human_duration((datetime.now(UTC) - started).total_seconds())
    else:
        duration = human_duration((finished - started).total_seconds())
    conditions = {c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "Complete" in conditions:
        shown = "Complete"
    elif "Failed" in conditions:
        shown = "Failed"
    elif meta.get("deletionTimestamp"):
        shown = "Terminating"
    else:
        shown = next((c for c in ("Suspended", "FailureTarget", "SuccessCriteriaMet") if c in conditions), "Running")
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    return [
        meta.get("name"), shown, completions, duration, since(meta.get("creationTimestamp")),
        ",".join(str(c.get("name")) for c in containers), ",".join(str(c.get("image")) for c in containers),
        _label_selector(spec.get("selector")),
    ]


JOBS = Convertor((
    _NAME_COLUMN,
    _column("Status", description="Status of the job."),
    _column("Completions", description="The number of pods which reached phase Succeeded."),
    _column("Duration", description="Time required to complete the job."),
    _column("Age", description=_CREATED_DOC),
    _column("Containers", priority=1, description="Names of each container in the template."),
    _column("Images", priority=1, description="Images referenced by each container in the template."),
    _column("Selector", priority=1, description="A label query over pods that should match the pod count."),
), _job_cells)

BUILT_IN: dict[tuple[str, str], Convertor] = {
    ("", "Pod"): PODS,
    ("", "Node"): NODES,
    ("", "Event"): EVENTS,
    ("events.k8s.io", "Event"): EVENTS,
    ("", "Namespace"): NAMESPACES,
    ("batch", "Job"): JOBS,
}


def built_in(group: str, kind: str) -> Convertor:
    """The printer of a built-in kind, or the default Name / Created At one."""
    return BUILT_IN.get((group, kind), DEFAULT)


# --- the Table ----------------------------------------------------------------------------


def _row_object(obj: Obj, include: str) -> Obj | None:
    if include == "Object":
        return obj
    if include == "None":
        return None
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata") or {}}


def include_object(params: Mapping[str, str]) -> str:
    """The `includeObject` option (None, Metadata or Object); Metadata by default."""
    value = params.get("includeObject") or "Metadata"
    if value not in ("None", "Metadata", "Object"):
        raise ValueError(f"includeObject: Unsupported value: {value!r}: supported values: \"None\", \"Metadata\", \"Object\"")
    return value


def table(
    convertor: Convertor, objects: Iterable[Obj], *, include: str = "Metadata", resource_version: str | None = None,
    columns: bool = True,
) -> Obj:
    """A meta.k8s.io/v1 Table of `objects`; `columns=False` leaves out the column definitions
    (watch events after the first, as the server sends them)."""
    rows = []
    for obj in objects:
        row: Obj = {"cells": convertor.cells(obj)}
        shown = _row_object(obj, include)
        if shown is not None:
            row["object"] = shown
        rows.append(row)
    metadata: Obj = {}
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    return {
        "kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": metadata,
        "columnDefinitions": list(convertor.columns) if columns else None, "rows": rows,
    }
