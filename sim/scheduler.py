"""The living parts of a simulated cluster, like KWOK: a scheduler and a kubelet stand-in that
talk to the Kubernetes API over plain HTTP (the emulator, for the demo and the tests).

Scheduler: binds each pending pod to a Ready, schedulable Node whose labels meet the pod's
nodeSelector and required node affinity, whose NoSchedule/NoExecute taints the pod tolerates,
and whose free `nvidia.com/gpu` (allocatable minus what bound, unfinished pods request) covers
the pod's effective request (init containers and sidecars counted as Kubernetes does). A pod no Node fits is marked `PodScheduled=False, reason=Unschedulable`, as
the real scheduler does, which is what the bridge reads as demand.

Kubelet: a bound pod starts Running at once. A pod annotated `tgp.io/sim-run-seconds: "N"`
completes (`Succeeded`) N seconds after it started; without it, it runs until deleted. A pod
being deleted stays Terminating for its grace period (the emulator's graceful deletion).

Like kube-scheduler v1.34's scheduling queue where tgp depends on it (its source:
pkg/scheduler/backend/queue): a pod that did not fit waits in `unschedulablePods` until a cluster
event could make it fit (queueing hints, GA in 1.34: here a Node added, or one whose readiness,
cordon, labels, taints, allocatable or free GPUs changed, that now fits the pod; or a change to
the pod itself), or for five minutes (podMaxInUnschedulablePodsDuration); it is not retried
while nothing changes. Moved by an event,
it goes to the backoff queue while its per-pod backoff runs (1 s after its last failure,
doubling per failure, capped at 10 s: podInitialBackoffSeconds, podMaxBackoffSeconds), else to
the active queue. Pods in the active queue are tried first, oldest first (the queue's timestamp,
refreshed at each failure); pods still backing off are tried when the active queue is empty
(SchedulerPopFromBackoffQ, on by default since 1.33). So a Node that appears is taken at once by
a pod that waited for it, unless a pod in the active queue comes first: a newer pod may take the
node another pod was bought for (what a real scheduler does to tgp's nominations). A Node that
is not Ready, is cordoned, or carries a NoSchedule taint the pod does not tolerate
(`node.kubernetes.io/not-ready` included, which a registering node has until its kubelet
reports Ready) takes nothing; GPUs are counted as allocatable minus the requests of the pods
bound and not finished (terminating ones included). tests/test_sim_scheduler.py holds the
model; tests/test_scheduler_queue.py compares it with the real kube-scheduler.

Like kube-scheduler, it lists Nodes and pods once and keeps them from watches (its informers),
binds on that cache and counts a pod it bound as bound until the watch shows it (assumed pods);
a pass runs when something changed, at most every `interval`, and every RESYNC regardless.

The fit checks and the queueing hints, with no I/O, are sim.scheduler_fit.

Simplifications, on purpose: no CPU/memory accounting, no preferred affinity or pod
(anti-)affinity, no preemption, no scoring (the first fitting node by name).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Coroutine, Mapping
from datetime import datetime, timezone
from typing import Any

import httpx
import structlog

from activities.http_wire import new_client
from sim.kube_scheduler_events import failed_scheduling_note, scheduled_note, scheduling_event
from sim.scheduler_fit import Queued, Requeue, Snapshot, allocatable_gpus, fits, pod_gpus, pod_shape, static_view

__all__ = ["RUN_SECONDS_ANNOTATION", "UNSCHEDULABLE_LEFTOVER", "SimScheduler", "fits"]

log = structlog.get_logger("sim.scheduler")

RUN_SECONDS_ANNOTATION = "tgp.io/sim-run-seconds"
# kube-scheduler's podInitialBackoffSeconds and podMaxBackoffSeconds defaults.
POD_INITIAL_BACKOFF = 1.0
POD_MAX_BACKOFF = 10.0
# podMaxInUnschedulablePodsDuration: an unschedulable pod no event moved is tried again after this.
UNSCHEDULABLE_LEFTOVER = 300.0
MERGE = {"Content-Type": "application/merge-patch+json"}
# Binds and status writes of one pass in flight at once.
WRITES_AT_ONCE = 16
# With nothing changing, a pass on the cache this often (pods whose run ends on a timer).
RESYNC = 1.0

Obj = Mapping[str, Any]


class SimScheduler:
    """`async with SimScheduler(api_url):` binds, runs and completes pods until the block ends."""

    def __init__(
        self,
        api_url: str,
        *,
        interval: float = 0.5,
        client: httpx.AsyncClient | None = None,
        initial_backoff: float = POD_INITIAL_BACKOFF,
        max_backoff: float = POD_MAX_BACKOFF,
        clock: Callable[[], float] = time.monotonic,
        refresh_unschedulable: bool = True,
    ) -> None:
        """`refresh_unschedulable=False`: a pod already marked Unschedulable is not marked again
        while it stays unschedulable (its message keeps the node counts of its first mark).
        kube-scheduler writes the message again whenever it changes ("0/N nodes are available"
        changes with every new Node); tgp reads only the reason, and in `make bench` 500 pending
        pods rewritten on every pass kept the one process serving the API saturated."""
        self._http = client or new_client(base_url=api_url.rstrip("/"), timeout=10)
        self._owns = client is None
        self.interval = interval
        self.initial_backoff, self.max_backoff = initial_backoff, max_backoff
        self._clock = clock
        self.refresh_unschedulable = refresh_unschedulable
        # Pod uid -> its place in the scheduling queue (kube-scheduler's QueuedPodInfo).
        self._queue: dict[str, Queued] = {}
        # Pod uid -> the Node this scheduler bound it to, until the API shows the bind.
        self._assumed: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> SimScheduler:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._owns:
            await self._http.aclose()

    async def _loop(self) -> None:
        while True:
            try:
                await self._informed()
            except (httpx.HTTPError, ValueError, KeyError, WatchEnded) as exc:  # the API is restarting, or a watch expired: list again
                log.info("sim_scheduler_relist", error=str(exc)[:200])
            except Exception:  # noqa: BLE001 - a malformed object or a broken stream must not stop the binding
                log.exception("sim_scheduler_pass_failed")
            await asyncio.sleep(self.interval)

    async def _informed(self) -> None:
        """kube-scheduler's informers: list Nodes and pods once, then keep them from two watches
        and make a pass on the cache when something changed (at most every `interval`), or
        every RESYNC for the pods whose run ends on a timer. A watch that ends badly (410 Gone)
        raises, and the loop lists again."""
        nodes, pods = {}, {}
        node_list = (await self._http.get("/api/v1/nodes")).raise_for_status().json()
        pod_list = (await self._http.get("/api/v1/pods")).raise_for_status().json()
        for n in node_list.get("items") or []:
            nodes[n["metadata"]["name"]] = n
        for p in pod_list.get("items") or []:
            pods[_uid(p)] = p
        changed = asyncio.Event()
        changed.set()
        watches = [
            asyncio.create_task(self._watch("/api/v1/nodes", _version(node_list), nodes, lambda n: n["metadata"]["name"], changed)),
            asyncio.create_task(self._watch("/api/v1/pods", _version(pod_list), pods, _uid, changed)),
        ]
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(RESYNC):
                        await changed.wait()
                changed.clear()
                for watch in watches:
                    if watch.done():
                        watch.result()  # raises what ended it
                await self._pass(list(nodes.values()), list(pods.values()))
                await asyncio.sleep(self.interval)
        finally:
            for watch in watches:
                watch.cancel()
            await asyncio.gather(*watches, return_exceptions=True)

    async def _watch(self, path: str, version: str, store: dict[str, Any], key: Callable[[Any], str], changed: asyncio.Event) -> None:
        """Keep `store` as the API has it, from `version` on; set `changed` at each event."""
        while True:
            params = {"watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true", "timeoutSeconds": "60"}
            async with self._http.stream("GET", path, params=params, timeout=httpx.Timeout(10.0, read=90.0)) as stream:
                if stream.status_code != 200:
                    raise WatchEnded(f"watch {path} answered {stream.status_code}")
                async for line in stream.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        raise WatchEnded(f"watch {path}: {obj.get('message') or obj.get('reason')}")
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if kind == "BOOKMARK":
                        continue
                    if kind == "DELETED":
                        store.pop(key(obj), None)
                    else:
                        store[key(obj)] = obj
                    changed.set()

    async def step(self) -> None:
        """One pass on the API as listed now (the tests drive the scheduler with it)."""
        nodes = (await self._http.get("/api/v1/nodes")).raise_for_status().json().get("items") or []
        pods = (await self._http.get("/api/v1/pods")).raise_for_status().json().get("items") or []
        await self._pass(nodes, pods)

    async def _pass(self, nodes: list[Obj], pods: list[Obj]) -> None:
        """One pass: complete finished pods, start bound ones, bind pending ones. A pod this
        scheduler bound counts as bound until the API shows it so (kube-scheduler's assumed
        pods: a pass on a cache the bind has not reached yet must not bind it again)."""
        present = {_uid(p) for p in pods}
        self._assumed = {uid: node for uid, node in self._assumed.items() if uid in present}
        now, tick = datetime.now(timezone.utc), self._clock()
        free = self._free(nodes, pods)
        by_name = {n["metadata"]["name"]: n for n in nodes}
        static = static_view(nodes)
        order, bound = self._queue_order(pods, tick, Requeue(static, free, by_name))
        self._queue = {uid: q for uid, q in self._queue.items() if uid in present}
        binds, marks = self._decide(order, nodes, free, static, tick)
        # Written after the whole pass is decided: binds first, then the Unschedulable marks,
        # each kind concurrently. Written one by one, a pass of 500 pending pods took minutes
        # against a loaded API server (each bind behind 500 marks), and one failed write ended
        # the pass.
        await self._all([self._bind(pod, node, now) for pod, node in binds])
        # The kubelets' reports are made here, not with the order: a pass cut short at its binds
        # (a teardown) leaves no report made and never awaited.
        await self._all([*(self._kubelet(pod, now) for pod in bound), *(self._unschedulable(pod, reasons, by_name) for pod, reasons in marks)])

    def _free(self, nodes: list[Obj], pods: list[Obj]) -> dict[str, int]:
        """Each Node's free GPUs: allocatable minus what the unfinished pods bound (or assumed
        bound) to it request."""
        free = {n["metadata"]["name"]: allocatable_gpus(n) for n in nodes}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName") or self._assumed.get(_uid(pod))
            if node in free and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                free[node] -= max(pod_gpus(pod), 0)
        return free

    def _queue_order(self, pods: list[Obj], tick: float, requeue: Requeue) -> tuple[list[Obj], list[Obj]]:
        """The pending pods to try this pass, in the queue's order: the active queue first,
        oldest first; then, the active queue empty, the backoff queue by expiry
        (SchedulerPopFromBackoffQ). Also the bound pods, whose kubelet reports each on its own."""
        bound: list[Obj] = []
        active, backing_off = [], []
        for pod in pods:
            meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
            if meta.get("deletionTimestamp"):
                continue  # Terminating: the emulator removes it after its grace period
            if spec.get("nodeName"):
                self._assumed.pop(_uid(pod), None)
                bound.append(pod)
                continue
            if _uid(pod) in self._assumed:
                continue  # bound by this scheduler; the API has not shown it yet
            q = self._queue.setdefault(_uid(pod), Queued(since=tick))
            if q.unschedulable is not None:
                if not requeue.worth_it(q, pod) and tick - q.since < UNSCHEDULABLE_LEFTOVER:
                    continue  # no event that could make it fit: it waits
                q.unschedulable = None
            expiry = q.since + self._backoff(q.attempts)
            if tick < expiry:
                backing_off.append((expiry, _uid(pod), pod))
            else:
                active.append((q.since, str(meta.get("creationTimestamp") or ""), _uid(pod), pod))
        order = [e[-1] for e in sorted(active, key=lambda e: e[:3])] + [e[-1] for e in sorted(backing_off, key=lambda e: e[:2])]
        return order, bound

    def _decide(
        self, order: list[Obj], nodes: list[Obj], free: dict[str, int], static: Mapping[str, tuple[Any, ...]], tick: float,
    ) -> tuple[list[tuple[Obj, str]], list[tuple[Obj, Mapping[str, str | None]]]]:
        """What each pod in `order` gets, in memory, as kube-scheduler's cycles do one pod after
        the other on its cache: the binds (taking their GPUs from `free`) and the pods that fit
        nowhere, with each Node's reason."""
        binds: list[tuple[Obj, str]] = []
        marks: list[tuple[Obj, Mapping[str, str | None]]] = []
        # Pods that fit no node this pass, by what the nodes answer depends on: binding only
        # takes GPUs away, so another pod asking the same fits nowhere either.
        fit_nowhere: dict[str, dict[str, str | None]] = {}
        snapshot: Snapshot | None = None  # the cluster as the pods failing now see it (until a bind)
        for pod in order:
            uid, shape = _uid(pod), pod_shape(pod)
            reasons = fit_nowhere.get(shape)
            fitting: str | None = None
            if reasons is None:
                reasons = {n["metadata"]["name"]: fits(pod, n, free[n["metadata"]["name"]]) for n in nodes}
                fitting = min((name for name, why in reasons.items() if why is None), default=None)
            if fitting is not None:
                binds.append((pod, fitting))
                self._assumed[uid] = fitting
                free[fitting] -= max(pod_gpus(pod), 0)
                self._queue.pop(uid, None)
                snapshot = None
            else:
                fit_nowhere[shape] = reasons
                snapshot = snapshot or Snapshot(static, dict(free))
                q = self._queue[uid]
                q.attempts, q.since, q.unschedulable, q.shape = q.attempts + 1, tick, snapshot, shape
                marks.append((pod, reasons))
        return binds, marks

    def _backoff(self, attempts: int) -> float:
        """The backoff after `attempts` failures: none before the first."""
        return 0.0 if attempts == 0 else min(self.initial_backoff * 2 ** (attempts - 1), self.max_backoff)

    async def _all(self, writes: list[Coroutine[Any, Any, None]]) -> None:
        """The writes, WRITES_AT_ONCE at a time; one that fails is logged (the next pass
        tries that pod again) and takes no other down."""
        gate = asyncio.Semaphore(WRITES_AT_ONCE)

        async def one(write: Coroutine[Any, Any, None]) -> None:
            async with gate:
                try:
                    await write
                except httpx.HTTPError as exc:
                    log.info("sim_scheduler_write_failed", error=str(exc))

        await asyncio.gather(*(one(w) for w in writes))

    async def _bind(self, pod: Obj, node: str, now: datetime) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        try:
            (await self._http.patch(path, json={"spec": {"nodeName": node}}, headers=MERGE)).raise_for_status()
        except httpx.HTTPStatusError:
            self._assumed.pop(_uid(pod), None)  # refused, not bound: tried again
            raise  # a timeout may have bound it: it stays assumed until the watch says
        status = {"phase": "Running", "startTime": _ts(now), "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]}
        await self._http.patch(f"{path}/status", json={"status": status}, headers=MERGE)
        log.info("sim_pod_bound", pod=f"{meta['namespace']}/{meta['name']}", node=node)
        await self._event(pod, "Scheduled", scheduled_note(pod, node))

    async def _unschedulable(self, pod: Obj, reasons: Mapping[str, str | None], nodes: Mapping[str, Obj]) -> None:
        """Mark `pod` Unschedulable with why no Node fits, and record a FailedScheduling Event
        when that changed: one per distinct message, not one per retry (kube-scheduler's events
        recorder folds repeats of one message into a series)."""
        meta, status = pod["metadata"], pod.get("status") or {}
        counts: dict[str, int] = {}
        for why in reasons.values():
            if why:
                counts[why] = counts.get(why, 0) + 1
        message = f"0/{len(reasons)} nodes are available" + "".join(f", {n} {why}" for why, n in sorted(counts.items()))
        current = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
        if current and current.get("reason") == "Unschedulable" and (current.get("message") == message or not self.refresh_unschedulable):
            return
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        await self._http.patch(path, json={"status": {"phase": "Pending", "conditions": [condition]}}, headers=MERGE)
        note, queued = failed_scheduling_note(reasons, nodes), self._queue.get(_uid(pod))
        if queued is not None and queued.noted != note:
            queued.noted = note
            await self._event(pod, "FailedScheduling", note, warning=True)

    async def _event(self, pod: Obj, reason: str, note: str, *, warning: bool = False) -> None:
        event = scheduling_event(pod, reason=reason, note=note, warning=warning)
        path = f"/apis/events.k8s.io/v1/namespaces/{pod['metadata']['namespace']}/events"
        (await self._http.post(path, json=event)).raise_for_status()

    async def _kubelet(self, pod: Obj, now: datetime) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        if status.get("phase") in (None, "", "Pending"):
            started = {"phase": "Running", "startTime": _ts(now), "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]}
            await self._http.patch(path, json={"status": started}, headers=MERGE)
            return
        seconds = (meta.get("annotations") or {}).get(RUN_SECONDS_ANNOTATION)
        if status.get("phase") != "Running" or seconds is None or not status.get("startTime"):
            return
        try:
            due = datetime.fromisoformat(str(status["startTime"]).replace("Z", "+00:00")).timestamp() + float(seconds)
        except ValueError:
            return
        if now.timestamp() >= due:
            done = {"phase": "Succeeded", "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted"}]}
            await self._http.patch(path, json={"status": done}, headers=MERGE)
            log.info("sim_pod_completed", pod=f"{meta['namespace']}/{meta['name']}")


class WatchEnded(Exception):
    """A watch the API ended with an error (410 Gone: too old a resourceVersion): list again."""


def _version(listing: Obj) -> str:
    return str((listing.get("metadata") or {}).get("resourceVersion") or "")


def _uid(pod: Obj) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")


def _ts(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")
