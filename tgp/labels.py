"""Kubernetes label and taint syntax, and the label keys a tenant may not set.

Pool labels and taints come from tenants (GPUNodePool is namespaced) and end up in the boot
payload (the kubelet's `--node-labels`, Talos `machine.nodeLabels`, `registerWithTaints`) and on
the Node. Kubernetes' own syntax admits no whitespace, quote, `$`, `%`, `,` or `=` in either,
so a key or value that passes these checks is inert in YAML, shell and systemd lines alike.

The rules are apimachinery's (`IsQualifiedName`, `IsValidLabelValue`):

* key: an optional DNS-subdomain prefix (at most 253 characters) and `/`, then a name of at
  most 63 characters of `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`;
* value: empty, or at most 63 characters of the same name charset.

This module imports nothing outside the standard library: the template renderer's child
process (`activities/boot/sandbox.py`) uses it too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

DNS_SUBDOMAIN_MAX_LENGTH = 253
NAME_MAX_LENGTH = 63
LABEL_VALUE_MAX_LENGTH = 63
QUALIFIED_NAME_MAX_LENGTH = DNS_SUBDOMAIN_MAX_LENGTH + 1 + NAME_MAX_LENGTH

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"

# For the CRD schema (RE2, as the API server runs it). The name part's length is in the
# pattern ({0,61}); the prefix's 253 cannot be (RE2 has no lookahead), so the schema bounds the
# whole key with maxLength and admission checks the prefix.
QUALIFIED_NAME_PATTERN = rf"^({_DNS_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")

_DNS_SUBDOMAIN_RE = re.compile(_DNS_SUBDOMAIN)
_NAME_RE = re.compile(_NAME)

# Label-key prefixes tgp sets itself (tgp.io/managed, tgp.io/pool, ...): a tenant's label must
# never override them (`tgp.io/managed: "false"` would hide the Node from tgp's evict watch).
# Any subdomain of tgp.io is tgp's as well.
TGP_DOMAIN = "tgp.io"
# Prefixes that grant a role in the cluster rather than describe a node.
ROLE_PREFIXES = ("node-role.kubernetes.io",)
# A Node's identity and what the cluster tells about it are not a tenant's to write. The
# kubernetes.io and k8s.io namespaces (and their subdomains) are the cluster's: the kubelet sets
# kubernetes.io/hostname, /os, /arch, topology.kubernetes.io/zone and region come from the
# cloud, node-role.kubernetes.io/ grants a role, and scheduling rules rely on them all
# (`kubernetes.io/hostname=victim-node` on a bought node broke every rule keyed on hostname);
# any other key there makes the kubelet refuse --node-labels, so the node never joins.
KUBERNETES_NAMESPACES = ("kubernetes.io", "k8s.io")
# Within them a pool may use exactly these namespaces (not their subdomains): the ones the
# kubelet documents as its own to accept in --node-labels (IsKubeletLabel) ...
TENANT_KUBELET_NAMESPACES = ("node.kubernetes.io", "kubelet.kubernetes.io")
# ... except the well-known identity key among them, which the cloud provider sets.
IDENTITY_KEYS = ("node.kubernetes.io/instance-type",)
# What the node reports about its own GPUs (NVIDIA's GPU feature discovery and device plugin,
# node-feature-discovery): a label there would lie about the hardware to every scheduler rule.
GPU_DISCOVERY_NAMESPACES = ("nvidia.com", "feature.node.kubernetes.io")


def shown(text: str, limit: int = 80) -> str:
    """`text` quoted for a message: escaped (a newline shows as \\n) and cut to `limit`."""
    quoted = repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"
    return quoted


def qualified_name_problems(key: str) -> list[str]:
    """What is wrong with `key` as a label or taint key; empty when it is valid."""
    if not isinstance(key, str):
        return ["must be a string"]
    if not key:
        return ["must not be empty"]
    prefix, slash, name = key.rpartition("/")
    problems = []
    if slash:
        if not prefix:
            problems.append("prefix part must not be empty")
        elif len(prefix) > DNS_SUBDOMAIN_MAX_LENGTH:
            problems.append(f"prefix part must be no more than {DNS_SUBDOMAIN_MAX_LENGTH} characters")
        elif not _DNS_SUBDOMAIN_RE.fullmatch(prefix):
            problems.append(
                "prefix part must be a lowercase DNS subdomain (lower case alphanumerics, '-' and '.', "
                "starting and ending with an alphanumeric, e.g. 'example.com')"
            )
    if not name:
        problems.append("name part must not be empty")
    elif len(name) > NAME_MAX_LENGTH:
        problems.append(f"name part must be no more than {NAME_MAX_LENGTH} characters")
    elif not _NAME_RE.fullmatch(name):
        problems.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
            "with an alphanumeric character (e.g. 'MyName', 'my.name' or '123-abc'), with an optional "
            "DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        )
    return problems


def label_value_problems(value: str) -> list[str]:
    """What is wrong with `value` as a label (or taint) value; empty when it is valid."""
    if not isinstance(value, str):
        return ["must be a string"]
    if len(value) > LABEL_VALUE_MAX_LENGTH:
        return [f"must be no more than {LABEL_VALUE_MAX_LENGTH} characters"]
    if value and not _NAME_RE.fullmatch(value):
        return [
            "must be empty or consist of alphanumeric characters, '-', '_' or '.', and must start and end "
            "with an alphanumeric character (e.g. 'MyValue', 'my_value' or '12345')"
        ]
    return []


def _namespace(key: str) -> str:
    return key.rpartition("/")[0]


def _in_domain(namespace: str, domain: str) -> bool:
    return namespace == domain or namespace.endswith("." + domain)


def reserved_key_problem(key: str) -> str | None:
    """Why a tenant may not use `key` (a label or taint key), or None."""
    namespace = _namespace(key)
    if _in_domain(namespace, TGP_DOMAIN):
        return f"keys under {TGP_DOMAIN}/ (and its subdomains) are tgp's own; use a prefix of your own, e.g. example.com/"
    if namespace in ROLE_PREFIXES:
        return f"{namespace}/ labels give a node a role in the cluster; tgp does not let a pool set them"
    return None


def node_identity_problem(key: str) -> str | None:
    """Why a pool may not set the label `key` on its Nodes (identity, the cluster's own
    namespaces, GPU discovery), or None. The same verdict as TENANT_LABEL_KEY_RULE."""
    namespace = _namespace(key)
    if any(_in_domain(namespace, d) for d in GPU_DISCOVERY_NAMESPACES):
        return f"{namespace}/ labels are what the node reports about its GPUs; a pool may not set them"
    if any(_in_domain(namespace, d) for d in KUBERNETES_NAMESPACES):
        if namespace in TENANT_KUBELET_NAMESPACES and key not in IDENTITY_KEYS:
            return None
        return (
            "keys in the kubernetes.io and k8s.io namespaces are the cluster's (a Node's identity, topology and role); "
            f"a pool may use only {' and '.join(n + '/' for n in TENANT_KUBELET_NAMESPACES)} there "
            f"(not {', '.join(IDENTITY_KEYS)}), or a prefix of its own"
        )
    return None


def _cel_in(domain: str) -> str:
    """CEL: the key `k` (a qualified name: at most one '/', none in its name part) is in
    `domain` or a subdomain of it."""
    return f"k.startsWith('{domain}/') || k.contains('.{domain}/')"


# The CRD's rule over a pool's label keys (x-kubernetes-validations on the labels map): the API
# server refuses at apply what `label_problems(tenant=True)` refuses for being reserved, so a
# tenant hears it from `kubectl apply` (422) and not only from the pool's status. The emulator
# (sim/kube_cel.py) evaluates it as a real API server does.
TENANT_LABEL_KEY_RULE = (
    "self.all(k, !("
    + " || ".join(f"({_cel_in(d)})" for d in (TGP_DOMAIN, *GPU_DISCOVERY_NAMESPACES))
    + " || (("
    + " || ".join(f"({_cel_in(d)})" for d in KUBERNETES_NAMESPACES)
    + ") && !(("
    + " || ".join(f"k.startsWith('{n}/')" for n in TENANT_KUBELET_NAMESPACES)
    + ")"
    + "".join(f" && k != '{key}'" for key in IDENTITY_KEYS)
    + "))))"
)
TENANT_LABEL_KEY_MESSAGE = (
    "label keys may not be under tgp.io/, nvidia.com/, feature.node.kubernetes.io/ or the kubernetes.io and k8s.io "
    "namespaces (except node.kubernetes.io/ and kubelet.kubernetes.io/, not node.kubernetes.io/instance-type)"
)


def label_problems(labels: Mapping[str, str], *, tenant: bool) -> list[str]:
    """Every problem of a label map, one message each naming the key. `tenant`: also refuse
    the keys a pool may not set (tgp's own, node roles, a Node's identity and the cluster's
    namespaces, GPU discovery: see node_identity_problem)."""
    problems = []
    for key, value in labels.items():
        for p in qualified_name_problems(key):
            problems.append(f"label key {shown(key)}: {p}")
        for p in label_value_problems(value):
            problems.append(f"value of label {shown(key)} ({shown(value, 40)}): {p}")
        if tenant and not qualified_name_problems(key):
            reserved = reserved_key_problem(key) or node_identity_problem(key)
            if reserved:
                problems.append(f"label key {shown(key)}: {reserved}")
    return problems


def taint_problems(taints: Iterable[Mapping[str, str]], *, tenant: bool) -> list[str]:
    """Every problem of a list of taints ({key, value, effect}), naming the taint by index."""
    problems = []
    for index, taint in enumerate(taints):
        key, value, effect = taint.get("key", ""), taint.get("value", ""), taint.get("effect", "NoSchedule")
        for p in qualified_name_problems(key):
            problems.append(f"taints[{index}].key {shown(key)}: {p}")
        for p in label_value_problems(value):
            problems.append(f"taints[{index}].value {shown(value, 40)}: {p}")
        if effect not in TAINT_EFFECTS:
            problems.append(f"taints[{index}].effect {shown(str(effect), 40)}: must be one of {', '.join(TAINT_EFFECTS)}")
        if tenant and not qualified_name_problems(key):
            reserved = reserved_key_problem(key)
            if reserved:
                problems.append(f"taints[{index}].key {shown(key)}: {reserved}")
    return problems
