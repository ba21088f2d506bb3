"""Which of the bridge's `node_facts` a node workflow keeps: by the sending bridge's incarnation
and its sequence number, never by the bridge's wall clock.

Facts used to be ordered by `NodeFacts.at` (the bridge's clock): during a rollout two bridges
send, and a restarted bridge's clock may be skewed, so a re-send from a bridge whose clock is
behind was dropped, and facts dated in the future shut out every later one until that time
passed. Now each bridge process (an incarnation, `source`) numbers its facts (`seq`); the
workflow keeps the incarnations in the order it first heard them, and takes facts from the
newest one only, in sequence order. Facts without a source (a bridge of an earlier release)
keep the old rule. `at` still dates what the bridge saw; the watch never dates it later than
the workflow's own now (`workflows.node._apply_facts`)."""

from __future__ import annotations

from tgp.types import NodeFacts

# Incarnations remembered (oldest first dropped): a rollout runs two at a time.
SOURCES_KEPT = 8


def take_facts(kept: NodeFacts | None, sources: list[str], incoming: NodeFacts) -> tuple[bool, list[str]]:
    """Whether `incoming` replaces `kept`, and the incarnations heard of, oldest first."""
    if not incoming.source:
        # An earlier release's bridge: by its clock, as before (and never over a numbered one).
        return (kept is None or (not kept.source and incoming.at >= kept.at)), sources
    if incoming.source not in sources:
        # A bridge first heard now started after those heard before: its facts are the newest.
        return True, [*sources, incoming.source][-SOURCES_KEPT:]
    if incoming.source != sources[-1]:
        return False, sources  # a bridge replaced since (the old one of a rollout, still sending)
    return (kept is None or kept.source != incoming.source or incoming.seq >= kept.seq), sources
