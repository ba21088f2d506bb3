"""GPUNodeClassWorkflow: one per GPUNodeClass, the budget ledger shared by all its pools.

Node slots and $/h are reserved before a node is launched and released when it is gone,
through Temporal updates. Update handlers decide without awaiting, so each decision runs to
completion before the next: `maxNodes` and `maxHourlyCost` hold however many pools launch at once.

The ledger never stops: `reserve` may wait for the main loop's first validation and listing, so
the main loop never waits for handlers. It continues as new only once no handler is running, and
until then keeps making the passes those handlers wait for; a deleted class that still holds
reservations continues as new too. Everything a run knows is carried in its input.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.entity import EntityActivities, StatusWrite
    from activities.node_class import NodeClassActivities, ValidateClassInput
    from tgp.budget import admit, admit_many, hold
    from tgp.class_ledger import sighted
    from tgp.class_status import AccountProblem, class_status
    from tgp.crds import Condition, GPUNodeClassSpec
    from tgp.events import EventSpec
    from tgp.messages import (
        ClassInput,
        ClassUpdate,
        Grant,
        Grants,
        Ledger,
        ObjectRef,
        Releases,
        Reservation,
        Reservations,
    )
    from tgp.types import NODE_WORKFLOW_PREFIX
    from workflows.continuation import continue_as_new, continue_as_new_due
    from workflows.entity import best_effort, running_nodes_changed, write_status_once

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
        self.validate = inp.validated_at is None  # a run continued as new keeps its last check
        # None until validated: a class nobody has checked grants nothing.
        self.problems: list[str] | None = inp.problems
        self.written = inp.written
        self.seen_at: datetime | None = inp.seen_at
        self.validated_at: datetime | None = inp.validated_at
        self.conditions: dict[str, Condition] = {c.type: c for c in inp.conditions}
        # Each resync's look at the provider accounts (a new run looks at its first pass).
        self.accounts: list[AccountProblem] = []
        self.accounts_at: datetime | None = None
        # Due to continue as new, once the handlers still running have finished.
        self.continuing = False

    @workflow.update
    async def reserve_many(self, batch: Reservations) -> Grants:
        """A pool's launches of one pass, in one call: the class grants what fits its budget, in
        the order given, and says why for the rest (`tgp.budget.admit_many`). Waits like
        `reserve`; the decision itself does not await, so batches are decided one at a time."""
        refused = await self._wait_until_valid()
        if refused is not None:
            return Grants(grants=[refused] * len(batch.reservations))
        return self._admit_many(batch)

    @workflow.update
    def settle_many(self, batch: Reservations) -> Grants:
        """Many nodes' prices at once (the worker gathers the settlements made meanwhile)."""
        return self._admit_many(batch)

    def _admit_many(self, batch: Reservations) -> Grants:
        """Grant what of `batch` fits the budget, in order (tgp.budget.admit_many)."""
        self.ledger, grants = admit_many(self.ledger, batch.reservations, workflow.now())
        if any(g.granted for g in grants):
            self.dirty = True
        return Grants(grants=grants)

    @workflow.update
    def release_many(self, batch: Releases) -> None:
        """Many nodes are gone (the worker gathers the releases made meanwhile)."""
        for node_id in batch.node_ids:
            self.release(node_id)

    async def _wait_until_valid(self) -> Grant | None:
        """Wait for the first validation and for one look at the running node workflows (a new
        run of this ledger, after a crash or reset, must count the live nodes before it grants
        anything); a refusal when the class cannot grant."""
        await workflow.wait_condition(lambda: (self.problems is not None and self.seen_at is not None) or self.inp.spec is None)
        if self.inp.spec is None:
            return Grant(granted=False, reason=f"GPUNodeClass {self.inp.name} does not exist")
        if self.problems:
            # The reason reaches tenants' pool status and Events: name the class, not its Secrets.
            return Grant(granted=False, reason=f"GPUNodeClass {self.inp.name} is not valid (its Ready condition says why; ask the cluster admin)")
        return None

    @workflow.update
    async def reserve(self, r: Reservation) -> Grant:
        """Hold a node slot (and its price, if known) for a node about to launch. Waits for the
        class's first validation; everything after that wait runs without awaiting, so
        concurrent reservations are still decided one at a time."""
        refused = await self._wait_until_valid()
        return refused if refused is not None else self._admit(r)

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
        """The ledger: what each node holds of the class's limits."""
        return self.ledger

    def _hold(self, r: Reservation) -> None:
        self.ledger = hold(self.ledger, r, workflow.now())
        self.dirty = True

    @workflow.run
    async def run(self, inp: ClassInput) -> None:
        if inp.spec is not None:
            self.ledger = self.ledger.model_copy(update={"limits": inp.spec.limits})
        while True:
            try:
                await workflow.wait_condition(
                    lambda: self.dirty or (self.continuing and workflow.all_handlers_finished()), timeout=self.inp.resync_interval
                )
            except TimeoutError:
                pass
            self.dirty = False
            if self.validated_at is None or workflow.now() - self.validated_at >= REVALIDATE_INTERVAL:
                self.validate = True
            if self.inp.spec is None:
                await self._see_running_nodes()  # reservations of nodes closed by hand go too
                if not self.ledger.reservations:
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    return  # the class is gone and nothing holds its budget
                # Its nodes may hold their reservations for days: this run must not grow for ever.
                if continue_as_new_due(HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW):
                    self._continue_as_new_when_idle()
                continue
            await self._check_accounts(self.inp.spec)
            if self.validate:
                self.validate = False
                checked = await best_effort(
                    NodeClassActivities.validate_class, ValidateClassInput(name=self.inp.name, spec=self.inp.spec), summary="validate the class"
                )
                # A class that could not be checked is not valid yet: it grants nothing.
                self.problems = checked.value if checked.ok else [f"{checked.error}; retrying"]
                self.validated_at = workflow.now() if checked.ok else None
            await self._see_running_nodes()
            await self._write_status()
            if continue_as_new_due(HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW):
                self._continue_as_new_when_idle()

    def _continue_as_new_when_idle(self) -> None:
        """Continue as new unless a handler is still running. A `reserve` waits for this loop's
        validation and listing, so waiting for it here would stop both for good: the loop
        makes its next pass instead (at the latest after a resync interval) and comes back."""
        if workflow.all_handlers_finished():
            self._continue_as_new()
        self.continuing = True

    def _continue_as_new(self) -> None:
        carried = {"ledger": self.ledger, "problems": self.problems, "conditions": list(self.conditions.values()), "written": self.written}
        continue_as_new(self.inp.model_copy(update={**carried, "seen_at": self.seen_at, "validated_at": self.validated_at}))

    async def _see_running_nodes(self) -> None:
        """Reality check, once per resync: a node workflow of this class that runs without a
        reservation (a new run of this ledger after a crash or reset) gets one, so the limits
        count it; a reservation whose node workflow closed without releasing it (terminated
        by hand, timed out) is released."""
        now = workflow.now()
        if self.seen_at is not None and now - self.seen_at < self.inp.resync_interval:
            return
        # Only what differs from the reservations is recorded (ids in, changes out): a full
        # listing of 1,000 nodes was ~1 MB of history a minute.
        changed = await running_nodes_changed(f"TgpClass = '{self.inp.name}'", NODE_WORKFLOW_PREFIX, self.ledger.reservations)
        if not changed.ok:
            return
        self.seen_at = now
        if changed.value is None:
            return  # a server without visibility: nothing to rebuild from
        holds, stale = sighted(self.ledger, changed.value.unknown, changed.value.gone, now=now, grace=self.inp.reservation_grace)
        for r in holds:
            self._hold(r)
        if stale:
            closed = await best_effort(EntityActivities.closed_workflows, stale, summary="check closed nodes")
            for wid in closed.value or []:
                workflow.logger.info("releasing the reservation of %s: its workflow closed without releasing it", wid)
                self.release(wid)

    async def _check_accounts(self, spec: GPUNodeClassSpec) -> None:
        """Once a resync: a credentials Secret gone, an account blocked (tgp.class_status). A
        change validates the class again now (a Secret back clears InvalidSpec at once too)."""
        if self.accounts_at is not None and workflow.now() - self.accounts_at < self.inp.resync_interval:
            return
        found = await best_effort(NodeClassActivities.account_problems, ValidateClassInput(name=self.inp.name, spec=spec), summary="check the accounts")
        if found.ok:
            self.validate |= found.value != self.accounts
            self.accounts, self.accounts_at = found.value, workflow.now()

    async def _write_status(self) -> None:
        status, warning = class_status(
            generation=self.inp.generation, problems=self.problems, accounts=self.accounts, ledger=self.ledger, now=workflow.now(), previous=self.conditions
        )
        self.conditions = {c.type: c for c in status.conditions}
        ref = ObjectRef(kind="GPUNodeClass", name=self.inp.name, uid=self.inp.uid)
        if warning is not None:  # once, when it appears or changes
            await best_effort(EntityActivities.emit_events, [EventSpec(ref=ref, type="Warning", reason="CredentialsMissing", message=warning)], summary="write Events")
        # Transition times alone do not make a new status worth writing.
        unchanged = status.model_dump(mode="json", by_alias=True, exclude={"conditions": {"__all__": {"last_transition_time"}}})
        self.written = await write_status_once(
            StatusWrite(ref=ref, status=status.model_dump(mode="json", by_alias=True)),
            fingerprint=repr(unchanged),
            written=self.written,
            summary="write the class status",
            timeout=STATUS_TIMEOUT,
        )
