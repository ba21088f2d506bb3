"""OpenAPI documents of the embedded Kubernetes API (`sim.kube`), for kubectl.

kubectl reads OpenAPI v3 (`/openapi/v3`, an index of one document per group-version such as
`/openapi/v3/apis/tgp.io/v1`) for three things, each checked against kubectl 1.37:

* `kubectl apply/create --validate=strict` (the default) first asks whether the server validates
  fields itself: it looks for a `fieldValidation` query parameter on the PATCH operation of the
  kind (`x-kubernetes-group-version-kind`). The emulator offers it, so kubectl sends
  `?fieldValidation=Strict` and the server refuses unknown fields of custom resources (400), as a
  real server does. A kind missing from these documents would make kubectl fall back to
  client-side validation with OpenAPI v2 (as against a server older than 1.25, which
  `field_validation=False` plays); every served kind therefore has a document here.
* `kubectl explain`: the kind's schema, found by its `x-kubernetes-group-version-kind`, with
  `$ref`s into `components.schemas` (`allOf: [{$ref}]` where a description sits beside one,
  as the real server writes them).
* client-side `kubectl apply` of built-in kinds computes a strategic merge patch from v3 only
  when the PATCH operation accepts `application/strategic-merge-patch+json`; the documents here
  leave it out, so kubectl uses the patch metadata compiled into it, which is complete (the
  schemas here are not).

Schemas: a CRD's served version contributes its `openAPIV3Schema` (metadata as ObjectMeta) and
a list kind. Built-in kinds kubectl is used on here (Pod, Node, Event, Namespace, Job and the
metadata types) have hand-written schemas with the fields tgp and its tests touch, descriptions
shortened from Kubernetes'; every other built-in kind gets an object schema that keeps unknown
fields. The emulator does not validate built-in kinds against these schemas.

`/openapi/v2` serves the same schemas and operations as Swagger 2.0 (kube_openapi_v2): JSON, or
the protobuf kubectl asks for.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import kmock

Obj = dict[str, Any]

META = "io.k8s.apimachinery.pkg.apis.meta.v1"
CORE = "io.k8s.api.core.v1"
BATCH = "io.k8s.api.batch.v1"
OBJECT_META = f"{META}.ObjectMeta"
LIST_META = f"{META}.ListMeta"
REF_V3 = "#/components/schemas/"

_PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json")


# --- schema builders ------------------------------------------------------------------------


def _s(description: str, type_: str = "string", **extra: Any) -> Obj:
    return {"type": type_, "description": description, **extra}


def _ref(name: str, description: str = "") -> Obj:
    reference = {"$ref": REF_V3 + name}
    return {"allOf": [reference], "description": description} if description else reference


def _array(items: Obj, description: str, **extra: Any) -> Obj:
    return {"type": "array", "items": items, "description": description, **extra}


def _map(description: str) -> Obj:
    return {"type": "object", "additionalProperties": {"type": "string", "default": ""}, "description": description}


def _object(description: str, properties: Mapping[str, Obj], *, required: Iterable[str] = ()) -> Obj:
    schema: Obj = {"type": "object", "description": description, "properties": dict(properties)}
    if required:
        schema["required"] = list(required)
    return schema


def _time(description: str) -> Obj:
    return _s(description, format="date-time")


def _quantity(description: str) -> Obj:
    return {"type": "object", "additionalProperties": {"x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}]}, "description": description}


_API_VERSION = _s(
    "APIVersion defines the versioned schema of this representation of an object. Servers should convert "
    "recognized schemas to the latest internal value, and may reject unrecognized values."
)
_KIND = _s(
    "Kind is a string value representing the REST resource this object represents. Servers may infer this from "
    "the endpoint the client submits requests to. Cannot be updated. In CamelCase."
)
_METADATA_DOC = "Standard object's metadata."
_LIST_METADATA_DOC = "Standard list metadata."


def _top(description: str, properties: Mapping[str, Obj], gvk: tuple[str, str, str], **extra: Any) -> Obj:
    group, version, kind = gvk
    schema = _object(description, {"apiVersion": _API_VERSION, "kind": _KIND, **properties})
    schema["x-kubernetes-group-version-kind"] = [{"group": group, "kind": kind, "version": version}]
    schema.update(extra)
    return schema


def _list(kind_schema: str, gvk: tuple[str, str, str]) -> Obj:
    return _top(
        f"{gvk[2]} is a list of {gvk[2].removesuffix('List')}.",
        {"items": _array(_ref(kind_schema), "List of objects."), "metadata": _ref(LIST_META, _LIST_METADATA_DOC)},
        gvk, required=["items"],
    )


def _meta_schemas() -> dict[str, Obj]:
    owner = _object("OwnerReference contains enough information to let you identify an owning object.", {
        "apiVersion": _s("API version of the referent."),
        "kind": _s("Kind of the referent."),
        "name": _s("Name of the referent."),
        "uid": _s("UID of the referent."),
        "controller": _s("If true, this reference points to the managing controller.", "boolean"),
        "blockOwnerDeletion": _s("If true, AND if the owner has the \"foregroundDeletion\" finalizer, then the owner "
                                 "cannot be deleted from the key-value store until this reference is removed.", "boolean"),
    }, required=["apiVersion", "kind", "name", "uid"])
    owner["x-kubernetes-map-type"] = "atomic"
    return {
        OBJECT_META: _object(
            "ObjectMeta is metadata that all persisted resources must have, which includes all objects users must create.", {
                "name": _s("Name must be unique within a namespace. Is required when creating resources, although some "
                           "resources may allow a client to request the generation of an appropriate name automatically."),
                "generateName": _s("GenerateName is an optional prefix, used by the server, to generate a unique name "
                                   "ONLY IF the Name field has not been provided."),
                "namespace": _s("Namespace defines the space within which each name must be unique. Not all objects "
                                "are required to be scoped to a namespace."),
                "uid": _s("UID is the unique in time and space value for this object. It is typically generated by the "
                          "server on successful creation of a resource and is not allowed to change on PUT operations."),
                "resourceVersion": _s("An opaque value that represents the internal version of this object that can be "
                                      "used by clients to determine when objects have changed."),
                "generation": _s("A sequence number representing a specific generation of the desired state. Populated "
                                 "by the system. Read-only.", "integer", format="int64"),
                "creationTimestamp": _time("CreationTimestamp is a timestamp representing the server time when this "
                                           "object was created."),
                "deletionTimestamp": _time("DeletionTimestamp is RFC 3339 date and time at which this resource will be "
                                           "deleted. Set by the server when a graceful deletion is requested by the user."),
                "deletionGracePeriodSeconds": _s("Number of seconds allowed for this object to gracefully terminate "
                                                 "before it will be removed from the system.", "integer", format="int64"),
                "labels": _map("Map of string keys and values that can be used to organize and categorize (scope and "
                               "select) objects."),
                "annotations": _map("Annotations is an unstructured key value map stored with a resource that may be "
                                    "set by external tools to store and retrieve arbitrary metadata."),
                "finalizers": _array(_s("", default=""), "Must be empty before the object is deleted from the registry.",
                                     **{"x-kubernetes-list-type": "set", "x-kubernetes-patch-strategy": "merge"}),
                "ownerReferences": _array(_ref(f"{META}.OwnerReference", ""), "List of objects depended by this object.",
                                          **{"x-kubernetes-patch-merge-key": "uid", "x-kubernetes-patch-strategy": "merge"}),
            }),
        f"{META}.OwnerReference": owner,
        LIST_META: _object("ListMeta describes metadata that synthetic resources must have, including lists.", {
            "resourceVersion": _s("String that identifies the server's internal version of this object."),
            "continue": _s("continue may be set if the user set a limit on the number of items returned."),
            "remainingItemCount": _s("The number of subsequent items in the list which are not included in this "
                                     "list response.", "integer", format="int64"),
        }),
        f"{META}.LabelSelector": _object("A label selector is a label query over a set of resources.", {
            "matchLabels": _map("matchLabels is a map of {key,value} pairs."),
            "matchExpressions": _array({"type": "object"}, "matchExpressions is a list of label selector requirements."),
        }),
    }


def _core_schemas() -> dict[str, Obj]:
    toleration = _object("The pod this Toleration is attached to tolerates any taint that matches the triple "
                         "<key,value,effect> using the matching operator <operator>.", {
        "key": _s("Key is the taint key that the toleration applies to. Empty means match all taint keys."),
        "operator": _s("Operator represents a key's relationship to the value. Valid operators are Exists and Equal."),
        "value": _s("Value is the taint value the toleration matches to."),
        "effect": _s("Effect indicates the taint effect to match. Empty means match all taint effects."),
        "tolerationSeconds": _s("TolerationSeconds represents the period of time the toleration tolerates the taint.",
                                "integer", format="int64"),
    })
    container = _object("A single application container that you want to run within a pod.", {
        "name": _s("Name of the container specified as a DNS_LABEL. Each container in a pod must have a unique name."),
        "image": _s("Container image name."),
        "command": _array(_s("", default=""), "Entrypoint array. Not executed within a shell."),
        "args": _array(_s("", default=""), "Arguments to the entrypoint."),
        "env": _array(_ref(f"{CORE}.EnvVar"), "List of environment variables to set in the container.",
                      **{"x-kubernetes-patch-merge-key": "name", "x-kubernetes-patch-strategy": "merge"}),
        "ports": _array(_ref(f"{CORE}.ContainerPort"), "List of ports to expose from the container.",
                        **{"x-kubernetes-patch-merge-key": "containerPort", "x-kubernetes-patch-strategy": "merge"}),
        "resources": _ref(f"{CORE}.ResourceRequirements", "Compute Resources required by this container."),
        "imagePullPolicy": _s("Image pull policy. One of Always, Never, IfNotPresent."),
    }, required=["name"])
    pod_spec = _object("PodSpec is a description of a pod.", {
        "containers": _array(_ref(f"{CORE}.Container"), "List of containers belonging to the pod.",
                             **{"x-kubernetes-patch-merge-key": "name", "x-kubernetes-patch-strategy": "merge"}),
        "initContainers": _array(_ref(f"{CORE}.Container"), "List of initialization containers belonging to the pod.",
                                 **{"x-kubernetes-patch-merge-key": "name", "x-kubernetes-patch-strategy": "merge"}),
        "nodeName": _s("NodeName indicates in which node this pod is scheduled."),
        "nodeSelector": _map("NodeSelector is a selector which must be true for the pod to fit on a node."),
        "tolerations": _array(_ref(f"{CORE}.Toleration"), "If specified, the pod's tolerations."),
        "restartPolicy": _s("Restart policy for all containers within the pod. One of Always, OnFailure, Never."),
        "terminationGracePeriodSeconds": _s("Optional duration in seconds the pod needs to terminate gracefully.",
                                            "integer", format="int64"),
        "serviceAccountName": _s("ServiceAccountName is the name of the ServiceAccount to use to run this pod."),
        "priorityClassName": _s("If specified, indicates the pod's priority."),
        "affinity": _s("If specified, the pod's scheduling constraints", "object",
                       **{"x-kubernetes-preserve-unknown-fields": True}),
    }, required=["containers"])
    condition = _object("PodCondition contains details for the current condition of this pod.", {
        "type": _s("Type is the type of the condition."),
        "status": _s("Status is the status of the condition. Can be True, False, Unknown."),
        "reason": _s("Unique, one-word, CamelCase reason for the condition's last transition."),
        "message": _s("Human-readable message indicating details about last transition."),
        "lastTransitionTime": _time("Last time the condition transitioned from one status to another."),
    }, required=["type", "status"])
    pod_status = _object("PodStatus represents information about the status of a pod.", {
        "phase": _s("The phase of a Pod is a simple, high-level summary of where the Pod is in its lifecycle."),
        "conditions": _array(_ref(f"{CORE}.PodCondition"), "Current service state of pod.",
                             **{"x-kubernetes-patch-merge-key": "type", "x-kubernetes-patch-strategy": "merge"}),
        "reason": _s("A brief CamelCase message indicating details about why the pod is in this state."),
        "message": _s("A human readable message indicating details about why the pod is in this condition."),
        "podIP": _s("podIP address allocated to the pod."),
        "startTime": _time("RFC 3339 date and time at which the object was acknowledged by the Kubelet."),
        "containerStatuses": _array({"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                    "Statuses of containers in this pod."),
    })
    taint = _object("The node this Taint is attached to has the \"effect\" on any pod that does not tolerate the Taint.", {
        "key": _s("Required. The taint key to be applied to a node."),
        "value": _s("The taint value corresponding to the taint key."),
        "effect": _s("Required. The effect of the taint on pods that do not tolerate the taint. Valid effects are "
                     "NoSchedule, PreferNoSchedule and NoExecute."),
        "timeAdded": _time("TimeAdded represents the time at which the taint was added."),
    }, required=["key", "effect"])
    node_spec = _object("NodeSpec describes the attributes that a node is created with.", {
        "unschedulable": _s("Unschedulable controls node schedulability of new pods. By default, node is schedulable.",
                            "boolean"),
        "taints": _array(_ref(f"{CORE}.Taint"), "If specified, the node's taints."),
        "providerID": _s("ID of the node assigned by the cloud provider in the format: <ProviderName>://<ProviderSpecificNodeID>"),
        "podCIDR": _s("PodCIDR represents the pod IP range assigned to the node."),
    })
    node_status = _object("NodeStatus is information about the current status of a node.", {
        "capacity": _quantity("Capacity represents the total resources of a node."),
        "allocatable": _quantity("Allocatable represents the resources of a node that are available for scheduling."),
        "conditions": _array(_ref(f"{CORE}.NodeCondition"), "Conditions is an array of current observed node conditions.",
                             **{"x-kubernetes-patch-merge-key": "type", "x-kubernetes-patch-strategy": "merge"}),
        "addresses": _array(_ref(f"{CORE}.NodeAddress"), "List of addresses reachable to the node.",
                            **{"x-kubernetes-patch-merge-key": "type", "x-kubernetes-patch-strategy": "merge"}),
        "nodeInfo": _ref(f"{CORE}.NodeSystemInfo", "Set of ids/uuids to uniquely identify the node."),
    })
    node_condition = _object("NodeCondition contains condition information for a node.", {
        "type": _s("Type of node condition."),
        "status": _s("Status of the condition, one of True, False, Unknown."),
        "reason": _s("(brief) reason for the condition's last transition."),
        "message": _s("Human readable message indicating details about last transition."),
        "lastHeartbeatTime": _time("Last time we got an update on a given condition."),
        "lastTransitionTime": _time("Last time the condition transit from one status to another."),
    }, required=["type", "status"])
    system_info = _object("NodeSystemInfo is a set of ids/uuids to uniquely identify the node.", {
        "kubeletVersion": _s("Kubelet Version reported by the node."),
        "containerRuntimeVersion": _s("ContainerRuntime Version reported by the node through runtime remote API."),
        "osImage": _s("OS Image reported by the node from /etc/os-release."),
        "kernelVersion": _s("Kernel Version reported by the node from 'uname -r'."),
        "architecture": _s("The Architecture reported by the node"),
        "operatingSystem": _s("The Operating System reported by the node"),
        "machineID": _s("MachineID reported by the node."),
    })
    reference = _object("ObjectReference contains enough information to let you inspect or modify the referred object.", {
        "apiVersion": _s("API version of the referent."),
        "kind": _s("Kind of the referent."),
        "name": _s("Name of the referent."),
        "namespace": _s("Namespace of the referent."),
        "uid": _s("UID of the referent."),
        "resourceVersion": _s("Specific resourceVersion to which this reference is made, if any."),
        "fieldPath": _s("If referring to a piece of an object instead of an entire object, this string should contain "
                        "a valid JSON/Go field access statement."),
    })
    reference["x-kubernetes-map-type"] = "atomic"
    return {
        f"{CORE}.Pod": _top(
            "Pod is a collection of containers that can run on a host. This resource is created by clients and "
            "scheduled onto hosts.", {
                "metadata": _ref(OBJECT_META, _METADATA_DOC),
                "spec": _ref(f"{CORE}.PodSpec", "Specification of the desired behavior of the pod."),
                "status": _ref(f"{CORE}.PodStatus", "Most recently observed status of the pod."),
            }, ("", "v1", "Pod")),
        f"{CORE}.PodList": _list(f"{CORE}.Pod", ("", "v1", "PodList")),
        f"{CORE}.PodSpec": pod_spec,
        f"{CORE}.PodStatus": pod_status,
        f"{CORE}.PodCondition": condition,
        f"{CORE}.PodTemplateSpec": _object("PodTemplateSpec describes the data a pod should have when created from a "
                                           "template", {
            "metadata": _ref(OBJECT_META, _METADATA_DOC),
            "spec": _ref(f"{CORE}.PodSpec", "Specification of the desired behavior of the pod."),
        }),
        f"{CORE}.Container": container,
        f"{CORE}.EnvVar": _object("EnvVar represents an environment variable present in a Container.", {
            "name": _s("Name of the environment variable."),
            "value": _s("Variable references $(VAR_NAME) are expanded using the previously defined environment variables."),
            "valueFrom": _s("Source for the environment variable's value.", "object",
                            **{"x-kubernetes-preserve-unknown-fields": True}),
        }, required=["name"]),
        f"{CORE}.ContainerPort": _object("ContainerPort represents a network port in a single container.", {
            "containerPort": _s("Number of port to expose on the pod's IP address.", "integer", format="int32"),
            "name": _s("If specified, this must be an IANA_SVC_NAME and unique within the pod."),
            "protocol": _s("Protocol for port. Must be UDP, TCP, or SCTP. Defaults to \"TCP\"."),
        }, required=["containerPort"]),
        f"{CORE}.ResourceRequirements": _object("ResourceRequirements describes the compute resource requirements.", {
            "limits": _quantity("Limits describes the maximum amount of compute resources allowed."),
            "requests": _quantity("Requests describes the minimum amount of compute resources required."),
        }),
        f"{CORE}.Toleration": toleration,
        f"{CORE}.Node": _top(
            "Node is a worker node in Kubernetes. Each node will have a unique identifier in the cache (i.e. in etcd).", {
                "metadata": _ref(OBJECT_META, _METADATA_DOC),
                "spec": _ref(f"{CORE}.NodeSpec", "Spec defines the behavior of a node."),
                "status": _ref(f"{CORE}.NodeStatus", "Most recently observed status of the node."),
            }, ("", "v1", "Node")),
        f"{CORE}.NodeList": _list(f"{CORE}.Node", ("", "v1", "NodeList")),
        f"{CORE}.NodeSpec": node_spec,
        f"{CORE}.NodeStatus": node_status,
        f"{CORE}.NodeCondition": node_condition,
        f"{CORE}.NodeAddress": _object("NodeAddress contains information for the node's address.", {
            "type": _s("Node address type, one of Hostname, ExternalIP or InternalIP."),
            "address": _s("The node address."),
        }, required=["type", "address"]),
        f"{CORE}.NodeSystemInfo": system_info,
        f"{CORE}.Taint": taint,
        f"{CORE}.Event": _top(
            "Event is a report of an event somewhere in the cluster.", {
                "metadata": _ref(OBJECT_META, _METADATA_DOC),
                "involvedObject": _ref(f"{CORE}.ObjectReference", "The object that this event is about."),
                "reason": _s("This should be a short, machine understandable string that gives the reason for the "
                             "transition into the object's current status."),
                "message": _s("A human-readable description of the status of this operation."),
                "type": _s("Type of this event (Normal, Warning), new types could be added in the future"),
                "source": _s("The component reporting this event.", "object", **{"x-kubernetes-preserve-unknown-fields": True}),
                "firstTimestamp": _time("The time at which the event was first recorded."),
                "lastTimestamp": _time("The time at which the most recent occurrence of this event was recorded."),
                "count": _s("The number of times this event has occurred.", "integer", format="int32"),
                "eventTime": _s("Time when this Event was first observed.", format="date-time"),
                "reportingComponent": _s("Name of the controller that emitted this Event."),
                "reportingInstance": _s("ID of the controller instance."),
                "action": _s("What action was taken/failed regarding to the Regarding object."),
            }, ("", "v1", "Event"), required=["metadata", "involvedObject"]),
        f"{CORE}.EventList": _list(f"{CORE}.Event", ("", "v1", "EventList")),
        f"{CORE}.ObjectReference": reference,
        f"{CORE}.Namespace": _top(
            "Namespace provides a scope for Names. Use of multiple namespaces is optional.", {
                "metadata": _ref(OBJECT_META, _METADATA_DOC),
                "spec": _object("NamespaceSpec describes the attributes on a Namespace.", {
                    "finalizers": _array(_s("", default=""), "Finalizers is an opaque list of values that must be empty "
                                         "to permanently remove object from storage."),
                }),
                "status": _object("NamespaceStatus is information about the current status of a Namespace.", {
                    "phase": _s("Phase is the current lifecycle phase of the namespace."),
                }),
            }, ("", "v1", "Namespace")),
        f"{CORE}.NamespaceList": _list(f"{CORE}.Namespace", ("", "v1", "NamespaceList")),
    }


def _batch_schemas() -> dict[str, Obj]:
    return {
        f"{BATCH}.Job": _top("Job represents the configuration of a single job.", {
            "metadata": _ref(OBJECT_META, _METADATA_DOC),
            "spec": _ref(f"{BATCH}.JobSpec", "Specification of the desired behavior of a job."),
            "status": _ref(f"{BATCH}.JobStatus", "Current status of a job."),
        }, ("batch", "v1", "Job")),
        f"{BATCH}.JobList": _list(f"{BATCH}.Job", ("batch", "v1", "JobList")),
        f"{BATCH}.JobSpec": _object("JobSpec describes how the job execution will look like.", {
            "template": _ref(f"{CORE}.PodTemplateSpec", "Describes the pod that will be created when executing a job."),
            "completions": _s("Specifies the desired number of successfully finished pods the job should be run with.",
                              "integer", format="int32"),
            "parallelism": _s("Specifies the maximum desired number of pods the job should run at any given time.",
                              "integer", format="int32"),
            "backoffLimit": _s("Specifies the number of retries before marking this job failed.", "integer", format="int32"),
            "activeDeadlineSeconds": _s("Specifies the duration in seconds relative to the startTime that the job may "
                                        "be continuously active before the system tries to terminate it.",
                                        "integer", format="int64"),
            "ttlSecondsAfterFinished": _s("ttlSecondsAfterFinished limits the lifetime of a Job that has finished "
                                          "execution.", "integer", format="int32"),
            "selector": _ref(f"{META}.LabelSelector", "A label query over pods that should match the pod count."),
            "suspend": _s("suspend specifies whether the Job controller should create Pods or not.", "boolean"),
        }, required=["template"]),
        f"{BATCH}.JobStatus": _object("JobStatus represents the current state of a Job.", {
            "active": _s("The number of pending and running pods which are not terminating.", "integer", format="int32"),
            "succeeded": _s("The number of pods which reached phase Succeeded.", "integer", format="int32"),
            "failed": _s("The number of pods which reached phase Failed.", "integer", format="int32"),
            "startTime": _time("Represents time when the job controller started processing a job."),
            "completionTime": _time("Represents time when the job was completed."),
            "conditions": _array({"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                 "The latest available observations of an object's current state."),
        }),
    }


def _built_in_schemas() -> dict[str, Obj]:
    return {**_meta_schemas(), **_core_schemas(), **_batch_schemas()}


def schema_name(group: str, version: str, kind: str) -> str:
    """The component name of a kind: `io.k8s.api.core.v1.Pod`, `io.tgp.v1.GPUNodePool` (a custom
    group's domain reversed, as the API server names them)."""
    if group == "":
        return f"io.k8s.api.core.{version}.{kind}"
    if "." not in group or group.endswith(".k8s.io"):
        short = group.removesuffix(".k8s.io").replace(".", "")
        return f"io.k8s.api.{short}.{version}.{kind}"
    return ".".join(reversed(group.split("."))) + f".{version}.{kind}"


def custom_resource_schema(schema: Mapping[str, Any], gvk: tuple[str, str, str]) -> Obj:
    """A CRD version's openAPIV3Schema as the server publishes it: metadata is ObjectMeta,
    apiVersion and kind are described, the GVK extension names the kind."""
    published = copy.deepcopy(dict(schema))
    properties = published.setdefault("properties", {})
    properties["apiVersion"] = {**_API_VERSION, **{k: v for k, v in (properties.get("apiVersion") or {}).items() if k != "type"}}
    properties["kind"] = {**_KIND, **{k: v for k, v in (properties.get("kind") or {}).items() if k != "type"}}
    properties["metadata"] = _ref(OBJECT_META, _METADATA_DOC)
    published.setdefault("type", "object")
    group, version, kind = gvk
    published["x-kubernetes-group-version-kind"] = [{"group": group, "kind": kind, "version": version}]
    return published


def _generic(gvk: tuple[str, str, str]) -> Obj:
    return _top(
        f"{gvk[2]} (a built-in kind whose fields the emulator does not model).",
        {"metadata": _ref(OBJECT_META, _METADATA_DOC)}, gvk, **{"x-kubernetes-preserve-unknown-fields": True},
    )


# --- paths -----------------------------------------------------------------------------------

_QUERY = {
    "dryRun": "When present, indicates that modifications should not be persisted.",
    "fieldManager": "fieldManager is a name associated with the actor or entity that is making these changes.",
    "fieldValidation": (
        "fieldValidation instructs the server on how to handle objects in the request (POST/PUT/PATCH) containing "
        "unknown or duplicate fields. Valid values are: - Ignore - Warn - Strict. (The emulator checks custom "
        "resources only.)"
    ),
}


def _query(*names: str) -> list[Obj]:
    return [{"name": n, "in": "query", "description": _QUERY[n], "schema": {"type": "string", "uniqueItems": True}}
            for n in names]


def _body(schema: str, types: Iterable[str] = ("application/json",)) -> Obj:
    return {"content": {t: {"schema": {"$ref": REF_V3 + schema}} for t in types}, "required": True}


def _ok(schema: str) -> Obj:
    return {"200": {"description": "OK", "content": {"application/json": {"schema": {"$ref": REF_V3 + schema}}}}}


def _operation(action: str, kind: str, gvk: tuple[str, str, str], schema: str, **extra: Any) -> Obj:
    group, version, _ = gvk
    return {
        "description": f"{action} {kind}",
        "operationId": f"{action}{kind}",
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": group, "kind": gvk[2], "version": version},
        "responses": _ok(schema),
        **extra,
    }


def _paths(
    resource: kmock.resource, info: kmock.ResourceInfo, schema: str, list_schema: str, *, field_validation: bool,
) -> dict[str, Obj]:
    group, version, plural = resource.group or "", str(resource.version), str(resource.plural)
    kind = info.kind or plural.capitalize()
    gvk = (group, version, kind)
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    namespaced = info.namespaced is not False
    collection = f"{prefix}/namespaces/{{namespace}}/{plural}" if namespaced else f"{prefix}/{plural}"
    verbs = info.verbs or {"get", "list", "watch", "create", "update", "patch", "delete"}
    path_params = [{"name": "namespace", "in": "path", "required": True, "schema": {"type": "string"},
                    "description": "object name and auth scope, such as for teams and projects"}] if namespaced else []
    name_param = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"},
                  "description": f"name of the {kind}"}
    write = ("dryRun", "fieldManager", "fieldValidation") if field_validation else ("dryRun", "fieldManager")
    items: Obj = {"parameters": path_params}
    if "list" in verbs:
        items["get"] = _operation("list", kind, gvk, list_schema)
    if "create" in verbs:
        items["post"] = _operation("create", kind, gvk, schema, requestBody=_body(schema),
                                   parameters=_query(*write))
    if "deletecollection" in verbs:
        items["delete"] = _operation("deletecollection", kind, gvk, "io.k8s.apimachinery.pkg.apis.meta.v1.Status")
    item: Obj = {"parameters": [name_param, *path_params]}
    if "get" in verbs:
        item["get"] = _operation("get", kind, gvk, schema)
    if "update" in verbs:
        item["put"] = _operation("put", kind, gvk, schema, requestBody=_body(schema),
                                 parameters=_query(*write))
    if "patch" in verbs:
        item["patch"] = _operation("patch", kind, gvk, schema, requestBody=_body(META + ".Patch", _PATCH_TYPES),
                                   parameters=_query(*write))
    if "delete" in verbs:
        item["delete"] = _operation("delete", kind, gvk, schema)
    paths = {collection: items, f"{collection}/{{name}}": item}
    if namespaced and "list" in verbs:
        paths[f"{prefix}/{plural}"] = {"get": _operation("list", kind, gvk, list_schema)}
    return paths


# --- documents -----------------------------------------------------------------------------


def _closure(schemas: Mapping[str, Obj], roots: Iterable[str]) -> dict[str, Obj]:
    """The schemas `roots` refer to, transitively."""
    wanted: dict[str, Obj] = {}
    pending = [r for r in roots if r in schemas]
    while pending:
        name = pending.pop()
        if name in wanted:
            continue
        wanted[name] = schemas[name]
        pending.extend(ref for ref in _refs(schemas[name]) if ref in schemas and ref not in wanted)
    return dict(sorted(wanted.items()))


def _refs(value: Any) -> Iterable[str]:
    if isinstance(value, Mapping):
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith(REF_V3):
            yield ref[len(REF_V3):]
        for item in value.values():
            yield from _refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


def group_version(
    group: str,
    version: str,
    served: Mapping[kmock.resource, kmock.ResourceInfo],
    custom: Mapping[str, Mapping[str, Any]],
    *,
    field_validation: bool = True,
) -> Obj | None:
    """The OpenAPI v3 document of one group-version: paths of its resources and the schemas
    they use. `custom` maps a custom kind of this group-version to its openAPIV3Schema.
    `field_validation`: whether writes offer the `fieldValidation` parameter."""
    resources = sorted((r for r in served if (r.group or "") == group and r.version == version and r.plural),
                       key=lambda r: str(r.plural))
    if not resources:
        return None
    schemas = _built_in_schemas()
    schemas[f"{META}.Patch"] = {"type": "object", "description": "Patch is provided to give a concrete name and type "
                                "to the Kubernetes PATCH request body."}
    schemas[f"{META}.Status"] = {"type": "object", "description": "Status is a return value for calls that don't "
                                 "return other objects.", "x-kubernetes-preserve-unknown-fields": True}
    paths: dict[str, Obj] = {}
    roots = [f"{META}.Patch", f"{META}.Status"]
    for resource in resources:
        info = served[resource]
        kind = info.kind or str(resource.plural).capitalize()
        name = schema_name(group, version, kind)
        list_name = f"{name}List"
        gvk = (group, version, kind)
        if kind in custom:
            schemas[name] = custom_resource_schema(custom[kind], gvk)
        elif name not in schemas:
            schemas[name] = _generic(gvk)
        if list_name not in schemas:
            schemas[list_name] = _list(name, (group, version, f"{kind}List"))
        roots += [name, list_name]
        paths.update(_paths(resource, info, name, list_name, field_validation=field_validation))
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (tgp emulator)", "version": "unversioned"},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": _closure(schemas, roots)},
    }


def document_path(group: str, version: str) -> str:
    """The index key of a group-version: `api/v1`, `apis/tgp.io/v1`."""
    return f"apis/{group}/{version}" if group else f"api/{version}"


def digest(document: Obj) -> str:
    return hashlib.sha512(json.dumps(document, sort_keys=True).encode()).hexdigest().upper()


def index(documents: Mapping[str, Obj]) -> Obj:
    """`/openapi/v3`: each group-version document's URL, with a hash of its content."""
    return {"paths": {
        path: {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest(document)}"}
        for path, document in sorted(documents.items())
    }}
