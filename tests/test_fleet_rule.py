"""The fleet look's rule (tgp.fleet.sightings): one account's listing x the Ready nodes whose
instances it holds -> which node to tell what. Pure: Hypothesis generates listings that lag,
show instances in every state, carry twins under a node's name and other nodes' instances."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from tgp.fleet import WatchedNode, plainly_running, sightings
from tgp.types import Instance, InstanceState, instance_name

AT = datetime(2026, 11, 24, 9, 0, tzinfo=timezone.utc)
WINDOW = timedelta(minutes=3)


def node(i: int, *, since: datetime = AT - timedelta(hours=1), provider: str = "lambdalabs") -> WatchedNode:
    return WatchedNode(workflow_id=f"gpunode/ml/rtx/gpu-{i}", node_name=f"gpu-{i}", provider=provider, instance_id=f"i-{i}", since=since)


def listed(n: WatchedNode, state: InstanceState = InstanceState.RUNNING, *, interrupted: bool = False, instance_id: str | None = None) -> Instance:
    return Instance(
        provider=n.provider, instance_id=instance_id or n.instance_id, name=instance_name(n.node_name, 1), state=state, interrupted=interrupted
    )


# What the listing shows of one node's recorded instance: nothing (lag or gone), or the
# instance in some state, perhaps marked interrupted; plus, maybe, a twin under its name.
shown = st.one_of(st.none(), st.tuples(st.sampled_from(list(InstanceState)), st.booleans()))
node_case = st.tuples(
    shown,
    st.integers(min_value=0, max_value=600),  # seconds since the node entered Ready
    st.one_of(st.none(), st.sampled_from(list(InstanceState))),  # a twin under its name, other id
)


@given(
    cases=st.lists(node_case, max_size=8),
    strangers=st.lists(st.tuples(st.integers(100, 120), st.sampled_from(list(InstanceState)), st.booleans()), max_size=4),
    window_s=st.integers(min_value=0, max_value=300),
)
def test_nodes_are_told_exactly_when_their_recorded_instance_is_not_plainly_running(
    cases: list[tuple[tuple[InstanceState, bool] | None, int, InstanceState | None]],
    strangers: list[tuple[int, InstanceState, bool]],
    window_s: int,
) -> None:
    window = timedelta(seconds=window_s)
    nodes = [node(i, since=AT - timedelta(seconds=age)) for i, (_, age, _) in enumerate(cases)]
    listing: list[Instance] = []
    for n, (show, _, twin) in zip(nodes, cases):
        if show is not None:
            listing.append(listed(n, show[0], interrupted=show[1]))
        if twin is not None:
            listing.append(listed(n, twin, instance_id=f"twin-{n.instance_id}"))
    # Other nodes' instances (not watched here) in any state, and the same id on another provider.
    for i, state, interrupted in strangers:
        listing.append(listed(node(i), state, interrupted=interrupted))
        listing.append(Instance(provider="vastai", instance_id=nodes[0].instance_id if nodes else "x", name="tgp-x-1", state=state))

    told = sightings(listing, nodes, at=AT, window=window)

    assert set(told) <= {n.workflow_id for n in nodes}, "only the watched nodes are told"
    for n, (show, age, _) in zip(nodes, cases):
        got = told.get(n.workflow_id)
        if show is not None:
            state, interrupted = show
            if state in (InstanceState.RUNNING, InstanceState.PENDING) and not interrupted:
                assert got is None, "never a sighting for a running recorded instance (a twin or a stranger does not count)"
            else:
                assert got is not None and got.instance_id == n.instance_id and got.state is state and got.interrupted is interrupted
                assert got.at == AT
        elif timedelta(seconds=age) >= window:
            assert got is not None and got.instance_id is None and got.state is None, "missing past its window: told"
        else:
            assert got is None, "missing within the consistency window: the list may lag"
        if got is not None:
            assert got.instance_id in (None, n.instance_id), "never another node's (or a twin's) instance"


def test_a_lagging_listing_does_not_tell_a_node_that_just_became_ready() -> None:
    """(c) The instance was bought, the node is Ready, the list does not show it yet: within
    the window nothing is sent; past it, the node is told (and confirms by its own describe)."""
    young = node(1, since=AT - timedelta(seconds=30))
    assert sightings([], [young], at=AT, window=WINDOW) == {}
    assert sightings([], [young], at=AT + WINDOW, window=WINDOW)[young.workflow_id].state is None


def test_at_rest_nothing_is_sent() -> None:
    nodes = [node(i) for i in range(50)]
    assert sightings([listed(n) for n in nodes], nodes, at=AT, window=WINDOW) == {}
    assert all(plainly_running(listed(n)) for n in nodes)


def test_an_interrupted_instance_is_told_even_while_the_provider_still_says_running() -> None:
    n = node(7)
    got = sightings([listed(n, InstanceState.RUNNING, interrupted=True)], [n], at=AT, window=WINDOW)[n.workflow_id]
    assert (got.instance_id, got.state, got.interrupted) == (n.instance_id, InstanceState.RUNNING, True)
