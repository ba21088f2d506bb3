"""The fleet look: each provider account's instances listed once per interval (workflows/fleet.py
runs it every FLEET_LOOK_EVERY), and the running nodes whose recorded instance the listing shows
interrupted, stopped, failed, terminated or missing told so (signal `instance_seen`,
tgp.types.InstanceSighting). Nothing is sent for an instance plainly running: a fleet at rest
costs one list call per account and one visibility listing per interval, and no request per
node. The node confirms with one describe of its own before it acts (lists lag).

What each node's instance is (its id, since when it surely exists, and which account holds it)
is learnt once per node life, when the look first finds the node Ready: from the listing's
search attributes (`TgpInstanceId` and `TgpReadySince`, upserted with the node's Ready phase),
or for a node begun by an older release one `status` query; and
for a class with its own credentials one read of its GPUNodeClass. It is kept in this process
(it does not change while the node lives; a new run is asked again) and dropped when the node
leaves the listing.

One list function serves the fleet look and the sweeper (`list_account`): both see an account
the same way, and its list age and failures are one metric (activities.listing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

import structlog
from pydantic import BaseModel, ConfigDict
from temporalio import activity
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.accounts import ProviderRegistry
from activities.kube.cluster import CustomResource, KubernetesCluster
from activities.listing import SIGHTINGS_SENT, list_account
from activities.termination import consistency_window
from activities.visibility import RUNNING_NODES, Listed, list_workflows
from tgp.crds import GROUP, VERSION, GPUNodeClassSpec
from tgp.errors import TgpError, TransientError
from tgp.fleet import WatchedNode, sightings
from tgp.pools import provider_credentials
from tgp.types import CredentialsRef, InstanceSighting, NodeStatus, Stage

log = structlog.get_logger("tgp.fleet")

# The nodes the look is for: past their launch and join (a node launching looks for itself).
WATCHED_NODES = f"{RUNNING_NODES} AND TgpPhase = 'Ready'"


def watched_nodes(task_queue: str | None) -> str:
    """The visibility query of the Ready node workflows on `task_queue` (None: on any)."""
    if task_queue is None:
        return WATCHED_NODES
    quoted = task_queue.replace("\\", "\\\\").replace("'", "\\'")
    return f"{WATCHED_NODES} AND TaskQueue = '{quoted}'"
INSTANCE_PREFIX = "tgp-"
# The search attributes `recorded_instance` reads, and those a node is learnt from (its
# instance, `_ready_since`, its class).
INSTANCE_KEYS = ("TgpNodeName", "TgpProvider", "TgpInstanceId")
LEARN_KEYS = (*INSTANCE_KEYS, "TgpReadySince", "TgpClass")
SIGNAL = "instance_seen"
# Status queries (and class reads) in flight at once while learning new nodes: after a worker
# restart every Ready node is new, and 1,000 queries one by one would hold the look for seconds.
LEARN_AT_ONCE = 16


class FleetLookInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    skip: list[str] = []  # accounts backing off after a failed listing (their keys, AccountLook.account)
    # The task queue whose node workflows are looked at (the look's own: one installation's
    # nodes, not another's sharing the namespace); None: every node workflow (looks before it).
    task_queue: str | None = None


class AccountLook(BaseModel):
    """One account's part of a look: listed (how many instances, how many nodes told), skipped
    (backing off), or failed (the error's type only: provider text stays out)."""

    model_config = ConfigDict(extra="forbid")
    account: str
    provider: str
    nodes: int = 0
    listed: int | None = None
    sent: int = 0
    skipped: bool = False
    failure: str | None = None
    retry_after: float | None = None


class FleetLookResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nodes: int = 0  # Ready node workflows listed
    unresolved: int = 0  # of which the look could not tell the instance or account this time
    accounts: list[AccountLook] = []

    @property
    def sent(self) -> int:
        return sum(a.sent for a in self.accounts)


def account_key(provider: str, credentials: CredentialsRef | None) -> str:
    """The account a node's instance is reached through, as the look and its metrics name it:
    the provider, and the class Secret key when the class brings its own (a reference, no key)."""
    if credentials is None:
        return provider
    return f"{provider}:{credentials.namespace}/{credentials.name}/{credentials.key}"


class _Known(BaseModel):
    """What the look learnt of a node once: its instance, and the account that holds it."""

    model_config = ConfigDict(frozen=True)
    node: WatchedNode
    credentials: CredentialsRef | None
    node_class: str | None = None


def _value(search_attributes: Mapping[str, object], key: str) -> object | None:
    values = search_attributes.get(key) or []
    return values[0] if isinstance(values, list) and values else None


def _first(search_attributes: Mapping[str, object], key: str) -> str | None:
    value = _value(search_attributes, key)
    return str(value) if value is not None else None


def recorded_instance(search_attributes: Mapping[str, object]) -> tuple[str, str, str] | None:
    """Node name, provider and instance id from a node's search attributes (TgpInstanceId is
    upserted with its phase from the launch on, in a life-v2 run), or None (an older run). The
    sweeper reads it too. TgpReadySince (`_ready_since`) comes with the Ready upsert."""
    found = tuple(_first(search_attributes, key) for key in INSTANCE_KEYS)
    return found if all(found) else None  # type: ignore[return-value]


def _ready_since(search_attributes: Mapping[str, object]) -> datetime | None:
    value = _value(search_attributes, "TgpReadySince")
    return value if isinstance(value, datetime) else None


def ready_since(status: NodeStatus, fallback: datetime) -> datetime:
    """When the node last entered Ready (its instance's create had ended by then)."""
    readies = [r.at for r in status.stages if r.stage is Stage.READY]
    return max(readies) if readies else fallback


class FleetActivities:
    def __init__(
        self,
        *,
        registry: ProviderRegistry,
        cluster: KubernetesCluster | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
    ) -> None:
        self.registry = registry
        self.cluster = cluster
        self.now = now
        # (workflow id, run id) -> what its node's instance is. By run: a run continued as new
        # is learnt again, so a workflow reset by hand is never judged by an old run.
        self._known: dict[tuple[str, str], _Known] = {}

    @activity.defn
    async def look_at_fleet(self, inp: FleetLookInput) -> FleetLookResult:
        """List each account that holds a Ready node's instance once (accounts in `inp.skip`
        wait), and tell every node whose recorded instance is not plainly running (tgp.fleet).
        A failed listing is reported per account (its error type), never raised: the other
        accounts are still looked at. Raises only when Temporal's visibility cannot be read."""
        client = activity.client()
        try:
            listed = [wf async for wf in list_workflows(client, watched_nodes(inp.task_queue))]
        except RPCError as exc:
            raise TransientError(f"could not list the running node workflows ({exc.status.name})") from None
        result = FleetLookResult(nodes=len(listed))
        present = {(wf.id, wf.run_id) for wf in listed}
        for gone in set(self._known) - present:
            del self._known[gone]
        # Nodes new to this process (all of them after a worker restart) are learnt a few at a time.
        classes: dict[str, asyncio.Task[dict[str, CredentialsRef] | None]] = {}
        gate = asyncio.Semaphore(LEARN_AT_ONCE)

        async def learn(wf: Listed) -> None:
            async with gate:
                known = await self._learn(client, wf.id, wf.attributes(LEARN_KEYS), classes)
            if known is not None:
                self._known[(wf.id, wf.run_id)] = known

        await asyncio.gather(*(learn(wf) for wf in listed if (wf.id, wf.run_id) not in self._known))
        groups: dict[str, tuple[str, CredentialsRef | None, list[WatchedNode]]] = {}
        owners: dict[str, set[str]] = {}  # account -> the classes of its nodes
        for wf in listed:
            known = self._known.get((wf.id, wf.run_id))
            if known is None:
                result.unresolved += 1
                continue
            key = account_key(known.node.provider, known.credentials)
            groups.setdefault(key, (known.node.provider, known.credentials, []))[2].append(known.node)
            if known.node_class:
                owners.setdefault(key, set()).add(known.node_class)
        skip = set(inp.skip)
        for key, (provider_name, credentials, nodes) in sorted(groups.items()):
            look = AccountLook(account=key, provider=provider_name, nodes=len(nodes), skipped=key in skip)
            result.accounts.append(look)
            if look.skipped:
                continue
            try:
                provider = await self.registry.get(provider_name, credentials)
                at = self.now()
                instances = await list_account(provider, INSTANCE_PREFIX, account=key)
            except TgpError as exc:
                look.failure, look.retry_after = type(exc).__name__, getattr(exc, "retry_after", None)
                log.warning("fleet_list_failed", account=key, provider=provider_name, error_type=look.failure, nodes=len(nodes))
                await self._tell_classes(sorted(owners.get(key, ())), provider_name, look.failure, len(nodes))
                continue
            look.listed = len(instances)
            told = sightings(instances, nodes, at=at, window=consistency_window(provider))
            look.sent = await self._tell(client, provider_name, told)
            activity.heartbeat(key)
        return result

    async def _learn(
        self,
        client: Client,
        workflow_id: str,
        search_attributes: Mapping[str, object],
        classes: dict[str, asyncio.Task[dict[str, CredentialsRef] | None]],
    ) -> _Known | None:
        """A node's instance and account, from its search attributes (else its `status` answer)
        and its class; None when it cannot be told now (no instance recorded yet, the node busy
        or closing, the class unreadable): the next look asks again."""
        recorded = recorded_instance(search_attributes)
        if recorded is not None:
            # Its Ready upsert carries the instance and when (life v2): no query, which would
            # replay a node workflow the worker's cache no longer holds (a thousand after a
            # restart). Without the time (a run between releases), Ready since at least now.
            node_name, provider_name, instance_id = recorded
            since = _ready_since(search_attributes) or self.now()
        else:
            try:
                status = await client.get_workflow_handle(workflow_id).query("status", result_type=NodeStatus)
            except Exception as exc:  # noqa: BLE001 - a node busy, closing or of an older shape: next look
                log.info("fleet_node_not_resolved", workflow_id=workflow_id, error_type=type(exc).__name__)
                return None
            if not status.instance_id or not status.provider:
                return None
            node_name, provider_name, instance_id = status.node_name, status.provider, status.instance_id
            since = ready_since(status, self.now())
        credentials: CredentialsRef | None = None
        klass = _first(search_attributes, "TgpClass")
        if klass:
            if klass not in classes:  # one read per class per look, shared by its new nodes
                classes[klass] = asyncio.ensure_future(self._class_credentials(klass))
            per_provider = await asyncio.shield(classes[klass])
            if per_provider is None:
                return None
            credentials = per_provider.get(provider_name)
        node = WatchedNode(workflow_id=workflow_id, node_name=node_name, provider=provider_name, instance_id=instance_id, since=since)
        return _Known(node=node, credentials=credentials, node_class=klass)

    async def _class_credentials(self, name: str) -> dict[str, CredentialsRef] | None:
        """Provider -> the class's credentialsRef (absent: the worker's own key); None when the
        class cannot be read (its nodes wait for the next look rather than be listed with the
        wrong key, which would show their instances missing)."""
        if self.cluster is None:
            return {}
        try:
            found = await self.cluster.get_custom(CustomResource(GROUP, VERSION, "gpunodeclasses", "GPUNodeClass", name))
            if found is None:
                return None
            return provider_credentials(GPUNodeClassSpec.model_validate(found.get("spec") or {}))
        except Exception as exc:  # noqa: BLE001 - unreadable now: the next look tries again
            log.warning("fleet_class_unreadable", node_class=name, error_type=type(exc).__name__)
            return None

    async def _tell_classes(self, classes: list[str], provider: str, failure: str, nodes: int) -> None:
        """A Warning Event `InstanceListFailed` on each class whose nodes the failed listing
        was for: its admin learns that their interruptions are noticed late, and why by error
        type only (the provider's text stays out). Best effort: the look goes on either way."""
        if self.cluster is None:
            return
        for klass in classes:
            message = (
                f"the fleet look could not list the {provider} instances of this class's account ({failure}); interruptions of "
                f"its {nodes} Ready node(s) there are noticed at the next listing that works (the account backs off meanwhile)"
            )
            try:
                await self.cluster.record_class_event(klass, type="Warning", reason="InstanceListFailed", message=message)
            except Exception as exc:  # noqa: BLE001 - a courtesy: the look must not fail for it
                log.warning("class_event_failed", node_class=klass, error_type=type(exc).__name__)

    async def _tell(self, client: Client, provider: str, told: Mapping[str, InstanceSighting]) -> int:
        """Signal each node its sighting; a node that closed meanwhile needs nothing."""
        sent = 0
        for workflow_id, sighting in sorted(told.items()):
            try:
                await client.get_workflow_handle(workflow_id).signal(SIGNAL, sighting)
            except RPCError as exc:
                if exc.status is not RPCStatusCode.NOT_FOUND:
                    log.warning("fleet_signal_failed", workflow_id=workflow_id, status=exc.status.name)
                continue
            sent += 1
            seen = "interrupted" if sighting.interrupted else (sighting.state.value.lower() if sighting.state else "missing")
            SIGHTINGS_SENT.labels(provider, seen).inc()
            log.info("instance_sighting_sent", workflow_id=workflow_id, provider=provider, instance_id=sighting.instance_id, seen=seen)
        return sent

    def all(self) -> list[object]:
        return [self.look_at_fleet]


__all__ = ["AccountLook", "FleetActivities", "FleetLookInput", "FleetLookResult", "account_key"]
