"""Events in the embedded Kubernetes API (`sim.kube`): `v1` and `events.k8s.io/v1` share one
storage, as in a real cluster. An Event is stored in its core form; a client of either version
reads and writes its own field names (`event_to_core`, `event_to_v1`, after
pkg/apis/events/v1/conversion.go), and a create is validated as ValidateEventCreate does
(`event_errors`: the involved object's namespace, the fields of new-style events; events.k8s.io/v1
is stricter).
"""

from __future__ import annotations

import kmock

from sim.kube_machinery import EVENTS, FieldError, Obj

# events.k8s.io/v1 field -> core/v1 field (pkg/apis/events/v1/conversion.go); the rest share names.
_EVENT_FIELDS = {
    "regarding": "involvedObject",
    "note": "message",
    "reportingController": "reportingComponent",
    "deprecatedSource": "source",
    "deprecatedFirstTimestamp": "firstTimestamp",
    "deprecatedLastTimestamp": "lastTimestamp",
    "deprecatedCount": "count",
}


def event_to_core(event: Obj) -> Obj:
    core = {_EVENT_FIELDS.get(k, k): v for k, v in event.items()}
    core.update(apiVersion="v1", kind="Event")
    return core


def event_to_v1(event: Obj) -> Obj:
    back = {v: k for k, v in _EVENT_FIELDS.items()}
    converted = {back.get(k, k): v for k, v in event.items()}
    converted.update(apiVersion="events.k8s.io/v1", kind="Event")
    return converted


def event_errors(event: Obj, resource: kmock.resource) -> list[FieldError]:
    """ValidateEventCreate (pkg/apis/core/validation/events.go) on the core form of `event`."""
    errors: list[FieldError] = []
    namespace = event["metadata"].get("namespace") or ""
    involved_namespace = (event.get("involvedObject") or {}).get("namespace") or ""
    controller_field = "reportingComponent" if resource == EVENTS else "reportingController"
    if not event.get("eventTime"):
        # Old-style events: the namespace must be the involved object's ("default" for
        # cluster-scoped objects such as Nodes).
        if involved_namespace != namespace and not (not involved_namespace and namespace == "default"):
            errors.append(FieldError.invalid("involvedObject.namespace", involved_namespace, "does not match event.namespace"))
    else:
        if not involved_namespace and namespace not in ("default", "kube-system"):
            errors.append(FieldError.invalid("involvedObject.namespace", involved_namespace, "does not match event.namespace"))
        for field, key in ((controller_field, "reportingComponent"), ("reportingInstance", "reportingInstance"),
                           ("action", "action"), ("reason", "reason")):
            if not event.get(key):
                errors.append(FieldError.required(field))
    if resource == EVENTS:
        return errors
    # events.k8s.io/v1 is strict.
    if not event.get("eventTime"):
        errors.append(FieldError.required("eventTime"))
    if event.get("type") not in ("Normal", "Warning"):
        errors.append(FieldError.invalid("type", "", f"has invalid value: {event.get('type') or ''}"))
    for field in ("firstTimestamp", "lastTimestamp", "count"):
        if event.get(field):
            errors.append(FieldError.invalid(field, "", "needs to be unset"))
    source = event.get("source") or {}
    if source.get("component") or source.get("host"):
        errors.append(FieldError.invalid("source", "", "needs to be unset"))
    return errors
