"""From a GPUNodePool and its GPUNodeClass to what one node needs. Pure, no I/O."""

from __future__ import annotations

from datetime import timedelta

from workflows.legacy.r31e9066.crds import GPUNodeClassSpec, GPUNodePoolSpec
from workflows.legacy.r31e9066.messages import class_workflow_id, pool_workflow_id
from workflows.legacy.r31e9066.types import LABEL_GPU_TYPE, LABEL_REGION, OPERATOR_NAMESPACE, BootConfig, LifecycleTimeouts, NodeRequest, OfferRequirements


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
        min_gpu_count=ir.min_gpu_count,
        max_hourly_price=pool.max_hourly_price,
        allow_spot=ir.spot_allowed,
    )


def boot_config(klass: GPUNodeClassSpec) -> BootConfig:
    """The class's boot template and the reference to its join Secret (no secret values)."""
    talos = klass.talos_config
    return BootConfig(
        template=talos.machine_config_template if talos else klass.bootstrap_template,
        join_secret=f"{OPERATOR_NAMESPACE}/{klass.join_secret_ref}" if klass.join_secret_ref else None,
        login_server=klass.tailscale_config.login_server,
        talos_image=talos.image if talos else "",
    )


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
) -> NodeRequest:
    """Everything a node workflow of this pool needs. A `floor` node keeps the pool at its
    minNodes and never idles out (it would only be replaced at once)."""
    d = pool.disruption
    requirements = offer_requirements(pool, klass)
    if min_gpus > requirements.min_gpu_count:
        # A pod asking for more GPUs than the class minimum needs a node that has them.
        requirements = requirements.model_copy(update={"min_gpu_count": min_gpus})
    timeouts = LifecycleTimeouts(idle=None if floor else d.idle_timeout, drain=d.drain_timeout, expire_after=d.expire_after)
    if watch_interval is not None:
        timeouts = timeouts.model_copy(update={"watch_interval": watch_interval})
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
        boot=boot_config(klass),
        timeouts=timeouts,
        pool_workflow_id=pool_workflow_id(namespace, pool_name),
        class_workflow_id=class_workflow_id(class_name),
    )
