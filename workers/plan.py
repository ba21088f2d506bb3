"""`tgp plan`: what a pool would buy now (the offers ranked, and why each other one was not
chosen), its disruption plan (what consolidation would do, its savings, what holds each node
back). It reads the cluster through the same adapter as the bridge and the providers through
the worker's accounts; it says what to fix when the input is wrong (a `ConfigError`, exit status
2) and never prints a secret."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime, timedelta

from activities.accounts import ProviderRegistry
from activities.clouds.registry import providers_from_env
from activities.kube.cluster import CustomResource, KubernetesCluster
from activities.kube.summaries import node_summary_of
from tgp.capacity import OfferSize
from tgp.consolidation import ConsolidationNode, ConsolidationPlan, describe_plan, plan_consolidation
from tgp.crds import GROUP, VERSION, GPUNodeClass, GPUNodePool, GPUNodePoolStatus, format_duration
from tgp.demand import UnreadablePod, gpu_request
from tgp.disruption import pod_holds_node
from tgp.drift import COMPARED_KEYS, DRIFT_HASH_ANNOTATION, NodeFacts, drift_hash, drifted, unmet_requirements
from tgp.errors import ConfigError
from tgp.offers import rank_offers, rejection_reasons
from tgp.pools import offer_requirements
from tgp.types import LABEL_POOL, LABEL_POOL_NAMESPACE, LABEL_PROVIDER, Offer


def _cluster() -> KubernetesCluster:
    url = os.environ.get("TGP_KUBE_URL")
    return KubernetesCluster.from_url(url) if url else KubernetesCluster.from_kubeconfig(os.environ.get("KUBECONFIG"))


def _split(ref: str) -> tuple[str, str]:
    namespace, _, name = ref.rpartition("/")
    if not name:
        raise ConfigError(f"{ref!r}: expected NAMESPACE/NAME or NAME")
    return namespace or "default", name


async def plan(pool_ref: str | None, *, limit: int = 20) -> str:
    """Dry run for a GPUNodePool (or every pool): the offer a new node would get and why every
    other one would not be chosen, then what disruption would do now (drifted nodes to replace,
    underutilized nodes to remove, cheaper offers to move to) with the savings and what holds
    each back. Buys and disrupts nothing."""
    if pool_ref is not None:
        return await _plan_pool(pool_ref, limit=limit)
    async with _cluster() as cluster:
        pools = await cluster.list_custom(GROUP, VERSION, "gpunodepools")
    refs = sorted(f"{(p.get('metadata') or {}).get('namespace') or 'default'}/{(p.get('metadata') or {}).get('name')}" for p in pools)
    if not refs:
        return "No GPUNodePools (kubectl get gnp -A)."
    sections = []
    for ref in refs:
        try:
            sections.append(await _plan_pool(ref, limit=0))
        except ConfigError as exc:
            sections.append(f"Plan for GPUNodePool {ref}: {exc}")
    return "\n\n".join(sections)


async def _plan_pool(pool_ref: str, *, limit: int) -> str:
    namespace, name = _split(pool_ref)
    async with _cluster() as cluster:
        raw_pool = await cluster.get_custom(CustomResource(GROUP, VERSION, "gpunodepools", "GPUNodePool", name, namespace))
        if raw_pool is None:
            raise ConfigError(f"GPUNodePool {namespace}/{name} not found (kubectl get gnp -A lists them)")
        pool = GPUNodePool.model_validate(raw_pool)
        class_name = pool.spec.node_class_ref.name
        raw_class = await cluster.get_custom(CustomResource(GROUP, VERSION, "gpunodeclasses", "GPUNodeClass", class_name, None))
    if raw_class is None:
        raise ConfigError(f"GPUNodeClass {class_name} (spec.nodeClassRef of {namespace}/{name}) not found")
    klass = GPUNodeClass.model_validate(raw_class)
    req = offer_requirements(pool.spec, klass.spec)
    # The class's own accounts (providers[].credentialsRef, read from their Secrets), else the
    # keys in this environment: the offers the worker would see.
    providers = providers_from_env(os.environ, only=req.providers or None)
    names = sorted(set(providers) | set(req.credentials))
    if not names:
        raise ConfigError(
            f"none of the class's providers ({', '.join(req.providers)}) has credentials in this environment or a credentialsRef: "
            "set their API key variables (docs/providers.md), or `source .demo/env` for the demo"
        )
    async with _cluster() as cluster:
        registry = ProviderRegistry(cluster=cluster, env=os.environ, fallback=providers)

        async def offers_of(name: str) -> list[Offer]:
            return await (await registry.get(name, req.credentials.get(name))).list_offers()

        listed = await asyncio.gather(*(offers_of(n) for n in names), return_exceptions=True)
        await registry.aclose()
    for provider in providers.values():
        await provider.aclose()  # type: ignore[attr-defined]
    offers: list[Offer] = []
    lines = [f"Plan for GPUNodePool {namespace}/{name} (class {class_name}): nothing is bought.", ""]
    for n, result in zip(names, listed, strict=True):
        if isinstance(result, BaseException):
            lines.append(f"  provider {n}: could not list offers: {result}")
        else:
            offers.extend(result)
    ranked = rank_offers(offers, req)
    if ranked:
        best = ranked[0]
        lines.append(f"CHOSEN  {_describe(best)}")
    else:
        lines.append("CHOSEN  nothing: no offer meets the requirements (see the reasons below)")
    shown = 0
    for offer in ranked[1:]:
        if shown >= limit:
            break
        lines.append(f"  next  {_describe(offer)}  (more expensive, or later in the tie-break)")
        shown += 1
    rejected = sorted(((o, rejection_reasons(o, req)) for o in offers if o not in ranked), key=lambda x: (x[0].hourly_price, x[0].key))
    for offer, reasons in rejected[: max(limit - shown, 0)]:
        lines.append(f"  no    {_describe(offer)}  {'; '.join(reasons)}")
    hidden = len(ranked) - 1 - shown + max(len(rejected) - max(limit - shown, 0), 0)
    if hidden > 0:
        lines.append(f"  ... and {hidden} more (--limit)")
    async with _cluster() as cluster:
        lines += ["", *await _disruption_plan(cluster, pool, klass, ranked)]
    return "\n".join(lines)


async def _disruption_plan(cluster: KubernetesCluster, pool: GPUNodePool, klass: GPUNodeClass, ranked: list[Offer]) -> list[str]:
    """What disruption would do to the pool's Ready nodes now (tgp.consolidation over the
    cluster as it is and the offers just listed), and what holds each candidate back."""
    status = pool.status or GPUNodePoolStatus()
    now = datetime.now(UTC)
    nodes = await _consolidation_nodes(cluster, pool, klass, now)
    disruption = pool.spec.disruption
    result = plan_consolidation(
        nodes,
        _cheapest_sizes(ranked),
        disruption.consolidation_policy,
        disruption.budgets,
        now,
        disrupting=status.disrupting,
        min_nodes=pool.spec.min_nodes,
        min_gpus=offer_requirements(pool.spec, klass.spec).min_gpu_count,
    )
    return _disruption_lines(pool, status, len(nodes), result)


async def _consolidation_nodes(cluster: KubernetesCluster, pool: GPUNodePool, klass: GPUNodeClass, now: datetime) -> list[ConsolidationNode]:
    """The pool's Ready, schedulable Nodes as consolidation sees them, by name: price and age
    from the pool's status, pods and do-not-disrupt holders from the cluster, and drift."""
    namespace = pool.metadata.namespace or "default"
    selector = f"{LABEL_POOL}={pool.metadata.name},{LABEL_POOL_NAMESPACE}={namespace}"
    recorded = {n.name: n for n in (pool.status or GPUNodePoolStatus()).nodes}
    current_hash = drift_hash(klass.spec, pool.spec)
    nodes: list[ConsolidationNode] = []
    for obj in sorted(await cluster.list_objects("nodes", label_selector=selector), key=lambda o: (o.get("metadata") or {}).get("name") or ""):
        summary = node_summary_of(obj)
        if not summary.ready or summary.unschedulable:
            continue  # booting, or cordoned: being disrupted already
        meta = obj.get("metadata") or {}
        mine = recorded.get(summary.name)
        since = (mine.created_at if mine else None) or _timestamp(meta.get("creationTimestamp")) or now
        pods, pod_holders = await _pods_on(cluster, summary.name)
        holders = (["the Node"] if summary.do_not_disrupt else []) + pod_holders
        # The hash the node was made with, as its pool's status lists it (an annotation, if a
        # Node carries one, for Nodes the status does not list).
        recorded_hash = (mine.drift_hash if mine else None) or (meta.get("annotations") or {}).get(DRIFT_HASH_ANNOTATION)
        provider = summary.labels.get(LABEL_PROVIDER)
        nodes.append(
            ConsolidationNode(
                name=summary.name,
                gpus=summary.gpus,
                hourly_price=mine.hourly_price if mine else None,
                running_for=max(now - since, timedelta(0)),
                pods=pods,
                do_not_disrupt=bool(holders),
                holders=holders,
                drifted=drifted(recorded_hash, drift_hash(klass.spec, pool.spec, provider) if provider else current_hash)
                or bool(unmet_requirements(_facts(summary.labels, summary.gpus), klass.spec, pool.spec)),
            )
        )
    return nodes


async def _pods_on(cluster: KubernetesCluster, node: str) -> tuple[dict[str, int], list[str]]:
    """The GPUs each unfinished pod on `node` requests (namespace/name -> GPUs; pods with none
    left out), and the pods that hold the node (do-not-disrupt)."""
    pods: dict[str, int] = {}
    holders: list[str] = []
    for pod in await cluster.list_objects("pods", field_selector=f"spec.nodeName={node}"):
        pmeta, phase = pod.get("metadata") or {}, (pod.get("status") or {}).get("phase") or "Pending"
        if phase in ("Succeeded", "Failed"):
            continue
        key = f"{pmeta.get('namespace')}/{pmeta.get('name')}"
        if pod_holds_node(pmeta.get("annotations"), phase, bool(pmeta.get("deletionTimestamp"))):
            holders.append(key)
        try:
            gpus = gpu_request(pod)
        except (UnreadablePod, ValueError, TypeError):
            gpus = 0
        if gpus:
            pods[key] = gpus
    return pods, holders


def _cheapest_sizes(ranked: list[Offer]) -> list[OfferSize] | None:
    """The cheapest offer of each GPU count, fewest GPUs first; None when there are no offers."""
    sizes: dict[int, OfferSize] = {}
    for o in sorted(ranked, key=lambda o: o.hourly_price):
        sizes.setdefault(o.gpu_count, OfferSize(gpu_count=o.gpu_count, hourly_price=o.hourly_price))
    return [sizes[c] for c in sorted(sizes)] if sizes else None


def _disruption_lines(pool: GPUNodePool, status: GPUNodePoolStatus, ready: int, result: ConsolidationPlan) -> list[str]:
    """The plan's section of `tgp plan`: the pool's consolidation and budgets, then the plan."""
    disruption = pool.spec.disruption
    policy = disruption.consolidation_policy
    how = (
        f"{policy.policy}, cheaperBy {policy.cheaper_by}, after {format_duration(policy.after)}"
        if policy is not None
        else "off (spec.disruption.consolidation); drift only"
    )
    budgets = "; ".join(b.describe() for b in disruption.budgets) or "none (no limit)"
    lines = [
        f"DISRUPTION now ({ready} Ready node(s), {status.disrupting} disrupting; this command disrupts nothing)",
        f"  consolidation: {how}",
        f"  budgets: {budgets}",
    ]
    shown = describe_plan(result)
    lines += [f"  {line}" for line in shown] or ["  nothing to do"]
    if status.consolidation and status.consolidation.consolidating:
        lines.append(f"  under way: {status.consolidation.consolidating}")
    lines.append(f"  savings found: ${result.savings}/h" + (f" (made so far: ${status.consolidation.savings_made_hourly}/h)" if status.consolidation else ""))
    return lines


def _facts(labels: dict[str, str], gpus: int) -> NodeFacts:
    """What drift compares of a Node, from the Node itself (whether it is spot, a Node does not say)."""
    return NodeFacts(labels={k: v for k, v in labels.items() if k in COMPARED_KEYS}, gpus=gpus or None)


def _timestamp(value: object) -> datetime | None:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")) if value else None
    except ValueError:
        return None


def _describe(o: Offer) -> str:
    spot = " spot" if o.spot else ""
    return f"{o.provider:<11} {o.gpu_type} x{o.gpu_count:<2} {o.region:<14} ${o.hourly_price}/h{spot}"
