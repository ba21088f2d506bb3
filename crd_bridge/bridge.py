"""The CRD bridge: Kubernetes events in, Temporal workflow signals out. It holds no state of
its own: everything it knows comes from its informers, so a restarted bridge re-lists and sends
the same signals again, which the workflows (stable ids, signal-with-start) absorb.

* GPUNodeClass -> signal-with-start `update_class` on gpunodeclass/<name>.
* GPUNodePool  -> add the finalizer, then signal-with-start `update` on gpunodepool/<ns>/<name>
  (with the class it refers to, or None), including `deleting` once it is being deleted.
  A pool the API server stored but tgp cannot admit (a disruption duration outside
  `DisruptionBounds`) is not sent: it gets Ready=False (InvalidSpec) and a Warning Event.
* Pods         -> unschedulable GPU pods, batched, assigned to pools (tgp.demand) -> `demand`.
* Nodes        -> `tgp.io/evict=<reason>` on a managed Node -> `evict` on its node workflow.
* Pods + Nodes -> each managed Node's facts (present, Ready, GPUs, busy pods), on a change and
  once after every list -> `node_facts` on its node workflow (crd_bridge/node_facts.py).

A pool or class is sent only when what its workflow reads changed since the bridge last sent it
(spec and generation, uid, deletion, the class a pool refers to): the status the workflows write
comes back as events and is not sent back to them. A restarted bridge sends everything once.

Level-triggered as well: every `entity_resync` the bridge checks that each pool and class it
knows has a running workflow, and starts the missing ones (a workflow terminated by hand, or
lost with a Temporal namespace) with the object as it is; a restarted pool gets its demand again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import structlog
from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from activities.kube.cluster import CustomResource, KubernetesCluster
from activities.kube.summaries import pod_summary_of
from crd_bridge.informer import Informer, Obj, object_key
from crd_bridge.metrics import OBJECTS_SKIPPED
from crd_bridge.node_facts import NodeFactsSender
from tgp.conditions import condition_list
from tgp.crds import FINALIZER, GROUP, VERSION, DisruptionBounds, GPUNodeClass, GPUNodePool
from tgp.errors import TgpError
from tgp.demand import BATCH_IDLE, BATCH_MAX, Batch, PendingPod, PoolCandidate, UnreadablePod, assign_pods, gpu_request, pending_gpu_pod, tracked, unsold_counts
from tgp.disruption import do_not_disrupt_problem
from tgp.messages import ClassInput, ClassUpdate, Demand, PoolUpdate, class_workflow_id, pool_workflow_id
from tgp.types import DEFAULT_TASK_QUEUE, GPU_RESOURCE, LABEL_MANAGED, LABEL_POOL, LABEL_POOL_NAMESPACE, node_workflow_id
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow, PoolInput

log = structlog.get_logger("tgp.bridge")

EVICT_ANNOTATION = "tgp.io/evict"
# How often every pool and class is checked for a running workflow: the pools' own resync
# interval, so a pool whose workflow was terminated is served again within about as long as a
# running pool takes to notice a node workflow terminated by hand.
ENTITY_RESYNC = timedelta(minutes=1)


class Bridge:
    def __init__(
        self,
        client: Client,
        cluster: KubernetesCluster,
        *,
        task_queue: str = DEFAULT_TASK_QUEUE,
        batch_idle: timedelta = BATCH_IDLE,
        batch_max: timedelta = BATCH_MAX,
        pool_watch_interval: timedelta | None = None,
        disruption_bounds: DisruptionBounds = DisruptionBounds(),
        entity_resync: timedelta = ENTITY_RESYNC,
    ) -> None:
        self.client = client
        self.cluster = cluster
        self.task_queue = task_queue
        self.batch_idle, self.batch_max = batch_idle, batch_max
        self.pool_watch_interval = pool_watch_interval
        self.disruption_bounds = disruption_bounds
        self.entity_resync = entity_resync
        self.refused: dict[str, str] = {}  # pool key or class name -> what was last reported about its invalid spec
        self.classes: dict[str, GPUNodeClass] = {}
        self.pools: dict[str, GPUNodePool] = {}
        self.pending: dict[str, PendingPod] = {}
        self.sent_demand: dict[str, str] = {}
        # What was last sent to each class and pool workflow (JSON), so that an event that changes
        # nothing they read (the status they wrote themselves) sends nothing. A restarted bridge
        # starts empty and sends everything once: level-triggered.
        self.sent_class: dict[str, str] = {}
        self.sent_pool: dict[str, str] = {}
        # GPUs in use by bound, unfinished pods (pod key -> node, GPUs) and the managed Nodes
        # (name -> pool key, allocatable GPUs, schedulable and Ready): the pools' free capacity.
        self.bound: dict[str, tuple[str, int]] = {}
        self.gpu_nodes: dict[str, tuple[str, int, bool]] = {}
        self.evicted: set[str] = set()
        self._batch = Batch()
        self._batch_changed = asyncio.Event()
        self.informers: list[Informer] = []
        self.facts = NodeFactsSender(client)  # each managed Node's facts for its workflow
        self.dnd_warned: dict[str, str] = {}  # pod key -> the do-not-disrupt problem it was told (uid/message)
        self.unsold_warned: dict[str, str] = {}  # pending pod key -> the unsold GPU resources it was told of (uid/names)

    async def run(self) -> None:
        """Watch until cancelled."""
        core = await self.cluster._client()  # the adapter owns the connection and its credentials
        custom = await self.cluster._custom()
        self.informers = [
            Informer(
                "gpunodeclasses",
                lambda **kw: custom.list_cluster_custom_object_without_preload_content(GROUP, VERSION, "gpunodeclasses", **kw),
                self.on_class,
            ),
            Informer(
                "gpunodepools",
                lambda **kw: custom.list_custom_object_for_all_namespaces_without_preload_content(GROUP, VERSION, "gpunodepools", **kw),
                self.on_pool,
            ),
            Informer("pods", core.list_pod_for_all_namespaces_without_preload_content, self.on_pod, on_synced=lambda: self.facts.on_listed("pods")),
            Informer(
                "nodes",
                core.list_node_without_preload_content,
                self.on_node,
                on_synced=lambda: self.facts.on_listed("nodes"),
                label_selector=f"{LABEL_MANAGED}=true",
            ),
        ]
        async with asyncio.TaskGroup() as tasks:
            for informer in self.informers:
                tasks.create_task(informer.run())
            tasks.create_task(self._demand_loop())
            tasks.create_task(self._entities_loop())
            tasks.create_task(self.facts.run())

    # --- classes -------------------------------------------------------------------------

    async def on_class(self, kind: str, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.classes.pop(name, None)
            self.sent_class.pop(name, None)
            self.refused.pop(name, None)
            update = ClassUpdate(spec=None)
        else:
            try:
                klass = GPUNodeClass.admit(obj)
            except ValidationError as exc:
                OBJECTS_SKIPPED.labels("GPUNodeClass", "invalid").inc()
                await self._refuse(name, obj, exc, "gpunodeclasses", "GPUNodeClass")
                return
            self.refused.pop(name, None)
            self.classes[name] = klass
            update = ClassUpdate(spec=klass.spec, generation=klass.metadata.generation, uid=klass.metadata.uid)
        if not await self._send_class(name, update):
            return  # our own status write (or a re-list): nothing the workflows read changed
        for key in list(self.pools):
            # Read each pool as it is now, not as it was when the loop began: a pool event
            # handled meanwhile (its deletion) must not be overtaken by the older object.
            pool = self.pools.get(key)
            if pool is not None and pool.spec.node_class_ref.name == name:
                await self._send_pool(pool)

    async def _send_class(self, name: str, update: ClassUpdate, *, again: bool = False) -> bool:
        """Send the class to its workflow when what the workflow reads changed since the last
        send (`again`: regardless). Returns whether it was sent."""
        fingerprint = update.model_dump_json()
        if not again and self.sent_class.get(name) == fingerprint:
            return False
        async with _marked_sent(self.sent_class, name, fingerprint):
            await self._signal_with_start(
                GPUNodeClassWorkflow.run, ClassInput(name=name), class_workflow_id(name), "update_class", update, f"GPUNodeClass {name}"
            )
        return True

    # --- pools ---------------------------------------------------------------------------

    async def on_pool(self, kind: str, obj: Obj) -> None:
        key = object_key(obj)
        if kind == "DELETED" or (obj.get("metadata") or {}).get("deletionTimestamp"):
            # A pool of the same name created later is a new workflow run: send it its demand.
            self.sent_demand.pop(key.lstrip("/"), None)
        if kind == "DELETED":
            self.pools.pop(key, None)
            self.refused.pop(key, None)
            self.sent_pool.pop(key, None)
            return  # the workflow removed the finalizer; nothing left to do
        try:
            if (obj.get("metadata") or {}).get("deletionTimestamp"):
                pool = GPUNodePool.model_validate(obj)  # bounds never block a deletion
            else:
                pool = GPUNodePool.admit(obj, self.disruption_bounds)
        except ValidationError as exc:
            OBJECTS_SKIPPED.labels("GPUNodePool", "invalid").inc()
            await self._refuse(key, obj, exc, "gpunodepools", "GPUNodePool")
            return
        self.refused.pop(key, None)
        self.pools[key] = pool
        meta = pool.metadata
        if not meta.deletionTimestamp and FINALIZER not in meta.finalizers:
            await self.cluster.set_finalizer(_pool_ref(pool), FINALIZER, present=True)
        if await self._send_pool(pool):
            self._batch = self._batch.add(_now())  # pools changed: demand may go elsewhere
            self._batch_changed.set()

    async def _refuse(self, key: str, obj: Obj, exc: ValidationError, plural: str, kind: str) -> None:
        """Say on the pool or class, once per generation, why tgp does not act on it (a log line
        alone left users with a pool that silently did nothing)."""
        meta = obj.get("metadata") or {}
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        what = "pool" if kind == "GPUNodePool" else "class"
        message = f"tgp does not act on this {what}: {problems}"
        fingerprint = f"{meta.get('uid')}/{meta.get('generation')}/{message}"
        if self.refused.get(key) == fingerprint:
            return  # our own status write (or a resync) brought it back
        log.warning(f"{what}_invalid", **{what: key}, error=message[:500])
        namespace = (meta.get("namespace") or "default") if kind == "GPUNodePool" else None
        ref = CustomResource(GROUP, VERSION, plural, kind, meta.get("name", ""), namespace, meta.get("uid"))
        generation = meta.get("generation")
        conditions = condition_list({"Ready": ("False", "InvalidSpec", message)}, generation, _now())
        status = {"observedGeneration": generation, "conditions": [c.model_dump(mode="json", by_alias=True) for c in conditions]}
        try:
            await self.cluster.patch_custom_status(ref, status)
            await self.cluster.create_event(ref, type="Warning", reason="InvalidSpec", message=message, component="tgp-bridge")
        except TgpError as error:
            log.warning(f"{what}_invalid_not_reported", **{what: key}, error=str(error))
            return  # reported on the next event or resync
        self.refused[key] = fingerprint

    async def _send_pool(self, pool: GPUNodePool, *, again: bool = False) -> bool:
        """Send the pool (with its class) to its workflow when what the workflow reads changed
        since the last send: its spec (generation), uid, deletion or class spec, not the status
        the workflow itself wrote (`again`: regardless). Returns whether it was sent."""
        meta = pool.metadata
        klass = self.classes.get(pool.spec.node_class_ref.name)
        update = PoolUpdate(
            spec=pool.spec,
            generation=meta.generation,
            uid=meta.uid,
            node_class=klass.spec if klass else None,
            deleting=meta.deletionTimestamp is not None,
        )
        namespace = meta.namespace or "default"
        key = f"{namespace}/{meta.name}"
        fingerprint = update.model_dump_json()
        if not again and self.sent_pool.get(key) == fingerprint:
            return False
        async with _marked_sent(self.sent_pool, key, fingerprint):
            await self._signal_with_start(
                GPUNodePoolWorkflow.run,
                PoolInput(namespace=namespace, name=meta.name, watch_interval=self.pool_watch_interval),
                pool_workflow_id(namespace, meta.name),
                "update",
                update,
                f"GPUNodePool {namespace}/{meta.name}",
            )
        return True

    # --- every pool and class has a running workflow ---------------------------------------

    async def _entities_loop(self) -> None:
        while True:
            await asyncio.sleep(self.entity_resync.total_seconds())
            try:
                await self.restart_missing_workflows()
            except (RPCError, TgpError) as exc:
                log.warning("entity_check_failed", error=str(exc))  # the next interval tries again

    async def restart_missing_workflows(self) -> list[str]:
        """Start the workflow of each pool and class whose workflow is not running, with the
        object as the informers last saw it (signal-with-start: a workflow that runs after all
        only gets the same update again). Returns the workflow ids started."""
        if not all(i.synced.is_set() for i in self.informers if i.name in ("gpunodeclasses", "gpunodepools")):
            return []  # a half-listed cache would not know every object
        wanted: dict[str, tuple[str, GPUNodeClass | GPUNodePool]] = {}
        for name, klass in self.classes.items():
            wanted[class_workflow_id(name)] = (name, klass)
        for key, pool in self.pools.items():
            meta = pool.metadata
            if meta.deletionTimestamp is not None and FINALIZER not in meta.finalizers:
                continue  # its workflow finished the deletion; the object is about to go
            wanted[pool_workflow_id(meta.namespace or "default", meta.name)] = (key, pool)
        running = await self._running_entities()
        started = []
        for workflow_id, (key, obj) in wanted.items():
            # Visibility lags: a workflow it does not list is described before it is started.
            if workflow_id in running or await self._runs(workflow_id):
                continue
            log.warning("entity_workflow_restarted", workflow_id=workflow_id)
            if isinstance(obj, GPUNodeClass):
                await self._send_class(key, ClassUpdate(spec=obj.spec, generation=obj.metadata.generation, uid=obj.metadata.uid), again=True)
            else:
                await self._send_pool(obj, again=True)
                self.sent_demand.pop(key.lstrip("/"), None)  # the new run has no demand yet
                self._batch = self._batch.add(_now())
                self._batch_changed.set()
            started.append(workflow_id)
        return started

    async def _running_entities(self) -> set[str]:
        """Ids of the running pool and class workflows, as visibility lists them (empty where
        the server has no visibility: each is then described)."""
        query = "WorkflowType IN ('GPUNodePoolWorkflow', 'GPUNodeClassWorkflow') AND ExecutionStatus = 'Running'"
        try:
            return {w.id async for w in self.client.list_workflows(query)}
        except RPCError as exc:
            if exc.status is RPCStatusCode.UNIMPLEMENTED:
                return set()
            raise

    async def _runs(self, workflow_id: str) -> bool:
        try:
            description = await self.client.get_workflow_handle(workflow_id).describe()
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                return False
            raise
        return description.status is WorkflowExecutionStatus.RUNNING

    # --- pods and demand -------------------------------------------------------------------

    async def on_pod(self, kind: str, obj: Obj) -> None:
        key = object_key(obj).lstrip("/")
        held_on = self.facts.holding.where.get(key)
        self.facts.on_pod(kind, obj)
        await self._warn_do_not_disrupt(key, kind, obj)
        try:
            pod = None if kind == "DELETED" else pending_gpu_pod(obj)
        except UnreadablePod as exc:  # not demand; every other pod still is
            log.warning("pod_skipped", pod=key, reason=exc.reason, detail=exc.detail[:500])
            OBJECTS_SKIPPED.labels("Pod", exc.reason).inc()
            pod = None
        await self._warn_unsold(key, obj, pod)
        changed = (key in self.pending) != (pod is not None) or (pod is not None and pod.unsold != self.pending[key].unsold)
        if pod is None:
            self.pending.pop(key, None)
        else:
            self.pending[key] = pod
        changed |= self._track_bound(key, kind, obj)
        changed |= held_on != self.facts.holding.where.get(key)  # the pool's held nodes changed
        if changed:
            self._batch = self._batch.add(_now())
            self._batch_changed.set()

    async def _warn_do_not_disrupt(self, key: str, kind: str, obj: Obj) -> None:
        """A pod on a tgp Node whose do-not-disrupt value tgp reads otherwise than Karpenter
        would (tgp.disruption.do_not_disrupt_problem: a duration, or a value that holds nothing)
        gets a Warning Event `DoNotDisruptValue` naming it, once per pod and value: never silently."""
        meta, node = obj.get("metadata") or {}, (obj.get("spec") or {}).get("nodeName")
        problem = do_not_disrupt_problem(meta.get("annotations")) if kind != "DELETED" and node in self.facts.workflow_ids else None
        if problem is None:
            if kind == "DELETED":
                self.dnd_warned.pop(key, None)
            return
        mark = f"{meta.get('uid')}/{problem}"
        if self.dnd_warned.get(key) == mark:
            return
        try:
            await self.cluster.record_pod_event(pod_summary_of(obj), type="Warning", reason="DoNotDisruptValue", message=f"on node {node}: {problem}", component="tgp-bridge")
        except TgpError as error:
            log.warning("do_not_disrupt_event_failed", pod=key, error=str(error))
            return  # told on the pod's next event or a re-list
        self.dnd_warned[key] = mark

    async def _warn_unsold(self, key: str, obj: Obj, pod: PendingPod | None) -> None:
        """A pending pod asking for a GPU resource tgp does not sell gets a Warning Event
        `GPUResourceNotSold` naming it (the resource name, cut, is the only text of the pod's
        quoted), once per pod and resource: no node is bought for it, and it is told so."""
        if pod is None or not pod.unsold:
            self.unsold_warned.pop(key, None)
            return
        mark = f"{(obj.get('metadata') or {}).get('uid')}/{','.join(pod.unsold)}"
        if self.unsold_warned.get(key) == mark:
            return
        message = f"asks for {', '.join(pod.unsold)}, which tgp does not sell: no node is bought for it (tgp buys nodes with {GPU_RESOURCE})"
        try:
            await self.cluster.record_pod_event(pod_summary_of(obj), type="Warning", reason="GPUResourceNotSold", message=message, component="tgp-bridge")
        except TgpError as error:
            log.warning("unsold_event_failed", pod=key, error=str(error))
            return  # told on the pod's next event or a re-list
        self.unsold_warned[key] = mark

    def _track_bound(self, key: str, kind: str, obj: Obj) -> bool:
        """Record the GPUs a bound, unfinished pod holds on its node; True when that changed."""
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        node, gpus = spec.get("nodeName"), 0
        if kind != "DELETED" and node and status.get("phase") not in ("Succeeded", "Failed"):
            try:
                gpus = gpu_request(obj)
            except (UnreadablePod, ValueError, TypeError):
                gpus = 0  # not ours to count; the scheduler decides
        old = self.bound.get(key)
        if gpus:
            self.bound[key] = (node, gpus)
        else:
            self.bound.pop(key, None)
        return old != self.bound.get(key)

    def _track_node(self, kind: str, obj: Obj) -> bool:
        """Record a managed Node's pool, allocatable GPUs and readiness; True when that changed."""
        meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
        labels, name = meta.get("labels") or {}, meta.get("name", "")
        old = self.gpu_nodes.get(name)
        if kind == "DELETED" or LABEL_POOL not in labels:
            self.gpu_nodes.pop(name, None)
        else:
            gpus = (status.get("allocatable") or {}).get(GPU_RESOURCE) or (status.get("capacity") or {}).get(GPU_RESOURCE) or 0
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
            try:
                count = int(str(gpus))
            except ValueError:
                count = 0
            pool = f"{labels.get(LABEL_POOL_NAMESPACE, 'default')}/{labels[LABEL_POOL]}"
            self.gpu_nodes[name] = (pool, count, ready and not spec.get("unschedulable"))
        return old != self.gpu_nodes.get(name)

    def free_gpus(self, pool: str) -> dict[str, int]:
        """Free GPUs (allocatable minus the requests of bound, unfinished pods) of each
        schedulable, Ready node of `pool` (pool key namespace/name). A node whose GPUs are not
        registered yet (allocatable 0: the device plugin is still starting) is left out: its
        room is unknown, not zero, so the pool neither voids its nominations nor lends it."""
        used: dict[str, int] = {}
        for node, gpus in self.bound.values():
            used[node] = used.get(node, 0) + gpus
        return {
            name: max(gpus - used.get(name, 0), 0)
            for name, (owner, gpus, usable) in sorted(self.gpu_nodes.items())
            if owner == pool and usable and gpus > 0
        }

    def bound_gpus(self, pool: str) -> dict[str, list[int]]:
        """The GPU requests of the pods bound to each node `free_gpus` lists (largest first), for
        the pool's consolidation look: which nodes' pods would fit on the others' free GPUs."""
        free = self.free_gpus(pool)
        bound: dict[str, list[int]] = {}
        for node, gpus in self.bound.values():
            if node in free:
                bound.setdefault(node, []).append(gpus)
        return {node: sorted(gpus, reverse=True) for node, gpus in sorted(bound.items())}

    def _held(self, node: str) -> bool:
        """Whether do-not-disrupt holds Node `node` (the Node or a pod on it)."""
        facts = self.facts.latest.get(node)
        return facts is not None and facts.present and (facts.do_not_disrupt or facts.holding > 0)

    def held_nodes(self, pool: str) -> list[str]:
        """The nodes of `free_gpus` that do-not-disrupt holds, for the pool's consolidation look."""
        return [node for node in self.free_gpus(pool) if self._held(node)]

    async def _demand_loop(self) -> None:
        """Send demand once a batch of pod changes has settled (idle window) or grown old
        (maximum window), and only when a pool's pod list actually changed."""
        while True:
            if self._batch.first is None:
                await self._batch_changed.wait()
                self._batch_changed.clear()
                continue
            wait = self._batch.wait(_now(), self.batch_idle, self.batch_max).total_seconds()
            if wait > 0:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
                # that arrives as the event is set (CPython gh-86296), and the bridge never stops.
                try:
                    async with asyncio.timeout(wait):
                        await self._batch_changed.wait()
                    self._batch_changed.clear()
                    continue
                except TimeoutError:
                    pass
            self._batch = Batch()
            await self.send_demand()

    async def send_demand(self) -> None:
        if not all(i.synced.is_set() for i in self.informers if i.name in ("pods", "gpunodepools")):
            return  # half a picture would shrink demand; the next batch sends it
        candidates = [
            PoolCandidate(namespace=p.metadata.namespace or "default", name=p.metadata.name, spec=p.spec)
            for p in self.pools.values()
            if p.metadata.deletionTimestamp is None
        ]
        assigned = assign_pods(self.pending.values(), candidates)
        for key, fitting in assigned.items():
            # A pod asking for a GPU resource tgp does not sell is no demand: its pool only counts it.
            pods, untracked = tracked(p for p in fitting if not p.unsold)
            demand = Demand(
                pods=sorted(p.key for p in pods),
                observed_at=_now(),
                max_gpus=max((p.gpus for p in pods), default=1),
                pod_gpus={p.key: p.gpus for p in pods if p.gpus != 1},
                free_gpus=self.free_gpus(key),
                bound_gpus=self.bound_gpus(key),
                held_nodes=self.held_nodes(key),
                unsold=unsold_counts(fitting),
                untracked=untracked,
            )
            fingerprint = demand.model_dump_json(exclude={"observed_at"})
            if self.sent_demand.get(key) == fingerprint:
                continue
            namespace, name = key.split("/", 1)
            try:
                await self.client.get_workflow_handle(pool_workflow_id(namespace, name)).signal(GPUNodePoolWorkflow.demand, demand)
                self.sent_demand[key] = fingerprint
            except RPCError as exc:
                log.warning("demand_not_sent", pool=key, error=str(exc))
                if exc.status is not RPCStatusCode.NOT_FOUND:
                    self._batch = self._batch.add(_now())  # try again with the next batch
                    self._batch_changed.set()

    # --- nodes ---------------------------------------------------------------------------

    async def on_node(self, kind: str, obj: Obj) -> None:
        name = (obj.get("metadata") or {}).get("name") or ""
        held = self._held(name)
        self.facts.on_node(kind, obj)
        if self._track_node(kind, obj) or held != self._held(name):
            self._batch = self._batch.add(_now())  # the pool's free GPUs or held nodes changed
            self._batch_changed.set()
        meta = obj.get("metadata") or {}
        reason = (meta.get("annotations") or {}).get(EVICT_ANNOTATION)
        labels = meta.get("labels") or {}
        if kind == "DELETED" or reason is None or LABEL_POOL not in labels:
            return
        workflow_id = node_workflow_id(labels.get(LABEL_POOL_NAMESPACE, "default"), labels[LABEL_POOL], meta["name"])
        if workflow_id in self.evicted:
            return
        try:
            await self.client.get_workflow_handle(workflow_id).signal("evict", {"reason": reason or "annotation"})
            self.evicted.add(workflow_id)
            log.info("node_evict_requested", node=meta["name"], reason=reason)
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                self.evicted.add(workflow_id)  # no live workflow for it: nothing to evict
            else:
                raise

    # --- plumbing ------------------------------------------------------------------------

    async def _signal_with_start(self, run: Any, arg: Any, workflow_id: str, signal: str, payload: Any, summary: str) -> None:
        await self.client.start_workflow(
            run,
            arg,
            id=workflow_id,
            task_queue=self.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal=signal,
            start_signal_args=[payload],
            static_summary=summary,
        )


def _pool_ref(pool: GPUNodePool) -> CustomResource:
    meta = pool.metadata
    return CustomResource(GROUP, VERSION, "gpunodepools", "GPUNodePool", meta.name, meta.namespace or "default", meta.uid)


def _now() -> datetime:
    return datetime.now(timezone.utc)


@contextlib.asynccontextmanager
async def _marked_sent(sent: dict[str, str], key: str, fingerprint: str) -> AsyncIterator[None]:
    """Mark `fingerprint` sent for `key` before the send, not after: the class's informer (its
    pools' new class spec) and the pool's own informer run side by side, and both found the
    same update unsent while the first send was in flight, so the pool got it twice (a loaded
    machine: tests/test_bridge_quiet). A send that fails is unmarked: its handler's retry, or the
    next event, sends it."""
    sent[key] = fingerprint
    try:
        yield
    except BaseException:
        if sent.get(key) == fingerprint:
            sent.pop(key, None)
        raise
