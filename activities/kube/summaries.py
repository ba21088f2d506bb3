"""What tgp reads of Nodes and Pods as the API serves them (camelCase JSON): one reading of each,
shared by the Cluster adapter's reads, the bridge's informers and `tgp plan`, so that all of them
agree on which Node is Ready and which pods keep a node busy."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from tgp.disruption import do_not_disrupt
from tgp.types import GPU_RESOURCE, NodeSummary, PodSummary, Taint

MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


def _count(quantity: str | None) -> int:
    """A whole-number extended resource (`nvidia.com/gpu: "8"`); 0 when absent or unreadable."""
    try:
        return max(0, int(Decimal(str(quantity).strip()))) if quantity is not None else 0
    except (InvalidOperation, ValueError):
        return 0


def node_summary_of(obj: Mapping[str, Any]) -> NodeSummary:
    """What tgp reads of a Node as the API serves it (camelCase JSON): a read's answer or an
    informer's object, read by the same rules."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    return NodeSummary(
        name=meta.get("name") or "",
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []),
        labels=dict(meta.get("labels") or {}),
        taints=[Taint(key=t.get("key"), value=t.get("value") or "", effect=t.get("effect")) for t in spec.get("taints") or []],
        unschedulable=bool(spec.get("unschedulable")),
        gpus=_count((status.get("allocatable") or {}).get(GPU_RESOURCE)),
        do_not_disrupt=do_not_disrupt(meta.get("annotations")),
        deleting=bool(meta.get("deletionTimestamp")),
    )


def pod_summary_of(obj: Mapping[str, Any]) -> PodSummary:
    """What tgp reads of a Pod as the API serves it (camelCase JSON): a listing's item or an
    informer's object, one reading, so the bridge and the activities agree on which pods keep a
    node busy."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    controller = next((ref for ref in meta.get("ownerReferences") or [] if ref.get("controller")), None)
    containers = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
    return PodSummary(
        namespace=meta.get("namespace") or "",
        name=meta.get("name") or "",
        uid=meta.get("uid") or "",
        phase=status.get("phase") or "Pending",
        owner_kind=controller.get("kind") if controller else None,
        is_mirror=MIRROR_ANNOTATION in (meta.get("annotations") or {}),
        requests_gpu=any(_wants_gpu(c) for c in containers),
        deleting=bool(meta.get("deletionTimestamp")),
        do_not_disrupt=do_not_disrupt(meta.get("annotations")),
        **_grace(spec.get("terminationGracePeriodSeconds")),
    )


def _grace(seconds: object) -> dict[str, timedelta]:
    """A pod's terminationGracePeriodSeconds as PodSummary's grace_period (absent: its default)."""
    return {"grace_period": timedelta(seconds=max(0, int(seconds)))} if isinstance(seconds, int) else {}


def _wants_gpu(container: Mapping[str, Any]) -> bool:
    resources = container.get("resources") or {}
    return any(_positive_quantity(amounts.get(GPU_RESOURCE)) for amounts in (resources.get("requests") or {}, resources.get("limits") or {}))


def _positive_quantity(quantity: str | None) -> bool:
    if quantity is None:
        return False
    text = str(quantity).strip()
    try:
        return Decimal(text.removesuffix("m")) > 0
    except InvalidOperation:
        return text not in ("", "0")  # unusual suffixes: only an explicit zero means none
