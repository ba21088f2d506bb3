"""The story `tgp demo` and `tgp dev` print as it happens: GPU pods Pending, Running, Completed;
each node's stages from its workflow, from Pending to its end; each pool back to zero.

A node is followed from the first look that finds it in its pool's status until its workflow
says it ended, whether or not the pool still lists it: a node that ends and leaves the status
between two looks still gets its end lines (its workflow answers `status` after it closed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from tgp.demand import gpu_request
from tgp.types import NodeStatus

POOLS = "/apis/tgp.io/v1/gpunodepools"
PODS = "/api/v1/pods"


@dataclass
class Story:
    """Prints what happens, once each: GPU pods, nodes (their workflow's stages), pools."""

    client: Client
    kube: httpx.AsyncClient
    ui: str
    said: set[str] = field(default_factory=set)
    # Node workflows found in a pool's status whose end has not been told yet, and their pools.
    following: dict[str, str] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    had_nodes: set[str] = field(default_factory=set)  # pools that have had nodes

    def say(self, key: str, line: str) -> None:
        """Print `line` unless `key` was said before."""
        if key not in self.said:
            self.said.add(key)
            print(line, flush=True)

    async def look(self) -> bool:
        """One look; True when every pool that had nodes is back to zero, every node followed
        has ended and told its end, and every GPU pod has finished."""
        try:
            pools = await self._items(POOLS)
            pods = await self._items(PODS)
        except (httpx.HTTPError, ValueError):  # the API server restarting or busy: next look
            return False
        listed = {n["workflowId"]: _key(pool) for pool in pools for n in (pool.get("status") or {}).get("nodes") or []}
        self.following |= {w: p for w, p in listed.items() if w not in self.ended}
        for workflow_id in sorted(self.following):
            await self._node(workflow_id)
        self.had_nodes |= set(listed.values())
        for key in map(_key, pools):
            if key in listed.values() or key in self.following.values():  # a node still told: zero comes after its end
                self.said.discard(f"{key}/zero")
            elif key in self.had_nodes:
                self.say(f"{key}/zero", f"  pool {_shown(key)} is back to zero nodes ($0.00/h)")
        unfinished = sum(self._pod(pod) for pod in pods if gpu_request(pod) > 0)
        return bool(self.had_nodes) and not listed and not self.following and unfinished == 0

    async def _items(self, path: str) -> list[dict[str, Any]]:
        response = await self.kube.get(path)
        response.raise_for_status()
        return response.json().get("items") or []

    def _pod(self, pod: dict[str, Any]) -> bool:
        """Tell `pod`'s news; True while it has not finished."""
        name, status = _shown(_key(pod)), pod.get("status") or {}
        phase, node = status.get("phase", "Pending"), (pod.get("spec") or {}).get("nodeName")
        if phase == "Pending" and not node:
            why = next((c.get("message", "") for c in status.get("conditions") or [] if c.get("reason") == "Unschedulable"), "")
            if why:
                self.say(f"{name}/pending", f"  pod {name:<12} Pending: {why}")
        elif phase == "Running":
            self.say(f"{name}/running", f"  pod {name:<12} Running on {node}")
        elif phase in ("Succeeded", "Failed"):
            self.say(f"{name}/done", f"  pod {name:<12} {'Completed' if phase == 'Succeeded' else 'Failed'}")
        return phase not in ("Succeeded", "Failed")

    async def _node(self, workflow_id: str) -> None:
        try:
            s: NodeStatus = await self.client.get_workflow_handle(workflow_id).query("status", result_type=NodeStatus)
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:  # gone from Temporal (retention): nothing left to tell
                self.following.pop(workflow_id, None)
            return
        except Exception:  # noqa: BLE001 - busy or just continued as new: next look
            return
        self.say(f"{workflow_id}/ui", f"  node {s.node_name}: workflow {self.ui}/namespaces/default/workflows/{quote(workflow_id, safe='')}")
        for record in s.stages:
            stage, detail = record.stage.value, f" ({record.reason})" if record.reason else ""
            if stage == "Launching" and s.provider:
                detail = f" bought {s.gpu_type} on {s.provider}/{s.region} at ${s.hourly_price}/h"
            self.say(f"{workflow_id}/{stage}", f"  [{record.at.astimezone():%H:%M:%S}] node {s.node_name:<22} {stage}{detail}")
        if s.phase.is_final:
            self.following.pop(workflow_id, None)
            self.ended.add(workflow_id)


def _key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"


def _shown(key: str) -> str:
    """A name as the story prints it: bare in the default namespace, else namespace/name."""
    return key.removeprefix("default/")
