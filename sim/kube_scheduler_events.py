"""The Events kube-scheduler records on pods, for sim.scheduler: `Scheduled` when it binds one
and `FailedScheduling` when no Node fits, as events.k8s.io/v1 Events from `default-scheduler`
(`kubectl describe pod` lists them). The note of a FailedScheduling Event is in kube-scheduler's
words (framework.FitError): "0/3 nodes are available: 1 node(s) didn't match Pod's node
affinity/selector, 2 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 1
Preemption is not helpful for scheduling, 2 No preemption victims found for incoming pod.", or
"no nodes available to schedule pods" when the cluster has none.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from tgp.types import GPU_RESOURCE

REPORTING_CONTROLLER = "default-scheduler"
NO_NODES = "no nodes available to schedule pods"
_INSUFFICIENT_GPU = f"Insufficient {GPU_RESOURCE}"
# kube-scheduler's preemption (PostFilter) verdict per node: only a node short of resources
# could be freed by evicting pods of lower priority, and no pod here has a lower one.
_NO_VICTIMS = "No preemption victims found for incoming pod"
_NOT_HELPFUL = "Preemption is not helpful for scheduling"

Obj = Mapping[str, Any]


def failed_scheduling_note(reasons: Mapping[str, str | None], nodes: Mapping[str, Obj]) -> str:
    """kube-scheduler's message for a pod no Node fits: `reasons` is sim.scheduler.fits' answer
    per Node name, `nodes` the Nodes by name."""
    if not reasons:
        return NO_NODES
    why = {name: _kube_reason(reason, nodes.get(name) or {}) for name, reason in reasons.items() if reason}
    preemption = {name: _NO_VICTIMS if reason == _INSUFFICIENT_GPU else _NOT_HELPFUL for name, reason in why.items()}
    total = len(reasons)
    return f"0/{total} nodes are available: {_histogram(why)}. preemption: 0/{total} nodes are available: {_histogram(preemption)}."


def scheduling_event(pod: Obj, *, reason: str, note: str, warning: bool = False) -> dict[str, Any]:
    """An events.k8s.io/v1 Event about `pod` from the scheduler; POST it to the pod's namespace."""
    meta = pod["metadata"]
    now = datetime.now(UTC)
    return {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        # client-go's events recorder names an Event `<object>.<nanoseconds in hex>`.
        "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": meta["namespace"]},
        "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": f"{REPORTING_CONTROLLER}-{socket.gethostname()}",
        "action": "Binding" if reason == "Scheduled" else "Scheduling",
        "reason": reason, "note": note, "type": "Warning" if warning else "Normal",
        "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": meta["namespace"], "name": meta["name"],
                      "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")},
    }


def scheduled_note(pod: Obj, node: str) -> str:
    meta = pod["metadata"]
    return f"Successfully assigned {meta['namespace']}/{meta['name']} to {node}"


def _kube_reason(reason: str, node: Obj) -> str:
    """A reason of sim.scheduler.fits in kube-scheduler's words (its Filter plugins' messages)."""
    if reason == "node not ready or cordoned":
        if (node.get("spec") or {}).get("unschedulable"):
            return "node(s) were unschedulable"
        return "node(s) had untolerated taint {node.kubernetes.io/not-ready: }"
    if reason in ("node selector", "node affinity"):
        return "node(s) didn't match Pod's node affinity/selector"
    if reason.startswith("untolerated taint "):
        key = reason.removeprefix("untolerated taint ")
        value = next((t.get("value") or "" for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") == key), "")
        return f"node(s) had untolerated taint {{{key}: {value}}}"
    if reason == f"insufficient {GPU_RESOURCE}":
        return _INSUFFICIENT_GPU
    return reason


def _histogram(reasons: Mapping[str, str]) -> str:
    """`N reason` for each reason, sorted as strings (FitError.Error sorts them so)."""
    counts: dict[str, int] = {}
    for reason in reasons.values():
        counts[reason] = counts.get(reason, 0) + 1
    return ", ".join(sorted(f"{n} {reason}" for reason, n in counts.items()))
