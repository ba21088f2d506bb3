"""The node's watch is event-driven (issue 20): the bridge's informers tell each node workflow its
Node's facts on a change, the workflow holds durable timers, and a Ready node at rest costs no
request of its own to Kubernetes or the provider, and few history events.

Against the simulated world over HTTP (cloud, Kubernetes emulator), the real bridge and the
Temporal dev server or the time-skipping server; nothing of tgp is mocked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, Interceptor, OutboundInterceptor, SignalWorkflowInput, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from activities.kube.cluster import KubernetesCluster
from crd_bridge.bridge import Bridge
from sim.world import SimWorld
from tests.conftest import eventually, running_world, skip_time
from tests.test_node_lifecycle import assert_nothing_left, replay, request, start, wait_phase
from tests.test_node_long_lived import put_pod, remove_pod
from tgp.types import ANNOTATION_RELEASED, LifecycleTimeouts, NodeFacts, NodePhase, Stage
from workers.temporal import DATA_CONVERTER
from workflows.node import GPUNodeWorkflow

pytestmark = pytest.mark.timeout(600)

# Only the events can end these nodes: the backstop look is left at its default (45 minutes).
AT_REST = LifecycleTimeouts(
    launch=timedelta(seconds=20), tailnet_join=timedelta(seconds=20), node_ready=timedelta(seconds=20), drain=timedelta(seconds=10), idle=None
)
IDLE = timedelta(seconds=2)


@asynccontextmanager
async def bridge_running(env: WorkflowEnvironment, world: SimWorld, queue: str) -> AsyncIterator[Bridge]:
    """The CRD bridge on the world's API server (no pools there: only its Pod and Node side acts)."""
    bridge = Bridge(env.client, KubernetesCluster.from_url(world.kube_url), task_queue=queue)
    task = asyncio.create_task(bridge.run())
    try:
        yield bridge
    finally:
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=30)
        assert done, "the bridge did not stop within 30 s of being cancelled"


T = TypeVar("T")


async def signals_received(handle: WorkflowHandle, name: str, kind: type[T]) -> list[T]:
    """Every signal `name` in the workflow's history, in order, decoded as `kind`."""
    received: list[T] = []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            attrs = event.workflow_execution_signaled_event_attributes
            if attrs.signal_name == name:
                [value] = await DATA_CONVERTER.decode(attrs.input.payloads, [kind])
                received.append(value)
    return received


def local_activity(event: Any) -> str | None:
    """The summary of a local activity's marker event (what the workflow named the call), or
    None for any other event."""
    if event.event_type != EventType.EVENT_TYPE_MARKER_RECORDED or event.marker_recorded_event_attributes.marker_name != "core_local_activity":
        return None
    data = event.user_metadata.summary.data
    return data.decode().strip('"') if data else ""


async def facts_received(handle: WorkflowHandle) -> list[NodeFacts]:
    """Every `node_facts` signal in the node's history, in order."""
    return await signals_received(handle, "node_facts", NodeFacts)


async def told(handle: WorkflowHandle, **want: Any) -> NodeFacts:
    """Wait until the bridge has told the node facts with `want`."""

    async def check() -> NodeFacts | None:
        last = (await facts_received(handle) or [None])[-1]
        return last if last is not None and all(getattr(last, k) == v for k, v in want.items()) else None

    return await eventually(check, what=f"node_facts {want}")


def per_node_requests(world: SimWorld, node: str, since: int) -> list[str]:
    """tgp's Kubernetes requests about `node` alone (its Node by name, its pods by field
    selector) among those logged after the first `since`. The simulated kubelet (httpx) watches
    its own pods and renews its own Node, as a real kubelet does: not tgp's."""
    urls = [str(r.url) for r in list(world.kube)[since:] if not r.headers.get("User-Agent", "").startswith("python-httpx")]  # type: ignore[union-attr]
    return [u for u in urls if f"/nodes/{node}" in u or f"spec.nodeName%3D{node}" in u or f"spec.nodeName={node}" in u]


async def test_nodes_at_rest_make_no_request_of_their_own_and_few_history_events(time_skipping: WorkflowEnvironment) -> None:
    """(a) Two Ready nodes at rest for 30 minutes: no Kubernetes request about either Node, no
    provider call (the polling watch made one describe, one GET Node and one pod list per node
    every 30 s). (e) Over 10 hours at rest each node's history grows by fewer than 10 events
    an hour (the polling watch: about 1,300)."""
    async with running_world(time_skipping) as (world, _, queue):
        assert world.kube is not None
        world.kube.request_log = 1_000_000  # keep every request for counting
        async with bridge_running(time_skipping, world, queue):
            reqs = [request(timeouts=AT_REST) for _ in range(2)]
            handles = [await start(time_skipping, queue, req) for req in reqs]
            for handle, req in zip(handles, reqs):
                await wait_phase(handle, NodePhase.READY)
                await put_pod(world, req.node_name, f"job-{req.node_name}")
            for handle in handles:
                await told(handle, busy_pods=1, ready=True)

            kube_seen, describes = len(list(world.kube)), world.cloud.describe_requests
            lengths = [len((await h.fetch_history()).events) for h in handles]
            await skip_time(time_skipping, timedelta(minutes=30), step=timedelta(minutes=10))
            for req in reqs:
                assert per_node_requests(world, req.node_name, kube_seen) == [], "a node at rest asked Kubernetes about itself"
            assert world.cloud.describe_requests == describes, "a node at rest asked the provider about its instance"

            await skip_time(time_skipping, timedelta(hours=9, minutes=30), step=timedelta(hours=1))
            for handle in handles:
                status = await handle.query(GPUNodeWorkflow.status)
                assert status.phase is NodePhase.READY
            per_hour = [(len((await h.fetch_history()).events) - n) / 10 for h, n in zip(handles, lengths)]
            print(f"history events per node-hour at rest: {per_hour}")
            assert all(rate < 10 for rate in per_hour), per_hour
            for handle in handles:
                await handle.signal("evict", {"reason": "test done"})
                await handle.result()
            assert_nothing_left(world, reqs[0].node_name)


async def test_a_pod_deletion_ends_an_idle_node_at_the_idle_timeout_after_the_pod_left(temporal: WorkflowEnvironment) -> None:
    """(b) The node's timer is set for the moment the bridge saw the last pod go plus the idle
    timeout, not for a later look: in workflow time, the drain starts right then."""
    async with running_world(temporal) as (world, _, queue), bridge_running(temporal, world, queue):
        req = request(timeouts=AT_REST.model_copy(update={"idle": IDLE}))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await put_pod(world, req.node_name, "job")
        await told(handle, busy_pods=1)
        await remove_pod(world, "job")
        status = await asyncio.wait_for(handle.result(), 60)
        assert status.phase is NodePhase.TERMINATED and (status.end_reason or "").startswith("idle"), status

        received = await facts_received(handle)
        last_busy = max(i for i, f in enumerate(received) if f.busy_pods)
        gone = received[last_busy + 1]  # the pod left (what came after is the drain's and the release's)
        assert gone.busy_pods == 0 and gone.present
        # The watch's last timer was aimed at exactly gone.at + idle (the workflow's clock at
        # that task plus the timer's duration), and the drain began when it fired.
        history = await handle.fetch_history()
        task_started, aimed_at = None, None
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                task_started = event.event_time.ToDatetime(tzinfo=gone.at.tzinfo)
            if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED and task_started is not None:
                aimed_at = task_started + event.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                if event.activity_task_scheduled_event_attributes.activity_type.name == "drain_node":
                    break
            if local_activity(event) == "drain":  # `life-v2` drains an idle node in a local activity
                break
        assert aimed_at is not None and abs(aimed_at - (gone.at + IDLE)) < timedelta(milliseconds=5), (aimed_at, gone.at + IDLE)
        draining = next(r for r in status.stages if r.stage is Stage.DRAINING)
        assert draining.at >= gone.at + IDLE
        assert_nothing_left(world, req.node_name)
        await replay(handle, "idle_by_facts")


async def test_a_node_that_went_idle_while_the_bridge_was_down_still_ends(temporal: WorkflowEnvironment) -> None:
    """(c) Level-triggered: the pod leaves while no bridge watches; the restarted bridge lists
    and tells every node its facts once, and the idle node ends."""
    async with running_world(temporal) as (world, _, queue):
        req = request(timeouts=AT_REST.model_copy(update={"idle": IDLE}))
        handle = await start(temporal, queue, req)
        async with bridge_running(temporal, world, queue):
            await wait_phase(handle, NodePhase.READY)
            await put_pod(world, req.node_name, "job")
            await told(handle, busy_pods=1)
        await remove_pod(world, "job")  # nobody tells the node
        assert (await handle.query(GPUNodeWorkflow.status)).phase is NodePhase.READY
        async with bridge_running(temporal, world, queue):
            status = await asyncio.wait_for(handle.result(), 60)
        assert status.phase is NodePhase.TERMINATED and (status.end_reason or "").startswith("idle"), status
        assert_nothing_left(world, req.node_name)


# --- the sender -------------------------------------------------------------------------------


def _node(name: str, *, ready: bool = True, gpus: str = "1") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"tgp.io/managed": "true", "tgp.io/pool": "rtx", "tgp.io/pool-namespace": "ml"}},
        "status": {"allocatable": {"nvidia.com/gpu": gpus}, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _pod(name: str, node: str, **status: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": {"nodeName": node, "containers": [{"name": "c"}]}, "status": {"phase": "Running", **status}}


async def test_the_bridge_tells_nothing_before_both_lists_then_every_node_once(temporal: WorkflowEnvironment) -> None:
    """A Node listed before its pods would read idle: nothing is sent until the Pods and the
    Nodes informers have both listed; then every managed node's facts are, once. A node whose
    workflow is not running (NOT_FOUND) is dropped, not retried, and holds up no other."""
    from crd_bridge.node_facts import NodeFactsSender

    sender = NodeFactsSender(temporal.client)
    task = asyncio.create_task(sender.run())
    try:
        sender.on_node("ADDED", _node("a"))
        sender.on_node("ADDED", _node("b", ready=False))
        sender.on_listed("nodes")
        # A sender that sent now would have its NOT_FOUND answer within milliseconds; this wait
        # can only miss such a bug on a very slow machine, never fail a correct sender.
        await asyncio.sleep(0.5)
        assert sender.sent == {}, "facts sent from half a picture"
        sender.on_pod("ADDED", _pod("job", "a"))
        sender.on_pod("ADDED", _pod("done", "a", phase="Succeeded"))
        sender.on_listed("pods")

        async def all_sent() -> bool:
            return set(sender.sent) == {"a", "b"} and not sender.due

        await eventually(all_sent, what="every node's facts sent once both informers listed")
        assert (sender.sent["a"].busy_pods, sender.sent["a"].ready, sender.sent["a"].gpus) == (1, True, 1)
        assert (sender.sent["b"].busy_pods, sender.sent["b"].ready) == (0, False)
        sent_a = sender.sent["a"]
        sender.on_pod("MODIFIED", _pod("job", "a", phase="Running"))  # no change of the facts
        sender.on_pod("DELETED", _pod("job", "a"))
        await eventually(lambda: asyncio.sleep(0, sender.sent["a"].busy_pods == 0), what="the change sent")
        assert sender.sent["a"].at >= sent_a.at
    finally:
        task.cancel()


class SignalsSent(Interceptor):
    """Records each signal the client sends: (workflow id, signal name, its argument). With
    `gate`, a signal waits for it to be set (never set: it never answers); with `fail`, it then
    raises that instead of going to the server."""

    def __init__(self, *, gate: asyncio.Event | None = None, fail: Exception | None = None) -> None:
        self.sent: list[tuple[str, str, Any]] = []
        self.gate, self.fail = gate, fail

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        outer = self

        class Recording(OutboundInterceptor):
            async def signal_workflow(self, input: SignalWorkflowInput) -> None:
                outer.sent.append((input.id, input.signal, input.args[0] if input.args else None))
                if outer.gate is not None:
                    await outer.gate.wait()
                if outer.fail is not None:
                    raise outer.fail
                await super().signal_workflow(input)

        return Recording(next)


async def test_a_node_its_workflow_released_is_forgotten_untold_and_any_other_deletion_is_told(temporal: WorkflowEnvironment) -> None:
    """A node workflow annotates its Node released (tgp.io/released) just before deleting it: it
    is completing, and a `node_facts` signal then would have its last workflow task refused
    (UnhandledCommand) and run again. That deletion is not told; a Node deleted by anyone else
    is (present False), so a watching node learns its Node is gone."""
    from crd_bridge.node_facts import NodeFactsSender

    signals = SignalsSent()
    sender = NodeFactsSender(Client(**{**temporal.client.config(), "interceptors": [signals]}))
    task = asyncio.create_task(sender.run())
    try:
        for name in ("released", "deleted"):
            sender.on_node("ADDED", _node(name))
        sender.on_listed("nodes")
        sender.on_listed("pods")
        await eventually(lambda: asyncio.sleep(0, set(sender.sent) == {"released", "deleted"}), what="both nodes' facts sent")
        released = _node("released")
        released["metadata"]["annotations"] = {ANNOTATION_RELEASED: "true"}
        sender.on_node("DELETED", released)
        sender.on_node("DELETED", _node("deleted"))
        await eventually(lambda: asyncio.sleep(0, not sender.latest and not sender.due), what="both nodes forgotten")
    finally:
        task.cancel()
    told = [(wf.rsplit("/", 1)[-1], facts.present) for wf, name, facts in signals.sent if name == "node_facts"]
    assert sorted(told) == [("deleted", False), ("deleted", True), ("released", True)], told


@pytest.mark.parametrize("answer", ["failed", "delivered"])
async def test_a_send_in_flight_when_its_node_is_forgotten_leaves_nothing_behind(temporal: WorkflowEnvironment, answer: str) -> None:
    """A Node its workflow released is forgotten while its facts are still being sent: what that
    send answers (delivered or failed) must not bring the name back. A new Node of that name (the
    next launch attempt's) would otherwise inherit the old one's backoff or its Ready."""
    from crd_bridge.node_facts import NodeFactsSender

    go = asyncio.Event()
    # Failed, or sent on to the server, which has no such workflow: taken as delivered.
    held = SignalsSent(gate=go, fail=RPCError("the server is busy", RPCStatusCode.UNAVAILABLE, b"") if answer == "failed" else None)
    sender = NodeFactsSender(Client(**{**temporal.client.config(), "interceptors": [held]}))
    task = asyncio.create_task(sender.run())
    try:
        sender.on_listed("nodes")
        sender.on_listed("pods")
        sender.on_node("ADDED", _node("n"))
        await eventually(lambda: asyncio.sleep(0, "n" not in sender.due), what="the send in flight")
        released = _node("n")
        released["metadata"]["annotations"] = {ANNOTATION_RELEASED: "true"}
        sender.on_node("DELETED", released)
        go.set()  # the send ends now, after the Node was forgotten
        await eventually(lambda: asyncio.sleep(0, not any(t for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith("NodeFactsSender._send"))), what="the send to end")
        assert "n" not in sender.sent and "n" not in sender._failures and "n" not in sender._retry_at and "n" not in sender.due
    finally:
        task.cancel()


async def test_a_joining_nodes_facts_go_together_and_a_ready_nodes_at_once(temporal: WorkflowEnvironment) -> None:
    """A kubelet registers its Node, turns it Ready and reports its GPUs milliseconds apart: the
    facts of a Node never told Ready wait (JOINING_FACTS_SETTLE) for its next change and go as one
    signal, sent at once when they are Ready with GPUs. A Node told Ready before is told every
    change at once (here with a settle of a minute: a held change would not be told in time);
    one that never gets its GPUs is told after the settle."""
    from crd_bridge.node_facts import NodeFactsSender

    signals = SignalsSent()
    sender = NodeFactsSender(Client(**{**temporal.client.config(), "interceptors": [signals]}), joining_settle=timedelta(minutes=1))
    task = asyncio.create_task(sender.run())
    told = lambda name: [facts for wf, signal, facts in signals.sent if signal == "node_facts" and wf.endswith("/" + name)]  # noqa: E731
    try:
        sender.on_listed("nodes")
        sender.on_listed("pods")
        sender.on_node("ADDED", _node("joining", ready=False, gpus="0"))
        # A sender that did not hold would have sent within milliseconds; this wait can only
        # miss such a bug on a very slow machine, never fail a correct sender.
        await asyncio.sleep(0.3)
        sender.on_node("MODIFIED", _node("joining", gpus="0"))
        await asyncio.sleep(0.3)
        assert told("joining") == [], "a joining node's facts were not held"
        sender.on_node("MODIFIED", _node("joining"))
        await eventually(lambda: asyncio.sleep(0, "joining" in sender.sent), what="the joining node's facts sent once Ready with GPUs")
        [facts] = told("joining")
        assert (facts.ready, facts.gpus) == (True, 1)
        sender.on_node("MODIFIED", _node("joining", ready=False))  # told Ready before: at once
        await eventually(lambda: asyncio.sleep(0, len(told("joining")) == 2), what="a NotReady change told at once")
        assert told("joining")[1].ready is False
    finally:
        task.cancel()

    quick = NodeFactsSender(Client(**{**temporal.client.config(), "interceptors": [signals]}), joining_settle=timedelta(milliseconds=50))
    task = asyncio.create_task(quick.run())
    try:
        quick.on_listed("nodes")
        quick.on_listed("pods")
        quick.on_node("ADDED", _node("no-gpus", gpus="0"))
        await eventually(lambda: asyncio.sleep(0, "no-gpus" in quick.sent), what="facts without GPUs told after the settle")
        assert [(f.ready, f.gpus) for f in told("no-gpus")] == [(True, 0)]
    finally:
        task.cancel()


async def test_a_sighting_from_the_providers_listing_makes_the_node_look_then_act(temporal: WorkflowEnvironment) -> None:
    """`instance_seen`: a listing that does not show the instance running makes the node look
    for itself (one describe) before acting: a sighting the look contradicts (lists lag) keeps
    the node; one the look confirms (preempted) ends it Interrupted."""
    from tgp.types import InstanceSighting, InstanceState

    async with running_world(temporal) as (world, _, queue):
        req = request(timeouts=AT_REST)  # the backstop look is 45 minutes away: only the sighting looks
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY)
        await eventually(lambda: asyncio.sleep(0, world.cloud.describe_requests > 0), what="the seeding look")

        looked = world.cloud.describe_requests
        stale = InstanceSighting(instance_id=ready.instance_id, state=None, at=datetime.now(timezone.utc))
        await handle.signal(GPUNodeWorkflow.instance_seen, stale)  # listed as missing, but it runs
        await eventually(lambda: asyncio.sleep(0, world.cloud.describe_requests == looked + 1), what="one look")
        assert (await handle.query(GPUNodeWorkflow.status)).phase is NodePhase.READY, "a lagging list is no reason to end a node"

        await world.cloud.preempt(ready.instance_id or "")
        seen = InstanceSighting(instance_id=ready.instance_id, state=InstanceState.TERMINATED, interrupted=True, at=datetime.now(timezone.utc))
        await handle.signal(GPUNodeWorkflow.instance_seen, seen)
        final = await asyncio.wait_for(handle.result(), 60)
        assert final.phase is NodePhase.INTERRUPTED and (final.end_reason or "").startswith("interrupted"), final
        assert_nothing_left(world, req.node_name)


class Gate:
    """A TCP forwarder to the Temporal frontend that can be shut (every connection cut, new
    ones refused) and opened again: the bridge's signals fail while it is shut."""

    def __init__(self, upstream: str) -> None:
        self.host, port = upstream.rsplit(":", 1)
        self.port = int(port)
        self.open = True
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def shut(self) -> None:
        self.open = False
        for writer in list(self.writers):
            writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self.writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()
                self.writers.discard(dst)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_a_failed_signal_is_sent_again_until_it_gets_through(temporal: WorkflowEnvironment) -> None:
    """The Temporal frontend unreachable: every node's facts wait and are retried with backoff;
    once it answers again each node gets its latest facts (a change made meanwhile included)."""
    from temporalio.client import Client

    from crd_bridge.node_facts import NodeFactsSender

    gate = Gate(temporal.client.service_client.config.target_host)
    client = await Client.connect(await gate.start(), namespace=temporal.client.namespace, data_converter=DATA_CONVERTER)
    sender = NodeFactsSender(client, signal_timeout=timedelta(seconds=1))
    task = asyncio.create_task(sender.run())
    try:
        gate.shut()
        for name in ("a", "b"):
            sender.on_node("ADDED", _node(name))
        sender.on_listed("nodes")
        sender.on_listed("pods")
        await eventually(lambda: asyncio.sleep(0, set(sender._failures) == {"a", "b"}), what="both sends failed")
        assert sender.sent == {}, "nothing got through"
        sender.on_pod("ADDED", _pod("job", "b"))  # a change while it cannot be told
        gate.open = True
        # Told its latest facts: a send of b's older ones still in flight as the gate opened (the
        # client retries it) may land first, and the latest go after it.
        told = lambda: all(sender.sent.get(n) is sender.latest.get(n) for n in ("a", "b")) and not sender.due  # noqa: E731
        await eventually(lambda: asyncio.sleep(0, told()), what="every node told its latest facts once it answers")
        assert sender.sent["b"].busy_pods == 1, "the latest facts, not the ones that failed"
    finally:
        task.cancel()
        if gate.server is not None:
            gate.server.close()


async def test_facts_told_during_bring_up_start_the_watch_without_a_look(temporal: WorkflowEnvironment) -> None:
    """Facts that arrive before Ready are kept and start the watch: no look is needed to seed
    it, and idleness counts from Ready (never from before it)."""
    async with running_world(temporal) as (world, _, queue):
        req = request(timeouts=AT_REST.model_copy(update={"idle": IDLE}))
        handle = await start(temporal, queue, req)
        early = NodeFacts(node_name=req.node_name, present=True, ready=True, gpus=1, busy_pods=0, at=datetime.now(timezone.utc))
        await handle.signal(GPUNodeWorkflow.node_facts, early)
        status = await asyncio.wait_for(handle.result(), 60)
        assert status.phase is NodePhase.TERMINATED and (status.end_reason or "").startswith("idle"), status
        ready = next(r for r in status.stages if r.stage is Stage.READY)
        draining = next(r for r in status.stages if r.stage is Stage.DRAINING)
        assert draining.at >= ready.at + IDLE, "idle counted from before Ready"
        history = await handle.fetch_history()
        # A life under `life-v2` runs its short calls as local activities too: a look is the one
        # named so.
        looks = [e for e in history.events if local_activity(e) == "look"]
        assert looks == [], "the watch looked although the bridge had told it"
        assert_nothing_left(world, req.node_name)


async def test_a_launch_that_saw_its_node_up_starts_the_watch_on_that_look(time_skipping: WorkflowEnvironment) -> None:
    """No facts at all (no bridge runs here; with one, they come once the joining taint is off):
    the launch's look saw the Node Ready with its GPUs and labelled it, and the watch begins on
    that look, not a look of its own, and judges the node healthy: it is still Ready past the
    grace that ends a node whose Node is missing or NotReady (NODE_LOST_AFTER)."""
    from tgp.lifecycle import NODE_LOST_AFTER

    async with running_world(time_skipping) as (world, _, queue):
        req = request(timeouts=AT_REST)
        handle = await start(time_skipping, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await skip_time(time_skipping, NODE_LOST_AFTER + timedelta(minutes=2), step=timedelta(minutes=1))
        status = await handle.query(GPUNodeWorkflow.status)
        assert status.phase is NodePhase.READY, status
        looks = [e for e in (await handle.fetch_history()).events if local_activity(e) == "look"]
        assert looks == [], "the watch looked although the launch's look had just seen the Node up"
        await handle.signal("evict", {"reason": "test done"})
        await handle.result()
        assert_nothing_left(world, req.node_name)


async def test_a_nodes_facts_wait_for_its_joining_taint_to_go(temporal: WorkflowEnvironment) -> None:
    """A Node registered while the bridge watched, told nothing yet, Ready with its GPUs and still
    with tgp's joining taint is being labelled by its launch, which has looked at it: its facts
    wait for the taint's removal (a signal meanwhile cost the node a workflow task that did
    nothing). So do its NotReady facts before (real kubelets register NotReady). Then facts the
    launch's look saw (Ready with its GPUs, no pod) are not told at all, the next change is;
    facts that differ go at once. A Node the bridge found in its first list is told at once;
    one that keeps the taint is told after JOINING_TAINT_HOLD all the same, and every change
    after that at once."""
    from crd_bridge.node_facts import NodeFactsSender

    signals = SignalsSent()
    client = Client(**{**temporal.client.config(), "interceptors": [signals]})
    sender = NodeFactsSender(client, joining_settle=timedelta(milliseconds=50), taint_hold=timedelta(minutes=10))
    task = asyncio.create_task(sender.run())
    told = lambda name: [facts for wf, signal, facts in signals.sent if signal == "node_facts" and wf.endswith("/" + name)]  # noqa: E731
    at_once = timedelta(seconds=10).total_seconds()  # far below the hold: "at once", not after it

    def tainted(name: str, **kw: Any) -> dict[str, Any]:
        node = _node(name, **kw)
        return {**node, "spec": {"taints": [{"key": "tgp.io/joining", "effect": "NoSchedule"}]}}

    try:
        sender.on_node("ADDED", tainted("listed"))  # in the first list: maybe told by another bridge
        sender.on_listed("nodes")
        sender.on_listed("pods")
        await eventually(lambda: asyncio.sleep(0, "listed" in sender.sent), what="a listed Node's facts", timeout=at_once)

        sender.on_node("ADDED", tainted("labelled"))
        # A sender that did not hold would have sent within milliseconds (past the 50 ms settle);
        # this wait can only miss such a bug on a very slow machine, never fail a correct sender.
        await asyncio.sleep(0.3)
        assert told("labelled") == [], "a joining Node's facts went while it still had the taint"
        sender.on_node("MODIFIED", _node("labelled"))  # the launch took the taint off: it knows them
        assert "labelled" in sender.sent and "labelled" not in sender.due, "facts its launch saw were to be told"
        sender.on_pod("ADDED", _pod("job", "labelled"))  # the first change after: told at once
        await eventually(lambda: asyncio.sleep(0, len(told("labelled")) == 1), what="the pod told", timeout=at_once)
        assert [(f.ready, f.gpus, f.busy_pods) for f in told("labelled")] == [(True, 1, 1)]

        sender.on_node("ADDED", tainted("busy"))
        sender.on_pod("ADDED", _pod("early", "busy"))  # a pod that tolerates the taint
        sender.on_node("MODIFIED", _node("busy"))  # facts the launch did not see: told at once
        await eventually(lambda: asyncio.sleep(0, len(told("busy")) == 1), what="the busy Node's facts once the taint is off", timeout=at_once)
        assert [(f.ready, f.busy_pods) for f in told("busy")] == [(True, 1)]

        sender.on_node("ADDED", tainted("kubelet", ready=False, gpus="0"))  # NotReady first, as real kubelets register
        await asyncio.sleep(0.3)  # past the 50 ms settle, as above
        sender.on_node("MODIFIED", tainted("kubelet"))  # Ready: the launch's look sees it and labels it
        await asyncio.sleep(0.3)
        assert told("kubelet") == [], "a joining Node's NotReady or Ready facts went while it still had the taint"
        sender.on_node("MODIFIED", _node("kubelet"))
        assert "kubelet" in sender.sent and "kubelet" not in sender.due, "facts its launch saw were to be told"
    finally:
        task.cancel()

    quick = NodeFactsSender(client, taint_hold=timedelta(milliseconds=100))
    task = asyncio.create_task(quick.run())
    try:
        quick.on_listed("nodes")
        quick.on_listed("pods")
        quick.on_node("ADDED", tainted("kept"))
        await eventually(lambda: asyncio.sleep(0, "kept" in quick.sent), what="the facts of a Node that keeps the taint, after the hold")
        assert [(f.ready, f.gpus) for f in told("kept")] == [(True, 1)]
        quick.on_node("ADDED", tainted("slow", ready=False, gpus="0"))  # NotReady past the hold: told, then Ready at once
        await eventually(lambda: asyncio.sleep(0, len(told("slow")) == 1), what="the NotReady facts after the hold")
        quick.on_node("MODIFIED", tainted("slow"))
        await eventually(lambda: asyncio.sleep(0, len(told("slow")) == 2), what="Ready after NotReady", timeout=at_once)
        assert [(f.ready, f.gpus) for f in told("slow")] == [(False, 0), (True, 1)]
    finally:
        task.cancel()
