"""The controllers of kube-controller-manager that users' workloads need, in the embedded
Kubernetes API (`sim.kube`): `KubeControllers`, the layer of `KubeEmulator` on top of
kube_namespaces' `KubeNamespaces`. Without them a Deployment applied to the demo's cluster was
stored and nothing else happened: no pod, so no demand and nothing bought.

* Deployment: one ReplicaSet per pod template, named `<deployment>-<pod-template-hash>` and
  labelled with the hash, owned by the Deployment (ownerReferences); the current one gets
  `spec.replicas`, older ones are scaled to 0 at once (no surge: a simplified rollout); status
  counts replicas, updated, ready and available ones, with the Available and Progressing
  conditions.
* ReplicaSet: keeps `spec.replicas` active pods (not terminating, not finished), created from
  its template with `generateName` and an ownerReference; extra pods go unbound ones first, then
  not ready, then newest; status counts replicas, fully labelled, ready and available ones.
* Job: runs `parallelism` pods at a time until `completions` have succeeded (Complete), or fails
  once more pods failed than `backoffLimit` (Failed, BackoffLimitExceeded, its active pods
  deleted). Pods are counted as they are now (no tracking finalizers: a deleted pod is not a
  failure). A pod annotated `tgp.io/sim-run-seconds` completes on its own (the kubelet stand-in).
* Pod garbage collection (podgc): a pod bound to a Node that no longer exists is marked Failed
  (DisruptionTarget, DeletionByPodGC) and deleted at once after `pod_gc_quarantine` seconds
  (kube-controller-manager: 40 s, checked every 20 s), and its ReplicaSet or Job replaces it.
  Deleting an owner deletes what it owns: kube_store's garbage collector.

They run as one task in the emulator, woken by the writes that can give them work (a Deployment,
ReplicaSet or Job, a pod a controller owns or whose Node is not there, a Node that goes with pods
on it) and when an orphan's quarantine ends, and write through the store directly (as the real
ones do through the API, without the HTTP). Not emulated: adoption of orphans by selector,
rollout strategies and history, minReadySeconds, Job backoff delays, indexed Jobs, suspend, TTL
after finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

import attrs
import kmock
import structlog
from typing_extensions import override

from sim.kube_machinery import NODES, PODS, ApiStatus, Key, Obj, api_version, now_time, same_resource
from sim.kube_namespaces import KubeNamespaces
from sim.kube_selection import node_name_of

log = structlog.get_logger("sim.kube_controllers")

DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
REPLICASETS = kmock.resource("apps", "v1", "replicasets")
JOBS = kmock.resource("batch", "v1", "jobs")
POD_TEMPLATE_HASH = "pod-template-hash"
# kube-controller-manager's podgc quarantine: a Node missing from its cache may only be late.
POD_GC_QUARANTINE = 40.0
# Writes come in bursts (a kubectl apply, a scheduler pass): one pass after each burst.
_SETTLE = 0.05
_WATCHED = (PODS, NODES, DEPLOYMENTS, REPLICASETS, JOBS)
# k8s.io/apimachinery/pkg/util/rand.SafeEncodeString's alphabet.
_SAFE = "bcdfghjklmnpqrstvwxz2456789"
_JOB_BACKOFF_LIMIT = 6


@attrs.define(kw_only=True)
class KubeControllers(KubeNamespaces):
    """The store with the Deployment, ReplicaSet, Job and pod GC controllers. A layer of
    `KubeEmulator`, not used alone.

    Test knob: `pod_gc_quarantine`.
    """

    pod_gc_quarantine: float = POD_GC_QUARANTINE
    """Seconds a pod bound to a Node that does not exist stays before the pod GC deletes it."""

    _controllers: asyncio.Task[None] | None = attrs.field(default=None, init=False)
    _wake: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _orphans: dict[str, float] = attrs.field(factory=dict, init=False)  # pod uid -> first seen without its Node

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        if self._controllers is None:
            self._controllers = asyncio.create_task(self._run_controllers())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc_value: BaseException | None, traceback: TracebackType | None,
    ) -> None:
        if self._controllers is not None and self._entered == 1:
            task, self._controllers = self._controllers, None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await super().__aexit__(exc_type, exc_value, traceback)

    @override
    def _publish(self, resource: kmock.resource, kind: str, obj: Obj, previous: Obj | None) -> None:
        super()._publish(resource, kind, obj, previous)
        if self._concerns_controllers(resource, kind, obj, previous):
            self._wake.set()

    def _concerns_controllers(self, resource: kmock.resource, kind: str, obj: Obj, previous: Obj | None) -> bool:
        """Whether a write can give a controller work. A Node matters only to the pod GC, and
        only when it goes with pods bound to it (a pod that waits for its Node is looked at
        again when its quarantine ends; heartbeats and cordons change nothing). A pod only if a
        controller owns it (now or before the write) or it is bound to a Node that is not there.
        A burst's bare pods and new Nodes wake nothing: each pass reads every pod and Node, and
        `make bench`'s burst of 500 woke one every 50 ms."""
        if resource not in _WATCHED:
            return False
        if resource == NODES:
            return kind == "DELETED" and bool(self._pods_on.get(str(obj["metadata"].get("name"))))
        if resource != PODS:
            return True
        if any(_controller_of(o) is not None for o in (obj, previous) if o is not None):
            return True
        node = node_name_of(obj)
        if not node:
            return False
        key = (NODES, None, node)
        return key not in self.objects or self.objects[key].deleted

    async def _run_controllers(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = min(self._orphans.values(), default=None)
            timeout = None if due is None else max(0.0, due + self.pod_gc_quarantine - loop.time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            try:
                self._reconcile(loop.time())
            except Exception as exc:  # a bug here must fail the test that met it, not stop the controllers
                log.exception("sim_controllers_failed")
                self.errors.append(exc)
            await asyncio.sleep(_SETTLE)

    def _reconcile(self, now: float) -> None:
        """One pass of every controller over the store as it is now."""
        live = {k: o.raw for k, o in self.stored(*_WATCHED) if not o.deleted}
        owned: dict[str, list[tuple[Key, Obj]]] = {}
        for key, obj in live.items():
            ref = _controller_of(obj)
            if ref is not None:
                owned.setdefault(str(ref.get("uid")), []).append((key, obj))
        for key, obj in live.items():
            children = owned.get(str(obj["metadata"].get("uid")), [])
            with _refused_write(key):
                if key[0] == DEPLOYMENTS:
                    self._sync_deployment(key, obj, children)
                elif key[0] == REPLICASETS:
                    self._sync_replicaset(key, obj, children)
                elif key[0] == JOBS:
                    self._sync_job(key, obj, children)
        self._collect_orphaned_pods(live, now)

    # --- Deployment ----------------------------------------------------------------------

    def _sync_deployment(self, key: Key, deployment: Obj, sets: list[tuple[Key, Obj]]) -> None:
        spec = deployment.get("spec") or {}
        replicas = int(spec.get("replicas", 1))
        template = copy.deepcopy(spec.get("template") or {})
        digest = template_hash(template)
        current = next((s for s in sets if _labels(s[1]).get(POD_TEMPLATE_HASH) == digest), None)
        if current is None:
            template.setdefault("metadata", {}).setdefault("labels", {})[POD_TEMPLATE_HASH] = digest
            selector = copy.deepcopy(spec.get("selector") or {"matchLabels": dict(_labels(template))})
            selector.setdefault("matchLabels", {})[POD_TEMPLATE_HASH] = digest
            created = self._create(REPLICASETS, key[1], {
                "apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": f"{key[2]}-{digest}", "labels": _labels(template),
                             "ownerReferences": [owner_reference(DEPLOYMENTS, deployment)]},
                "spec": {"replicas": replicas, "selector": selector, "template": template},
            })
            sets = [*sets, ((REPLICASETS, key[1], created["metadata"]["name"]), created)]
            current = sets[-1]
        for set_key, replica_set in sets:
            wanted = replicas if set_key == current[0] else 0
            if int((replica_set.get("spec") or {}).get("replicas", 1)) != wanted:
                scaled = copy.deepcopy(replica_set)
                scaled["spec"]["replicas"] = wanted
                self._update(REPLICASETS, None, set_key, replica_set, scaled)
        counts = {field: sum(int((s.get("status") or {}).get(field) or 0) for _, s in sets)
                  for field in ("replicas", "readyReplicas", "availableReplicas")}
        updated = int((current[1].get("status") or {}).get("replicas") or 0)
        available = counts["availableReplicas"] >= replicas
        status = {
            "observedGeneration": deployment["metadata"].get("generation", 1),
            **_nonzero(**counts, updatedReplicas=updated, unavailableReplicas=max(replicas - counts["availableReplicas"], 0)),
            "conditions": _conditions(deployment, [
                ("Available", available, "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
                 "Deployment has minimum availability." if available else "Deployment does not have minimum availability."),
                ("Progressing", True, "NewReplicaSetAvailable" if available else "ReplicaSetUpdated",
                 f'ReplicaSet "{current[0][2]}" ' + ("has successfully progressed." if available else "is progressing.")),
            ]),
        }
        self._write_status(DEPLOYMENTS, key, deployment, status)

    # --- ReplicaSet ----------------------------------------------------------------------

    def _sync_replicaset(self, key: Key, replica_set: Obj, pods: list[tuple[Key, Obj]]) -> None:
        spec = replica_set.get("spec") or {}
        replicas = int(spec.get("replicas", 1))
        active = [(k, p) for k, p in pods if _active(p)]
        for _ in range(replicas - len(active)):
            self._create_pod(replica_set, REPLICASETS, spec.get("template") or {}, {})
        if len(active) > replicas:
            # kube-controller-manager's ActivePods order: unbound, then pending, not ready, newest first.
            doomed = sorted(active, key=lambda e: (bool(node_name_of(e[1])), _phase(e[1]) == "Running",
                                                   _ready(e[1]), _negated(e[1]["metadata"].get("creationTimestamp"))))
            for pod_key, pod in doomed[: len(active) - replicas]:
                self._delete_pod(pod_key, pod, None)
            active = [e for e in active if e not in doomed[: len(active) - replicas]]
        ready = sum(_ready(p) for _, p in active)
        status = {"replicas": len(active), **_nonzero(fullyLabeledReplicas=len(active), readyReplicas=ready,
                  availableReplicas=ready), "observedGeneration": replica_set["metadata"].get("generation", 1)}
        self._write_status(REPLICASETS, key, replica_set, status)

    # --- Job -----------------------------------------------------------------------------

    def _sync_job(self, key: Key, job: Obj, pods: list[tuple[Key, Obj]]) -> None:
        spec, status = job.get("spec") or {}, copy.deepcopy(job.get("status") or {})
        if any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in status.get("conditions") or []):
            return
        completions = int(spec.get("completions") or 1)
        parallelism = int(spec.get("parallelism", 1))
        active = [(k, p) for k, p in pods if _active(p)]
        succeeded = sum(_phase(p) == "Succeeded" for _, p in pods)
        failed = sum(_phase(p) == "Failed" for _, p in pods)
        status.update(startTime=status.get("startTime") or now_time(), succeeded=succeeded, failed=failed, active=0)
        conditions: list[tuple[str, bool, str, str]] = []
        if failed > int(spec.get("backoffLimit", _JOB_BACKOFF_LIMIT)):
            for pod_key, pod in active:
                self._delete_pod(pod_key, pod, None)
            active = []
            conditions = [("Failed", True, "BackoffLimitExceeded", "Job has reached the specified backoff limit")]
        elif succeeded >= completions:
            conditions = [("SuccessCriteriaMet", True, "CompletionsReached", "Reached expected number of succeeded pods"),
                          ("Complete", True, "CompletionsReached", "Reached expected number of succeeded pods")]
            status["completionTime"] = now_time()
        else:
            labels = {"batch.kubernetes.io/controller-uid": job["metadata"]["uid"], "batch.kubernetes.io/job-name": key[2],
                      "controller-uid": job["metadata"]["uid"], "job-name": key[2]}
            started = max(min(parallelism, completions - succeeded) - len(active), 0)
            for _ in range(started):
                self._create_pod(job, JOBS, spec.get("template") or {}, labels)
            status["active"] = len(active) + started
        status["ready"] = sum(_ready(p) for _, p in active)
        if conditions:
            status["conditions"] = _conditions(job, conditions)
        self._write_status(JOBS, key, job, {k: v for k, v in status.items() if v != 0})  # omitempty, as the API writes it

    # --- pod garbage collection ----------------------------------------------------------

    def _collect_orphaned_pods(self, live: dict[Key, Obj], now: float) -> None:
        nodes = {k[2] for k in live if same_resource(k[0], NODES)}
        orphans = {}
        for key, pod in live.items():
            node = node_name_of(pod) if same_resource(key[0], PODS) else ""
            if not node or node in nodes:
                continue
            uid = str(pod["metadata"].get("uid"))
            orphans[uid] = self._orphans.get(uid, now)
            if now - orphans[uid] < self.pod_gc_quarantine:
                continue
            with _refused_write(key):
                failed = copy.deepcopy(pod)
                failed.setdefault("status", {})["phase"] = "Failed" if _phase(pod) not in ("Succeeded", "Failed") else _phase(pod)
                failed["status"]["conditions"] = [
                    *[c for c in failed["status"].get("conditions") or [] if c.get("type") != "DisruptionTarget"],
                    {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC",
                     "message": "PodGC: node no longer exists", "lastTransitionTime": now_time()},
                ]
                marked = self._update(PODS, "status", key, pod, failed)
                self._delete_pod(key, self.objects[key].raw if key in self.objects else marked, 0)
                log.info("sim_pod_gc_deleted_orphan", pod=f"{key[1]}/{key[2]}", node=node)
            orphans.pop(uid)
        self._orphans = orphans

    # --- shared --------------------------------------------------------------------------

    def _create_pod(self, owner: Obj, kind: kmock.resource, template: Obj, labels: dict[str, str]) -> None:
        meta = template.get("metadata") or {}
        self._create(PODS, owner["metadata"]["namespace"], {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "generateName": f"{owner['metadata']['name']}-", "labels": {**(meta.get("labels") or {}), **labels},
                "annotations": copy.deepcopy(meta.get("annotations") or {}), "ownerReferences": [owner_reference(kind, owner)],
            },
            "spec": copy.deepcopy(template.get("spec") or {}),
        })

    def _write_status(self, resource: kmock.resource, key: Key, current: Obj, status: Obj) -> None:
        """Write `status` when it differs (a pass that changes nothing writes nothing)."""
        if current.get("status") != status:
            self._update(resource, "status", key, current, {**current, "status": status})


def template_hash(template: Obj) -> str:
    """The pod-template-hash of a pod template: FNV-32a of its JSON, its decimal digits in
    SafeEncodeString's alphabet (kube-controller-manager hashes the Go object the same way)."""
    value = 0x811C9DC5
    for byte in json.dumps(template, sort_keys=True).encode():
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return "".join(_SAFE[ord(c) % len(_SAFE)] for c in str(value))


def owner_reference(resource: kmock.resource, owner: Obj) -> Obj:
    """A controller's ownerReference to `owner` (the garbage collector deletes what it owns)."""
    return {"apiVersion": api_version(resource), "kind": owner.get("kind"), "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


@contextlib.contextmanager
def _refused_write(key: Key) -> Any:
    """A write the store refuses (a namespace being deleted) skips this object this pass."""
    try:
        yield
    except ApiStatus as refused:
        log.info("sim_controller_write_refused", object=f"{key[1]}/{key[2]}", error=refused.message)


def _conditions(obj: Obj, wanted: Iterable[tuple[str, bool, str, str]]) -> list[Obj]:
    """Conditions as `wanted` (type, status, reason, message), keeping each one's
    lastTransitionTime while its status stays."""
    previous = {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}
    result = []
    for kind, true, reason, message in wanted:
        status = "True" if true else "False"
        before = previous.get(kind) or {}
        since = before.get("lastTransitionTime") if before.get("status") == status else None
        result.append({"type": kind, "status": status, "reason": reason, "message": message,
                       "lastTransitionTime": since or now_time()})
    return result


def _nonzero(**counts: int) -> dict[str, int]:
    """Counts as the API writes them: a zero is left out (omitempty)."""
    return {k: v for k, v in counts.items() if v}


def _controller_of(obj: Obj) -> Obj | None:
    return next((r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def _labels(obj: Obj) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


def _phase(pod: Obj) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def _active(pod: Obj) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and _phase(pod) not in ("Succeeded", "Failed")


def _ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def _negated(timestamp: object) -> tuple[int, ...]:
    """Newest first in an ascending sort."""
    return tuple(-ord(c) for c in str(timestamp or ""))
