"""Carried states of this release, for tests/test_carried_state.py: what a run of each workflow
type hands the next at continue-as-new, saved as the payload Temporal stores (its metadata and
its JSON), so a later release's code is checked to read what this one's runs wrote.

* GPUNodeWorkflow: recorded from a real run, the input of the continue-as-new by which a Ready
  node moved to the new build in tests/test_upgrade.py (`TGP_RECORD_CARRIED=1` re-records it).
* GPUNodePoolWorkflow and GPUNodeClassWorkflow: built here from their models, every part of the
  state they carry filled (`python -m tests.carried_state` re-records them).

Re-record only at a release that breaks compatibility on purpose (and says so in CHANGELOG.md);
otherwise a failure means the current models cannot read the previous release's runs.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from temporalio.api.common.v1 import Payload

from workers.temporal import DATA_CONVERTER

CARRIED = Path(__file__).parent / "data" / "carried"
RECORD_ENV = "TGP_RECORD_CARRIED"
SEEDS = Path(__file__).parent / "data" / "seed_examples.yaml"
AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def models() -> dict[str, type[Any]]:
    """Each workflow type's input model, as the current code names it."""
    from tgp.messages import ClassInput
    from tgp.node import NodeWorkflowInput
    from workflows.pool import PoolInput

    return {"GPUNodeWorkflow": NodeWorkflowInput, "GPUNodePoolWorkflow": PoolInput, "GPUNodeClassWorkflow": ClassInput}


def save(workflow_type: str, payload: Payload) -> Path:
    """Write a payload as {"metadata": {key: text}, "data": its JSON}."""
    CARRIED.mkdir(parents=True, exist_ok=True)
    path = CARRIED / f"{workflow_type}.json"
    saved = {"metadata": {k: v.decode() for k, v in sorted(payload.metadata.items())}, "data": json.loads(payload.data)}
    path.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
    return path


def load(workflow_type: str) -> Payload:
    saved = json.loads((CARRIED / f"{workflow_type}.json").read_text())
    data = json.dumps(saved["data"], separators=(",", ":")).encode()
    return Payload(metadata={k: v.encode() for k, v in saved["metadata"].items()}, data=data)


def recording() -> bool:
    return bool(os.environ.get(RECORD_ENV))


def pool_input() -> Any:
    from tgp.capacity import Nomination
    from tgp.crds import Condition, GPUNodeClass, GPUNodePool
    from tgp.events import EventSpec
    from tgp.messages import ObjectRef, PoolNode, PoolUpdate
    from tgp.types import NodePhase
    from workflows.pool import PoolInput, PoolState

    docs = {d["kind"]: d for d in yaml.safe_load_all(SEEDS.read_text()) if d}
    pool, klass = GPUNodePool.model_validate(docs["GPUNodePool"]), GPUNodeClass.model_validate(docs["GPUNodeClass"])
    ready, launching = "ml-rtx-gpu-a1b2c3", "ml-rtx-gpu-d4e5f6"
    state = PoolState(
        update=PoolUpdate(spec=pool.spec, generation=3, uid="5b9f0c8e-pool", node_class=klass.spec),
        demand=["ml/train-1", "ml/train-2"],
        pending_since={"ml/train-2": AT},
        demand_at=AT,
        pod_gpus={"ml/train-1": 1, "ml/train-2": 2},
        free_gpus={"gpu-a1b2c3": 0},
        nominations={"ml/train-2": Nomination(workflow_id=launching, since=AT)},
        nodes={
            ready: PoolNode(
                workflow_id=ready, node_name="gpu-a1b2c3", phase=NodePhase.READY, provider="simulated", gpu_type="RTX4090",
                hourly_price=Decimal("0.44"), created_at=AT - timedelta(hours=2), phase_at=AT - timedelta(hours=1, minutes=50),
                gpus=1, reported_at=AT - timedelta(hours=1, minutes=50), drift_hash="d1f7", timeouts_sent='{"idle":"PT10M"}', template_sent="t9",
            ),
            launching: PoolNode(
                workflow_id=launching, node_name="gpu-d4e5f6", phase=NodePhase.LAUNCHING, created_at=AT, phase_at=AT, gpus=2,
                hold_ends_when_busy=True,
            ),
        },
        conditions={"Ready": Condition(type="Ready", status="True", reason="NodesReady", message="1 node Ready", last_transition_time=AT, observed_generation=3)},
        written="f00d",
        seen_running_at=AT,
        ended=["ml-rtx-gpu-0ld"],
        events=[
            EventSpec(
                ref=ObjectRef(kind="GPUNodePool", name="rtx", namespace="ml", uid="5b0c4f7e-1d2a-4c3b-9e8f-0a1b2c3d4e5f"),
                reason="NodeLaunched", message="launching node ml-rtx-gpu-a1b for pod ml/train-0 (1 GPU)",
            )
        ],
        nodes_ended=1,
        granted={ready: AT},
    )
    return PoolInput(namespace="ml", name="rtx", watch_interval=timedelta(minutes=45), state=state)


def class_input() -> Any:
    from tgp.crds import Condition, GPUNodeClass
    from tgp.messages import ClassInput, Ledger, Reservation

    docs = {d["kind"]: d for d in yaml.safe_load_all(SEEDS.read_text()) if d}
    klass = GPUNodeClass.model_validate(docs["GPUNodeClass"])
    ledger = Ledger(
        limits=klass.spec.limits,
        reservations={"ml-rtx-gpu-a1b2c3": Reservation(node_id="ml-rtx-gpu-a1b2c3", pool="ml/rtx", hourly_price=Decimal("0.44"))},
        released=["ml-rtx-gpu-0ld"],
    )
    return ClassInput(
        name=klass.metadata.name,
        spec=klass.spec,
        generation=2,
        uid="7c1e-class",
        ledger=ledger,
        problems=[],
        conditions=[Condition(type="Ready", status="True", reason="Valid", last_transition_time=AT, observed_generation=2)],
        written="beef",
        seen_at=AT,
        validated_at=AT,
    )


async def record_entities() -> None:
    for workflow_type, value in (("GPUNodePoolWorkflow", pool_input()), ("GPUNodeClassWorkflow", class_input())):
        (payload,) = await DATA_CONVERTER.encode([value])
        print(save(workflow_type, payload))


if __name__ == "__main__":
    asyncio.run(record_entities())
