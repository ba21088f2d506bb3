"""Review #6: the bridge's node facts are ordered by (bridge incarnation, sequence), never by the
bridge's wall clock: two bridges during a rollout, or a restarted bridge with a skewed clock,
never make an older send overwrite a newer one (tgp.facts_order, the node's `node_facts`)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from tests.test_node_lifecycle import request
from tgp.facts_order import take_facts
from tgp.node import NodeWorkflowInput
from tgp.types import NodeFacts
from workflows.node import GPUNodeWorkflow

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=timezone.utc)


def facts(source: str, seq: int, at: datetime, busy: int = 0) -> NodeFacts:
    return NodeFacts(node_name="n", present=True, ready=True, gpus=1, busy_pods=busy, at=at, source=source, seq=seq)


def started(b: int) -> str:
    """Bridge b's source: its start (ns, fixed width), then an id (crd_bridge.node_facts)."""
    return f"{1_700_000_000_000_000_000 + b:020d}-{b:032x}"


@st.composite
def deliveries(draw: st.DrawFn) -> list[tuple[int, NodeFacts]]:
    """Bridges 0..k-1 started one after another, each numbering its sends 1..n with a clock off
    by up to a day either way; the signals arrive in any order (a rollout overlaps them: the new
    bridge may be heard before the old one), some twice, some never."""
    bridges = draw(st.integers(min_value=1, max_value=3))
    sends = []
    for b in range(bridges):
        skew = timedelta(minutes=draw(st.integers(min_value=-1440, max_value=1440)))
        for seq in range(1, draw(st.integers(min_value=1, max_value=5)) + 1):
            sends.append((b, facts(started(b), seq, NOW + skew + timedelta(seconds=seq), busy=seq)))
    return draw(st.lists(st.sampled_from(sends), min_size=1, max_size=20))


@given(deliveries())
def test_an_older_send_never_overwrites_a_newer_one_whatever_the_clocks(order: list[tuple[int, NodeFacts]]) -> None:
    kept: NodeFacts | None = None
    key: tuple[int, int] | None = None
    sources: list[str] = []
    for bridge, incoming in order:
        take, sources = take_facts(kept, sources, incoming)
        if take:
            assert key is None or (bridge, incoming.seq) >= key, f"facts {bridge}/{incoming.seq} overwrote the newer {key}"
            kept, key = incoming, (bridge, incoming.seq)
    # The newest send delivered is what the node keeps.
    newest = max(order, key=lambda d: (d[0], d[1].seq))
    assert key == (newest[0], newest[1].seq)


def test_the_node_keeps_facts_by_bridge_and_sequence_not_by_the_bridges_clock() -> None:
    """Through the workflow's own `node_facts` handler: facts dated an hour in the future (a
    bridge whose clock is ahead) do not shut out the same bridge's next facts; a restarted
    bridge whose clock is behind is heard; the replaced bridge, still sending during the
    rollout, is not, however late its clock says it is."""
    wf = GPUNodeWorkflow(NodeWorkflowInput(request=request(demand_since=None)))
    wf.node_facts(facts("a", 5, NOW + timedelta(hours=1), busy=1))
    idle = facts("a", 6, NOW, busy=0)
    wf.node_facts(idle)
    assert wf.life.state.facts == idle, "facts dated in the future shut out the bridge's next facts"
    restarted = facts("b", 1, NOW - timedelta(hours=1), busy=2)
    wf.node_facts(restarted)
    assert wf.life.state.facts == restarted, "a restarted bridge whose clock is behind was not heard"
    wf.node_facts(facts("a", 7, NOW + timedelta(hours=2), busy=0))
    assert wf.life.state.facts == restarted, "the replaced bridge's late send overwrote the new bridge's facts"
    wf.node_facts(facts("b", 1, NOW - timedelta(hours=1), busy=2))  # a re-send (level-triggered)
    assert wf.life.state.facts == restarted


def test_a_new_bridge_heard_before_the_old_one_of_a_rollout_is_not_shut_out() -> None:
    """Review: a Node registered during a rollout heard the new bridge first, then the old one;
    once the old one exited, every fact of the new one was dropped (sources kept in the order
    heard). The source that started last wins, whatever was heard first."""
    new, old = started(2), started(1)
    kept: NodeFacts | None = None
    sources: list[str] = []
    for incoming in (facts(new, 1, NOW), facts(old, 9, NOW), facts(new, 2, NOW, busy=1)):
        take, sources = take_facts(kept, sources, incoming)
        if take:
            kept = incoming
    assert kept is not None and (kept.source, kept.seq) == (new, 2), kept
