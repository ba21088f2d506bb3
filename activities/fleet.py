"""Activities of the pool and class workflows: the budget ledger calls, starting and evicting
node workflows, status and Events on the custom resources, offer checks, class validation."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from decimal import Decimal

import structlog
from pydantic import BaseModel, ConfigDict
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.kube.cluster import CustomResource, KubernetesCluster
from activities.node import temporal_errors
from activities.boot.render import JOIN_VARIABLES, BootSettings, check_template, class_check_settings, default_template, shipped_template, template_uses
from activities.ports import CloudProvider
from activities.accounts import ProviderRegistry
from activities import metrics
from tgp.capabilities import capability_problems
from tgp.crds import GROUP, VERSION, GPUNodeClassSpec
from tgp.messages import Grant, NodeSighting, ObjectRef, OfferCheck, Reservation, StartNodeInput, StartNodeResult
from tgp.errors import TransientError
from tgp.offers import offer_satisfies
from tgp.types import CredentialsRef, NodePhase, NodeRequest, Offer, OfferRequirements

log = structlog.get_logger("tgp.fleet")

FINALIZER = "tgp.io/nodes-terminated"
_PLURALS = {"GPUNodePool": "gpunodepools", "GPUNodeClass": "gpunodeclasses"}


class StatusWrite(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ref: ObjectRef
    status: dict[str, object]


class EventSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ref: ObjectRef
    type: str = "Normal"
    reason: str
    message: str


class LedgerCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    class_workflow_id: str
    reservation: Reservation


class ValidateClassInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    spec: GPUNodeClassSpec
    operator_namespace: str = "tgp-system"


async def _template_problems(field: str, template: str, settings: BootSettings | None = None) -> list[str]:
    """A class template's problems, each naming `field`. check_template reports rather than
    raises; anything it still raises is a problem of the class too, never a failed activity
    (which would leave the class without a status)."""
    try:
        problems = await asyncio.to_thread(check_template, template, settings)
    except Exception as exc:  # noqa: BLE001
        problems = [f"could not be checked ({type(exc).__name__}: {str(exc)[:300]})"]
    return [f"{field}: {m}" for m in problems]


async def boot_problems(spec: GPUNodeClassSpec, payload_kinds: Mapping[str, list[str]]) -> list[str]:
    """The problems of the template each node of the class would boot with: the class's own,
    else the shipped default for each provider's boot payload kind (`payload_kinds`: kind ->
    providers), trial-rendered with the class's settings, so a class whose every node would
    fail at launch is not Ready."""
    settings = class_check_settings(
        kubernetes_version=spec.kubernetes_version,
        login_server=spec.tailscale_config.login_server,
        tags=spec.tailscale_config.tags,
        accept_routes=spec.tailscale_config.accept_routes,
    )
    problems: list[str] = []
    templates: list[tuple[str, str]] = []  # (what, text)
    if spec.talos_config is not None:
        templates.append(("talosConfig.machineConfigTemplate", spec.talos_config.machine_config_template))
    elif spec.bootstrap_template is not None:
        templates.append(("bootstrapTemplate", spec.bootstrap_template))
    else:
        for kind, names in sorted(payload_kinds.items()):
            default = default_template(kind)
            which = f"provider{'s' if len(names) > 1 else ''} {', '.join(names)}"
            if default is None:
                if kind != "env":  # env: the built-in payload, no template
                    problems.append(
                        f"bootstrapTemplate: {which} boot{'s' if len(names) == 1 else ''} with a {kind} payload and tgp ships no "
                        "default template for it; "
                        "set bootstrapTemplate (see docs/bootstrap.md)"
                    )
                continue
            text = shipped_template(default)
            if spec.kubernetes_version is None and "KubernetesVersion" in template_uses(text):
                problems.append(
                    f"kubernetesVersion: the default Ubuntu boot template ({default}, used by {which} without a "
                    "bootstrapTemplate) needs it; set it to the control plane's version, e.g. 1.34.1"
                )
                settings = settings.model_copy(update={"kubernetes_version": "1.34.1"})  # check the rest all the same
            templates.append((f"the default boot template {default} (used by {which})", text))
    for what, text in templates:
        problems += await _template_problems(what, text, settings)
        try:
            join = template_uses(text) & JOIN_VARIABLES
        except Exception:  # noqa: BLE001 - a template that does not parse is reported above
            join = set()
        if join and not spec.join_secret_ref:
            problems.append(
                f"joinSecretRef: {what} uses the cluster join material ({', '.join(sorted(join))}) but the class sets "
                "no joinSecretRef; create the join Secret and reference it (see docs/bootstrap.md)"
            )
    return problems


def _resource(ref: ObjectRef) -> CustomResource:
    return CustomResource(GROUP, VERSION, _PLURALS[ref.kind], ref.kind, ref.name, ref.namespace, ref.uid)


class FleetActivities:
    def __init__(
        self,
        *,
        cluster: KubernetesCluster,
        providers: Mapping[str, CloudProvider],
        task_queue: str | None = None,
        registry: ProviderRegistry | None = None,
    ) -> None:
        self.cluster = cluster
        self.providers = dict(providers)
        self.task_queue = task_queue
        # Adapters per class account (providers[].credentialsRef); `providers` is the fallback.
        self.registry = registry or ProviderRegistry(cluster=cluster, fallback=self.providers)

    # --- node workflows and the class ledger ---------------------------------------------

    @activity.defn
    async def reserve_and_start_node(self, inp: StartNodeInput) -> StartNodeResult:
        """Reserve a slot in the class budget, then start the node workflow (idempotent: a
        retried call finds the same reservation and the same running workflow)."""
        client = activity.client()
        grant = await self._ledger_update(inp.class_name, "reserve", inp.reservation)
        if not grant.granted:
            return StartNodeResult(started=False, reason=grant.reason)
        request = NodeRequest.model_validate_json(inp.request_json)
        from workflows.node import NodeWorkflowInput  # the input type; workflows import nothing from here

        try:
            await client.start_workflow(
                "GPUNodeWorkflow",
                NodeWorkflowInput(request=request),
                id=request.workflow_id,
                task_queue=self.task_queue or activity.info().task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                # A retried start after the node already lived and ended must not buy it again.
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                static_summary=inp.static_summary or f"GPU node {request.node_name} (pool {request.namespace}/{request.pool})",
            )
        except WorkflowAlreadyStartedError:
            pass  # it ran (and reported to the pool) already
        return StartNodeResult(started=True)

    @activity.defn
    async def settle_reservation(self, call: LedgerCall) -> Grant:
        """Tell the class ledger the price a node is about to pay; it may refuse."""
        return await self._ledger_update(call.class_workflow_id, "settle", call.reservation)

    @activity.defn
    async def release_reservation(self, call: LedgerCall) -> None:
        """Give the node's slot and $/h back to the class budget."""
        try:
            await activity.client().get_workflow_handle(call.class_workflow_id).execute_update("release", call.reservation.node_id)
        except RPCError as exc:
            if exc.status is not RPCStatusCode.NOT_FOUND:
                raise
            log.info("ledger_gone", class_workflow_id=call.class_workflow_id)  # nothing left to release

    async def _ledger_update(self, class_workflow_id: str, name: str, reservation: Reservation) -> Grant:
        try:
            return await activity.client().get_workflow_handle(class_workflow_id).execute_update(name, reservation, result_type=Grant)
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                return Grant(granted=False, reason=f"the class ledger {class_workflow_id} is not running (is the GPUNodeClass applied?)")
            raise
        except WorkflowUpdateFailedError as exc:
            return Grant(granted=False, reason=str(exc.cause or exc))

    @activity.defn
    async def evict_nodes(self, workflow_ids: list[str]) -> list[str]:
        """Ask node workflows to drain and terminate (pool deleted). Returns the ids whose
        workflow is already closed (nothing left to evict)."""
        client = activity.client()

        async def evict(wid: str) -> str | None:
            try:
                await client.get_workflow_handle(wid).signal("evict", {"reason": "pool deleted"})
            except RPCError as exc:
                if exc.status is not RPCStatusCode.NOT_FOUND:
                    raise
                return wid
            return None

        return [w for w in await asyncio.gather(*(evict(w) for w in workflow_ids)) if w is not None]

    @activity.defn
    async def running_nodes(self, query: str) -> list[NodeSighting] | None:
        """Running node workflows matching `query` (a visibility filter on tgp's search
        attributes, e.g. `TgpPool = 'ml/rtx'`): what a pool or class rebuilds its state from.
        None when this Temporal server has no visibility API at all (the time-skipping test
        server): there is nothing to rebuild from, and waiting for it would stall for ever."""
        client = activity.client()
        found: list[NodeSighting] = []
        visibility = f"WorkflowType = 'GPUNodeWorkflow' AND ExecutionStatus = 'Running' AND {query}"
        try:
            listing = [wf async for wf in client.list_workflows(visibility)]
        except RPCError as exc:
            if exc.status is RPCStatusCode.UNIMPLEMENTED:
                return None
            raise
        for wf in listing:
            sa = wf.search_attributes or {}
            phase = (sa.get("TgpPhase") or [None])[0]
            price = (sa.get("TgpHourlyPrice") or [None])[0]
            found.append(
                NodeSighting(
                    workflow_id=wf.id,
                    node_name=(sa.get("TgpNodeName") or [""])[0],
                    phase=NodePhase(phase) if phase in NodePhase._value2member_map_ else None,
                    provider=(sa.get("TgpProvider") or [None])[0],
                    hourly_price=Decimal(str(price)) if price is not None else None,
                    started_at=wf.start_time,
                )
            )
        return found

    @activity.defn
    async def closed_workflows(self, workflow_ids: list[str]) -> list[str]:
        """Those of `workflow_ids` whose latest run is closed or that never existed (read from
        the workflows themselves, not from eventually consistent visibility)."""
        client = activity.client()

        async def closed(wid: str) -> str | None:
            try:
                desc = await client.get_workflow_handle(wid).describe()
            except RPCError as exc:
                if exc.status is not RPCStatusCode.NOT_FOUND:
                    raise
                return wid
            return None if desc.status is WorkflowExecutionStatus.RUNNING else wid

        return [w for w in await asyncio.gather(*(closed(w) for w in workflow_ids)) if w is not None]

    # --- Kubernetes objects ---------------------------------------------------------------

    @activity.defn
    async def write_status(self, write: StatusWrite) -> bool:
        """Patch the status subresource; False when the object is gone."""
        with temporal_errors():
            return await self.cluster.patch_custom_status(_resource(write.ref), write.status)

    @activity.defn
    async def emit_events(self, events: list[EventSpec]) -> None:
        with temporal_errors():
            for e in events:
                await self.cluster.create_event(_resource(e.ref), type=e.type, reason=e.reason, message=e.message)

    @activity.defn
    async def remove_finalizer(self, ref: ObjectRef) -> None:
        """The pool's nodes are gone: let Kubernetes delete the pool."""
        with temporal_errors():
            await self.cluster.set_finalizer(_resource(ref), FINALIZER, present=False)

    # --- checks -----------------------------------------------------------------------------

    @activity.defn
    async def check_offers(self, req: OfferRequirements) -> OfferCheck:
        """Is there any offer for these requirements, and what is the cheapest with and
        without the price cap? Used to tell a user their maxHourlyPrice is below every offer."""
        names = [n for n in req.providers or sorted(self.providers) if n in self.providers or n in req.credentials]

        async def offers_of(name: str) -> list[Offer]:
            # The class's account when it names one (its Secret read now), else the worker's.
            ref = req.credentials.get(name)
            return await (self.providers[name] if ref is None else await self.registry.get(name, ref)).list_offers()

        # One provider failing (a rotated key, an inactive account, an outage, a missing
        # Secret) must not hide the others' offers; it is named in the result instead.
        listed = await asyncio.gather(*(offers_of(n) for n in names), return_exceptions=True)
        offers, failed = [], {}
        for name, result in zip(names, listed, strict=True):
            if isinstance(result, BaseException):
                failed[name] = str(result)[:300]
                log.warning("offers_unavailable", provider=name, error=str(result))
            else:
                metrics.OFFER_AGES.listed(name)
                offers.extend(result)
        if names and len(failed) == len(names):
            with temporal_errors():
                raise TransientError(f"no provider could list offers: {'; '.join(f'{n}: {m}' for n, m in failed.items())}")
        uncapped = req.model_copy(update={"max_hourly_price": None})
        matching = sorted((o for o in offers if offer_satisfies(o, req)), key=lambda o: o.hourly_price)
        any_price = sorted((o for o in offers if offer_satisfies(o, uncapped)), key=lambda o: o.hourly_price)
        best = any_price[0] if any_price else None
        return OfferCheck(
            matching=len(matching),
            cheapest=matching[0].hourly_price if matching else None,
            cheapest_any_price=best.hourly_price if best else None,
            cheapest_description=f"{best.gpu_type} on {best.provider} in {best.region}" if best else "",
            failed=failed,
        )

    @activity.defn
    async def validate_class(self, inp: ValidateClassInput) -> list[str]:
        """What is wrong with a GPUNodeClass, each problem saying what to fix. Reads the Secrets
        it references (never returning their contents)."""
        problems: list[str] = []
        payload_kinds: dict[str, list[str]] = {}
        with temporal_errors():
            for p in inp.spec.providers:
                if not p.enabled:
                    continue
                if p.name not in self.providers and p.credentials_ref is None:
                    problems.append(f"provider {p.name} has no credentialsRef and is not configured on the worker")
                ref = None
                if p.credentials_ref is not None:
                    ns = p.credentials_ref.namespace or inp.operator_namespace
                    found = await self._check_secret_key(ns, p.credentials_ref.name, p.credentials_ref.key, f"providers[{p.name}].credentialsRef")
                    problems += found
                    if not found:
                        ref = CredentialsRef(namespace=ns, name=p.credentials_ref.name, key=p.credentials_ref.key)
                # What the adapter nodes of this class would use can do (a Vast.ai adapter with
                # VAST_VM=true rents VMs), else the provider's table entry.
                caps = await self.registry.capabilities(p.name, ref)
                if caps is not None:
                    # spotAllowed permits spot, it does not require it: only node-ness and Talos matter.
                    problems += capability_problems(p.name, caps, wants_talos=inp.spec.talos_config is not None, wants_spot=False)
                    payload_kinds.setdefault(caps.boot_payload, []).append(p.name)
            # The template every node would boot with, the shipped default included. Off the
            # event loop: a check renders in a child process for up to a few seconds.
            problems += await boot_problems(inp.spec, payload_kinds)
            ts = inp.spec.tailscale_config
            if ts.oauth_secret_ref:
                keys = ("api-key",) if ts.login_server else ("client-id", "client-secret")
                for key in keys:
                    problems += await self._check_secret_key(inp.operator_namespace, ts.oauth_secret_ref, key, "tailscaleConfig.oauthSecretRef")
        return problems

    async def _check_secret_key(self, namespace: str, name: str, key: str, field: str) -> list[str]:
        data = await self.cluster.read_secret(namespace, name)
        if data is None:
            return [f"{field}: Secret {namespace}/{name} does not exist; create it or fix the reference"]
        if key not in data:
            return [f"{field}: Secret {namespace}/{name} has no key {key!r} (keys: {', '.join(sorted(data)) or 'none'})"]
        return []

    def all(self) -> list[object]:
        return [
            self.reserve_and_start_node,
            self.settle_reservation,
            self.release_reservation,
            self.evict_nodes,
            self.write_status,
            self.emit_events,
            self.remove_finalizer,
            self.check_offers,
            self.validate_class,
            self.running_nodes,
            self.closed_workflows,
        ]

