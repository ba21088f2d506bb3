"""How the emulator (sim.kube) picks the reaction that answers a request, as kmock would, at a
fraction of kmock's cost: the reactions in kmock's order (`by_priority`), and the answers of the
filters that read only a request's method, path and Kubernetes action, remembered
(`criteria_hold`): kmock's check of one filter compiles regexes for every mismatch, and each
request went through about ten of them (a third of the emulator's CPU per request)."""

from __future__ import annotations

from typing import Any

import attrs
import kmock

# The criteria whose answer depends on these request fields alone (the others are `...`: any).
_PURE_FIELDS: dict[type, frozenset[str]] = {
    kmock.HTTPCriteria: frozenset({"method", "path"}),
    kmock.K8sCriteria: frozenset({"method", "action"}),
}
# Paths carry object names: the remembered answers are forgotten at this many.
MAX_ANSWERS = 4096
# (id of the criteria, method, path, action) -> (the criteria, its answer). Each entry keeps
# its criteria, so an id reused by a later one is not mistaken for it.
_answers: dict[tuple[int, Any, str, Any], tuple[Any, bool]] = {}


def by_priority(payloads: list[Any]) -> list[Any]:
    """kmock's order of reactions: by priority, highest first, priorities of unequal length
    padded with zeros (so `fallback ** N` sorts within the fallbacks); among equal priorities the
    order of registration (`sorted` is stable)."""
    keys = {id(p): tuple(-x for x in p.priorities) for p in payloads}
    depth = max((len(k) for k in keys.values()), default=0)
    return sorted(payloads, key=lambda p: keys[id(p)] + (0,) * (depth - len(keys[id(p)])))


def criteria_hold(criteria: Any, request: kmock.Request) -> bool:
    """`bool(criteria(request))`, remembered for criteria that read only the method, path and
    action (kmock's fallbacks, `kube["get /api/v1/nodes/n1"]`): a pure function of those."""
    key = (id(criteria), request.method, request.url.path, request.action)
    known = _answers.get(key)
    if known is not None and known[0] is criteria:
        return known[1]  # only pure criteria are remembered
    fields = _PURE_FIELDS.get(type(criteria))
    if fields is None or any(getattr(criteria, f.name) is not ... for f in attrs.fields(type(criteria)) if f.name not in fields):
        return bool(criteria(request))
    if len(_answers) >= MAX_ANSWERS:
        _answers.clear()
    holds = bool(criteria(request))
    _answers[key] = (criteria, holds)
    return holds
