"""Messages between the CRD bridge, the pool and class workflows, and the node workflows.
Small serializable types so they can grow compatibly; no secrets."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field

from workflows.legacy.r31e9066.crds import ClassLimits, GPUNodeClassSpec, GPUNodePoolSpec
from workflows.legacy.r31e9066.types import NodePhase


class Msg(BaseModel):
    model_config = ConfigDict(extra="ignore")


def pool_workflow_id(namespace: str, name: str) -> str:
    return f"gpunodepool/{namespace}/{name}"


def class_workflow_id(name: str) -> str:
    return f"gpunodeclass/{name}"


class ObjectRef(Msg):
    """Enough of a Kubernetes object to patch its status and attach Events to it."""

    kind: str
    name: str
    namespace: str | None = None
    uid: str | None = None


# --- class ledger ---------------------------------------------------------------------------


class Reservation(Msg):
    node_id: str = Field(description="The node workflow id.")
    pool: str
    hourly_price: Decimal | None = Field(None, description="Known once an offer is chosen.")


class Grant(Msg):
    granted: bool
    reason: str = ""


class Ledger(Msg):
    limits: ClassLimits = ClassLimits()
    reservations: dict[str, Reservation] = {}
    released: list[str] = Field([], description="Recently released node ids: a late reserve or settle for one is refused.")

    @property
    def hourly_cost(self) -> Decimal:
        return sum((r.hourly_price or Decimal(0) for r in self.reservations.values()), Decimal(0))


class ClassInput(Msg):
    name: str
    spec: GPUNodeClassSpec | None = None
    generation: int | None = None
    uid: str | None = None
    ledger: Ledger = Ledger()


class ClassUpdate(Msg):
    spec: GPUNodeClassSpec | None = Field(None, description="None: the GPUNodeClass is gone.")
    generation: int | None = None
    uid: str | None = None


# --- pool -----------------------------------------------------------------------------------


class PoolUpdate(Msg):
    """The pool as the bridge sees it; sent on every change (signal-with-start)."""

    spec: GPUNodePoolSpec
    generation: int | None = None
    uid: str | None = None
    node_class: GPUNodeClassSpec | None = Field(None, description="The referenced class, None when it does not exist.")
    deleting: bool = False


class Demand(Msg):
    """Pending GPU pods this pool should serve (keys namespace/name), from one batch."""

    pods: list[str]
    observed_at: datetime
    max_gpus: int = Field(1, description="The most GPUs one of these pods asks for; new nodes get at least that many.")


class NodeReport(Msg):
    """A node workflow telling its pool where it is."""

    workflow_id: str
    node_name: str
    phase: NodePhase
    provider: str | None = None
    gpu_type: str | None = None
    hourly_price: Decimal | None = None
    reason: str | None = None
    at: datetime


class PoolNode(Msg):
    workflow_id: str
    node_name: str
    phase: NodePhase = NodePhase.PENDING
    provider: str | None = None
    gpu_type: str | None = None
    hourly_price: Decimal | None = None
    created_at: datetime
    phase_at: datetime
    reason: str | None = None
    floor: bool = Field(False, description="Launched for minNodes; does not idle out.")


class StartNodeInput(Msg):
    class_name: str
    reservation: Reservation
    request_json: str = Field(description="The NodeRequest, serialized (kept opaque to this message).")
    static_summary: str = ""


class StartNodeResult(Msg):
    started: bool
    reason: str = ""


class OfferCheck(Msg):
    matching: int
    cheapest: Decimal | None = None
    cheapest_any_price: Decimal | None = None
    cheapest_description: str = ""


# How long a freshly Ready node is assumed to be taking a pending pod (the scheduler binds in
# seconds); within it, pending pods are not counted again.
NOMINATION_WINDOW = timedelta(minutes=2)
