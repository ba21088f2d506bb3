"""From a GPUNodePool and its GPUNodeClass to what one node needs. Pure, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec
from tgp.drift import drift_hash
from tgp.messages import NodeStart, class_workflow_id, pool_workflow_id
from tgp.types import (
    LABEL_GPU_TYPE,
    LABEL_REGION,
    OPERATOR_NAMESPACE,
    BootConfig,
    CredentialsRef,
    LifecycleTimeouts,
    NodeRequest,
    OfferRequirements,
    TailnetRef,
    TimeoutsUpdate,
)


def _intersect(a: list[str], b: list[str] | None) -> list[str]:
    if b is None:
        return list(a)
    if not a:
        return list(b)
    return [x for x in a if x in b]


def offer_requirements(pool: GPUNodePoolSpec, klass: GPUNodeClassSpec) -> OfferRequirements:
    """The class's instance requirements narrowed by the pool's requirements and price cap.

    An intersection that comes out empty is kept as an impossible value, so the offer check
    reports "no offer" instead of silently allowing anything.
    """
    ir = klass.instance_requirements
    gpus = _intersect(ir.gpu_types, pool.gpu_types)
    regions = _intersect(ir.regions, pool.regions)
    if (ir.gpu_types or pool.gpu_types is not None) and not gpus:
        gpus = ["(none: the class and pool GPU types do not overlap)"]
    if (ir.regions or pool.regions is not None) and not regions:
        regions = ["(none: the class and pool regions do not overlap)"]
    enabled = sorted((p for p in klass.providers if p.enabled), key=lambda p: p.priority)
    return OfferRequirements(
        gpu_types=[g for g in gpus if g not in pool.excluded(LABEL_GPU_TYPE)],
        regions=[r for r in regions if r not in pool.excluded(LABEL_REGION)],
        providers=[p.name for p in enabled],
        provider_priority={p.name: p.priority for p in enabled},
        credentials=provider_credentials(klass),
        min_gpu_count=ir.min_gpu_count,
        max_hourly_price=pool.max_hourly_price,
        allow_spot=ir.spot_allowed,
    )


def provider_credentials(klass: GPUNodeClassSpec) -> dict[str, CredentialsRef]:
    """Provider -> the Secret key its class buys with (references only; the key is read by the
    activities). A provider without credentialsRef is absent: it uses the worker's own key."""
    return {
        p.name: CredentialsRef(
            namespace=p.credentials_ref.namespace or OPERATOR_NAMESPACE, name=p.credentials_ref.name, key=p.credentials_ref.key
        )
        for p in klass.providers
        if p.enabled and p.credentials_ref is not None
    }


def tailnet_ref(klass: GPUNodeClassSpec) -> TailnetRef | None:
    """The class's own tailnet credentials Secret (tailscaleConfig.oauthSecretRef, in the
    operator's namespace), or None: the worker's own tailnet."""
    ts = klass.tailscale_config
    return TailnetRef(name=ts.oauth_secret_ref, login_server=ts.login_server) if ts.oauth_secret_ref else None


def boot_config(klass: GPUNodeClassSpec, name: str = "") -> BootConfig:
    """The class's (called `name`) boot template and the reference to its join Secret (no
    secret values)."""
    talos = klass.talos_config
    return BootConfig(
        template=talos.machine_config_template if talos else klass.bootstrap_template,
        join_secret=f"{OPERATOR_NAMESPACE}/{klass.join_secret_ref}" if klass.join_secret_ref else None,
        login_server=klass.tailscale_config.login_server,
        talos_image=talos.image if talos else "",
        kubernetes_version=klass.kubernetes_version,
        accept_routes=klass.tailscale_config.accept_routes,
        ephemeral=klass.tailscale_config.ephemeral,
        node_class=name,
    )


def node_timeouts(pool: GPUNodePoolSpec, *, floor: bool) -> TimeoutsUpdate:
    """The pool's disruption settings for one node. A `floor` node keeps the pool at its
    minNodes and never idles out (it would only be replaced at once)."""
    d = pool.disruption
    return TimeoutsUpdate(idle=None if floor else d.idle, drain=d.drain_timeout, expire_after=d.expiry)


def node_request(
    *,
    namespace: str,
    pool_name: str,
    class_name: str,
    node_name: str,
    pool: GPUNodePoolSpec,
    klass: GPUNodeClassSpec,
    watch_interval: timedelta | None = None,
    floor: bool = False,
    min_gpus: int = 1,
    bind_grace: timedelta | None = None,
    unlimited: Sequence[str] = (),
) -> NodeRequest:
    """Everything a node workflow of this pool needs. A `floor` node keeps the pool at its
    minNodes and never idles out (it would only be replaced at once). `bind_grace`: how long
    after Ready the node holds the place of the pods bought for it (it does not idle out).
    `unlimited`: the disruption reasons the pool tells its nodes its budgets cannot refuse
    (tgp.disruption.unlimited_reasons, as its settings signal sends them)."""
    requirements = offer_requirements(pool, klass)
    if min_gpus > requirements.min_gpu_count:
        # A pod asking for more GPUs than the class minimum needs a node that has them.
        requirements = requirements.model_copy(update={"min_gpu_count": min_gpus})
    timeouts = LifecycleTimeouts(**node_timeouts(pool, floor=floor).model_dump(exclude={"hold", "unlimited_reasons"}))
    # Its drains for these reasons begin without asking the pool; the pool's settings signal
    # (`update_timeouts`) keeps them current, so only a pool that sends them gives them.
    timeouts = timeouts.model_copy(update={"unlimited_reasons": list(unlimited)})
    if watch_interval is not None:
        timeouts = timeouts.model_copy(update={"watch_interval": watch_interval})
    if bind_grace is not None:
        timeouts = timeouts.model_copy(update={"bind_grace": bind_grace})
    # Carried by the request only: the pool's settings signal (TimeoutsUpdate) does not carry it
    # yet, so a running node keeps the terminationGracePeriod it was started with.
    if pool.disruption.termination_grace_period is not None:
        timeouts = timeouts.model_copy(update={"termination_grace": pool.disruption.termination_grace_period})
    return NodeRequest(
        namespace=namespace,
        pool=pool_name,
        node_name=node_name,
        node_class=class_name,
        requirements=requirements,
        labels=dict(pool.template.metadata.labels),
        taints=list(pool.template.spec.taints),
        tailnet_tags=list(klass.tailscale_config.tags),
        tailnet="headscale" if klass.tailscale_config.login_server else "tailscale",
        tailnet_ref=tailnet_ref(klass),
        boot=boot_config(klass, class_name),
        timeouts=timeouts,
        pool_workflow_id=pool_workflow_id(namespace, pool_name),
        class_workflow_id=class_workflow_id(class_name),
        drift_hashes=drift_hashes(klass, pool),
    )


def drift_hashes(klass: GPUNodeClassSpec, pool: GPUNodePoolSpec) -> dict[str, str]:
    """The drift hash of a node of `pool` for each provider of its class it may be bought from."""
    return {p.name: drift_hash(klass, pool, p.name) for p in klass.providers if p.enabled}


def request_for(template: NodeRequest, start: NodeStart) -> NodeRequest:
    """The request of one node of a batch: what `node_request` gives for its name, floor, GPUs
    and bind grace, built from the batch's `template` (`node_request` with an empty name, no
    floor, the class's GPU minimum and no bind grace)."""
    requirements = template.requirements
    if start.min_gpus > requirements.min_gpu_count:
        requirements = requirements.model_copy(update={"min_gpu_count": start.min_gpus})
    timeouts = template.timeouts
    if start.floor:
        timeouts = timeouts.model_copy(update={"idle": None})
    if start.bind_grace is not None:
        timeouts = timeouts.model_copy(update={"bind_grace": start.bind_grace})
    return template.model_copy(
        update={
            "node_name": start.node_name,
            "requirements": requirements,
            "timeouts": timeouts,
            "demand_since": start.demand_since,
            "reserved_price": start.hourly_price,
            "hold_ends_when_busy": start.hold_ends_when_busy,
        }
    )
