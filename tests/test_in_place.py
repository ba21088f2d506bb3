"""In-place changes (issue 21 item 3): a pool's template labels and taints reach its running
Nodes without replacing them. Only what tgp set is removed, never the user's own or another
controller's labels and taints, and tgp's own labels always win.

The rules are pure (tgp.drift: label_removals, taint_removals, patch_labels, patch_taints) and
proved by property; the whole path (pool -> node signal -> label activity -> Kubernetes
emulator over HTTP) by a test against the simulated world and the time-skipping server."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tgp.drift import label_removals, patch_labels, patch_taints, taint_removals
from tgp.types import Taint

_KEYS = st.sampled_from(["team", "tier", "example.com/x", "tgp.io/pool", "tgp.io/managed"])
_VALUES = st.sampled_from(["", "a", "b"])
_LABELS = st.dictionaries(_KEYS, _VALUES, max_size=5)
_OWN = st.fixed_dictionaries({"tgp.io/managed": st.just("true"), "tgp.io/pool": st.sampled_from(["rtx", "a"])})
_TAINT = st.builds(Taint, key=st.sampled_from(["gpu", "example.com/x", "dedicated"]), value=_VALUES, effect=st.sampled_from(["NoSchedule", "NoExecute"]))


def _unique(taints: list[Taint]) -> list[Taint]:
    """At most one taint per key and effect, as the API allows (and the CRD requires)."""
    seen: dict[tuple[str, str], Taint] = {}
    for t in taints:
        seen.setdefault((t.key, t.effect), t)
    return list(seen.values())


_TAINTS = st.lists(_TAINT, max_size=4).map(_unique)


def _wire(t: Taint) -> dict[str, str]:
    return {"key": t.key, "effect": t.effect, **({"value": t.value} if t.value else {})}


def _apply(current: dict[str, str], patch: dict[str, str | None]) -> dict[str, str]:
    """A JSON merge patch of `metadata.labels`, as the API server applies it."""
    out = dict(current)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


@given(others=_LABELS, applied=_LABELS, own=_OWN, edits=_LABELS, wanted=_LABELS)
def test_a_label_change_sets_the_pools_and_removes_only_what_tgp_set(
    others: dict[str, str], applied: dict[str, str], own: dict[str, str], edits: dict[str, str], wanted: dict[str, str]
) -> None:
    """Invariant: whatever labels others put on the Node before and after tgp (`others`,
    `edits`), after the in-place patch the Node has every label the pool now lists and tgp's
    own (own win); a label tgp had set and the pool dropped is gone if the Node still had it as
    tgp set it, and untouched otherwise; every other label is as it was. A second patch
    changes nothing."""
    current = {**others, **applied, **own, **edits}
    labels = {**wanted, **own}
    removals = label_removals(applied, wanted, own)
    after = _apply(current, patch_labels(current, labels, removals))
    assert {k: after.get(k) for k in labels} == labels
    for k, v in current.items():
        if k in labels:
            continue
        if k in applied and applied[k] == v:
            assert k not in after, f"{k}={v} that tgp set and the pool dropped stayed"
        else:
            assert after.get(k) == v, f"{k}={v}, not tgp's to remove, was touched"
    assert not any(k.startswith("tgp.io/") and k not in after for k in current if k in own), "tgp's own label removed"
    assert patch_labels(after, labels, removals) == {}, "not idempotent"


@given(others=_TAINTS, applied=_TAINTS, wanted=_TAINTS, edits=_TAINTS)
def test_a_taint_change_sets_the_pools_and_removes_only_what_tgp_set(
    others: list[Taint], applied: list[Taint], wanted: list[Taint], edits: list[Taint]
) -> None:
    """Invariant, for taints (one per key and effect): after the patch the Node has each taint
    the pool lists, once, with its value; a taint tgp had set and the pool dropped is gone if
    still there with tgp's value; every other taint is as it was. A second patch changes
    nothing."""
    by_pair: dict[tuple[str, str], Taint] = {}
    for t in [*others, *applied, *edits]:  # later writers replace a pair's value
        by_pair[(t.key, t.effect)] = t
    current = [_wire(t) for t in by_pair.values()]
    after = patch_taints(current, wanted, taint_removals(applied, wanted))
    pairs = [(t["key"], t["effect"]) for t in after]
    assert len(pairs) == len(set(pairs)), f"a key and effect twice: {after}"
    assert all(_wire(t) in after for t in wanted)
    wanted_pairs = {(t.key, t.effect) for t in wanted}
    for t in current:
        pair = (t["key"], t["effect"])
        if pair in wanted_pairs:
            continue
        if any(_wire(a) == t for a in applied):
            assert t not in after, f"{t}, set by tgp and dropped by the pool, stayed"
        else:
            assert t in after, f"{t}, not tgp's to remove, was removed"
    assert patch_taints(after, wanted, taint_removals(applied, wanted)) == after, "not idempotent"


# --- end to end: kubectl patch of the pool, the running Node follows ------------------------------


async def test_a_pools_new_labels_and_taints_reach_its_running_node_in_place(temporal: Any, kube_api: Any) -> None:
    """A pool's template changes (a label changed, one dropped, one added; its taint replaced by
    another) while its node runs, and the Node's user added a label and a taint of their own:
    the running Node gets the pool's new labels and taints and loses the dropped ones, the
    user's stay, tgp's own labels stay; no instance is bought and nothing is drained."""
    from tests.conftest import eventually
    from tests.test_bridge import NO_IDLING, apply, gpu_class, gpu_pool, ready_nodes, running_stack
    from tests.test_pool_changes import MERGE, patch_pool

    async with running_stack(temporal, kube_api) as s:
        await apply(s.kube, gpu_class())
        pool = gpu_pool("rtx", minNodes=1, disruption=NO_IDLING)
        pool["spec"]["template"]["metadata"]["labels"] = {"team": "ml", "tier": "gold"}
        await apply(s.kube, pool)
        [node] = await ready_nodes(s, "ml", "rtx", 1)
        name = node["name"]
        # The user's own label and taint on the Node (kubectl label / kubectl taint).
        k8s_node = (await s.kube.get(f"/api/v1/nodes/{name}")).json()
        mine = {"key": "example.com/maintenance", "value": "soon", "effect": "PreferNoSchedule"}
        user = {"metadata": {"labels": {"owner": "me"}}, "spec": {"taints": [*k8s_node["spec"]["taints"], mine]}}
        (await s.kube.patch(f"/api/v1/nodes/{name}", json=user, headers=MERGE)).raise_for_status()
        bought = s.world.cloud.create_requests

        dedicated = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
        await patch_pool(s.kube, "rtx", {"template": {"metadata": {"labels": {"team": "vision", "region-pref": "eu", "tier": None}}, "spec": {"taints": [dedicated]}}})

        async def applied() -> dict[str, Any] | None:
            got = (await s.kube.get(f"/api/v1/nodes/{name}")).json()
            labels = got["metadata"].get("labels") or {}
            return got if labels.get("team") == "vision" and "tier" not in labels and dedicated in (got["spec"].get("taints") or []) else None

        got = await eventually(applied, timeout=60, what="the pool's new labels and taints on the running Node")
        labels, taints = got["metadata"]["labels"], got["spec"]["taints"]
        assert labels["region-pref"] == "eu" and labels["owner"] == "me", labels
        assert labels["tgp.io/managed"] == "true" and labels["tgp.io/pool"] == "rtx", labels
        assert mine in taints, "the user's own taint was removed"
        assert not [t for t in taints if t["key"] == "nvidia.com/gpu"], "the taint the pool dropped stayed"
        assert s.world.cloud.create_requests == bought and len(s.world.cloud.live_instances()) == 1, "a change in place bought a node"
        assert not got["spec"].get("unschedulable"), "the node was cordoned (drained)"
        status = await s.pool_status("ml", "rtx")
        assert [n["name"] for n in status["nodes"]] == [name] and status["readyNodes"] == 1, status


async def test_a_label_change_that_fails_is_tried_again_later_and_never_ends_the_node(time_skipping: Any) -> None:
    """The node's `update_template` while the API server refuses its Node writes (500, three
    times: the activity's quick tries): the node stays Ready, says why in its last error, and
    applies the change TEMPLATE_RETRY_AFTER later: the new label set, the dropped label and
    taint removed, tgp's own labels kept. The history replays."""
    from datetime import timedelta

    import httpx

    from activities.http_wire import default_tls

    from tests.conftest import eventually, running_world, skip_time
    from tests.test_node_lifecycle import replay, request, start, wait_phase
    from tests.test_watch_events import AT_REST
    from tgp.types import NodePhase, TemplateUpdate
    from workflows.node import GPUNodeWorkflow
    from workflows.node.labels import TEMPLATE_RETRY_AFTER

    async with running_world(time_skipping) as (world, _, queue):
        assert world.kube is not None
        req = request(timeouts=AT_REST, labels={"team": "research", "tier": "gold"})
        handle = await start(time_skipping, queue, req)
        await wait_phase(handle, NodePhase.READY)
        path = f"/api/v1/nodes/{req.node_name}"
        before = len(world.kube[f"patch {path}"])  # a slice counts the filter's requests from the first (bring-up's)
        refused = world.kube[f"patch {path}"][before : before + 3] << 500

        await handle.signal(GPUNodeWorkflow.update_template, TemplateUpdate(labels={"team": "vision"}, taints=[]))

        # The activity's quick tries (seconds), not yet its retry a minute later.
        await skip_time(time_skipping, timedelta(seconds=20), step=timedelta(seconds=5))
        status = await handle.query(GPUNodeWorkflow.status)
        assert len(refused) == 3, len(refused)
        assert status.phase is NodePhase.READY, f"a failed label write ended the node: {status.end_reason}"
        assert status.last_error and "could not apply the pool's new labels and taints" in status.last_error, status.last_error

        await skip_time(time_skipping, TEMPLATE_RETRY_AFTER, step=timedelta(seconds=30))

        async def applied() -> dict[str, Any] | None:
            async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
                node = (await kube.get(path)).json()
            labels = node["metadata"].get("labels") or {}
            return node if labels.get("team") == "vision" and "tier" not in labels else None

        node = await eventually(applied, what="the change applied on the retry")
        assert node["metadata"]["labels"]["tgp.io/managed"] == "true" and node["metadata"]["labels"]["tgp.io/pool"] == "rtx"
        assert not [t for t in node["spec"].get("taints") or [] if t["key"] == "nvidia.com/gpu"], "the dropped taint stayed"
        assert (await handle.query(GPUNodeWorkflow.status)).phase is NodePhase.READY
        await handle.signal("evict", {"reason": "manual"})
        await handle.result()
        await replay(handle, "in_place_labels_retried")
