"""A GPUNodeClass's template checked before any machine boots with it (the class's
validation condition): its syntax, the variables it reads that tgp does not define, a trial
render with harmless sample values (no real secret is involved), and what it renders to: YAML
that parses, Talos documents without keys the strict Talos parser rejects, and a payload each
of the class's providers can boot (cloud-init, a script, KEY=VALUE lines). Parsing, the name
lookup and the trial render run in one bounded child process (activities/boot/sandbox.py);
rendering for a real launch is activities/boot/render.py's.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping
from typing import Any

import structlog
import yaml
from pydantic import BaseModel, SecretStr

from activities.boot import renders
from activities.boot.render import (
    PEM_CERT,
    TEMPLATE_GLOBALS,
    TEMPLATE_VARIABLES,
    BootSettings,
    JoinSecrets,
    TemplateError,
    prepare,
    render_error,
    template_variables,
)
from activities.boot.renders import RendersBusy
from activities.boot.sandbox import RenderFailed
from tgp.types import Taint

log = structlog.get_logger(__name__)

# Harmless values of the right shape, for checking a template without any real secret.
SAMPLE_CA = base64.b64encode(f"{PEM_CERT}\nMIIBsample\n-----END CERTIFICATE-----\n".encode()).decode()
SAMPLE_JOIN = JoinSecrets(
    control_plane_endpoint="https://100.64.0.1:6443",
    cluster_ca=SecretStr(SAMPLE_CA),
    bootstrap_token=SecretStr("abcdef.0123456789abcdef"),
    machine_token=SecretStr("sample.machinetoken0"),
    machine_ca=SecretStr(SAMPLE_CA),
    cluster_id=SecretStr("c2FtcGxlLWNsdXN0ZXItaWQ="),
    cluster_secret=SecretStr("c2FtcGxlLWNsdXN0ZXItc2VjcmV0"),
    cluster_name="sample",
)
SAMPLE_SETTINGS = BootSettings(
    node_pool="sample-pool",
    node_labels={"tgp.io/pool": "sample-pool"},
    node_taints=[Taint(key="tgp.io/initializing", value="true")],
    tailscale_tags=["tag:gpu-node"],
    tailscale_login_server="https://headscale.example.com",
    kubernetes_version="1.34.1",
)


def class_check_settings(
    *, kubernetes_version: str | None, login_server: str | None = None, tags: Iterable[str] = (), accept_routes: bool = False
) -> BootSettings:
    """Settings for check_template from a class: the sample pool, labels and taints, with the
    class's own Kubernetes version (None stays undefined, as at launch), tailnet and tags."""
    return SAMPLE_SETTINGS.model_copy(
        update={
            "kubernetes_version": BootSettings(kubernetes_version=kubernetes_version).kubernetes_version,
            "tailscale_login_server": login_server,
            "tailscale_tags": list(tags),
            "tailscale_accept_routes": accept_routes,
        }
    )


class TemplateReport(BaseModel):
    """What checking a class's template found: its problems and the variables it reads."""

    problems: list[str] = []
    uses: set[str] = set()


def check_template(text: str, settings: BootSettings | None = None) -> list[str]:
    """Problems with a class's template, for its validation condition; empty when it is fine
    (see `template_report`)."""
    return template_report(text, settings).problems


# The first line of a user-data that cloud-init acts on (its user-data formats): anything else
# it ignores, so the machine boots and never joins.
CLOUD_INIT_HEADERS = (
    "#cloud-config", "#!", "#include", "#cloud-boothook", "#part-handler", "## template: jinja", "Content-Type: multipart/",
)  # fmt: skip
# One line of an `env` payload: KEY=VALUE (blank lines and # comments aside).
_ENV_LINE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


def payload_format_problems(rendered: str, payload_kinds: Mapping[str, Iterable[str]]) -> list[str]:
    """Whether the rendered template is a payload each boot payload kind (kind -> providers)
    can boot: cloud-init takes a cloud-config, a script or another of its formats (by the first
    line), a startup script or an onstart is a script (`#!`), an env payload KEY=VALUE lines.
    Names the line to fix, never quoting the rendered text."""
    lines = rendered.splitlines()
    head = next((line.strip() for line in lines if line.strip()), "")
    problems: list[str] = []
    for kind, names in sorted(payload_kinds.items()):
        who = f"provider{'s' if len(list(names)) > 1 else ''} {', '.join(names)} boot{'s' if len(list(names)) == 1 else ''}"
        if kind == "cloud-init" and not head.startswith(CLOUD_INIT_HEADERS):
            problems.append(
                f"the rendered template is neither cloud-init nor a script, and {who} with cloud-init, which would ignore "
                "it (the machine would boot and never join): begin it with #cloud-config (a cloud-config) or #! (a script, "
                "e.g. #!/bin/bash)"
            )
        elif kind in ("startup-script", "onstart") and not head.startswith("#!"):
            problems.append(
                f"the rendered template is not a script, and {who} with a {kind} script: begin it with an interpreter "
                "line such as #!/bin/bash"
            )
        elif kind == "env":
            bad = next((n for n, line in enumerate(lines, 1) if line.strip() and not line.lstrip().startswith("#")
                        and not _ENV_LINE.fullmatch(line.strip())), None)  # fmt: skip
            if bad is not None or not head:
                where = f"rendered line {bad}" if bad is not None else "it"
                problems.append(f"{who} with an env payload, KEY=VALUE lines, and {where} is not one: write one KEY=VALUE per line")
    return problems


def template_report(
    text: str, settings: BootSettings | None = None, payload_kinds: Mapping[str, Iterable[str]] | None = None
) -> TemplateReport:
    """A class's template checked: syntax, variables that tgp does not define, a trial render
    with sample values (no real secret is involved), and for YAML templates the YAML itself
    and, in Talos documents, keys the strict Talos parser would reject (such as
    machine.systemd); and the variables it reads. With the class's `settings` the trial render
    uses them, so a template needing an unset KubernetesVersion is reported; without, sample
    settings define every optional variable. With `payload_kinds` (kind -> providers), the
    rendered text must also be a payload each kind boots (`payload_format_problems`).

    Never raises but RendersBusy (a machine too loaded to run the child, which is retried):
    whatever else goes wrong is a problem of the template, reported as one (a class whose check
    crashed would get no status at all). Parsing, the name lookup and the trial
    render run in one bounded child process (activities/boot/sandbox.py), so this blocks for
    up to a few seconds: from async code, call it through `renders.bounded`.
    """
    try:
        return _template_report(text, settings, payload_kinds or {})
    except TemplateError as exc:
        return TemplateReport(problems=[str(exc)])
    except RendersBusy:
        raise  # the machine, not the template: the validation is retried (see renders.run)
    except Exception as exc:  # noqa: BLE001 - a bug in a check must still give the class a status
        log.warning("bootstrap.check_failed", error_type=type(exc).__name__)
        return TemplateReport(problems=[f"the template could not be checked ({type(exc).__name__}: {str(exc)[:300]})"])


def _template_report(text: str, settings: BootSettings | None, payload_kinds: Mapping[str, Iterable[str]]) -> TemplateReport:
    sample = template_variables(
        hostname="gpu-sample-0",
        auth_key=SecretStr("tskey-auth-sample"),
        settings=settings or SAMPLE_SETTINGS,
        join=SAMPLE_JOIN,
    )
    known = set(TEMPLATE_VARIABLES) | TEMPLATE_GLOBALS
    try:
        answer = renders.run(prepare(text), variables=sample, inspect=True, known=known)
    except RenderFailed as exc:
        raise render_error(exc, sample, []) from None
    names: dict[str, int] = {str(k): int(v) for k, v in answer["names"].items()}
    problems = [
        str(
            TemplateError(
                f"template variable {name!r} is not defined; defined: {', '.join(sorted(TEMPLATE_VARIABLES))}",
                line=names[name] or None,
                variable=name,
            )
        )
        for name in sorted(set(names) - known)
    ]
    if problems or "output" not in answer:
        return TemplateReport(problems=problems, uses=set(names))
    output = str(answer["output"])
    return TemplateReport(problems=_yaml_problems(output) + payload_format_problems(output, payload_kinds), uses=set(names))


_TALOS_TOP_KEYS = frozenset({"version", "debug", "persist", "machine", "cluster"})
_TALOS_MACHINE_KEYS = frozenset(
    {
        "type", "token", "ca", "acceptedCAs", "certSANs", "controlPlane", "kubelet", "pods", "network",
        "disks", "install", "files", "env", "time", "sysctls", "sysfs", "registries",
        "systemDiskEncryption", "features", "udev", "logging", "kernel", "seccompProfiles",
        "baseRuntimeSpecOverrides", "nodeLabels", "nodeAnnotations", "nodeTaints",
    }
)  # fmt: skip
_TALOS_KUBELET_KEYS = frozenset(
    {
        "image", "clusterDNS", "extraArgs", "extraMounts", "extraConfig", "credentialProviderConfig",
        "defaultRuntimeSeccompProfileEnabled", "registerWithFQDN", "nodeIP", "skipNodeRegistration",
        "disableManifestsDirectory",
    }
)  # fmt: skip
_TALOS_CLUSTER_KEYS = frozenset(
    {
        "id", "secret", "controlPlane", "clusterName", "network", "token", "aescbcEncryptionSecret",
        "secretboxEncryptionSecret", "ca", "acceptedCAs", "aggregatorCA", "serviceAccount", "apiServer",
        "controllerManager", "proxy", "scheduler", "discovery", "etcd", "coreDNS", "externalCloudProvider",
        "extraManifests", "extraManifestHeaders", "inlineManifests", "adminKubeconfig",
        "allowSchedulingOnMasters", "allowSchedulingOnControlPlanes",
    }
)  # fmt: skip


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# Deeper YAML than this is a problem: Python's own loader (cloud-init's) recurses per level.
_MAX_YAML_DEPTH = 100


def _too_deep(document: object) -> bool:
    """Whether `document` nests collections deeper than _MAX_YAML_DEPTH (walked without recursion)."""
    pending = [(document, 1)]
    seen: set[int] = set()
    while pending:
        value, depth = pending.pop()
        if depth > _MAX_YAML_DEPTH:
            return True
        if isinstance(value, (dict, list)) and id(value) not in seen:  # aliases: each node once
            seen.add(id(value))
            pending.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return False


def _yaml_problems(rendered: str) -> list[str]:
    """YAML syntax, and Talos keys the strict parser rejects. Scripts are not YAML: skipped."""
    first = rendered.lstrip().split("\n", 1)[0]
    is_cloud_config = first.startswith("#cloud-config")
    looks_talos = re.search(r"^(version:\s*v1alpha1|machine:|kind:\s*\w+Config)\s*$", rendered, re.MULTILINE)
    if not (is_cloud_config or looks_talos):
        return []
    try:
        # libyaml when present: the pure-Python loader holds the worker's GIL for a tenth of a
        # second on a big payload, which a thread running this takes from the event loop.
        documents = [d for d in yaml.load_all(rendered, Loader=_YAML_LOADER) if d is not None]
    except yaml.YAMLError as exc:
        if "nesting depth" in str(getattr(exc, "problem", "")):
            # libyaml from PyYAML 6.0.4 bounds the nesting itself (a scanner error); before, the
            # loader recursed out (below). The same problem either way.
            return ["the rendered template is YAML nested too deeply to read"]
        mark = getattr(exc, "problem_mark", None)
        where = f"rendered line {mark.line + 1}: " if mark is not None else ""
        return [f"{where}the rendered template is not valid YAML: {getattr(exc, 'problem', None) or exc}"]
    except RecursionError:
        return ["the rendered template is YAML nested too deeply to read"]
    if any(_too_deep(d) for d in documents):
        # libyaml reads it; the pure-Python loader a node's cloud-init uses would recurse out.
        return ["the rendered template is YAML nested too deeply to read"]
    problems: list[str] = []
    for doc in documents:
        if not isinstance(doc, dict):
            problems.append("a YAML document of the rendered template is not a mapping")
        elif "machine" in doc or "cluster" in doc or doc.get("version") == "v1alpha1":
            problems.extend(_talos_v1alpha1_problems(doc))
        elif doc.get("kind") == "ExtensionServiceConfig" and not doc.get("name"):
            problems.append("ExtensionServiceConfig needs a name (the extension, e.g. tailscale)")
    return problems


def _talos_v1alpha1_problems(doc: dict[str, Any]) -> list[str]:
    problems = [
        f"Talos v1alpha1 has no top-level key {k!r} (known: {', '.join(sorted(_TALOS_TOP_KEYS))}); Talos rejects unknown keys"
        for k in doc
        if k not in _TALOS_TOP_KEYS
    ]
    machine = doc.get("machine") or {}
    cluster = doc.get("cluster") or {}
    if isinstance(machine, dict):
        for key in machine:
            if key == "systemd":
                problems.append(
                    "machine.systemd does not exist: Talos has no systemd and rejects the key; run Tailscale with "
                    "the siderolabs/tailscale system extension and an ExtensionServiceConfig document"
                )
            elif key not in _TALOS_MACHINE_KEYS:
                problems.append(f"machine.{key} is not a Talos v1alpha1 key; Talos rejects unknown keys")
        kubelet = machine.get("kubelet") or {}
        if isinstance(kubelet, dict):
            problems.extend(
                f"machine.kubelet.{k} is not a Talos key (registerWithTaints belongs in machine.kubelet.extraConfig)"
                if k == "registerWithTaints"
                else f"machine.kubelet.{k} is not a Talos key; Talos rejects unknown keys"
                for k in kubelet
                if k not in _TALOS_KUBELET_KEYS
            )
        files = machine.get("files") or []
        if not isinstance(files, list):
            problems.append("machine.files must be a list of {content, path, op}")
            files = []
        for entry in files:
            if not isinstance(entry, dict):
                problems.append("each machine.files entry must be a mapping with content, path and op")
                continue
            path = str(entry.get("path", ""))
            if entry.get("op") == "create" and not (path.startswith("/var/") or path.startswith("/etc/cri/conf.d/")):
                problems.append(
                    f"machine.files creates {path!r}: Talos refuses op create outside /var "
                    "(except the CRI customization part under /etc/cri/conf.d/)"
                )
    if isinstance(cluster, dict):
        problems.extend(
            f"cluster.{k} is not a Talos v1alpha1 key; Talos rejects unknown keys"
            for k in cluster
            if k not in _TALOS_CLUSTER_KEYS
        )
    return problems
