"""GPUNodeWorkflow: one GPU node's whole life, read top to bottom.

    select offer -> mint tailnet key + launch -> wait for join (tailnet, then Node Ready)
    -> label/taint -> watch until idle, expired, interrupted or evicted -> drain -> terminate

Failover: a capacity error, a launch failure or a join timeout releases what that attempt
bought, takes the offer out of rotation and tries the next offer, up to max_launch_attempts.
Cleanup (instance, tailnet key and device, Node object) runs on every way out: success,
failure, eviction and cancellation, including a cancellation that lands while the launch
activity is still buying the instance.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel, ConfigDict

    from workflows.legacy.r31e9066.activities import FleetActivities, LedgerCall
    from workflows.legacy.r31e9066.activities import NodeActivities
    from workflows.legacy.r31e9066.messages import NodeReport, Reservation
    from workflows.legacy.r31e9066.handover import hand_over_node  # handover: not in 31e9066
    from workflows.legacy.r31e9066.lifecycle import EndReason, WatchState, judge_observation
    from workflows.legacy.r31e9066.types import (
        LABEL_GPU_TYPE,
        LABEL_MANAGED,
        LABEL_POOL,
        LABEL_POOL_NAMESPACE,
        LABEL_PROVIDER,
        LABEL_REGION,
        DeviceQuery,
        DrainInput,
        EvictRequest,
        InstanceRef,
        LabelInput,
        LaunchAttempt,
        LaunchInput,
        LaunchResult,
        MarkUnavailableInput,
        NodePhase,
        NodeRequest,
        NodeStatus,
        ObserveInput,
        Offer,
        SelectOfferInput,
        TailnetCleanupInput,
        instance_name,
    )

SA_POOL = SearchAttributeKey.for_keyword("TgpPool")
SA_PHASE = SearchAttributeKey.for_keyword("TgpPhase")
SA_PROVIDER = SearchAttributeKey.for_keyword("TgpProvider")
SA_GPU_TYPE = SearchAttributeKey.for_keyword("TgpGpuType")
SA_HOURLY_PRICE = SearchAttributeKey.for_float("TgpHourlyPrice")
SA_NODE_NAME = SearchAttributeKey.for_keyword("TgpNodeName")

# Continue-as-new well before Temporal's own suggestion (4,096 events), so a node that lives
# for weeks keeps each run's history small and quick to replay.
HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW = 600

# Heartbeat of the polling activities: they heartbeat on every look, so a dead worker is
# noticed (and the activity retried elsewhere) within this long.
POLL_HEARTBEAT_TIMEOUT = timedelta(seconds=30)

API_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30), maximum_attempts=10)
# Launch is bounded: failing over to the next offer beats hammering one provider.
LAUNCH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=2),
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=5,
    non_retryable_error_types=["CapacityError", "AuthError", "PermissionDenied", "ConfigError", "LaunchFailed"],
)
# Cleanup never gives up: a leaked instance costs money every hour.
CLEANUP_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(minutes=2), maximum_attempts=0)


class NodeState(BaseModel):
    """Everything the workflow knows; carried across continue-as-new."""

    model_config = ConfigDict(extra="ignore")
    phase: NodePhase = NodePhase.PENDING
    attempts: list[LaunchAttempt] = []
    offer: Offer | None = None
    instance: InstanceRef | None = None
    key_ids: list[str] = []
    watch: WatchState | None = None
    stage_times: dict[str, datetime] = {}
    evict_reason: str | None = None
    last_error: str | None = None
    end_reason: str | None = None


class NodeWorkflowInput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request: NodeRequest
    state: NodeState | None = None


class LaunchAttemptFailed(Exception):
    """This offer did not give a node; the next one may."""


class NodeEvicted(Exception):
    """An `evict` signal arrived before the node was up."""


@workflow.defn(name="GPUNodeWorkflow")
class GPUNodeWorkflow:
    @workflow.init
    def __init__(self, inp: NodeWorkflowInput) -> None:
        self.req = inp.request
        self.state = inp.state or NodeState()
        self._reports: list[asyncio.Future[None]] = []

    # --- messages ------------------------------------------------------------------------

    @workflow.signal
    def evict(self, request: EvictRequest) -> None:
        """Drain and terminate this node now. The first reason wins."""
        if self.state.evict_reason is None:
            self.state.evict_reason = request.reason or "manual"

    @workflow.query
    def status(self) -> NodeStatus:
        offer, inst = self.state.offer, self.state.instance
        return NodeStatus(
            phase=self.state.phase,
            node_name=self.req.node_name,
            pool=self.req.pool,
            provider=offer.provider if offer else None,
            gpu_type=offer.gpu_type if offer else None,
            region=offer.region if offer else None,
            instance_id=inst.instance_id if inst else None,
            hourly_price=offer.hourly_price if offer else None,
            stage_times=self.state.stage_times,
            attempts=self.state.attempts,
            last_error=self.state.last_error,
            end_reason=self.state.end_reason,
        )

    # --- the life ------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: NodeWorkflowInput) -> NodeStatus:
        final = NodePhase.TERMINATED
        try:
            if self.state.watch is None:
                self._enter(NodePhase.PENDING)
                await self._bring_up()
            end = await self._watch_until_done()
            final = NodePhase.INTERRUPTED if end in (EndReason.INTERRUPTED, EndReason.LOST) else NodePhase.TERMINATED
            if final is NodePhase.TERMINATED:
                await self._drain()
        except NodeEvicted:
            final = NodePhase.TERMINATED
        except LaunchAttemptFailed as exc:
            final = NodePhase.FAILED
            self.state.last_error = str(exc)
            self.state.end_reason = "failed"
        except asyncio.CancelledError:
            self.state.end_reason = self.state.end_reason or "cancelled"
            await self._release_all()
            self._enter(NodePhase.CANCELLED)
            await asyncio.gather(*self._reports)
            raise
        except ApplicationError as exc:
            # A non-retryable error the workflow has no plan for (bad config, auth): give up
            # cleanly, keeping the reason visible.
            final = NodePhase.FAILED
            self.state.last_error = exc.message
            self.state.end_reason = "failed"
        except ActivityError as exc:
            final = NodePhase.FAILED
            self.state.last_error = _describe(exc)
            self.state.end_reason = "failed"
        cleanup = asyncio.ensure_future(self._release_all())
        try:
            # Shielded: a cancel that lands now must not stop the cleanup half-way.
            await asyncio.shield(cleanup)
        except asyncio.CancelledError:
            await cleanup
            final = NodePhase.CANCELLED
            self._enter(final)
            await asyncio.gather(*self._reports)
            raise
        self._enter(final)
        await asyncio.gather(*self._reports)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self.status()

    async def _bring_up(self) -> None:
        """Select, launch and join, failing over to the next offer until one works."""
        tried = [a.offer.key for a in self.state.attempts]
        while len(self.state.attempts) < self.req.max_launch_attempts:
            self._check_evicted()
            offer = await self._select_offer(tried)
            self._check_evicted()  # evicted while choosing: buy nothing
            attempt = LaunchAttempt(attempt=len(self.state.attempts) + 1, offer=offer)
            self.state.attempts.append(attempt)
            tried.append(offer.key)
            try:
                await self._launch(attempt)
                await self._join()
                await self._label_and_taint()
                return
            except LaunchAttemptFailed as exc:
                self._record(attempt, str(exc))
                self.state.last_error = f"attempt {attempt.attempt} on {offer.key}: {exc}"
                workflow.logger.warning("launch attempt failed, trying the next offer: %s", self.state.last_error)
                await self._release_attempt()
                await self._mark_unavailable(offer)
        raise LaunchAttemptFailed(
            f"gave up after {self.req.max_launch_attempts} launch attempts; last error: {self.state.last_error}"
        )

    async def _select_offer(self, tried: list[str]) -> Offer:
        choice = await workflow.execute_activity_method(
            NodeActivities.select_offer,
            SelectOfferInput(requirements=self.req.requirements, exclude=tried),
            start_to_close_timeout=self.req.timeouts.api_call,
            retry_policy=API_RETRY,
            summary="select offer",
        )
        if choice.offer is None:
            if choice.matching == 0:
                why = f"no offer among {choice.seen} satisfies the requirements {self.req.requirements.model_dump(mode='json', exclude_defaults=True)}"
            else:
                why = f"all {choice.matching} matching offers were tried or recently failed"
            raise LaunchAttemptFailed(why if not self.state.last_error else f"{why}; last error: {self.state.last_error}")
        self.state.offer = choice.offer
        if self.req.class_workflow_id:
            grant = await workflow.execute_activity_method(
                FleetActivities.settle_reservation,
                LedgerCall(class_workflow_id=self.req.class_workflow_id, reservation=self._reservation(choice.offer)),
                start_to_close_timeout=self.req.timeouts.api_call,
                retry_policy=API_RETRY,
                summary="settle price with the class budget",
            )
            if not grant.granted:
                raise LaunchAttemptFailed(f"class budget refused {choice.offer.key} at ${choice.offer.hourly_price}/h: {grant.reason}")
        return choice.offer

    def _reservation(self, offer: Offer | None) -> Reservation:
        return Reservation(
            node_id=self.req.workflow_id,
            pool=f"{self.req.namespace}/{self.req.pool}",
            hourly_price=offer.hourly_price if offer else None,
        )

    async def _launch(self, attempt: LaunchAttempt) -> None:
        """Mint the key and buy the instance (one activity: the key never leaves it), then
        wait for the instance to run."""
        self._enter(NodePhase.LAUNCHING)
        offer = attempt.offer
        self.state.instance = InstanceRef(provider=offer.provider, instance_name=instance_name(self.req.node_name, attempt.attempt))
        self._upsert_offer_attributes(offer)
        launch = workflow.start_activity_method(
            NodeActivities.launch_instance,
            LaunchInput(
                node_name=self.req.node_name,
                attempt=attempt.attempt,
                offer=offer,
                tailnet_tags=self.req.tailnet_tags,
                tailnet=self.req.tailnet,
                boot=self.req.boot,
                pool=self.req.pool,
                labels=self.req.labels,
                taints=self.req.taints,
                unavailable_offer_ttl=self.req.unavailable_offer_ttl,
            ),
            start_to_close_timeout=self.req.timeouts.api_call,
            schedule_to_close_timeout=self.req.timeouts.launch,
            retry_policy=LAUNCH_RETRY,
            summary=f"launch {offer.gpu_type} on {offer.provider} ({offer.region}, ${offer.hourly_price}/h)",
        )
        try:
            # Shielded: a workflow cancel must not abandon a purchase in flight.
            result: LaunchResult = await asyncio.shield(launch)
        except asyncio.CancelledError:
            try:
                self._launched(await launch)
            except ActivityError:
                pass  # nothing bought, or cleanup finds it by name
            raise
        except ActivityError as exc:
            if isinstance(exc.cause, ApplicationError) and exc.cause.type == "ConfigError":
                raise  # a bad template or join Secret fails on every offer: end now, say what to fix
            raise LaunchAttemptFailed(_describe(exc)) from None
        self._launched(result)
        self._record(attempt, "launched", result.instance.instance_id)
        await self._wait_for(
            NodeActivities.wait_for_instance_running,
            self.state.instance,
            timeout=self.req.timeouts.launch,
            summary="wait for instance to run",
            timeout_error="launch timeout: the instance did not reach running within {}",
        )

    def _launched(self, result: LaunchResult) -> None:
        assert self.state.instance is not None
        self.state.instance = self.state.instance.model_copy(update={"instance_id": result.instance.instance_id})
        if result.key_id:
            self.state.key_ids.append(result.key_id)

    async def _join(self) -> None:
        """Both halves of joining, each with its own timeout and failure reason."""
        self._enter(NodePhase.JOINING)
        t = self.req.timeouts
        await self._wait_for(
            NodeActivities.wait_for_tailnet_device,
            DeviceQuery(hostname=self.req.node_name, tags=self.req.tailnet_tags, tailnet=self.req.tailnet),
            timeout=t.tailnet_join,
            summary="wait for tailnet device",
            timeout_error="join timeout: no tailnet device within {} (did the boot payload run and reach the control server?)",
        )
        self._stamp("TailnetJoined")
        await self._wait_for(
            NodeActivities.wait_for_node_ready,
            self.req.node_name,
            timeout=t.node_ready,
            summary="wait for Node Ready",
            timeout_error="join timeout: the Node did not become Ready within {} (kubelet registration or GPU driver)",
        )

    async def _label_and_taint(self) -> None:
        offer = self.state.offer
        assert offer is not None
        labels = {
            LABEL_MANAGED: "true",
            LABEL_POOL: self.req.pool,
            LABEL_POOL_NAMESPACE: self.req.namespace,
            LABEL_PROVIDER: offer.provider,
            LABEL_GPU_TYPE: offer.gpu_type,
            LABEL_REGION: offer.region,
            **self.req.labels,
        }
        await workflow.execute_activity_method(
            NodeActivities.label_and_taint_node,
            LabelInput(node_name=self.req.node_name, labels=labels, taints=self.req.taints),
            start_to_close_timeout=self.req.timeouts.api_call,
            retry_policy=API_RETRY,
            summary="label and taint",
        )
        self._enter(NodePhase.READY)
        self.state.watch = WatchState(ready_at=workflow.now())

    async def _watch_until_done(self) -> EndReason:
        """Look at the node every watch interval until it is idle, expired, gone or evicted."""
        t = self.req.timeouts
        assert self.state.instance is not None and self.state.watch is not None
        while True:
            await hand_over_node(self)  # handover: not in 31e9066
            if self._history_is_long():
                await workflow.wait_condition(workflow.all_handlers_finished)
                await asyncio.gather(*self._reports)
                workflow.continue_as_new(NodeWorkflowInput(request=self.req, state=self.state))
            try:
                await workflow.wait_condition(
                    lambda: self.state.evict_reason is not None, timeout=t.watch_interval, timeout_summary="watch"
                )
            except asyncio.TimeoutError:
                pass
            else:
                self.state.end_reason = f"evicted: {self.state.evict_reason}"
                return EndReason.EVICTED
            await hand_over_node(self)  # handover: not in 31e9066
            try:
                obs = await workflow.execute_activity_method(
                    NodeActivities.observe_node,
                    ObserveInput(instance=self.state.instance, node_name=self.req.node_name),
                    start_to_close_timeout=self.req.timeouts.api_call,
                    retry_policy=API_RETRY,
                    summary="observe",
                )
            except ActivityError as exc:
                # The provider or Kubernetes API is down: keep the node (it may be running a
                # job) and look again next interval rather than end its life for an outage.
                self.state.last_error = f"could not observe the node: {_describe(exc)}"
                continue
            verdict = judge_observation(obs, self.state.watch, workflow.now(), t)
            self.state.watch = verdict.state
            if verdict.end is not None:
                self.state.end_reason = f"{verdict.end.value}: {verdict.detail}"
                return verdict.end

    def _history_is_long(self) -> bool:
        info = workflow.info()
        return info.is_continue_as_new_suggested() or info.get_current_history_length() > HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW

    async def _drain(self) -> None:
        self._enter(NodePhase.DRAINING)
        result = await workflow.execute_activity_method(
            NodeActivities.drain_node,
            DrainInput(node_name=self.req.node_name, timeout=self.req.timeouts.drain),
            start_to_close_timeout=self.req.timeouts.drain + self.req.timeouts.api_call,
            heartbeat_timeout=self.req.timeouts.api_call,
            retry_policy=API_RETRY,
            summary="drain",
        )
        if result.remaining:
            self.state.last_error = f"drain timed out after {self.req.timeouts.drain}; terminated with pods still on the node: {', '.join(result.remaining)}"

    # --- release what was bought ---------------------------------------------------------

    async def _release_attempt(self) -> None:
        """Give back everything the current launch attempt bought: instance, tailnet key and
        device, Node object. Idempotent, retried until it succeeds."""
        if self.state.instance is not None:
            await workflow.execute_activity_method(
                NodeActivities.terminate_instance,
                self.state.instance,
                start_to_close_timeout=self.req.timeouts.api_call,
                retry_policy=CLEANUP_RETRY,
                summary="terminate instance",
            )
        await workflow.execute_activity_method(
            NodeActivities.remove_from_tailnet,
            TailnetCleanupInput(hostname=self.req.node_name, tags=self.req.tailnet_tags, key_ids=self.state.key_ids, tailnet=self.req.tailnet),
            start_to_close_timeout=self.req.timeouts.api_call,
            retry_policy=CLEANUP_RETRY,
            summary="remove from tailnet",
        )
        await workflow.execute_activity_method(
            NodeActivities.delete_node,
            self.req.node_name,
            start_to_close_timeout=self.req.timeouts.api_call,
            retry_policy=CLEANUP_RETRY,
            summary="delete Node",
        )
        self.state.key_ids = []

    async def _release_all(self) -> None:
        """The way out of every path: terminate whatever any attempt may have bought."""
        self._enter(NodePhase.TERMINATING)
        if self.state.attempts:
            await self._release_attempt()
            self._stamp("Released")
        if self.req.class_workflow_id:
            await workflow.execute_activity_method(
                FleetActivities.release_reservation,
                LedgerCall(class_workflow_id=self.req.class_workflow_id, reservation=self._reservation(self.state.offer)),
                start_to_close_timeout=self.req.timeouts.api_call,
                retry_policy=CLEANUP_RETRY,
                summary="release class budget",
            )

    async def _mark_unavailable(self, offer: Offer) -> None:
        await workflow.execute_activity_method(
            NodeActivities.mark_offer_unavailable,
            MarkUnavailableInput(offer_key=offer.key, ttl=self.req.unavailable_offer_ttl),
            start_to_close_timeout=self.req.timeouts.api_call,
            retry_policy=API_RETRY,
        )

    # --- helpers -------------------------------------------------------------------------

    async def _wait_for(self, activity: Any, arg: Any, *, timeout: timedelta, summary: str, timeout_error: str) -> object:
        """Run a polling (heartbeating) activity for at most `timeout`, but give it up when an
        `evict` signal arrives. A timeout becomes a failed launch attempt whose reason is
        `timeout_error`."""
        handle = workflow.start_activity_method(
            activity,
            arg,
            start_to_close_timeout=timeout,
            schedule_to_close_timeout=timeout,
            heartbeat_timeout=POLL_HEARTBEAT_TIMEOUT,
            retry_policy=API_RETRY,
            summary=summary,
        )
        evicted = asyncio.ensure_future(workflow.wait_condition(lambda: self.state.evict_reason is not None))
        try:
            await workflow.wait([handle, evicted], return_when=asyncio.FIRST_COMPLETED)
        finally:
            # On eviction or workflow cancellation, stop the wait: cleanup takes over.
            for task in (evicted, handle):
                if not task.done():
                    task.cancel()
        if not handle.done() or handle.cancelled():
            self._check_evicted()
        try:
            return handle.result()
        except ActivityError as exc:
            if isinstance(exc.cause, TimeoutError):
                raise LaunchAttemptFailed(timeout_error.format(_human(timeout))) from None
            raise LaunchAttemptFailed(_describe(exc)) from None

    def _check_evicted(self) -> None:
        if self.state.evict_reason is not None:
            self.state.end_reason = f"evicted before Ready: {self.state.evict_reason}"
            raise NodeEvicted()

    def _enter(self, phase: NodePhase) -> None:
        self.state.phase = phase
        self._stamp(phase.value)
        workflow.upsert_search_attributes(
            [SA_PHASE.value_set(phase.value), SA_POOL.value_set(f"{self.req.namespace}/{self.req.pool}"), SA_NODE_NAME.value_set(self.req.node_name)]
        )
        workflow.set_current_details(self._details())
        if self.req.pool_workflow_id:
            self._reports.append(asyncio.ensure_future(self._report(phase)))

    async def _report(self, phase: NodePhase) -> None:
        """Tell the pool where this node is. The pool may be gone (deleted, or a node started
        by hand): then nobody is listening, which is fine."""
        offer = self.state.offer
        report = NodeReport(
            workflow_id=self.req.workflow_id,
            node_name=self.req.node_name,
            phase=phase,
            provider=offer.provider if offer else None,
            gpu_type=offer.gpu_type if offer else None,
            hourly_price=offer.hourly_price if offer else None,
            reason=self.state.end_reason or self.state.last_error,
            at=workflow.now(),
        )
        try:
            await workflow.get_external_workflow_handle(self.req.pool_workflow_id or "").signal("node_phase", report)
        except Exception as exc:  # noqa: BLE001 - a missing pool must not stop the node
            workflow.logger.info("could not report %s to pool %s: %s", phase.value, self.req.pool_workflow_id, exc)

    def _upsert_offer_attributes(self, offer: Offer) -> None:
        workflow.upsert_search_attributes(
            [
                SA_PROVIDER.value_set(offer.provider),
                SA_GPU_TYPE.value_set(offer.gpu_type),
                SA_HOURLY_PRICE.value_set(float(offer.hourly_price)),
            ]
        )

    def _stamp(self, stage: str) -> None:
        self.state.stage_times.setdefault(stage, workflow.now())

    def _record(self, attempt: LaunchAttempt, outcome: str, instance_id: str | None = None) -> None:
        i = attempt.attempt - 1
        current = self.state.attempts[i]
        self.state.attempts[i] = current.model_copy(update={"outcome": outcome, "instance_id": instance_id or current.instance_id})

    def _details(self) -> str:
        """Markdown shown as Current Details in the Web UI."""
        offer = self.state.offer
        lines = [f"**{self.req.node_name}** in pool `{self.req.namespace}/{self.req.pool}` — **{self.state.phase.value}**"]
        if offer:
            lines.append(f"- offer: {offer.gpu_type} × {offer.gpu_count} on {offer.provider} ({offer.region}) at ${offer.hourly_price}/h")
        if self.state.instance and self.state.instance.instance_id:
            lines.append(f"- instance: `{self.state.instance.instance_id}`")
        if self.state.end_reason:
            lines.append(f"- end: {self.state.end_reason}")
        if self.state.last_error:
            lines.append(f"- last error: {self.state.last_error}")
        lines.append(f"- evict: `temporal workflow signal --workflow-id {workflow.info().workflow_id} --name evict --input '{{\"reason\":\"manual\"}}'`")
        return "\n".join(lines)


def _describe(exc: ActivityError) -> str:
    cause = exc.cause
    if isinstance(cause, ApplicationError):
        return f"{cause.type}: {cause.message}" if cause.type else cause.message
    if isinstance(cause, TimeoutError):
        return f"activity timed out ({cause.type.name if cause.type else 'timeout'})"
    return str(cause or exc)


def _human(d: timedelta) -> str:
    seconds = int(d.total_seconds())
    if seconds % 60:
        return f"{seconds}s"
    return f"{seconds // 60}m"
