"""Each managed Node's facts for its node workflow (issue 20: the event-driven watch).

From the Pods and Nodes informers the bridge already runs, it keeps for every managed Node
(label tgp.io/managed=true; the pool labels name its workflow, tgp.types.node_workflow_id)
whether it exists, is Ready, its allocatable GPUs, how many pods keep it busy
(tgp.lifecycle.pod_keeps_node_busy, pods read as the activities read them), and what holds it
against voluntary disruption (the Node's do-not-disrupt annotation; the names of the first
MAX_HOLDERS_NAMED pods that ask so, tgp.lifecycle.pod_holds_node, and their count), and signals
`node_facts` to the node workflow only when that changes.

* Coalesced: one send in flight per node, the latest facts sent; a failed send is retried with
  a doubling backoff and never holds up another node's. A workflow that is not running
  (NOT_FOUND) has nobody to tell: dropped.
* A Node its workflow deleted itself (annotated tgp.types.ANNOTATION_RELEASED just before) is
  forgotten without a word: the workflow is completing, and a signal then would have its last
  workflow task refused and run again. Any other deletion is told (present False), and so is a
  deletion that tgp's finalizer holds (`deleting`: `kubectl delete node`, drained and ended).
* A joining Node's facts (registered, Ready, GPUs: milliseconds apart) wait up to
  JOINING_FACTS_SETTLE for the next change and go together: one signal, one workflow task.
  They wait while the Node still has tgp's joining taint (at most JOINING_TAINT_HOLD from its
  first facts) if it registered while this process watched and nothing was sent for it yet:
  its launch is looking at it then (NotReady first, as real kubelets register, then Ready), and
  most likely labels it, and facts sent meanwhile cost the node a workflow task that does
  nothing (issue 37). When tgp takes the taint off, they are not sent at all if they are what
  the launch's look saw (Ready with its GPUs, no pod, nothing holding it); any others go at
  once. A Node told anything before is told each change at once, as before.
* Level-triggered: nothing is sent until both informers have listed (a Node without its pods
  would look idle), and after every list of either (a start, a re-list after 410 Gone) every
  managed node's current facts are sent once, so a signal lost while the bridge was down heals.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from datetime import datetime, timedelta, timezone

import structlog
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.kube.summaries import node_summary_of, pod_summary_of
from crd_bridge.informer import Obj, object_key
from crd_bridge.metrics import NODE_FACTS_SIGNALS
from tgp.lifecycle import pod_holds_node, pod_keeps_node_busy
from tgp.types import ANNOTATION_RELEASED, LABEL_POOL, LABEL_POOL_NAMESPACE, MAX_HOLDERS_NAMED, TAINT_JOINING, NodeFacts, node_workflow_id

log = structlog.get_logger("tgp.bridge.facts")

# A failed signal is sent again after this, doubling per failure up to the maximum.
FACTS_RETRY_START = timedelta(seconds=0.5)
FACTS_RETRY_MAX = timedelta(seconds=30)
# One signal's RPC; past it the send counts as failed and is retried.
FACTS_SIGNAL_TIMEOUT = timedelta(seconds=10)
# Signals in flight at once (a re-send of a thousand nodes after a restart must not open a
# thousand RPCs).
FACTS_SENDS_AT_ONCE = 32
# A joining Node's facts (present, never yet told Ready) wait this long for its next change
# before they are sent: a kubelet registers the Node, turns it Ready and its device plugin
# reports the GPUs within a few hundred milliseconds, and the node workflow acts on Ready with
# GPUs only; each signal costs it a workflow task (three in a row in every life). Facts that
# make it Ready with GPUs, and every change of a Node told Ready before (NotReady, gone, busy),
# go at once.
JOINING_FACTS_SETTLE = timedelta(seconds=0.3)
# A Node registered while the bridge watched, told nothing yet and still with tgp's joining
# taint is most likely being looked at by its launch, which looks every second for two seconds
# after its device joined (activities.node.join) and labels it once Ready: its facts (NotReady
# first, then Ready) wait for the taint's removal, at most this long from its first facts. A
# launch that missed it leaves the Node to its workflow's join, which these facts then reach
# this much later at most (its own first look comes two seconds in).
JOINING_TAINT_HOLD = timedelta(seconds=3)
# The informers whose lists make a whole picture.
INFORMERS = ("pods", "nodes")


class _PodsOnNodes:
    """Which pods of a kind (busy, holding) are on which Node, both ways."""

    def __init__(self) -> None:
        self.on: dict[str, set[str]] = {}  # Node name -> pod keys
        self.where: dict[str, str] = {}  # pod key -> its Node


class NodeFactsSender:
    def __init__(
        self,
        client: Client,
        *,
        signal_timeout: timedelta = FACTS_SIGNAL_TIMEOUT,
        joining_settle: timedelta = JOINING_FACTS_SETTLE,
        taint_hold: timedelta = JOINING_TAINT_HOLD,
    ) -> None:
        self.client = client
        self.signal_timeout = signal_timeout
        self.joining_settle = joining_settle.total_seconds()
        self.taint_hold = taint_hold.total_seconds()
        self._held_until: dict[str, float] = {}  # joining Node name -> when its held facts go (loop time)
        self._tainted_since: dict[str, float] = {}  # joining Node name -> when its first facts came while it had the taint
        self.tainted: set[str] = set()  # Nodes with tgp's joining taint
        # Nodes registered while this process watched (first seen after both lists) whose facts
        # it has not begun to send: their workflows have heard nothing of them from it.
        self.untold: set[str] = set()
        self.workflow_ids: dict[str, str] = {}  # managed Node name -> its node workflow id
        self.latest: dict[str, NodeFacts] = {}  # Node name -> its facts, `at` when they last changed
        self.sent: dict[str, NodeFacts] = {}  # Node name -> the facts its workflow last received (or knew from its launch's look)
        self.busy = _PodsOnNodes()  # the pods that keep their Node busy
        self.holding = _PodsOnNodes()  # the pods that hold their Node against voluntary disruption
        self.gone: set[str] = set()  # deleted Nodes whose last facts are still to be sent
        self.due: set[str] = set()
        self.listed: set[str] = set()  # informers that have listed at least once
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._wake = asyncio.Event()
        # This process's facts are numbered: the workflows order them by (incarnation, number),
        # not by this machine's clock (tgp.facts_order).
        # Its start first (nanoseconds, fixed width): the workflows take the latest-started bridge.
        self.incarnation = f"{time.time_ns():020d}-{uuid.uuid4().hex}"
        self._seq = itertools.count(1)

    # --- from the informers ----------------------------------------------------------------

    def on_pod(self, kind: str, obj: Obj) -> None:
        key = object_key(obj).lstrip("/")
        node = (obj.get("spec") or {}).get("nodeName")
        pod = pod_summary_of(obj)
        present = kind != "DELETED" and bool(node)
        for table in (self.busy, self.holding):
            counts = present and (pod_keeps_node_busy(pod) if table is self.busy else pod_holds_node(pod))
            self._place(table, key, node if counts else None)

    def _place(self, table: _PodsOnNodes, key: str, node: str | None) -> None:
        """Count pod `key` on `node` in `table` (None: on none), telling the nodes it left and
        joined."""
        old = table.where.get(key)
        if node == old:
            return
        if old is not None:
            del table.where[key]
            pods = table.on.get(old, set())
            pods.discard(key)
            if not pods:
                table.on.pop(old, None)
            self._changed(old)
        if node is not None:
            table.where[key] = node
            table.on.setdefault(node, set()).add(key)
            self._changed(node)

    def on_node(self, kind: str, obj: Obj) -> None:
        meta = obj.get("metadata") or {}
        name, labels = meta.get("name") or "", meta.get("labels") or {}
        if LABEL_POOL not in labels:
            return  # not (yet) a pool's node: no workflow to tell
        self.workflow_ids[name] = node_workflow_id(labels.get(LABEL_POOL_NAMESPACE) or "default", labels[LABEL_POOL], name)
        if kind == "DELETED" and (meta.get("annotations") or {}).get(ANNOTATION_RELEASED) == "true":
            # Its workflow released it and deleted it itself: nobody to tell (a signal now would
            # land as the workflow completes).
            self._forget(name)
            return
        if kind == "DELETED":
            self.gone.add(name)
            self._update(name, NodeFacts(node_name=name, present=False, at=_now()))
            return
        self.gone.discard(name)
        summary = node_summary_of(obj)
        facts = NodeFacts(
            node_name=name, present=True, ready=summary.ready, gpus=summary.gpus, do_not_disrupt=summary.do_not_disrupt, deleting=summary.deleting, at=_now()
        )
        if name not in self.latest and self.ready():
            self.untold.add(name)
        tainted = any(t.key == TAINT_JOINING.key for t in summary.taints)
        labelled = name in self.tainted and not tainted
        if tainted:
            self.tainted.add(name)
        else:
            self.tainted.discard(name)
        self._update(name, self._with_pods(facts))
        if labelled:
            self._labelled(name)

    def _labelled(self, name: str) -> None:
        """tgp took the joining taint off Node `name`: facts held for it are decided now. Its
        workflow already knows them if it has heard nothing from this process and they are what
        its launch's look saw (then nothing is sent); any others go at once."""
        self._tainted_since.pop(name, None)
        if self._held_until.pop(name, None) is None:
            return
        if name in self.untold and _as_its_launch_saw(self.latest[name]):
            self.untold.discard(name)
            self.sent[name] = self.latest[name]
            self.due.discard(name)
        else:
            self._wake.set()

    def on_listed(self, informer: str) -> None:
        """An informer has delivered a whole list: once both have, send every node's facts."""
        self.listed.add(informer)
        if self.ready():
            self.due.update(self.latest)
            self._wake.set()

    def ready(self) -> bool:
        return all(name in self.listed for name in INFORMERS)

    def _changed(self, name: str) -> None:
        current = self.latest.get(name)
        if current is not None and current.present:
            self._update(name, self._with_pods(current.model_copy(update={"at": _now()})))

    def _with_pods(self, facts: NodeFacts) -> NodeFacts:
        name = facts.node_name
        holders = sorted(self.holding.on.get(name, ()))
        return facts.model_copy(
            update={"busy_pods": len(self.busy.on.get(name, ())), "holders": holders[:MAX_HOLDERS_NAMED], "holding": len(holders)}
        )

    def _update(self, name: str, facts: NodeFacts) -> None:
        current = self.latest.get(name)
        if current is not None and _same(current, facts):
            return
        self.latest[name] = facts.model_copy(update={"source": self.incarnation, "seq": next(self._seq)})
        told = self.sent.get(name)
        joining = facts.present and not (told is not None and told.ready)
        now = asyncio.get_running_loop().time()
        if joining and name in self.tainted and name in self.untold:
            # Its launch looking at it, and most likely labelling it: held for the taint's
            # removal (`_labelled`), from its first facts (never postponed).
            self._held_until[name] = self._tainted_since.setdefault(name, now) + self.taint_hold
        elif joining and not (facts.ready and facts.gpus > 0):
            # Joining: held for its next change, from the first change held (never postponed).
            self._held_until.setdefault(name, now + self.joining_settle)
        else:
            self._held_until.pop(name, None)
        self.due.add(name)
        self._wake.set()

    # --- to the workflows ------------------------------------------------------------------

    async def run(self) -> None:
        """Send due facts until cancelled."""
        loop = asyncio.get_running_loop()
        limit = asyncio.Semaphore(FACTS_SENDS_AT_ONCE)
        in_flight: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                now = loop.time()
                waits: list[float] = []
                if self.ready():
                    for name in sorted(self.due):
                        if name in in_flight:
                            continue
                        retry_at = max(self._retry_at.get(name, 0.0), self._held_until.get(name, 0.0))
                        if retry_at > now:
                            waits.append(retry_at - now)
                            continue
                        self._held_until.pop(name, None)
                        self.due.discard(name)
                        self.untold.discard(name)
                        task = asyncio.create_task(self._send(name, limit))
                        in_flight[name] = task
                        task.add_done_callback(lambda _, n=name: (in_flight.pop(n, None), self._wake.set()))
                try:
                    async with asyncio.timeout(min(waits) if waits else None):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                self._wake.clear()
        finally:
            for task in in_flight.values():
                task.cancel()

    async def _send(self, name: str, limit: asyncio.Semaphore) -> None:
        facts, workflow_id = self.latest.get(name), self.workflow_ids.get(name)
        if facts is None or workflow_id is None:
            return
        async with limit:
            try:
                await self.client.get_workflow_handle(workflow_id).signal("node_facts", facts, rpc_timeout=self.signal_timeout)
            except RPCError as exc:
                if exc.status is RPCStatusCode.NOT_FOUND:
                    NODE_FACTS_SIGNALS.labels("no_workflow").inc()
                    self._delivered(name, facts)  # no live workflow for it: nobody to tell
                    return
                self._failed(name, f"{exc.status.name if exc.status else 'RPCError'}: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - one node's failure must not stop the others
                self._failed(name, f"{type(exc).__name__}: {exc}")
                return
        NODE_FACTS_SIGNALS.labels("sent").inc()
        self._delivered(name, facts)

    def _delivered(self, name: str, facts: NodeFacts) -> None:
        if name not in self.latest:
            return  # forgotten while the send was in flight (its workflow released the Node)
        self.sent[name] = facts
        self._failures.pop(name, None)
        self._retry_at.pop(name, None)
        if name in self.gone and self.latest.get(name) is facts:
            self._forget(name)  # the workflow knows its Node is gone

    def _forget(self, name: str) -> None:
        """Drop everything kept for Node `name`: a new Node of that name starts over."""
        for table in (self.latest, self.sent, self.workflow_ids, self._failures, self._retry_at, self._held_until, self._tainted_since):
            table.pop(name, None)
        self.gone.discard(name)
        self.tainted.discard(name)
        self.untold.discard(name)
        self.due.discard(name)

    def _failed(self, name: str, error: str) -> None:
        NODE_FACTS_SIGNALS.labels("failed").inc()
        if name not in self.latest:
            return  # forgotten while the send was in flight: nothing to send again
        failures = self._failures.get(name, 0) + 1
        self._failures[name] = failures
        wait = min(FACTS_RETRY_START.total_seconds() * 2 ** (failures - 1), FACTS_RETRY_MAX.total_seconds())
        self._retry_at[name] = asyncio.get_running_loop().time() + random.uniform(wait / 2, wait)
        self.due.add(name)
        log.warning("node_facts_not_sent", node=name, workflow_id=self.workflow_ids.get(name), error=error[:300], retry_in=round(wait, 2))


def _as_its_launch_saw(facts: NodeFacts) -> bool:
    """What a launch's look saw before it took the joining taint off, and its node's watch
    starts on (workflows/node/watch.py `_seed_view`): Ready with its GPUs, no pod on it (none
    could land before), nothing holding it, not being deleted. A workflow whose launch did not
    see it up, and that has no facts, looks itself."""
    return (
        facts.present and facts.ready and facts.gpus > 0 and facts.busy_pods == 0 and facts.holding == 0
        and not facts.do_not_disrupt and not facts.deleting
    )


def _same(a: NodeFacts, b: NodeFacts) -> bool:
    return a.model_copy(update={"at": b.at, "source": b.source, "seq": b.seq}) == b


def _now() -> datetime:
    return datetime.now(timezone.utc)
