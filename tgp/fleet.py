"""The fleet look's rule: from one provider account's instance listing and the running nodes
whose instances that account holds, which nodes to tell about their instance (signal
`instance_seen`, tgp.types.InstanceSighting).

Pure: no I/O. activities/fleet.py takes the listing (one list call per account per interval,
FLEET_LOOK_EVERY in workflows/fleet.py) and the node records (one visibility listing), and sends
what this returns. The node then looks for itself (one describe) before it acts: lists lag
behind the truth, in both directions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

from pydantic import Field

from tgp.types import Instance, InstanceSighting, InstanceState, Model

# States in which a listed instance is plainly running: nothing is sent.
ALIVE = frozenset({InstanceState.PENDING, InstanceState.RUNNING})


class WatchedNode(Model):
    """A running node workflow past its launch, as the fleet look knows it: the instance it
    recorded, on which account, and since when its instance surely exists."""

    workflow_id: str
    node_name: str
    provider: str
    instance_id: str
    since: datetime = Field(
        description="A moment at or after the instance's create ended (when the node entered Ready): "
        "the provider's lists may omit the instance until its consistency window after this."
    )


def plainly_running(instance: Instance) -> bool:
    """Listed, alive and not marked interrupted by its provider."""
    return instance.state in ALIVE and not instance.interrupted


def sightings(
    listing: Iterable[Instance], nodes: Iterable[WatchedNode], *, at: datetime, window: timedelta
) -> dict[str, InstanceSighting]:
    """Workflow id -> what to tell it, for the `nodes` whose recorded instance the listing
    (taken `at`, of the one account that holds those nodes' instances) shows not plainly
    running: listed in another state or interrupted; or not listed at all, once the provider's
    consistency `window` after the node's `since` has passed (a younger instance may be missing
    from a lagging list). A node is matched by its recorded instance id only: an instance
    listed under its name with another id (a twin the launch's own watch ends) or another
    node's instance never speaks for it."""
    by_id: Mapping[tuple[str, str], Instance] = {(i.provider, i.instance_id): i for i in listing}
    told: dict[str, InstanceSighting] = {}
    for node in nodes:
        listed = by_id.get((node.provider, node.instance_id))
        if listed is not None:
            if plainly_running(listed):
                continue
            told[node.workflow_id] = InstanceSighting(
                instance_id=listed.instance_id, state=listed.state, interrupted=listed.interrupted, at=at
            )
        elif at - node.since >= window:
            told[node.workflow_id] = InstanceSighting(instance_id=None, state=None, at=at)
    return told
