"""Activities of the pool workflow (GPUNodePool): starting node workflows (after the class
ledger grants the slot), evicting them, checking offers, and letting the pool go."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import structlog
from temporalio import activity
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities import metrics
from activities.accounts import AccountActivities
from activities.entity import resource
from activities.errors import temporal_errors
from activities.ledger import ledger_batch, ledger_update
from activities.search_attributes import start_attributes
from activities.offer_cache import Listing
from activities.offer_choice import choose
from tgp.capacity import OfferSize
from tgp.crds import FINALIZER
from tgp.errors import TransientError
from tgp.messages import EvictNodesInput, ObjectRef, OfferCheck, Reservation, StartNodeInput, StartNodeResult, StartNodesInput, StartNodesResult
from tgp.node import NodeWorkflowInput
from tgp.pools import request_for
from tgp.offers import offer_satisfies
from tgp.types import NodeRequest, Offer, OfferChoice, OfferRequirements

log = structlog.get_logger("tgp.pool")

# Node workflows a batch starts at once: enough that a few hundred starts take seconds, few
# enough not to queue the Temporal frontend behind one pool.
START_CONCURRENCY = 25
# A start's choice of a node's first offer (`_offered`) takes at most this long: a cold listing
# behind a provider's pacer leaves the choice to the node instead of holding the starts.
FIRST_OFFER_TIMEOUT = timedelta(seconds=5)


class PoolActivities(AccountActivities):
    @activity.defn
    async def reserve_and_start_node(self, inp: StartNodeInput) -> StartNodeResult:
        """Reserve a slot in the class budget, then start the node workflow (idempotent: a
        retried call finds the same reservation and the same running workflow)."""
        client = activity.client()
        grant = await ledger_update(inp.class_name, "reserve", inp.reservation)
        if not grant.granted:
            return StartNodeResult(started=False, reason=grant.reason)
        await _start_node_workflow(client, await self._offered(inp.request.model_copy(update={"reserved_price": inp.reservation.hourly_price})))
        return StartNodeResult(started=True)

    @activity.defn
    async def reserve_and_start_nodes(self, inp: StartNodesInput) -> StartNodesResult:
        """A pool's launches of one pass: one `reserve_many` call to the class ledger (it grants
        what fits its budget and says why for the rest), then every granted node workflow
        started, concurrently. Idempotent like `reserve_and_start_node`: a retried call finds
        the same reservations and the same running workflows."""
        client = activity.client()
        requests = [request_for(inp.template, s) for s in inp.starts]
        reservations = [Reservation(node_id=r.workflow_id, pool=inp.pool, hourly_price=s.hourly_price) for r, s in zip(requests, inp.starts, strict=True)]
        grants = await ledger_batch(inp.class_name, "reserve_many", reservations)
        gate = asyncio.Semaphore(START_CONCURRENCY)
        choices: dict[str, asyncio.Future[OfferChoice]] = {}

        async def start(request: NodeRequest, granted: bool) -> str:
            """"" when started (or it ran already), else why its start failed."""
            if not granted:
                return ""
            async with gate:
                try:
                    await _start_node_workflow(client, await self._offered(request, choices))
                except Exception as exc:  # noqa: BLE001 - reported per start: the others did start
                    log.warning("node_start_failed", workflow_id=request.workflow_id, error=str(exc)[:300])
                    return f"starting its workflow failed ({type(exc).__name__}); retried with the same id"
            return ""

        # One start failing (an RPC error, maybe after the server took it) must not fail the
        # batch: the pool would not know which of the others started. Each start says.
        failed = await asyncio.gather(*(start(r, g.granted) for r, g in zip(requests, grants, strict=True)))
        return StartNodesResult(
            results=[
                StartNodeResult(started=False, reason=why, unsettled=True) if why else StartNodeResult(started=g.granted, reason=g.reason)
                for g, why in zip(grants, failed, strict=True)
            ]
        )

    async def _offered(self, request: NodeRequest, choices: dict[str, asyncio.Future[OfferChoice]] | None = None) -> NodeRequest:
        """`request` with its first offer chosen, as the node's own `select_offer` would now:
        the node starts Launching. One choice per requirements in `choices` (a batch's nodes
        share them), within FIRST_OFFER_TIMEOUT. Where the choice fails, takes longer or finds
        nothing, the node chooses (its retries, its message)."""
        choices = {} if choices is None else choices
        key = request.requirements.model_dump_json()
        if key not in choices:
            choices[key] = asyncio.ensure_future(asyncio.wait_for(choose(self.registry, request.requirements), FIRST_OFFER_TIMEOUT.total_seconds()))
        try:
            choice = await choices[key]
        except Exception as exc:  # noqa: BLE001 - the node's own choice says what went wrong
            log.info("first_offer_left_to_the_node", workflow_id=request.workflow_id, error=type(exc).__name__)
            return request
        return request if choice.offer is None else request.model_copy(update={"offer": choice.offer})

    @activity.defn
    async def evict_nodes(self, inp: EvictNodesInput) -> list[str]:
        """Ask node workflows to drain and terminate (pool deleted). Returns the ids whose
        workflow is closed (nothing left to evict). A start that may still happen is started
        with the evict (signal-with-start, the same id): it ends at once, buying nothing, and a
        late start of it is refused (REJECT_DUPLICATE) instead of buying after the pool is gone."""
        client = activity.client()
        evict = {"reason": "pool deleted"}

        async def signal(wid: str) -> str | None:
            try:
                await client.get_workflow_handle(wid).signal("evict", evict)
            except RPCError as exc:
                if exc.status is not RPCStatusCode.NOT_FOUND:
                    raise
                return wid
            return None

        async def prevent(request: NodeRequest) -> str | None:
            try:
                await _start_node_workflow(client, request, start_signal=("evict", evict))
            except WorkflowAlreadyStartedError:
                return request.workflow_id  # it ran and closed: nothing left of it
            return None

        ended = await asyncio.gather(*(signal(w) for w in inp.workflow_ids), *(prevent(r) for r in inp.may_start))
        return [w for w in ended if w is not None]

    @activity.defn
    async def remove_finalizer(self, ref: ObjectRef) -> None:
        """The pool's nodes are gone: let Kubernetes delete the pool."""
        with temporal_errors():
            await self.cluster.set_finalizer(resource(ref), FINALIZER, present=False)

    @activity.defn
    async def check_offers(self, req: OfferRequirements) -> OfferCheck:
        """Is there any offer for these requirements, and what is the cheapest with and
        without the price cap (to tell a user their maxHourlyPrice is below every offer), and
        per GPU count (what the pool sizes its nodes from)?"""
        names = [n for n in req.providers or sorted(self.providers) if n in self.providers or n in req.credentials]

        async def offers_of(name: str) -> Listing:
            # The class's account when it names one (its Secret read now), else the worker's;
            # from the pricing cache the node selections of this worker read too.
            ref = req.credentials.get(name)
            return await self.registry.list_offers(self.providers[name] if ref is None else await self.registry.get(name, ref))

        # One provider failing (a rotated key, an inactive account, an outage, a missing
        # Secret) must not hide the others' offers; it is named in the result instead.
        listed = await asyncio.gather(*(offers_of(n) for n in names), return_exceptions=True)
        offers, failed, stale = [], {}, {}
        for name, result in zip(names, listed, strict=True):
            if isinstance(result, BaseException):
                failed[name] = str(result)[:300]
                log.warning("offers_unavailable", provider=name, error=str(result))
            else:
                if result.stale:
                    stale[name] = f"offers listed {result.age:.0f}s ago; listing them again failed: {result.error}"[:300]
                    log.warning("offers_stale", provider=name, age_seconds=round(result.age), error=result.error)
                offers.extend(result.offers)
        if names and len(failed) == len(names):
            with temporal_errors():
                raise TransientError(f"no provider could list offers: {'; '.join(f'{n}: {m}' for n, m in failed.items())}")
        uncapped = req.model_copy(update={"max_hourly_price": None})
        matching = sorted((o for o in offers if offer_satisfies(o, req)), key=lambda o: o.hourly_price)
        any_price = sorted((o for o in offers if offer_satisfies(o, uncapped)), key=lambda o: o.hourly_price)
        best = any_price[0] if any_price else None
        # Demand by fit sizes each node from these: per GPU count, the price a node asking for
        # that many GPUs is bought at (matching offers are cheapest first).
        sizes: dict[int, OfferSize] = {}
        for o in matching:
            sizes.setdefault(o.gpu_count, OfferSize(gpu_count=o.gpu_count, hourly_price=o.hourly_price))
        return OfferCheck(
            sizes=[sizes[count] for count in sorted(sizes)],
            matching=len(matching),
            cheapest=matching[0].hourly_price if matching else None,
            cheapest_any_price=best.hourly_price if best else None,
            cheapest_description=f"{best.gpu_type} on {best.provider} in {best.region}" if best else "",
            failed=failed,
            stale=stale,
        )

    def all(self) -> list[object]:
        return [self.reserve_and_start_node, self.reserve_and_start_nodes, self.evict_nodes, self.remove_finalizer, self.check_offers]


async def _start_node_workflow(client: Client, request: NodeRequest, *, start_signal: tuple[str, object] | None = None) -> None:
    """Start the node's workflow on this worker's task queue; one that runs or ran already is
    left as it is (a retried start after the node lived and ended must not buy it again).
    `start_signal`: sent with the start (to a running one, sent to it); then a run that ran
    already raises WorkflowAlreadyStartedError, for the caller to count it closed."""
    signal: dict[str, Any] = {"start_signal": start_signal[0], "start_signal_args": [start_signal[1]]} if start_signal else {}
    try:
        await client.start_workflow(
            "GPUNodeWorkflow",
            NodeWorkflowInput(request=request),
            id=request.workflow_id,
            task_queue=activity.info().task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            static_summary=f"GPU node {request.node_name} (pool {request.namespace}/{request.pool})",
            search_attributes=start_attributes(request),
            **signal,
        )
    except WorkflowAlreadyStartedError:
        if start_signal is not None:
            raise
        # it ran (and reported to the pool) already
