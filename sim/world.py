"""The whole simulated outside world in one place: a Kubernetes API, a Tailscale API and a
GPU cloud, wired so that a launched instance joins the tailnet and registers its Node.

Used by `tgp demo` and by the tests, so both exercise the same adapters over real HTTP.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import httpx
from datetime import datetime, timezone

from sim.cloud import DEFAULT_CATALOG, SimOffer, SimulatedCloud
from sim.headscale import FakeHeadscale
from sim.kube import KubeEmulator
from sim.kube_kubelet import SimKubelet
from sim.tailscale import FakeTailscale

# Tag of the provisioner's OAuth client, and the tag it may give the nodes (tagOwners).
NODE_TAG = "tag:tgp-node"


@dataclass
class SimWorld:
    kube: KubeEmulator | None  # None when the world uses an external API server
    tailscale: FakeTailscale
    cloud: SimulatedCloud
    oauth_client_id: str
    oauth_client_secret: str
    cloud_api_key: str
    stack: AsyncExitStack
    boot_delay: float = 1.0
    headscale: FakeHeadscale | None = None
    headscale_api_key: str = ""
    kube_url: str = ""
    kubeconfig: str | None = None
    kubelets: dict[str, SimKubelet] = field(default_factory=dict)  # Node name -> its machine's kubelet

    def tailnet_devices(self, hostname: str) -> list[str]:
        """Ids of devices (Tailscale) or nodes (Headscale) called `hostname`."""
        found = [d.node_id for d in self.tailscale.devices.values() if d.hostname == hostname]
        if self.headscale is not None:
            found += [n.id for n in self.headscale.nodes.values() if hostname in (n.name, n.given_name)]
        return found

    def usable_keys(self) -> list[str]:
        """Ids of minted auth keys that could still join a machine (not revoked, used or expired)."""
        now = datetime.now(timezone.utc)
        usable = [k.id for k in self.tailscale.keys.values() if not k.invalid(now)]
        if self.headscale is not None:
            usable += [k.id for k in self.headscale.keys.values() if not (k.used and not k.reusable) and not k.expired(now)]
        return usable

    async def add_cloud(self, catalog: tuple[SimOffer, ...]) -> SimulatedCloud:
        """Another simulated cloud whose machines join the same tailnet and cluster (to stand
        in for a second provider)."""
        return await self.stack.enter_async_context(
            SimulatedCloud(
                catalog=catalog,
                boot_delay=self.boot_delay,
                tailnet_register=self.cloud._tailnet_register,
                node_register=self.cloud._node_register,
                api_key=self.cloud_api_key,
            )
        )

    def worker_env(self) -> dict[str, str]:
        """Environment variables that point a worker (workers.main.WorkerConfig.from_env) here."""
        headscale = {}
        if self.headscale is not None:
            headscale = {"HEADSCALE_URL": self.headscale.url, "HEADSCALE_API_KEY": self.headscale_api_key, "HEADSCALE_USER": "tgp"}
        return {
            **headscale,
            "TGP_SIMULATED_CLOUD_URL": self.cloud.url,
            "TGP_SIMULATED_CLOUD_API_KEY": self.cloud_api_key,
            "TGP_TAILSCALE_API_URL": self.tailscale.url,
            "TS_OAUTH_CLIENT_ID": self.oauth_client_id,
            "TS_OAUTH_CLIENT_SECRET": self.oauth_client_secret,
            **({"KUBECONFIG": self.kubeconfig} if self.kubeconfig else {"TGP_KUBE_URL": self.kube_url}),
        }

    def secrets(self) -> list[str]:
        """Every secret of this world, including each tailnet key minted so far: none of them
        may ever appear in workflow history, logs or status."""
        minted = [k.secret for k in self.tailscale.keys.values()]
        if self.headscale is not None:
            minted += [self.headscale_api_key, *(k.secret for k in self.headscale.keys.values())]
        return [self.oauth_client_secret, self.cloud_api_key, *self.cloud.accounts, *minted]


@asynccontextmanager
async def sim_world(
    *,
    boot_delay: float = 1.0,
    catalog: tuple[SimOffer, ...] = DEFAULT_CATALOG,
    headscale: bool = False,
    kube_url: str | None = None,
    kube_client: httpx.AsyncClient | None = None,
    kubeconfig: str | None = None,
    kubelet_intervals: Mapping[str, float] | None = None,
) -> AsyncIterator[SimWorld]:
    """Start the simulated world on loopback; everything stops when the block exits. With
    `headscale`, a Headscale control server runs beside the Tailscale API, and machines
    whose payload carries a Headscale key join it. With `kube_url` (and an authenticated
    `kube_client`, and the `kubeconfig` workers should use) the simulated machines register
    their Nodes in that API server instead of a fresh emulator, like Karpenter's KWOK.
    `kubelet_intervals` (SimKubelet's `lease_renew_interval`, `status_interval`,
    `pod_sync_interval`) replaces the kubelet's defaults: `make bench` lengthens them, since
    500 kubelets' heartbeats at the defaults saturate the one process that serves the API."""
    client_id = "k" + secrets.token_hex(6) + "CNTRL"
    client_secret = f"tskey-client-{client_id}-{secrets.token_hex(16)}"
    async with AsyncExitStack() as stack:
        kube = None if kube_url else await stack.enter_async_context(KubeEmulator())
        api_url = kube_url or (kube.url if kube is not None else "")  # an empty emulator is falsy
        tailscale = await stack.enter_async_context(FakeTailscale(clients={client_id: (client_secret, [NODE_TAG])}))

        headscale_api_key = "hskey-api-" + secrets.token_hex(16)
        hs = await stack.enter_async_context(FakeHeadscale(api_keys=[headscale_api_key], users=["tgp"])) if headscale else None

        async def join_tailnet(auth_key: str, hostname: str) -> None:
            # Headscale keys before 0.28 are plain hex: the control server that minted a key takes it.
            if hs is not None and (auth_key.startswith("hskey-") or any(k.secret == auth_key for k in hs.keys.values())):
                hs.register(auth_key, hostname)
            else:
                tailscale.register(auth_key, hostname)

        kubelets: dict[str, SimKubelet] = {}

        async def join_cluster(name: str, labels: dict[str, str], gpus: int, taints: list[dict[str, str]]) -> None:
            # The machine's kubelet, for as long as the machine lives (its boot task).
            kubelets[name] = kubelet = SimKubelet(api_url, name, labels=labels, taints=taints, gpus=gpus, client=kube_client, **(kubelet_intervals or {}))
            await kubelet.run()

        cloud_api_key = "sim-" + secrets.token_hex(16)
        cloud = await stack.enter_async_context(
            SimulatedCloud(
                catalog=catalog,
                boot_delay=boot_delay,
                tailnet_register=join_tailnet,
                node_register=join_cluster,
                api_key=cloud_api_key,
            )
        )
        yield SimWorld(
            kube=kube,
            tailscale=tailscale,
            cloud=cloud,
            oauth_client_id=client_id,
            oauth_client_secret=client_secret,
            cloud_api_key=cloud_api_key,
            stack=stack,
            boot_delay=boot_delay,
            headscale=hs,
            headscale_api_key=headscale_api_key,
            kube_url=api_url,
            kubeconfig=kubeconfig,
            kubelets=kubelets,
        )
