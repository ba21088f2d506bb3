"""Boot payloads: what a bought machine runs first to join the tailnet and the cluster.

A payload is either the built-in `env` payload (KEY=VALUE lines for container-style providers)
or a GPUNodeClass template rendered with Jinja2. Templates run in a sandbox (no attribute
access to Python internals, no mutation), with StrictUndefined (a misspelt variable is an error
naming it, never an empty string) and without autoescaping (the output is YAML or shell, not
HTML): values go through the filter for their context instead (`quote`, `to_json`,
`shell_quote`, `systemd_quote`, `kubelet_labels`). Every render runs in a child process with
bounded time, memory, output and loop work (activities/boot/sandbox.py). The original
operator's Go-template placeholders (`{{.MachineToken}}`, `{{ .ClusterCA }}`) are translated to
Jinja first, so its examples render unchanged.

Rendered inside the launch activity, next to the freshly minted auth key and the join secrets
read from the class's Secret, and handed straight to the provider: a payload is never returned,
logged or stored, and error messages carry variable names and line numbers, never values.

The variables are listed in `TEMPLATE_VARIABLES` and documented in docs/bootstrap.md; shipped
templates live in activities/boot/templates/ (package data: the wheel carries them). A class's
template is checked before any launch uses it by activities/boot/checks.py.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from activities.boot import renders
from activities.boot import sandbox as template_sandbox
from activities.boot.sandbox import RenderFailed
from tgp.crds import MAX_TEMPLATE_LENGTH
from tgp.errors import ConfigError
from tgp.labels import label_problems, taint_problems
from tgp.secrets import scrub as scrub_secrets
from tgp.types import BootPayload, Taint

__all__ = [
    "DEFAULT_TAILNET_CIDR",
    "DEFAULT_TEMPLATES",
    "JOIN_VARIABLES",
    "JOIN_SECRET_KEYS",
    "REQUIRED_JOIN_KEYS",
    "SECRET_VARIABLES",
    "TALOS_WORKER_TEMPLATE",
    "TEMPLATES_DIR",
    "TEMPLATE_VARIABLES",
    "UBUNTU_CLOUD_INIT_TEMPLATE",
    "BootSettings",
    "JoinSecrets",
    "TemplateError",
    "default_template",
    "join_secrets_from_secret",
    "render_boot_payload",
    "render_template",
    "shipped_template",
    "template_join_keys",
    "template_uses",
    "template_variables",
    "translate_go_placeholders",
]

log = structlog.get_logger(__name__)

# activities/boot/templates/: package data (pyproject's [tool.setuptools.package-data]), so an
# installed wheel has them next to this module.
TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
TALOS_WORKER_TEMPLATE = "talos-worker.yaml.j2"
UBUNTU_CLOUD_INIT_TEMPLATE = "ubuntu-cloud-init.yaml.j2"
# Boot payload kind -> the shipped template a node boots with when its class has none. `env`
# is built in (render_boot_payload); the other kinds (startup-script, onstart) need the class's.
DEFAULT_TEMPLATES: Mapping[str, str] = {"cloud-init": UBUNTU_CLOUD_INIT_TEMPLATE}

# Tailscale and Headscale hand out IPv4 addresses from the CGNAT range; the kubelet must pick
# its node IP from here so the node is reachable over the tailnet.
DEFAULT_TAILNET_CIDR = "100.64.0.0/10"
# talosctl gen config's defaults; a cluster with other subnets must say so in the class.
DEFAULT_POD_SUBNETS = ("10.244.0.0/16",)
DEFAULT_SERVICE_SUBNETS = ("10.96.0.0/12",)
DEFAULT_DNS_DOMAIN = "cluster.local"

TEMPLATE_VARIABLES: Mapping[str, str] = {
    # From the join Secret (JoinSecrets).
    "MachineToken": "Talos machine token (worker config machine.token; secrets bundle trustdinfo.token). Secret.",
    "MachineCA": "Talos OS CA certificate, base64 PEM (machine.ca.crt; bundle certs.os.crt). No key.",
    "ClusterCA": "Kubernetes CA certificate, base64 PEM (cluster.ca.crt; bundle certs.k8s.crt). No key.",
    "ClusterID": "Talos cluster id (cluster.id). Secret.",
    "ClusterSecret": "Talos cluster secret (cluster.secret). Secret.",
    "BootstrapToken": "Kubelet TLS-bootstrap token abcdef.0123456789abcdef (cluster.token). Secret.",
    "ControlPlaneEndpoint": "Kubernetes API URL, e.g. https://100.64.0.1:6443 (cluster.controlPlane.endpoint).",
    "ControlPlaneAddress": "host:port of ControlPlaneEndpoint (derived).",
    "ClusterName": "Cluster name (cluster.clusterName).",
    # Per node.
    "NodeName": "Kubernetes Node name, hostname and tailnet hostname.",
    "NodePool": "Name of the GPUNodePool.",
    "NodeIndex": "Index of the node in its pool.",
    "NodeLabels": "Labels the node registers with (mapping).",
    "NodeTaints": "Taints the node registers with (list of {key, value, effect}).",
    # Tailnet.
    "TailscaleAuthKey": "Single-use, pre-authorized, tagged tailnet auth key minted for this node. Secret.",
    "TailscaleLoginServer": "Headscale URL, or empty for Tailscale's own control plane.",
    "TailscaleTags": "Tags of the auth key (list).",
    "TailscaleAcceptRoutes": "The class's tailscaleConfig.acceptRoutes: pass --accept-routes to `tailscale up` (bool).",
    "TailscaleExtraArgs": "`tailscale up` arguments for the login server, tags and --accept-routes (derived).",
    "TailnetCIDR": "Range the node IP is taken from (100.64.0.0/10).",
    # Cluster settings from the class.
    "KubernetesVersion": "Kubelet version x.y.z; undefined when the class does not set it.",
    "ClusterDNSDomain": "Cluster DNS domain (cluster.local).",
    "PodSubnets": "Pod CIDRs (list).",
    "ServiceSubnets": "Service CIDRs (list).",
    "ClusterDNS": "Cluster DNS service IP: the 10th address of the first service subnet (derived).",
    "TalosInstallImage": "Talos installer image (Image Factory), or empty to leave machine.install out.",
    "NvidiaDefaultRuntime": "Make `nvidia` the default containerd runtime (bool).",
}

# Values that must never appear in a log line or an error message.
SECRET_VARIABLES: frozenset[str] = frozenset(
    {"MachineToken", "ClusterID", "ClusterSecret", "BootstrapToken", "TailscaleAuthKey"}
)

# Secret data key -> template variable. The keys are camelCase like the rest of the CRDs.
JOIN_SECRET_KEYS: Mapping[str, str] = {
    "controlPlaneEndpoint": "ControlPlaneEndpoint",
    "clusterCA": "ClusterCA",
    "bootstrapToken": "BootstrapToken",
    "machineToken": "MachineToken",
    "machineCA": "MachineCA",
    "clusterID": "ClusterID",
    "clusterSecret": "ClusterSecret",
    "clusterName": "ClusterName",
}
# What every kubelet join needs, Talos or not; Talos templates need the rest as well.
REQUIRED_JOIN_KEYS: tuple[str, ...] = ("controlPlaneEndpoint", "clusterCA", "bootstrapToken")
_VARIABLE_TO_JOIN_KEY = {v: k for k, v in JOIN_SECRET_KEYS.items()}
# The variables that come from the join Secret (ControlPlaneAddress is derived from one).
JOIN_VARIABLES: frozenset[str] = frozenset({*JOIN_SECRET_KEYS.values(), "ControlPlaneAddress"})

_BOOTSTRAP_TOKEN = re.compile(r"^[a-z0-9]{6}\.[a-z0-9]{16}$")
_K8S_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)$")
PEM_CERT = "-----BEGIN CERTIFICATE-----"
# `{{.Name}}`, `{{ .Name }}`, `{{- .Name -}}`: the Go-template field references the original
# operator documented. Anything richer (pipelines, range, if) is not translated.
_GO_FIELD = re.compile(r"\{\{(-?)\s*\.([A-Za-z_][A-Za-z0-9_]*)\s*(-?)\}\}")
# Go's actions `{{ range .Items }}`, `{{ with $x }}`, `{{ end }}`...: a keyword not called like a
# function (Jinja's `{{ range(3)|list }}` is a call).
_GO_LEFTOVER = re.compile(r"\{\{-?\s*(?:\.[A-Za-z_]|(?:range|with|end|define|template|block)\b(?!\s*\())")
_UNDEFINED_NAME = re.compile(r"^'([^']+)' is undefined$")


class TemplateError(ConfigError):
    """A template that cannot be rendered: a syntax error, an undefined variable, a sandbox
    violation. The message names the line and the variable, never a value."""

    def __init__(self, message: str, *, line: int | None = None, variable: str | None = None) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line
        self.variable = variable


class JoinSecrets(BaseModel):
    """The cluster join material, read at activity time from the Secret the class references.

    Only the worker subset of a Talos secrets bundle: certificates without their keys, the
    machine token, the discovery id and secret, and the kubelet bootstrap token. CAs are held
    as base64 of the PEM, the form both Talos configs and kubeconfigs embed. The endpoint and
    cluster name are not secret and are plain strings.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    control_plane_endpoint: str = Field(description="https URL of the Kubernetes API.")
    cluster_ca: SecretStr = Field(description="Kubernetes CA certificate, base64 PEM.")
    bootstrap_token: SecretStr = Field(description="Kubelet TLS-bootstrap token (Talos cluster.token).")
    machine_token: SecretStr | None = Field(None, description="Talos machine.token (trustd join token).")
    machine_ca: SecretStr | None = Field(None, description="Talos OS CA certificate, base64 PEM.")
    cluster_id: SecretStr | None = Field(None, description="Talos cluster.id.")
    cluster_secret: SecretStr | None = Field(None, description="Talos cluster.secret.")
    cluster_name: str | None = Field(None, description="Talos cluster.clusterName.")

    def variables(self) -> dict[str, str]:
        """The template variables this join material defines (secrets in the clear)."""
        values: dict[str, str | SecretStr | None] = {
            "ControlPlaneEndpoint": self.control_plane_endpoint,
            "ClusterCA": self.cluster_ca,
            "BootstrapToken": self.bootstrap_token,
            "MachineToken": self.machine_token,
            "MachineCA": self.machine_ca,
            "ClusterID": self.cluster_id,
            "ClusterSecret": self.cluster_secret,
            "ClusterName": self.cluster_name,
        }
        out = {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in values.items() if v is not None}
        out["ControlPlaneAddress"] = _host_port(self.control_plane_endpoint)
        return out


class BootSettings(BaseModel):
    """What the class and pool say about how their nodes boot. No secrets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node_pool: str = ""
    node_labels: dict[str, str] = {}
    node_taints: list[Taint] = []
    tailscale_tags: list[str] = []
    tailscale_login_server: str | None = Field(None, description="Headscale URL; None for Tailscale.")
    tailscale_accept_routes: bool = Field(False, description="tailscaleConfig.acceptRoutes: `tailscale up --accept-routes`.")
    tailnet_cidr: str = DEFAULT_TAILNET_CIDR
    kubernetes_version: str | None = Field(None, description="Kubelet version x.y.z, matching the control plane.")
    cluster_dns_domain: str = DEFAULT_DNS_DOMAIN
    pod_subnets: list[str] = list(DEFAULT_POD_SUBNETS)
    service_subnets: list[str] = list(DEFAULT_SERVICE_SUBNETS)
    talos_install_image: str = ""
    nvidia_default_runtime: bool = False

    @field_validator("kubernetes_version")
    @classmethod
    def _full_version(cls, value: str | None) -> str | None:
        if value is None:
            return None
        match = _K8S_VERSION.match(value.strip())
        if not match:
            raise ValueError(f"kubernetesVersion must be x.y.z (like 1.34.1), got {value!r}")
        return ".".join(match.groups())

    @field_validator("tailnet_cidr")
    @classmethod
    def _cidr(cls, value: str) -> str:
        ipaddress.ip_network(value, strict=False)
        return value

    @field_validator("service_subnets")
    @classmethod
    def _service_subnets(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one service subnet is needed (the cluster DNS IP comes from it)")
        for cidr in value:
            ipaddress.ip_network(cidr, strict=False)
        return value


# --- join secrets ------------------------------------------------------------------------


def join_secrets_from_secret(
    data: Mapping[str, str], *, secret_ref: str, required: Iterable[str] = REQUIRED_JOIN_KEYS
) -> JoinSecrets:
    """Build JoinSecrets from a Kubernetes Secret's `data` (base64 values).

    `secret_ref` names the Secret in messages ("Secret tgp-system/cluster-join"); `required`
    lists the data keys that must be present (pass `template_join_keys(template)` to require
    exactly what a template uses). Keys not in JOIN_SECRET_KEYS are ignored. Certificates may
    be stored as PEM or as base64 of the PEM. Raises ConfigError naming the Secret and key.
    """
    needed = set(required) | set(REQUIRED_JOIN_KEYS)
    unknown = needed - set(JOIN_SECRET_KEYS)
    if unknown:
        raise ConfigError(f"unknown join Secret key(s) {', '.join(sorted(unknown))}; known: {', '.join(JOIN_SECRET_KEYS)}")
    missing = sorted(k for k in needed if not data.get(k))
    if missing:
        raise ConfigError(
            f"{secret_ref} has no key {', '.join(repr(k) for k in missing)}: the join Secret must hold "
            f"{', '.join(sorted(needed))} (see docs/bootstrap.md)"
        )
    values: dict[str, str] = {}
    for key in JOIN_SECRET_KEYS:
        raw = data.get(key)
        if raw:
            values[key] = _decode_secret_value(raw, key, secret_ref)

    endpoint = values["controlPlaneEndpoint"]
    if urlsplit(endpoint).scheme != "https" or not urlsplit(endpoint).hostname:
        raise ConfigError(
            f"key 'controlPlaneEndpoint' of {secret_ref} must be an https URL like https://100.64.0.1:6443, got {endpoint!r}"
        )
    if not _BOOTSTRAP_TOKEN.match(values["bootstrapToken"]):
        raise ConfigError(
            f"key 'bootstrapToken' of {secret_ref} is not a bootstrap token (expected the form abcdef.0123456789abcdef)"
        )
    certs = {k: _base64_pem(values[k], k, secret_ref) for k in ("clusterCA", "machineCA") if k in values}

    def secret(key: str) -> SecretStr | None:
        return SecretStr(values[key]) if key in values else None

    return JoinSecrets(
        control_plane_endpoint=endpoint,
        cluster_ca=SecretStr(certs["clusterCA"]),
        bootstrap_token=SecretStr(values["bootstrapToken"]),
        machine_token=secret("machineToken"),
        machine_ca=SecretStr(certs["machineCA"]) if "machineCA" in certs else None,
        cluster_id=secret("clusterID"),
        cluster_secret=secret("clusterSecret"),
        cluster_name=values.get("clusterName"),
    )


def _decode_secret_value(raw: str, key: str, secret_ref: str) -> str:
    try:
        text = base64.b64decode(raw, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        raise ConfigError(f"key {key!r} of {secret_ref} is not base64-encoded UTF-8 text (Secret data must be)") from None
    # `kubectl create secret --from-file` keeps the file's trailing newline.
    value = text.strip()
    if not value:
        raise ConfigError(f"key {key!r} of {secret_ref} is empty")
    return value


def _base64_pem(value: str, key: str, secret_ref: str) -> str:
    """A certificate as base64 of its PEM, whichever of the two forms the Secret held."""
    if value.startswith(PEM_CERT):
        return base64.b64encode((value + "\n").encode()).decode()
    try:
        decoded = base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        decoded = ""
    if not decoded.lstrip().startswith(PEM_CERT):
        raise ConfigError(f"key {key!r} of {secret_ref} is neither a PEM certificate nor base64 of one")
    return value


def _host_port(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- variables ---------------------------------------------------------------------------


def template_variables(
    *,
    hostname: str,
    auth_key: SecretStr,
    settings: BootSettings | None = None,
    join: JoinSecrets | None = None,
    node_index: int = 0,
) -> dict[str, Any]:
    """Every variable a template can use for this node, secrets in the clear: keep the result
    inside the activity. Join variables are absent without `join`, and KubernetesVersion is
    absent when the class does not set it, so a template that needs them fails naming them."""
    s = settings or BootSettings()
    login_server = s.tailscale_login_server or ""
    extra_args = []
    if login_server:
        extra_args.append(f"--login-server={login_server}")
    if s.tailscale_tags:
        extra_args.append(f"--advertise-tags={','.join(s.tailscale_tags)}")
    if s.tailscale_accept_routes:
        extra_args.append("--accept-routes")
    service_net = ipaddress.ip_network(s.service_subnets[0], strict=False)
    variables: dict[str, Any] = {
        "NodeName": hostname,
        "NodePool": s.node_pool,
        "NodeIndex": node_index,
        "NodeLabels": dict(s.node_labels),
        "NodeTaints": [t.model_dump() for t in s.node_taints],
        "TailscaleAuthKey": auth_key.get_secret_value(),
        "TailscaleLoginServer": login_server,
        "TailscaleTags": list(s.tailscale_tags),
        "TailscaleAcceptRoutes": s.tailscale_accept_routes,
        "TailscaleExtraArgs": " ".join(extra_args),
        "TailnetCIDR": s.tailnet_cidr,
        "ClusterDNSDomain": s.cluster_dns_domain,
        "PodSubnets": list(s.pod_subnets),
        "ServiceSubnets": list(s.service_subnets),
        # Kubernetes' convention (and Talos's): the DNS service is the 10th service address.
        "ClusterDNS": str(service_net.network_address + 10),
        "TalosInstallImage": s.talos_install_image,
        "NvidiaDefaultRuntime": s.nvidia_default_runtime,
    }
    if s.kubernetes_version:
        variables["KubernetesVersion"] = s.kubernetes_version
    if join is not None:
        variables.update(join.variables())
    return variables


# --- rendering ---------------------------------------------------------------------------


# The sandbox, its bounds and the escaping filters: activities/boot/sandbox.py. The worker never
# parses or compiles a template (Jinja folds constants while compiling): every parse, name
# lookup and render runs in a bounded child process. These are the names the sandbox defines
# (templates may use them beside TEMPLATE_VARIABLES).
TEMPLATE_GLOBALS = frozenset(template_sandbox.environment().globals)


def translate_go_placeholders(text: str) -> str:
    """Turn Go-template field references (`{{.Name}}`, `{{ .Name }}`) into Jinja (`{{ Name }}`).
    Lines keep their numbers, so errors point at the user's own line."""
    return _GO_FIELD.sub(lambda m: f"{{{{{m.group(1)} {m.group(2)} {m.group(3)}}}}}", text)


def prepare(text: str) -> str:
    """Translate Go placeholders and refuse the Go constructs that would not survive."""
    if len(text) > MAX_TEMPLATE_LENGTH:
        raise TemplateError(f"the template is {len(text)} characters long; at most {MAX_TEMPLATE_LENGTH} (see docs/bootstrap.md)")
    translated = translate_go_placeholders(text)
    match = _GO_LEFTOVER.search(translated)
    if match:
        line = translated.count("\n", 0, match.start()) + 1
        end = translated.find("}}", match.start())
        snippet = translated[match.start() : end + 2 if end != -1 else match.end()]
        raise TemplateError(
            f"Go-template construct {snippet[:60]!r} is not supported: only {{{{.Name}}}} placeholders are "
            "translated; write Jinja instead ({% for %}, {% if %}, {{ Name }})",
            line=line,
        )
    return translated


def render_shipped_template(name: str, variables: Mapping[str, Any]) -> str:
    """`render_template` for the shipped template `name` (activities/boot/templates/; by name,
    so no other text can take this path): rendered in this process (sandbox.render_trusted: the
    same environment, filters and bounds, no child process), so it needs no renders' queue
    either. Raises TemplateError like `render_template`."""
    if name not in (UBUNTU_CLOUD_INIT_TEMPLATE, TALOS_WORKER_TEMPLATE):
        raise ConfigError(f"{name!r} is not a template tgp ships")
    secrets = [str(variables[key]) for key in SECRET_VARIABLES if variables.get(key)]
    try:
        return template_sandbox.render_trusted(prepare(shipped_template(name)), variables)
    except RenderFailed as exc:
        raise render_error(exc, variables, secrets) from None


def render_template(text: str, variables: Mapping[str, Any]) -> str:
    """Render `text` (Jinja, or Go-style `{{.Name}}` placeholders) with `variables`.

    Rendering runs in a child process with bounded time, memory, output and loop work
    (activities/boot/sandbox.py), so this blocks for up to a few seconds: from async code,
    call it through `renders.bounded`. Raises TemplateError for syntax errors, undefined
    variables, sandbox violations, values a filter refuses and exceeded bounds, with the line
    number; values of SECRET_VARIABLES are scrubbed from every message.
    """
    secrets = [str(variables[name]) for name in SECRET_VARIABLES if variables.get(name)]
    try:
        return renders.render(prepare(text), variables)
    except TemplateError as exc:
        exc.args = (_scrub(str(exc), secrets),)
        raise
    except RenderFailed as exc:
        raise render_error(exc, variables, secrets) from None


def render_error(exc: RenderFailed, variables: Mapping[str, Any], secrets: list[str]) -> TemplateError:
    message = _scrub(exc.message, secrets)
    if exc.kind == "syntax":
        return TemplateError(f"syntax error: {message}", line=exc.line)
    if exc.kind == "undefined":
        return _undefined(message, exc.line, variables)
    if exc.kind == "security":
        return TemplateError(f"the template sandbox refused: {message}", line=exc.line)
    return TemplateError(message, line=exc.line)


def _undefined(message: str, line: int | None, variables: Mapping[str, Any]) -> TemplateError:
    match = _UNDEFINED_NAME.match(message)
    if not match:
        # An attribute or key that does not exist; the message (already scrubbed) may quote a value.
        return TemplateError(message, line=line)
    name = match.group(1)
    defined = ", ".join(sorted(variables))
    hint = ""
    if name in _VARIABLE_TO_JOIN_KEY:
        hint = f" (it comes from key {_VARIABLE_TO_JOIN_KEY[name]!r} of the join Secret)"
    elif name == "KubernetesVersion":
        hint = " (set kubernetesVersion on the GPUNodeClass)"
    elif name not in TEMPLATE_VARIABLES:
        hint = " (not a tgp template variable: see docs/bootstrap.md)"
    return TemplateError(f"template variable {name!r} is not defined{hint}; defined: {defined}", line=line, variable=name)


# A quoted literal in an error message ('...' or "..."), long enough to carry part of a value.
_QUOTED = re.compile(r"'([^'\n]{6,})'|\"([^\"\n]{6,})\"")
_TYPE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]* object")
# A run of this many characters of a secret, in any letter case, is a part of it.
_RUN = 8


def template_error_for_admin(message: str, template: str, secrets: Iterable[str]) -> str:
    """A render error's text as the class's admin may read it (a class Event): scrubbed of
    `secrets` (tgp.secrets), of every run of 8 characters of one in any letter case, and of
    every quoted literal that is not the template's own text (Jinja quotes the value it
    choked on: a truncated, upper-cased or sliced join token)."""
    text = scrub_secrets(message, list(secrets))
    grams = {s.lower()[i : i + _RUN] for s in secrets if s for i in range(len(s) - _RUN + 1)}
    if grams:
        lowered, hidden = text.lower(), [False] * len(text)
        for i in range(len(text) - _RUN + 1):
            if lowered[i : i + _RUN] in grams:
                hidden[i : i + _RUN] = [True] * _RUN
        text = "".join("\0" if h else c for c, h in zip(text, hidden, strict=True))
        text = re.sub("\0+", "[redacted]", text)

    def literal(match: re.Match[str]) -> str:
        value = match.group(1) if match.group(1) is not None else match.group(2)
        return match.group(0) if value in template or _TYPE_NAME.fullmatch(value) else "'[value]'"

    return _QUOTED.sub(literal, text)


def _scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[redacted]")
    return text


# --- the variables a template reads --------------------------------------------------------


def template_join_keys(text: str) -> list[str]:
    """The join Secret keys a template uses, plus the ones every join needs: what to pass as
    `required` to join_secrets_from_secret. Raises TemplateError if the template does not
    parse. Blocks (a bounded child process): from async code, through `renders.bounded`."""
    return join_keys_of(template_uses(text))


def join_keys_of(names: Iterable[str]) -> list[str]:
    """The join Secret keys for a template that reads `names` (see template_join_keys)."""
    names = set(names)
    used = {_VARIABLE_TO_JOIN_KEY[n] for n in names if n in _VARIABLE_TO_JOIN_KEY}
    # ControlPlaneAddress is derived from the endpoint.
    if "ControlPlaneAddress" in names:
        used.add("controlPlaneEndpoint")
    return sorted(used | set(REQUIRED_JOIN_KEYS))


def template_uses(text: str) -> set[str]:
    """The variables a template reads. Raises TemplateError if it does not parse. Blocks (a
    bounded child process parses it): from async code, through `renders.bounded`."""
    return set(_inspect(text))


def _inspect(text: str) -> dict[str, int]:
    try:
        return renders.inspect(prepare(text))
    except RenderFailed as exc:
        raise render_error(exc, {}, []) from None


# --- payloads ----------------------------------------------------------------------------


def default_template(kind: str) -> str | None:
    """The shipped template a `kind` boot payload uses when the class has none (None: built
    in, for `env`, or none shipped: the class must give one)."""
    return DEFAULT_TEMPLATES.get(kind)


def shipped_template(name: str, *, directory: Path = TEMPLATES_DIR) -> str:
    """The text of a template shipped in activities/boot/templates/ (TALOS_WORKER_TEMPLATE,
    UBUNTU_CLOUD_INIT_TEMPLATE)."""
    path = directory / name
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"shipped template {name!r} not found in {directory}") from None


def render_boot_payload(
    kind: str,
    *,
    hostname: str,
    auth_key: SecretStr,
    login_server: str | None = None,
    template: str | None = None,
    settings: BootSettings | None = None,
    join: JoinSecrets | None = None,
    node_index: int = 0,
) -> BootPayload:
    """Build the payload of `kind` for `hostname`.

    With `template` (the class's), it is rendered with the variables of `template_variables`.
    Without one: `env` is the container-style payload (KEY=VALUE lines the Tailscale
    container/extension reads), `cloud-init` is the shipped Ubuntu template (needs `join` and
    a kubernetes_version in `settings`). `login_server` (Headscale) overrides the settings'.
    The class's own template renders in a bounded child process; `env` and the shipped
    templates (tgp's own code) render in this process, in microseconds.

    Labels and taints not in Kubernetes syntax are refused (ConfigError) before anything is
    rendered: the bridge admits no such pool, but a spec admitted before that check may still
    be in flight. A class template's render blocks for up to a few seconds (bounded child
    process): from async code, call this through `renders.bounded` when `template` is given.
    """
    s = settings or BootSettings()
    problems = label_problems(s.node_labels, tenant=False) + taint_problems([t.model_dump() for t in s.node_taints], tenant=False)
    if problems:
        raise ConfigError(f"the pool's labels or taints cannot go on a node: {'; '.join(problems)}")
    if login_server:
        s = s.model_copy(update={"tailscale_login_server": login_server})
    if template is None and kind == "env":
        lines = [f"TS_AUTHKEY={auth_key.get_secret_value()}", f"TS_HOSTNAME={hostname}"]
        extra = ([f"--login-server={s.tailscale_login_server}"] if s.tailscale_login_server else []) + (
            ["--accept-routes"] if s.tailscale_accept_routes else []
        )
        if extra:
            lines.append(f"TS_EXTRA_ARGS={' '.join(extra)}")
        # A machine that runs a kubelet registers with the pool's labels and taints, as the
        # shipped templates do, so no pod lands on it before tgp labels and taints the Node.
        # Both were checked above: Kubernetes syntax holds no space, quote or newline.
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.node_labels.items()))
        taints = ",".join(f"{t.key}={t.value}:{t.effect}" for t in s.node_taints)
        kubelet = ([f"--node-labels={labels}"] if labels else []) + ([f"--register-with-taints={taints}"] if taints else [])
        if kubelet:
            lines.append(f"KUBELET_EXTRA_ARGS={' '.join(kubelet)}")
        return BootPayload(kind=kind, content="\n".join(lines) + "\n", hostname=hostname)
    shipped = None
    if template is None:
        default = default_template(kind)
        if default is None:
            raise ConfigError(
                f"boot payload kind {kind!r} needs a template in the GPUNodeClass; built in: env, {', '.join(DEFAULT_TEMPLATES)}"
            )
        shipped = default
    variables = template_variables(hostname=hostname, auth_key=auth_key, settings=s, join=join, node_index=node_index)
    # A class's template renders in a bounded child process; tgp's own shipped one in this one.
    content = render_shipped_template(shipped, variables) if shipped is not None else render_template(template or "", variables)
    # Size only: the content holds the auth key and join secrets.
    log.info("bootstrap.rendered", kind=kind, hostname=hostname, size_bytes=len(content.encode()))
    return BootPayload(kind=kind, content=content, hostname=hostname)
