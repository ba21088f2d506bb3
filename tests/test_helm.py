"""deploy/helm/tgp: the chart lints, renders objects the Kubernetes schemas accept (strictly), is
as least-privilege and hardened as the kustomize manifests, renders the very objects kustomize
does for the same settings (so the two ways cannot drift), and its values.schema.json refuses
bad values naming the field.

helm is the binary hack/helm/build.sh built from the Go module proxy (`make helm`, cached).
Without it these tests are skipped in one line; under CI=true that is a failure.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_deploy import BRIDGE_USES, KUBERNETES_VERSIONS, RBAC_KINDS, WORKER_USES, dockerfile_uid, validate_strictly
from tests.test_deploy import render as kustomize

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "tgp"
INSTALL_DOC = ROOT / "docs" / "install.md"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
NAMESPACE = "tgp-system"


def helm_binary() -> str:
    """The cached helm, or a one-line skip (a failure under CI=true)."""
    path = subprocess.run(
        [str(ROOT / "hack" / "helm" / "build.sh"), "--path"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()
    if not os.access(path, os.X_OK):
        message = f"helm is not built ({path}): run `make helm`"
        if os.environ.get("CI") == "true":
            pytest.fail(f"under CI: {message}", pytrace=False)
        pytest.skip(message)
    return path


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120, check=False)


def values_file(values: dict[str, Any]) -> list[str]:
    """`--values <file>` holding `values` (a file, not --set, whose paths split keys at dots)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
        yaml.safe_dump(values, file)
    return ["--values", file.name]


@functools.cache
def _template(values_json: str, namespace: str = NAMESPACE) -> tuple[dict[str, Any], ...]:
    done = helm("template", "tgp", str(CHART), "--namespace", namespace, "--include-crds", *values_file(json.loads(values_json)))
    assert done.returncode == 0, done.stderr
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def template(values: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    return _template(json.dumps(values, sort_keys=True))


def refusal(values: dict[str, Any], namespace: str = NAMESPACE) -> str:
    """helm template's error for values it must refuse."""
    done = helm("template", "tgp", str(CHART), "--namespace", namespace, *values_file(values))
    assert done.returncode != 0, f"accepted {values}"
    return done.stderr


# Every option on: mutual TLS and an API key, Headscale, a versioned worker with a build still
# draining, the codec server, metrics with a ServiceMonitor, the egress policy, pull secrets.
FULL = {
    "image": {"repository": "registry.example.com/platform/tgp", "tag": "0.2.1"},
    "imagePullSecrets": ["registry"],
    "temporal": {
        "address": "tgp.a1b2c.tmprl.cloud:7233", "namespace": "tgp.a1b2c",
        "tls": {"enabled": True, "serverCA": True, "serverName": "frontend.example.internal"},
        "apiKey": {"secretName": "tgp-temporal-api-key"},
    },
    "tailnet": {"backend": "headscale", "headscale": {"url": "https://headscale.example.com", "user": "tgp"}},
    "log": {"level": "DEBUG"},
    "worker": {
        "replicas": 3, "buildId": "0.2.1-6f7a8b9c0d", "previousBuilds": [{"buildId": "0.2.0-1a2b3c4d5e", "tag": "0.2.0"}],
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
        "egressPolicy": {"enabled": True, "apiServerCIDRs": ["10.0.0.1/32", "fd00::1/128"]},
    },
    "bridge": {"nodeSelector": {"kubernetes.io/os": "linux"}},
    "codecServer": {"enabled": True, "corsOrigins": ["https://cloud.temporal.io"]},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
}
RENDERS = {"default": {}, "full": FULL}


def objects(values: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [o for o in template(values) if o["kind"] == kind]


def _label(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("name", RENDERS)
def test_helm_lint_strict(name: str) -> None:
    done = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values_file(RENDERS[name]))
    assert done.returncode == 0, done.stdout + done.stderr


def test_chart_version_is_tgps() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == VERSION


@pytest.mark.parametrize("name", RENDERS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_is_valid_for_kubernetes(name: str, version: str) -> None:
    """Strict schema validation: wrong types, missing required fields and unknown fields fail."""
    checked = validate_strictly(template(RENDERS[name]), name, version)
    assert checked >= 13, [_label(o) for o in template(RENDERS[name])]


def _grants(values: dict[str, Any], role_names: set[str]) -> set[tuple[str, str, str]]:
    out = set()
    for role in template(values):
        if role["kind"] in ("ClusterRole", "Role") and role["metadata"]["name"] in role_names:
            for rule in role["rules"]:
                out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


@pytest.mark.parametrize("name", RENDERS)
def test_rbac_is_exactly_what_the_processes_call(name: str) -> None:
    values = RENDERS[name]
    assert _grants(values, {"tgp-bridge"}) == BRIDGE_USES
    assert _grants(values, {"tgp-worker", "tgp-worker-secrets"}) == WORKER_USES
    roles = {_label(o) for o in template(values) if o["kind"] in RBAC_KINDS}
    assert roles == {
        "ServiceAccount/tgp-bridge", "ServiceAccount/tgp-worker", "ClusterRole/tgp-bridge", "ClusterRole/tgp-worker",
        "Role/tgp-worker-secrets", "ClusterRoleBinding/tgp-bridge", "ClusterRoleBinding/tgp-worker", "RoleBinding/tgp-worker-secrets",
    }
    (secrets,) = objects(values, "Role")
    assert secrets["metadata"]["namespace"] == NAMESPACE  # Secrets in tgp-system only, never cluster-wide
    for deployment in objects(values, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        if deployment["metadata"]["name"] == "tgp-codec-server":
            assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
        else:
            assert pod["serviceAccountName"] in ("tgp-worker", "tgp-bridge")


@pytest.mark.parametrize("name", RENDERS)
def test_every_object_but_the_crds_carries_the_release_label(name: str) -> None:
    """What `helm uninstall` removes, and what the lane checks is gone afterwards."""
    for obj in template(RENDERS[name]):
        if obj["kind"] != "CustomResourceDefinition":
            assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "tgp", _label(obj)


@pytest.mark.parametrize("name", RENDERS)
def test_deployments_are_hardened_probed_and_bounded(name: str) -> None:
    for deployment in objects(RENDERS[name], "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        where = f"{name}: {_label(deployment)}"
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == dockerfile_uid(), where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod), where
        (container,) = pod["containers"]
        security = container["securityContext"]
        assert security == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}}, where
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and "memory" in container["resources"]["limits"], where
        assert [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")] == ["/tmp"], where
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["tcpSocket"]["port"] in {p["name"] for p in container["ports"]}, f"{where} {probe}"


def test_a_versioned_worker_runs_each_build_side_by_side() -> None:
    """worker.buildId: a Deployment and PodDisruptionBudget per build, each selecting only its
    build's pods, polling as that build with its own image; TGP_WORKER_VERSIONING on."""
    workers = {d["metadata"]["name"]: d for d in objects(FULL, "Deployment") if d["metadata"]["name"].startswith("tgp-worker")}
    assert set(workers) == {"tgp-worker-0.2.1-6f7a8b9c0d", "tgp-worker-0.2.0-1a2b3c4d5e"}
    for name, deployment in workers.items():
        build = name.removeprefix("tgp-worker-")
        assert deployment["spec"]["selector"]["matchLabels"] == {"app": "tgp-worker", "tgp.io/build": build}
        assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert {"name": "TGP_BUILD_ID", "value": build} in container["env"]
        assert container["image"] == f"registry.example.com/platform/tgp:{build.split('-')[0]}"
    budgets = {p["metadata"]["name"]: p["spec"]["selector"]["matchLabels"]["tgp.io/build"] for p in objects(FULL, "PodDisruptionBudget")}
    assert budgets == {name: name.removeprefix("tgp-worker-") for name in workers}
    (settings,) = objects(FULL, "ConfigMap")
    assert settings["data"]["TGP_WORKER_VERSIONING"] == "on"
    # Unversioned: one Deployment, Recreate (two releases' workers never side by side).
    (worker,) = [d for d in objects({}, "Deployment") if d["metadata"]["name"].startswith("tgp-worker")]
    assert worker["metadata"]["name"] == "tgp-worker" and worker["spec"]["strategy"] == {"type": "Recreate"}
    assert "TGP_WORKER_VERSIONING" not in objects({}, "ConfigMap")[0]["data"]


def test_the_worker_alone_gets_the_provider_keys_and_tailnet_credentials() -> None:
    for values in RENDERS.values():
        for deployment in objects(values, "Deployment"):
            text = json.dumps(deployment)
            worker = deployment["metadata"]["name"].startswith("tgp-worker")
            assert ("tgp-operator-secret" in text) == worker, _label(deployment)
            assert ("HEADSCALE_" in text or "TS_OAUTH" in text) == worker, _label(deployment)


def test_every_variable_set_is_one_the_code_reads() -> None:
    source = "\n".join(
        p.read_text() for folder in ("tgp", "workers", "crd_bridge", "activities") for p in (ROOT / folder).rglob("*.py")
    )
    for values in RENDERS.values():
        names = {key for cm in objects(values, "ConfigMap") for key in cm["data"]}
        names |= {e["name"] for d in objects(values, "Deployment") for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
        for variable in names:
            assert re.search(rf"[\"']{variable}[\"']", source), f"{variable} is read nowhere in the code"


def test_no_secret_is_shipped_and_each_one_used_is_documented() -> None:
    doc = INSTALL_DOC.read_text()
    for values in RENDERS.values():
        assert not objects(values, "Secret")
        text = json.dumps([d for d in template(values) if d["kind"] == "Deployment"])
        used = set(re.findall(r'"secretKeyRef": \{"name": "([^"]+)"', text)) | set(re.findall(r'"secretName": "([^"]+)"', text))
        used |= set(re.findall(r'"secretRef": \{"name": "([^"]+)"', text))
        for secret in used - {"registry"}:
            assert f"`{secret}`" in doc, f"docs/install.md does not say how to create Secret {secret}"


def test_the_chart_crds_are_the_generated_files() -> None:
    generated = sorted((yaml.safe_load(p.read_text()) for p in (ROOT / "deploy" / "crds").glob("*.yaml")), key=json.dumps)
    assert sorted(objects({}, "CustomResourceDefinition"), key=json.dumps) == generated


def test_the_service_monitor_selects_the_metrics_services() -> None:
    (monitor,) = objects(FULL, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [s for s in objects(FULL, "Service") if wanted.items() <= s["metadata"]["labels"].items()]
    scraped = {s["metadata"]["name"] for s in selected if {"metrics"} & {p["name"] for p in s["spec"]["ports"]}}
    assert scraped == {"tgp-worker", "tgp-bridge"}
    assert not objects({}, "ServiceMonitor") and not objects({}, "NetworkPolicy")


# --- kustomize is the same objects -----------------------------------------------------------

# Each kustomize rendering beside the values that ask the chart for the same installation.
EQUIVALENTS = {
    "base": {"image": {"repository": "tgp"}, "metrics": {"service": False}},
    "overlays/self-hosted": {
        "image": {"repository": "<your-registry>/tgp"}, "metrics": {"service": False},
        "temporal": {"address": "temporal-frontend.temporal.svc:7233", "namespace": "tgp", "tls": {"enabled": True, "serverCA": True}},
    },
    "overlays/temporal-cloud": {
        "image": {"repository": "<your-registry>/tgp"}, "metrics": {"service": False},
        "temporal": {"address": "us-east-1.aws.api.temporal.io:7233", "namespace": "tgp.a1b2c", "apiKey": {"secretName": "tgp-temporal-api-key"}},
    },
    "all-components": {
        "image": {"repository": "tgp"}, "metrics": {"serviceMonitor": {"enabled": True}},
        "temporal": {"tls": {"enabled": True}, "apiKey": {"secretName": "tgp-temporal-api-key"}},
        "worker": {"egressPolicy": {"enabled": True}},
    },
    "rollout/example": {
        "image": {"repository": "<your-registry>/tgp", "tag": "0.2.1"}, "metrics": {"service": False},
        "worker": {"buildId": "0.2.1-6f7a8b9c0d", "previousBuilds": [{"buildId": "0.2.0-1a2b3c4d5e", "tag": "0.2.0"}]},
    },
}
# The labels the chart puts on every object's metadata (Helm's own, and the two the kustomize
# manifests carry on some objects only); pod templates and selectors are compared whole.
COMMON_LABELS = {
    "app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "app.kubernetes.io/version", "helm.sh/chart",
    "app.kubernetes.io/name", "app.kubernetes.io/part-of",
}


def _normalized(objs: tuple[dict[str, Any], ...]) -> list[str]:
    """What may differ between the two ways and nothing else: the objects' common labels and the
    pods' settings checksum (Helm's way to roll them), kustomize's hashed ConfigMap name (its
    way), the Namespace (`--create-namespace`), and the base's untagged placeholder image."""
    out = []
    for obj in objs:
        if obj["kind"] == "Namespace":
            continue
        obj = json.loads(re.sub(r'"tgp-settings-[a-z0-9]{10}"', '"tgp-settings"', json.dumps(obj)))
        labels = obj["metadata"].get("labels") or {}
        for key in COMMON_LABELS:
            labels.pop(key, None)
        if not labels:
            obj["metadata"].pop("labels", None)
        if obj["kind"] == "Deployment":
            obj["spec"]["template"]["metadata"].pop("annotations", None)
            for container in obj["spec"]["template"]["spec"]["containers"]:
                container["image"] = f"tgp:{VERSION}" if container["image"] == "tgp" else container["image"]
        out.append(json.dumps(obj, sort_keys=True))
    return sorted(out)


@pytest.mark.parametrize("name", EQUIVALENTS)
def test_kustomize_renders_the_charts_objects(name: str) -> None:
    """Two ways to install, one set of objects: a change to either that the other lacks fails here."""
    assert _normalized(kustomize(name)) == _normalized(template(EQUIVALENTS[name]))


# --- values.schema.json and the chart's own checks -----------------------------------------

REFUSED = [
    ({"worker": {"replicas": -1}}, "/worker/replicas"),
    ({"worker": {"replica": 2}}, "replica"),
    ({"tailnet": {"backend": "wireguard"}}, "/tailnet/backend"),
    ({"temporal": {"address": "https://temporal.example.com"}}, "/temporal/address"),
    ({"worker": {"buildId": "Build_1"}}, "/worker/buildId"),
    ({"worker": {"previousBuilds": [{"build": "0.2.0-1a2b3c4d5e"}]}}, "/worker/previousBuilds/0"),
    ({"worker": {"buildId": "0.2.1-6f7a8b9c0d", "previousBuilds": [{"buildId": "0.2.0-1a2b3c4d5e"}]}}, "/worker/previousBuilds/0"),
    ({"log": {"level": "LOUD"}}, "/log/level"),
    ({"image": {"repository": ""}}, "/image/repository"),
    ({"codecServer": {"corsOrigins": ["cloud.temporal.io"]}}, "/codecServer/corsOrigins/0"),
    # tgp's own Secrets are named tgp-...: the prefix no GPUNodeClass may reference (issue 35 item 12).
    ({"providerSecret": "operator-keys"}, "/providerSecret"),
    ({"payloadKeysSecret": "payload-keys"}, "/payloadKeysSecret"),
    ({"temporal": {"tls": {"secretName": "temporal-tls"}}}, "/temporal/tls/secretName"),
    ({"temporal": {"apiKey": {"secretName": "temporal-api-key"}}}, "/temporal/apiKey/secretName"),
    ({"tailnet": {"tailscale": {"oauthSecret": {"name": "ts-oauth"}}}}, "/tailnet/tailscale/oauthSecret/name"),
    ({"tailnet": {"headscale": {"apiKeySecret": {"name": "headscale", "key": "api-key"}}}}, "/tailnet/headscale/apiKeySecret/name"),
    ({"codecServer": {"tokenSecret": {"name": "codec-token", "key": "token"}}}, "/codecServer/tokenSecret/name"),
]


@pytest.mark.parametrize(("values", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_the_schema_refuses_bad_values_naming_the_field(values: dict[str, Any], field: str) -> None:
    assert field in refusal(values)


def test_the_chart_refuses_what_the_schema_cannot_see() -> None:
    assert "install tgp into namespace tgp-system" in refusal({}, namespace="default")
    assert "tailnet.headscale.url" in refusal({"tailnet": {"backend": "headscale"}})
    old = {"buildId": "0.2.0-1a2b3c4d5e", "tag": "0.2.0"}
    assert "worker.previousBuilds needs worker.buildId" in refusal({"worker": {"previousBuilds": [old]}})
    same = {"worker": {"buildId": "0.2.1-6f7a8b9c0d", "previousBuilds": [{"buildId": "0.2.1-6f7a8b9c0d", "tag": "0.2.1"}]}}
    assert "is worker.buildId, the current build" in refusal(same)
    assert "metrics.serviceMonitor.enabled needs metrics.service" in refusal({"metrics": {"service": False, "serviceMonitor": {"enabled": True}}})
