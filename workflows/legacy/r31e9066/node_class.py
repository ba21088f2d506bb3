"""GPUNodeClassWorkflow: one per GPUNodeClass, the budget ledger shared by all its pools.

Node slots and $/h are reserved before a node is launched and released when it is gone,
through Temporal updates. Update handlers here never await, so each runs to completion before
the next: `maxNodes` and `maxHourlyCost` hold however many pools launch at once.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.legacy.r31e9066.activities import FleetActivities, StatusWrite, ValidateClassInput
    from workflows.legacy.r31e9066.budget import admit
    from workflows.legacy.r31e9066.conditions import condition_list
    from workflows.legacy.r31e9066.crds import Condition, GPUNodeClassStatus
    from workflows.legacy.r31e9066.messages import ClassInput, ClassUpdate, Grant, Ledger, ObjectRef, Reservation
    from workflows.legacy.r31e9066.handover import class_input, hand_over  # handover: not in 31e9066

# Continue-as-new well before Temporal's suggestion; the ledger is small, history is not.
HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW = 2000
# A class with nothing happening still re-checks its Secrets this often.
REVALIDATE_INTERVAL = timedelta(minutes=10)
STATUS_TIMEOUT = timedelta(seconds=30)
# Released node ids remembered to refuse a late reserve/settle (a retried activity).
RELEASED_REMEMBERED = 1000


@workflow.defn(name="GPUNodeClassWorkflow")
class GPUNodeClassWorkflow:
    @workflow.init
    def __init__(self, inp: ClassInput) -> None:
        self.inp = inp
        self.ledger = inp.ledger
        self.dirty = True
        self.validate = True
        self.problems: list[str] = []
        self.written = ""
        self.conditions: dict[str, Condition] = {}

    @workflow.update
    def reserve(self, r: Reservation) -> Grant:
        """Hold a node slot (and its price, if known) for a node about to launch."""
        if self.inp.spec is None:
            return Grant(granted=False, reason=f"GPUNodeClass {self.inp.name} does not exist")
        if self.problems:
            return Grant(granted=False, reason=f"GPUNodeClass {self.inp.name} is not valid: {'; '.join(self.problems)}")
        return self._admit(r)

    @workflow.update
    def settle(self, r: Reservation) -> Grant:
        """Record the price a node is about to pay; refused when it would break the budget."""
        return self._admit(r)

    def _admit(self, r: Reservation) -> Grant:
        if r.node_id in self.ledger.released:
            return Grant(granted=False, reason=f"node {r.node_id} has already ended and released its budget")
        grant = admit(self.ledger, r)
        if grant.granted:
            self._hold(r)
        return grant

    @workflow.update
    def release(self, node_id: str) -> None:
        """The node is gone: give back its slot and $/h."""
        released = [*self.ledger.released, node_id][-RELEASED_REMEMBERED:]
        reservations = {k: v for k, v in self.ledger.reservations.items() if k != node_id}
        self.ledger = self.ledger.model_copy(update={"reservations": reservations, "released": released})
        self.dirty = True

    @workflow.signal
    def update_class(self, u: ClassUpdate) -> None:
        """The bridge saw the GPUNodeClass change (or disappear)."""
        self.inp = self.inp.model_copy(update={"spec": u.spec, "generation": u.generation, "uid": u.uid or self.inp.uid})
        if u.spec is not None:
            self.ledger = self.ledger.model_copy(update={"limits": u.spec.limits})
        self.dirty = self.validate = True

    @workflow.query
    def budget(self) -> Ledger:
        return self.ledger

    def _hold(self, r: Reservation) -> None:
        self.ledger = self.ledger.model_copy(update={"reservations": {**self.ledger.reservations, r.node_id: r}})
        self.dirty = True

    @workflow.run
    async def run(self, inp: ClassInput) -> None:
        if inp.spec is not None:
            self.ledger = self.ledger.model_copy(update={"limits": inp.spec.limits})
        while True:
            hand_over(self, class_input)  # handover: not in 31e9066
            try:
                await workflow.wait_condition(lambda: self.dirty, timeout=REVALIDATE_INTERVAL)
            except TimeoutError:
                self.validate = True
            hand_over(self, class_input)  # handover: not in 31e9066
            self.dirty = False
            if self.inp.spec is None:
                if not self.ledger.reservations:
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    return  # the class is gone and nothing holds its budget
                continue
            if self.validate:
                self.validate = False
                self.problems = await workflow.execute_activity_method(
                    FleetActivities.validate_class,
                    ValidateClassInput(name=self.inp.name, spec=self.inp.spec),
                    start_to_close_timeout=STATUS_TIMEOUT,
                )
            await self._write_status()
            info = workflow.info()
            if info.is_continue_as_new_suggested() or info.get_current_history_length() > HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW:
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(self.inp.model_copy(update={"ledger": self.ledger}))

    async def _write_status(self) -> None:
        if self.problems:
            ready = ("False", "InvalidSpec", "; ".join(self.problems))
        else:
            ready = ("True", "Valid", f"{len(self.ledger.reservations)} nodes hold ${self.ledger.hourly_cost}/h of the budget")
        status = GPUNodeClassStatus(
            observed_generation=self.inp.generation,
            conditions=condition_list({"Ready": ready}, self.inp.generation, workflow.now(), self.conditions),
            nodes=len(self.ledger.reservations),
            hourly_cost=self.ledger.hourly_cost,
        )
        self.conditions = {c.type: c for c in status.conditions}
        body = status.model_dump(mode="json", by_alias=True, exclude={"conditions": {"__all__": {"last_transition_time"}}})
        fingerprint = repr(body)
        if fingerprint == self.written:
            return
        self.written = fingerprint
        await workflow.execute_activity_method(
            FleetActivities.write_status,
            StatusWrite(ref=ObjectRef(kind="GPUNodeClass", name=self.inp.name, uid=self.inp.uid), status=status.model_dump(mode="json", by_alias=True)),
            start_to_close_timeout=STATUS_TIMEOUT,
        )
