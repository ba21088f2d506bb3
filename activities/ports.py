"""The small Protocols every external system hides behind. Activities depend on these only;
tests and the demo swap the adapter (or just its base URL), never the activity code."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from pydantic import BaseModel, ConfigDict, SecretStr

from tgp.capabilities import ProviderCapabilities
from tgp.types import BootPayload, Instance, NodeSummary, Offer, PodSummary, Taint, TailnetDevice


class CloudProvider(Protocol):
    """A GPU cloud. `launch` is idempotent by `name`: callers look up before they create."""

    name: str
    capabilities: ProviderCapabilities
    # How long after a create the API may show less than the truth (lagging lists, 404 on
    # describe, a create completing after the client gave up): see HttpAdapter.
    consistency_window: timedelta

    async def list_offers(self) -> list[Offer]: ...

    async def launch(self, offer: Offer, *, name: str, boot: BootPayload) -> Instance:
        """Buy one instance of `offer` named `name`. Raises CapacityError when sold out."""
        ...

    async def find_by_name(self, name: str) -> Instance | None:
        """The live (not terminated) instance called `name`, if any."""
        ...

    async def find_all_by_name(self, name: str) -> list[Instance]:
        """Every live instance called `name`. Clouds do not enforce unique names, so a create
        that overlapped itself shows up here as twins."""
        ...

    async def list_instances(self, prefix: str, names: Collection[str] | None = None) -> list[Instance]:
        """Every live instance whose name starts with `prefix` (the sweeper's view); with
        `names`, only those called one of them as the listing shows names (`listed_name` where
        an adapter shortens them): the rest of a large account is not read into Instances
        (the coalesced look-ups by name, activities.name_lists)."""
        ...

    async def describe(self, instance_id: str) -> Instance | None:
        """Current state, or None when the provider no longer knows the instance."""
        ...

    async def terminate(self, instance_id: str) -> None:
        """Stop paying for it. An instance that is already gone counts as terminated."""
        ...


class AuthKey(BaseModel):
    """A freshly minted tailnet auth key. `secret` exists only inside the activity that
    minted it; only `key_id` may leave it."""

    model_config = ConfigDict(frozen=True)
    key_id: str
    secret: SecretStr


class Tailnet(Protocol):
    """Tailscale or Headscale: mint ephemeral, pre-authorized, tagged, single-use keys, and
    find and remove the devices that used them."""

    async def mint_auth_key(self, *, hostname: str, tags: list[str], expiry: timedelta, ephemeral: bool = True) -> AuthKey:
        """A single-use, pre-authorized key carrying `tags`; `ephemeral` keys register devices
        that leave the tailnet once offline (the class's tailscaleConfig.ephemeral)."""
        ...

    async def revoke_auth_key(self, key_id: str) -> None:
        """Revoke; a key already gone counts as revoked."""
        ...

    async def revoke_keys_for(self, hostname: str) -> int:
        """Revoke every unused key minted for `hostname`; returns how many. Tailscale finds them
        by key description; Headscale keys carry no name, so only keys this process minted."""
        ...

    async def find_device(self, hostname: str, tags: list[str], *, within: float = 0.0) -> TailnetDevice | None:
        """The device called `hostname` carrying all of `tags`, from a listing begun after this
        call or, with `within`, at most that many seconds before it (a look that repeats)."""
        ...

    async def list_devices(self, tags: list[str]) -> list[TailnetDevice]:
        """Every device carrying all of `tags`."""
        ...

    async def delete_device(self, device_id: str) -> None:
        """Delete; a device already gone (404) counts as deleted."""
        ...


@dataclass(frozen=True)
class VersionedSecret:
    """A Secret's decoded data and its resourceVersion. Never log `data`."""

    data: dict[str, bytes] = field(repr=False)
    resource_version: str


@dataclass(frozen=True)
class ListedSecret:
    """One Secret of a labelled listing: its name, decoded data, resourceVersion and
    annotations. Never log `data`."""

    name: str
    data: dict[str, bytes] = field(repr=False)
    resource_version: str
    annotations: dict[str, str] = field(default_factory=dict)


class EvictionBlocked(Exception):
    """A PodDisruptionBudget forbids this eviction right now (HTTP 429)."""


class Cluster(Protocol):
    """The Kubernetes API as the node lifecycle needs it."""

    async def get_node(self, name: str) -> NodeSummary | None: ...

    async def label_and_taint(
        self, name: str, labels: dict[str, str], taints: list[Taint], *, remove_labels: Mapping[str, str] | None = None, remove_taints: Sequence[Taint] = ()
    ) -> None:
        """Merge `labels` into the Node's labels and add `taints` not already present; remove the
        `remove_labels` and `remove_taints` the Node still carries as tgp set them."""
        ...

    async def cordon(self, name: str) -> None: ...

    async def uncordon(self, name: str) -> None:
        """Mark the Node schedulable again (a drain called off); a Node gone is left gone."""
        ...

    async def list_pods_on_node(self, name: str) -> list[PodSummary]: ...

    async def evict_pod(self, namespace: str, name: str, *, grace_period: timedelta | None = None) -> None:
        """Eviction API (policy/v1, falling back to v1beta1). Raises EvictionBlocked on 429;
        a pod already gone counts as evicted."""
        ...

    async def delete_pod(self, namespace: str, name: str, *, grace_period: timedelta, uid: str = "") -> None:
        """Delete the pod over its PodDisruptionBudget, with `grace_period`; gone counts as deleted."""
        ...

    async def record_pod_event(self, pod: PodSummary, *, type: str, reason: str, message: str) -> None:
        """Record a core/v1 Event (type Normal or Warning) about the pod, for `kubectl describe pod`."""
        ...

    async def record_class_event(self, name: str, *, type: str, reason: str, message: str) -> None:
        """Record a core/v1 Event about the GPUNodeClass `name` (for its admin, `kubectl describe gnc`)."""
        ...

    async def delete_node(self, name: str) -> None:
        """Annotate the Node released (tgp.types.ANNOTATION_RELEASED), then delete it; one
        already gone counts as deleted."""
        ...

    async def read_secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        """A Secret's decoded data, or None when it does not exist. Never log it."""
        ...

    async def read_secret_versioned(self, namespace: str, name: str) -> VersionedSecret | None:
        """The Secret's data with its resourceVersion, or None when it does not exist."""
        ...

    # tgp's own Secrets in its namespace (activities/kept_accounts.py): the keys that bought nodes.

    async def create_secret(
        self, namespace: str, name: str, data: Mapping[str, bytes], *, labels: Mapping[str, str], annotations: Mapping[str, str]
    ) -> bool:
        """Create the Secret; False when one of that name exists already (left as it is)."""
        ...

    async def annotate_secret(self, namespace: str, name: str, annotations: Mapping[str, str]) -> bool:
        """Merge `annotations` into the Secret's; False when it does not exist."""
        ...

    async def list_secrets(self, namespace: str, label_selector: str) -> list[ListedSecret]:
        """The Secrets of `namespace` that `label_selector` selects."""
        ...

    async def delete_secret(self, namespace: str, name: str, *, resource_version: str) -> bool:
        """Delete the Secret if it is still at `resource_version`; False when it is gone or has
        changed since (a writer got there first)."""
        ...
