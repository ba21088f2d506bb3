"""The activities the 31e9066 workflows schedule, as that release declared them: names, argument
and result types (activities/fleet.py and activities/node.py of 31e9066). Declarations only:
the worker runs today's activities of the same names (every name still exists, and each
accepts 31e9066's arguments: tests/test_legacy_31e9066.py checks both), and a result is read
back into these types, which ignore fields added since."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from temporalio import activity

from workflows.legacy.r31e9066.crds import GPUNodeClassSpec
from workflows.legacy.r31e9066.messages import Grant, ObjectRef, OfferCheck, Reservation, StartNodeInput, StartNodeResult
from workflows.legacy.r31e9066.types import (
    DeviceQuery,
    DrainInput,
    DrainResult,
    Instance,
    InstanceRef,
    LabelInput,
    LaunchInput,
    LaunchResult,
    MarkUnavailableInput,
    NodeObservation,
    NodeSummary,
    ObserveInput,
    OfferChoice,
    OfferRequirements,
    SelectOfferInput,
    TailnetCleanupInput,
    TailnetCleanupResult,
    TailnetDevice,
)


class StatusWrite(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ref: ObjectRef
    status: dict[str, object]


class EventSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ref: ObjectRef
    type: str = "Normal"
    reason: str
    message: str


class LedgerCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    class_workflow_id: str
    reservation: Reservation


class ValidateClassInput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    spec: GPUNodeClassSpec
    operator_namespace: str = "tgp-system"


class FleetActivities:
    @activity.defn
    async def reserve_and_start_node(self, inp: StartNodeInput) -> StartNodeResult: ...

    @activity.defn
    async def settle_reservation(self, call: LedgerCall) -> Grant: ...

    @activity.defn
    async def release_reservation(self, call: LedgerCall) -> None: ...

    @activity.defn
    async def evict_nodes(self, workflow_ids: list[str]) -> list[str]: ...

    @activity.defn
    async def write_status(self, write: StatusWrite) -> bool: ...

    @activity.defn
    async def emit_events(self, events: list[EventSpec]) -> None: ...

    @activity.defn
    async def remove_finalizer(self, ref: ObjectRef) -> None: ...

    @activity.defn
    async def check_offers(self, req: OfferRequirements) -> OfferCheck: ...

    @activity.defn
    async def validate_class(self, inp: ValidateClassInput) -> list[str]: ...


class NodeActivities:
    @activity.defn
    async def select_offer(self, inp: SelectOfferInput) -> OfferChoice: ...

    @activity.defn
    async def mark_offer_unavailable(self, inp: MarkUnavailableInput) -> None: ...

    @activity.defn
    async def launch_instance(self, inp: LaunchInput) -> LaunchResult: ...

    @activity.defn
    async def wait_for_instance_running(self, ref: InstanceRef) -> Instance: ...

    @activity.defn
    async def wait_for_tailnet_device(self, q: DeviceQuery) -> TailnetDevice: ...

    @activity.defn
    async def wait_for_node_ready(self, node_name: str) -> NodeSummary: ...

    @activity.defn
    async def label_and_taint_node(self, inp: LabelInput) -> None: ...

    @activity.defn
    async def observe_node(self, inp: ObserveInput) -> NodeObservation: ...

    @activity.defn
    async def drain_node(self, inp: DrainInput) -> DrainResult: ...

    @activity.defn
    async def terminate_instance(self, ref: InstanceRef) -> bool: ...

    @activity.defn
    async def remove_from_tailnet(self, inp: TailnetCleanupInput) -> TailnetCleanupResult: ...

    @activity.defn
    async def delete_node(self, node_name: str) -> None: ...
