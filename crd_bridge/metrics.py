"""The bridge's Prometheus counters: objects it could not use, handler failures it retried, the
node facts it signalled."""

from __future__ import annotations

from prometheus_client import Counter

OBJECTS_SKIPPED = Counter(
    "tgp_bridge_objects_skipped_total",
    "Kubernetes objects the bridge ignored because it cannot read them (each event counts).",
    ["kind", "reason"],
)
HANDLER_ERRORS = Counter(
    "tgp_bridge_handler_errors_total",
    "Informer events whose handler failed; the object is retried without holding up others.",
    ["resource"],
)
NODE_FACTS_SIGNALS = Counter(
    "tgp_bridge_node_facts_signals_total",
    "node_facts signals to node workflows by outcome: sent, no_workflow (not running: dropped), failed (retried).",
    ["outcome"],
)
