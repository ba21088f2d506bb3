"""`labelSelector` and `fieldSelector` of the embedded Kubernetes API's lists and watches
(`Selection`), as the API server parses and applies them: equality, inequality, existence and
set terms on labels; equality and inequality on fields (`spec.nodeName=` among them, which the
store and the watches read to serve one Node's pods from their index, `node_of_pods`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import kmock

from sim.kube_machinery import PODS, ApiStatus, same_resource

_SET_TERM = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


@attrs.frozen
class Selection:
    """`labelSelector` and `fieldSelector` of a list or watch request."""

    labels: tuple[tuple[str, str, str, frozenset[str]], ...] = ()
    fields: tuple[tuple[str, str, str], ...] = ()

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> Selection:
        labels: list[tuple[str, str, str, frozenset[str]]] = []
        for term in _split_terms(params.get("labelSelector", "")):
            match = _SET_TERM.match(term)
            if match is None:
                raise ApiStatus(400, "BadRequest", f"unable to parse requirement: {term!r}")
            negated, key, op, value, set_op, set_values = match.groups()
            if set_op:
                labels.append((key, set_op, "", frozenset(v.strip() for v in set_values.split(",") if v.strip())))
            elif op:
                labels.append((key, "!=" if op == "!=" else "=", value, frozenset()))
            else:
                labels.append((key, "!" if negated else "exists", "", frozenset()))
        fields: list[tuple[str, str, str]] = []
        for term in _split_terms(params.get("fieldSelector", "")):
            match = re.match(r"^\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
            if match is None:
                raise ApiStatus(400, "BadRequest", f"invalid field selector: {term!r}")
            path, op, value = match.groups()
            fields.append((path, "!=" if op == "!=" else "=", value))
        return cls(tuple(labels), tuple(fields))

    def node_of_pods(self, storage: kmock.resource) -> str | None:
        """The Node whose pods this selects by `spec.nodeName=`, if `storage` is pods and it does."""
        if not same_resource(storage, PODS):
            return None
        return next((value for path, op, value in self.fields if path == "spec.nodeName" and op == "="), None)

    def matches(self, obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for key, op, value, values in self.labels:
            ok = {
                "=": labels.get(key) == value,
                "!=": labels.get(key) != value,
                "exists": key in labels,
                "!": key not in labels,
                "in": labels.get(key) in values,
                "notin": labels.get(key) not in values,
            }[op]
            if not ok:
                return False
        for path, op, value in self.fields:
            actual = _field(obj, path)
            if (actual == value) != (op == "="):
                return False
        return True


def node_name_of(pod: Mapping[str, Any]) -> str:
    """A pod's spec.nodeName ("" when unbound). Its spec is an object or absent: the store
    decodes every write (`decode_builtin`)."""
    return str((pod.get("spec") or {}).get("nodeName") or "")


def _split_terms(selector: str) -> Iterable[str]:
    """Split on commas outside parentheses: `a in (x,y),b=c` -> `a in (x,y)`, `b=c`."""
    depth, start = 0, 0
    for index, char in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            if selector[start:index].strip():
                yield selector[start:index]
            start = index + 1
    if selector[start:].strip():
        yield selector[start:]


def _field(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
