"""The node's join: the instance boots and its device joins the tailnet (`join_after_buy`, the
second half of `launch_instance`, with the twin watch beside it), a stage looked at once
(`check_stage`), the Node labelled."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import metrics
from activities.errors import temporal_errors
from activities.node.base import NodeBase, heartbeating, log, survivor
from activities.node.reports import _dated, carrying, sends_reports
from activities.termination import VERIFY_FOR, end_for_good, settled_at
from tgp.messages import PoolReport
from tgp.types import LABEL_PROVIDER, InstanceRef, InstanceState, JoinPlan, JoinResult, LabelInput, LaunchResult, StageCheck, StageLook, TailnetDevice, TwinWatchInput

# The join looks for the device this often (the tailnet's API, not a provider's), and takes a
# listing begun up to half that before its look: the joins of a burst share about two listings
# a second instead of one per round trip (activities.fresh_reads). The last look, at the
# deadline (`check_stage`), takes only a listing begun after it.
JOIN_LOOK_EVERY = timedelta(seconds=1)
JOIN_LOOK_SHARED = JOIN_LOOK_EVERY / 2
# Once the device joined, the join looks at the Node (Ready, its GPUs) for this long: the
# join's first look, which spares the workflow a timer where the Node registers with its device.
JOIN_NODE_LOOK = timedelta(seconds=2)


class Join(NodeBase):
    """The join's activities: `watch_for_twins`, `check_stage`, `label_and_taint_node`; and the
    join's wait, which `launch_instance` runs once it has bought (`join_after_buy`)."""

    async def join_after_buy(self, name: str, bought: LaunchResult, plan: JoinPlan) -> JoinResult:
        """The join's wait for what `bought` is, until `plan.within` has passed: then one last
        look (the instance booted on its own clock all along) keeps what is in fact up. A join
        that fails (the deadline, an instance that failed while it booted) is an answer, not an
        error: the instance is recorded either way, and the workflow releases it."""
        named = next((r for r in plan.seen if r.instance_name == name), None) or InstanceRef(provider=bought.instance.provider, instance_name=name)
        ref = named.bought(bought, self.now())
        check = StageCheck(instance=ref, device=plan.device, node_name=plan.node_name, gpus=plan.gpus)
        twins = TwinWatchInput(instances=[*(r for r in plan.seen if r.instance_name != name), ref], keep=ref.instance_id)
        try:
            async with asyncio.timeout(plan.within.total_seconds()):
                return await self.wait_for_join(check, twins)
        except TimeoutError:
            pass
        except ApplicationError as exc:  # the instance failed or vanished while it booted
            return JoinResult(error=exc.message)
        # The stage is the instance and its device: a Node still coming up is the next stage's.
        try:
            look = await self.check_stage(check.model_copy(update={"node_name": None, "gpus": None}))
        except ApplicationError as exc:
            return JoinResult(error=f"{plan.timeout_error}; the last look at the deadline failed: {exc.message}")
        if look.up:
            log.info("join_kept_at_deadline", seen=look.seen)
            return JoinResult()
        return JoinResult(error=f"{plan.timeout_error}; at the deadline {look.seen}")

    async def label_on_join(self, inp: LabelInput, ready: PoolReport | None) -> bool:
        """A Node up at the join's end gets its labels and taints (the joining taint off: pods
        may land), and the pool the Ready report, here rather than in a local activity of the
        workflow's; False if that failed, or this attempt sends no report (the workflow does both)."""
        if ready is not None and not sends_reports():
            return False
        try:
            with heartbeating():
                await self.label_and_taint_node(inp, _dated(ready, self.now()))
        except Exception as exc:  # noqa: BLE001 - the workflow's label step makes it
            log.info("labels_left_to_the_workflow", error=type(exc).__name__)
            return False
        return True

    async def wait_for_join(self, q: StageCheck, twins: TwinWatchInput | None = None) -> JoinResult:
        """Wait for the instance to boot and its device to join the tailnet, and beside it
        `watch_for_twins` (one activity and one workflow task instead of two). The device is
        looked for every JOIN_LOOK_EVERY (the tailnet is ours to ask; a joined device means a
        running machine); the provider is read every poll interval until the instance runs, the
        first time one interval after the buy (whose answer stood for the first read):
        LaunchFailed if it fails or vanishes meanwhile (a 404 inside the provider's consistency
        window after the create is the provider lagging, not a vanished instance). Heartbeats go
        on through every look, however slow; how long to wait is the workflow's stage deadline.

        The join decides when it ends: a twin watch not done by then (a provider whose
        consistency window outlasts the boot) or failed is cancelled and reported not done, and
        the workflow watches on in the background."""
        watch = asyncio.ensure_future(self._watch_for_twins(twins)) if twins is not None else None
        try:
            device = await self._wait_for_tailnet_join(q)
            node = await self._look_at_node(q) if q.node_name is not None else None
        finally:
            if watch is not None:
                if not watch.done():
                    watch.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watch  # its end taken, whatever it was (an error is logged below)
        if watch is None or watch.cancelled():
            return JoinResult(device=device, node=node)
        if (error := watch.exception()) is not None:
            log.info("twin_watch_left_to_the_workflow", error=type(error).__name__)
            return JoinResult(device=device, node=node)
        return JoinResult(device=device, twins=watch.result(), node=node)

    async def _look_at_node(self, q: StageCheck) -> StageLook | None:
        """The Node Ready with its GPUs (`q.gpus`), looked for JOIN_NODE_LOOK after the device
        joined; what the last look saw (None: it failed, the workflow waits for the facts)."""
        until = time.monotonic() + JOIN_NODE_LOOK.total_seconds()
        while True:
            try:
                look = await self.check_stage(StageCheck(node_name=q.node_name, gpus=q.gpus))
            except Exception as exc:  # noqa: BLE001 - the workflow waits for the facts instead
                log.info("node_look_failed", error=type(exc).__name__)
                return None
            if look.up or time.monotonic() >= until:
                return look
            await asyncio.sleep(JOIN_LOOK_EVERY.total_seconds())

    async def _wait_for_tailnet_join(self, q: StageCheck) -> TailnetDevice:
        assert q.instance is not None and q.device is not None
        ref, dq = q.instance, q.device
        running = False
        # The create's answer was the first read of the instance: the provider is read from one
        # poll interval after it (a read at once mostly met a provider not yet caught up).
        next_read = time.monotonic() + self.poll_interval.total_seconds()
        with heartbeating():
            while True:
                try:
                    with temporal_errors():
                        tailnet = await self._tailnet_for(dq.tailnet, dq.tailnet_ref)
                        device = await tailnet.find_device(dq.hostname, dq.tags, within=JOIN_LOOK_SHARED.total_seconds())
                        if device is not None:
                            return device
                        if not running and time.monotonic() >= next_read:
                            next_read = time.monotonic() + self.poll_interval.total_seconds()
                            provider = await self._provider_for(ref.provider, ref.credentials, ref.account)
                            inst = await provider.describe(ref.instance_id or "")
                            if inst is None and self._lagging(ref, provider):
                                pass  # a 404 right after the create: the provider has not caught up yet
                            elif inst is None or inst.interrupted or inst.state in (InstanceState.FAILED, InstanceState.TERMINATED, InstanceState.STOPPED):
                                state = "vanished" if inst is None else ("was interrupted" if inst.interrupted else inst.state.value.lower())
                                metrics.LAUNCH_FAILURES.labels(ref.provider, "LaunchFailed").inc()
                                raise ApplicationError(
                                    f"instance {ref.instance_id} on {ref.provider} {state} while booting", type="LaunchFailed", non_retryable=True
                                )
                            else:
                                running = inst.state is InstanceState.RUNNING
                except ApplicationError as exc:
                    if exc.non_retryable:
                        raise
                    log.info("poll_transient_error", activity=activity.info().activity_type, error=str(exc))
                await asyncio.sleep(min(self.poll_interval, JOIN_LOOK_EVERY).total_seconds())

    @activity.defn
    async def check_stage(self, inp: StageCheck) -> StageLook:
        """One look at a join stage: is the instance running, the device in the tailnet, the
        Node Ready, its GPUs registered? Taken as the join's backstop while the bridge says
        nothing, and once more when a stage's deadline has passed, before the attempt is failed
        over: the wait may have missed them by a slow look or by a worker that died, and a
        healthy instance must not be released for that."""
        with heartbeating(), temporal_errors():
            seen: list[str] = []
            looked, account = None, None
            if inp.instance is not None:
                ref = inp.instance
                provider = await self._provider_for(ref.provider, ref.credentials, ref.account)
                if ref.instance_id is None:  # a launch that ran out of time: what it bought, by its name
                    live = [i for i in await self.registry.lookups.find_all_by_name(provider, ref.instance_name) if i.state is not InstanceState.TERMINATED]
                    inst = looked = survivor(live) if live else None
                    account = self.registry.account(provider)
                else:
                    inst = await provider.describe(ref.instance_id)
                what = inst.instance_id if inst else ref.instance_id or f"named {ref.instance_name}"
                if inst is None and self._lagging(ref, provider):
                    return StageLook(up=False, seen=f"instance {what} is not visible yet ({provider.name} lags behind its create)")
                state = "gone" if inst is None else ("interrupted" if inst.interrupted else inst.state.value.lower())
                if inst is None or inst.interrupted or inst.state is not InstanceState.RUNNING:
                    return StageLook(up=False, seen=f"instance {what} is {state}")
                seen.append(f"instance {what} is {state}")
            if inp.device is not None:
                tailnet = await self._tailnet_for(inp.device.tailnet, inp.device.tailnet_ref)
                device = await tailnet.find_device(inp.device.hostname, inp.device.tags)
                if device is None:
                    return StageLook(up=False, seen=f"no tailnet device {inp.device.hostname}")
                seen.append(f"tailnet device {inp.device.hostname} is there")
            if inp.node_name is not None:
                node = await self.cluster.get_node(inp.node_name)
                if node is None or not node.ready:
                    return StageLook(up=False, seen=f"Node {inp.node_name} is {'missing' if node is None else 'not Ready'}")
                seen.append(f"Node {inp.node_name} is Ready")
                if inp.gpus is not None:
                    if node.gpus < inp.gpus:
                        return StageLook(up=False, seen=f"Node {inp.node_name} has {node.gpus} of {inp.gpus} GPUs allocatable")
                    seen.append(f"its {node.gpus} GPUs are registered")
        return StageLook(up=True, seen=", ".join(seen), instance=looked, account=account)

    @activity.defn
    async def label_and_taint_node(self, inp: LabelInput, report: PoolReport | None = None) -> None:
        """Give the Node its pool's labels and taints, and take off those tgp had set that the pool
        no longer lists (idempotent). `report` (Ready) goes to the pool once they are on
        (`carrying`: waited for REPORT_WAIT at most)."""
        with temporal_errors():
            await self.cluster.label_and_taint(inp.node_name, inp.labels, inp.taints, remove_labels=inp.remove_labels, remove_taints=inp.remove_taints)
        async with carrying(report, self.reports):
            pass  # Ready once the labels and taints are on: the pool may act on it (make-before-break)
        if inp.launched_at is not None:
            metrics.LAUNCH_TO_READY.labels(inp.labels.get(LABEL_PROVIDER, "")).observe(metrics.seconds_since(inp.launched_at))

    @activity.defn
    async def watch_for_twins(self, inp: TwinWatchInput) -> list[InstanceRef]:
        """While the node lives: end (and verify) every instance under its attempts' names
        that is not the one it recorded (`keep`), until each name's consistency window has
        passed, since a create can complete after its caller gave up. Returns the names with
        every id seen under them, for the workflow to remember."""
        return await self._watch_for_twins(inp)

    async def _watch_for_twins(self, inp: TwinWatchInput) -> list[InstanceRef]:
        with heartbeating(), temporal_errors():

            async def watch(ref: InstanceRef) -> InstanceRef:
                # Its look-ups by name share the account's listings with launches and other
                # watches (activities.name_lists: never an older view than its own call).
                provider = self.registry.sharing_lookups(await self._provider_for(ref.provider, ref.credentials, ref.account))
                settle = settled_at(ref.created_by, provider, self.now())
                budget = VERIFY_FOR + max(timedelta(0), (settle - self.now()) if settle else timedelta(0))
                seen = await end_for_good(
                    provider, ref.known_ids, names=[ref.instance_name], keep=inp.keep, settle=settle,
                    now=self.now, sleep=self.sleep, every=self.poll_interval, budget=budget,
                )
                return ref.model_copy(update={"known_ids": sorted(set(ref.known_ids) | seen)})

            return list(await asyncio.gather(*(watch(ref) for ref in inp.instances)))
