"""Which of the bridge's `node_facts` a node workflow keeps: by the sending bridge's incarnation
and its sequence number, never by the bridge's wall clock.

Not by `NodeFacts.at`: during a rollout two bridges send, and a restarted bridge's clock may be
skewed, so a re-send from a bridge whose clock is behind would be dropped, and facts dated in
the future would shut out every later one. Each bridge process (an incarnation, `source`)
numbers its facts (`seq`); the workflow takes facts from the incarnation that started last (a
source is its bridge's start time, then a random id: the order it was heard in does not count),
in sequence order. `at` still dates what the bridge saw; the watch never dates it later than
the workflow's own now (`workflows/node/watch.py`)."""

from __future__ import annotations

from tgp.types import NodeFacts

# Incarnations remembered (oldest first dropped): a rollout runs two at a time.
SOURCES_KEPT = 8


def _started(source: str) -> tuple[bool, str]:
    """A source's place in time: `<start, ns, 20 digits>-<uuid>` sorts by when its bridge
    started. (A source of another shape sorts first: there is none in a release.)"""
    return ("-" in source, source)


def take_facts(kept: NodeFacts | None, sources: list[str], incoming: NodeFacts) -> tuple[bool, list[str]]:
    """Whether `incoming` replaces `kept`, and the incarnations heard of, oldest first."""
    newest = max(sources, key=_started, default=None)
    if newest is not None and _started(incoming.source) < _started(newest):
        # The old bridge of a rollout, still sending (heard first or not): a newer one speaks.
        known = sources if incoming.source in sources else sorted([*sources, incoming.source], key=_started)[-SOURCES_KEPT:]
        return False, known
    if incoming.source != newest:
        # A bridge that started after every one heard before: its facts are the newest.
        return True, sorted([*sources, incoming.source], key=_started)[-SOURCES_KEPT:]
    return (kept is None or kept.source != incoming.source or incoming.seq >= kept.seq), sources
