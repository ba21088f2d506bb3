"""Eviction and graceful deletion of Pods in the embedded Kubernetes API (`sim.kube`):
`KubeEviction`, the layer of `KubeEmulator` on top of kube_watch's `KubeWatch`:

* the Eviction subresource (policy/v1 and policy/v1beta1, see `eviction_versions`) with
  PodDisruptionBudget checks: 429 when the budget forbids it, counted as the disruption
  controller does (minAvailable, or maxUnavailable and percentages against the replicas of the
  pods' controllers), 500 for a pod under two budgets;
* graceful deletion of Pods: a DELETE or an accepted Eviction sets `deletionTimestamp` (now plus
  the grace period) and `deletionGracePeriodSeconds` (from the DeleteOptions, else the pod's
  `terminationGracePeriodSeconds`, defaulted to 30 at create); the pod stays, Terminating, until
  the grace period has passed, then goes (DELETED). Unbound and finished pods and a grace period
  of 0 go at once; a later delete may shorten the grace period, never lengthen it.

The emulator plays the kubelet's last step of a graceful deletion (the final delete once the
containers stopped) with a wall-clock timer, as if every container used its whole grace period.
Finalizers of other kinds are kube_store's.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import attrs
import kmock

from sim.kube_machinery import PDBS, PODS, ApiStatus, Key, Obj, format_time, parse_time
from sim.kube_store import DEFAULT_GRACE_SECONDS
from sim.kube_watch import KubeWatch

# Controllers whose `spec.replicas` a PodDisruptionBudget counts against.
_SCALABLE_OWNERS = {
    "ReplicaSet": kmock.resource("apps", "v1", "replicasets"),
    "StatefulSet": kmock.resource("apps", "v1", "statefulsets"),
    "ReplicationController": kmock.resource("", "v1", "replicationcontrollers"),
}


@attrs.define(kw_only=True)
class KubeEviction(KubeWatch):
    """The store with Pods' eviction and graceful deletion. A layer of `KubeEmulator`, not used
    alone.

    Test knob: `eviction_versions`.
    """

    eviction_versions: frozenset[str] = frozenset({"policy/v1", "policy/v1beta1"})
    """Eviction apiVersions the server accepts; `{"policy/v1beta1"}` plays a pre-1.22 server."""

    # The kubelet's final delete of each pod in graceful deletion, due when its grace period ends.
    _grace_timers: dict[Key, asyncio.TimerHandle] = attrs.field(factory=dict, init=False)

    async def _serve_eviction(self, request: kmock.Request) -> kmock.Payload:
        """POST pods/<name>/eviction: 201 when allowed, 429 when a PDB forbids it."""
        assert request.namespace is not None and request.name is not None
        body = request.data if isinstance(request.data, Mapping) else {}
        if body.get("kind") != "Eviction" or body.get("apiVersion") not in self.eviction_versions:
            raise ApiStatus(
                400, "BadRequest",
                f'no kind "{body.get("kind")}" is registered for version "{body.get("apiVersion")}"',
            )
        if (body.get("metadata") or {}).get("name") != request.name:
            raise ApiStatus(400, "BadRequest", "name in URL does not match name in Eviction object")
        key, pod = self._existing(PODS, request.namespace, request.name)
        self._check_disruption_budget(pod, request.namespace)
        self._delete_pod(key, pod, grace_seconds((body.get("deleteOptions") or {}).get("gracePeriodSeconds")))
        return kmock.Response(status=201, payload={
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201,
        })

    def _check_disruption_budget(self, pod: Obj, namespace: str) -> None:
        """Raise 429 if a PodDisruptionBudget forbids evicting `pod` now. Pods that are not
        Running (or already deleting) go regardless, as in the real eviction handler."""
        if pod.get("status", {}).get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
            return
        labels = pod["metadata"].get("labels") or {}
        budgets = [
            obj.raw for (_, ns, _), obj in self.stored(PDBS)
            if ns == namespace and not obj.deleted
            if _selector_matches(obj.raw.get("spec", {}).get("selector"), labels)
        ]
        if not budgets:
            return
        if len(budgets) > 1:
            raise ApiStatus(
                500, "InternalError",
                "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
            )
        budget = budgets[0]
        selector = budget.get("spec", {}).get("selector")
        covered = [
            obj.raw for (_, ns, _), obj in self.stored(PODS)
            if ns == namespace and not obj.deleted
            if _selector_matches(selector, obj.raw["metadata"].get("labels") or {})
        ]
        healthy = sum(1 for p in covered if _pod_healthy(p))
        spec = budget.get("spec", {})
        name = budget["metadata"]["name"]
        if isinstance(spec.get("minAvailable"), int):
            desired = spec["minAvailable"]
        else:
            # maxUnavailable and percentages count against the owners' replicas, as the
            # disruption controller does; without known owners it cannot compute a budget.
            expected = self._expected_pods(covered, namespace)
            if expected is None:
                raise ApiStatus(
                    429, "TooManyRequests",
                    f"Cannot evict pod as it would violate the pod's disruption budget. The disruption budget {name} "
                    "does not have a computed status: its pods have no known controller with replicas",
                )
            desired = _desired_healthy(spec, expected=expected)
        # policy/v1's default unhealthyPodEvictionPolicy (IfHealthyBudget): an unhealthy pod may
        # go while the budget is met; a healthy one only while a disruption is still allowed.
        allowed = healthy - desired >= 1 if _pod_healthy(pod) else healthy >= desired
        if allowed:
            return
        raise ApiStatus(
            429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.",
            {"causes": [{
                "reason": "DisruptionBudget",
                "message": f"The disruption budget {name} needs {desired} healthy pods and has {healthy} currently",
            }]},
        )

    def _expected_pods(self, pods: list[Obj], namespace: str) -> int | None:
        """Sum of `spec.replicas` of the pods' controllers, or None if one is unknown."""
        owners: set[tuple[str, str]] = set()
        for pod in pods:
            ref = next((r for r in pod["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
            if ref is None or ref.get("kind") not in _SCALABLE_OWNERS:
                return None
            owners.add((ref["kind"], ref["name"]))
        total = 0
        for kind, owner_name in owners:
            key = (_SCALABLE_OWNERS[kind], namespace, owner_name)
            if key not in self.objects or self.objects[key].deleted:
                return None
            total += int(self.objects[key].raw.get("spec", {}).get("replicas", 1))
        return total

    # --- graceful deletion ---------------------------------------------------------------

    def _delete_dependent(self, key: Key, current: Obj) -> None:
        if key[0] == PODS:
            self._delete_pod(key, current, None)  # the garbage collector deletes pods gracefully
        else:
            super()._delete_dependent(key, current)

    def _delete_pod(self, key: Key, current: Obj, requested: int | None) -> Obj:
        """Delete a Pod gracefully, as the API server's pod strategy and generic registry do
        (CheckGracefulDelete, BeforeDelete); the pod afterwards. `requested` is the
        DeleteOptions' gracePeriodSeconds."""
        meta, spec = current["metadata"], current.get("spec") or {}
        if requested is not None and requested < 0:
            requested = 1  # a negative grace period means 1 s
        now = datetime.now(UTC).timestamp()
        pending = meta.get("deletionGracePeriodSeconds")
        if meta.get("deletionTimestamp"):
            if pending and (requested is None or requested >= pending):
                return current  # a graceful deletion under way can only be shortened
            period = requested if pending and requested is not None else 0
            if not pending and meta.get("finalizers"):
                return current  # due already, waiting for its finalizers
            # The deletionTimestamp is when the deletion is due: it moves earlier by the difference.
            due = parse_time(meta["deletionTimestamp"]) - pending + period if pending else now
        else:
            default = spec.get("terminationGracePeriodSeconds")
            period = requested if requested is not None else (DEFAULT_GRACE_SECONDS if default is None else int(default))
            if not spec.get("nodeName") or (current.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                period = 0  # no kubelet runs it, or its containers have stopped already
            due = now + period
        timer = self._grace_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if period == 0 and not meta.get("finalizers"):
            return self._remove(key, current)
        marked = copy.deepcopy(current)
        marked_meta = marked["metadata"]
        if not meta.get("deletionTimestamp") and int(marked_meta.get("generation") or 0) > 0:
            marked_meta["generation"] = int(marked_meta["generation"]) + 1
        marked_meta.update(deletionTimestamp=format_time(due), deletionGracePeriodSeconds=period)
        marked_meta["resourceVersion"] = self._next_resource_version()
        self.objects[key].history.append(marked)
        self._publish(key[0], "MODIFIED", marked, current)
        if period > 0:
            self._grace_timers[key] = asyncio.get_running_loop().call_later(
                max(0.0, due - now), self._grace_elapsed, key, meta.get("uid"),
            )
        return marked

    def _grace_elapsed(self, key: Key, uid: str | None) -> None:
        """The kubelet's final delete (grace period 0) of a pod whose grace period has passed."""
        self._grace_timers.pop(key, None)
        if key not in self.objects or self.objects[key].deleted:
            return
        current = self.objects[key].raw
        if current["metadata"].get("uid") == uid and current["metadata"].get("deletionTimestamp"):
            try:
                self._delete_pod(key, current, 0)
            except Exception as exc:  # a timer's exception would only be logged; tests check `errors`
                self.errors.append(exc)

    def _cancel_grace_timers(self) -> None:
        """Forget the pending final deletes, as when the server stops."""
        for timer in self._grace_timers.values():
            timer.cancel()
        self._grace_timers.clear()


def grace_seconds(value: Any) -> int | None:
    """DeleteOptions.gracePeriodSeconds from a JSON body or a query parameter."""
    if value in (None, ""):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ApiStatus(400, "BadRequest", f"invalid gracePeriodSeconds: {value!r}") from None


def _pod_healthy(pod: Mapping[str, Any]) -> bool:
    """Counted as healthy by the disruption controller: Running, not deleting, not un-Ready."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return not ready or ready[0].get("status") == "True"


def _desired_healthy(spec: Mapping[str, Any], *, expected: int) -> int:
    if spec.get("minAvailable") is not None:
        return _scaled(spec["minAvailable"], expected)
    if spec.get("maxUnavailable") is not None:
        return max(0, expected - _scaled(spec["maxUnavailable"], expected))
    return expected  # policy/v1 requires one of them; be strict if neither is set


def _scaled(value: int | str, total: int) -> int:
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * total / 100)
    return int(value)


def _selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); an empty selector matches all."""
    if selector is None:
        return False  # policy/v1beta1 semantics of a nil selector; policy/v1 always sets one
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True
