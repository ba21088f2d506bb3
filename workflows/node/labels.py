"""Labels and taints: the pool's template and tgp's own labels on the Node, the joining taint
removed (pods may land from then on); later, the pool's changed template applied in place."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.node import NodeActivities
    from tgp.drift import label_removals, taint_removals
    from tgp.lifecycle import WatchState
    from tgp.types import TAINT_JOINING, LabelInput, NodePhase
    from workflows.entity import describe
    from workflows.node.life import Life
    from workflows.retries import API_RETRY

# A change of the pool's labels and taints that could not be applied (the API down, the Node
# being replaced) is tried again this much later; the node lives on meanwhile.
TEMPLATE_RETRY_AFTER = timedelta(minutes=1)
# Applying it: a few quick tries inside the watch (which waits for them), not API_RETRY's
# minutes: an evict must not wait behind a Kubernetes outage.
TEMPLATE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5), maximum_attempts=3)


async def label_and_taint(life: Life, *, labelled: bool) -> None:
    """Put the labels and taints on the Node and enter Ready: the call carries the Ready report
    (sent once they are on), and the watch begins. `labelled`: the launch's activity found the
    Node up, put them on and told the pool (`label_on_join`)."""
    life.enter(NodePhase.READY)
    if labelled:
        life.unreported = []  # the pool was told Ready; it reads no join stage's record
    else:
        report = life.tell_pool(carry=True)
        await life.call(NodeActivities.label_and_taint_node, ready_labels(life), timeout=life.timeouts.api_call, retry=API_RETRY, summary="label and taint", more=(report,))
    # The launch's look saw the Node Ready with its GPUs just now: the watch's first look (the
    # bridge's facts come once the joining taint is off, crd_bridge.node_facts).
    now = workflow.now()
    life.state.watch = WatchState(ready_at=now, looked_at=now if labelled else None)


def ready_labels(life: Life) -> LabelInput:
    """The Node's labels and taints once Ready: the pool's template and tgp's own labels (which
    win: tgp.io/managed stays "true"), the joining taint off."""
    labels = {**life.template.labels, **life.own_labels()}
    launched_at = life.state.attempts[-1].started_at
    return LabelInput(node_name=life.req.node_name, labels=labels, taints=life.template.taints, launched_at=launched_at, remove_taints=[TAINT_JOINING])


def template_due(life: Life) -> bool:
    """Whether the pool's labels and taints differ from what tgp last put on the Node, and are
    not waiting for a retry."""
    applied = life.state.template_applied
    if applied is None or applied == life.template:
        return False
    return life.state.template_retry_at is None or workflow.now() >= life.state.template_retry_at


async def apply_template(life: Life) -> None:
    """Apply the pool's changed labels and taints in place: set the new and changed ones, remove
    those tgp had set that the pool no longer lists, never tgp's own. A failure is tried again
    TEMPLATE_RETRY_AFTER later; it never ends the node."""
    applied, wanted = life.state.template_applied, life.template
    assert applied is not None
    own = life.own_labels()
    change = LabelInput(
        node_name=life.req.node_name, labels={**wanted.labels, **own}, taints=wanted.taints,
        remove_labels=label_removals(applied.labels, wanted.labels, own), remove_taints=taint_removals(applied.taints, wanted.taints),
    )
    try:
        await workflow.execute_activity_method(
            NodeActivities.label_and_taint_node, args=[change, None], start_to_close_timeout=life.timeouts.api_call,
            retry_policy=TEMPLATE_RETRY, summary="apply the pool's new labels and taints",
        )
    except ActivityError as exc:
        if life.cancel_requested():
            raise asyncio.CancelledError() from None
        life.state.last_error = f"could not apply the pool's new labels and taints (trying again): {describe(exc)}"
        life.state.template_retry_at = workflow.now() + TEMPLATE_RETRY_AFTER
        return
    life.state.template_applied, life.state.template_retry_at = wanted, None
