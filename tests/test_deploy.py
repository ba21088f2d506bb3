"""deploy/: the RBAC grants what the code calls, and nothing the code does not call."""

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"

# (group, resource, verb) each process uses; keep in step with activities/cluster.py,
# activities/fleet.py and crd_bridge/bridge.py.
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
    ("tgp.io", "gpunodeclasses", "get"),
    ("tgp.io", "gpunodepools", "get"),
    ("tgp.io", "gpunodeclasses", "patch"),
    ("tgp.io", "gpunodepools", "patch"),
    ("tgp.io", "gpunodeclasses/status", "patch"),
    ("tgp.io", "gpunodepools/status", "patch"),
}


def grants(role_names: set[str]) -> set[tuple[str, str, str]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()) if d]
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
    for path in DEPLOY.glob("*.yaml"):
        assert all(isinstance(d, dict) for d in yaml.safe_load_all(path.read_text()) if d is not None), path
