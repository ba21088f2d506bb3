"""`tgp` command line: `tgp worker`, `tgp bridge`, `tgp offers`, `tgp demo`, `tgp codec-server`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from contextlib import AsyncExitStack

from tgp.errors import ConfigError, TgpError
from tgp.logs import configure_logging
from tgp.types import DEFAULT_TASK_QUEUE


def _temporal_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default=os.environ.get("TEMPORAL_ADDRESS", "localhost:7233"), help="Temporal frontend (env TEMPORAL_ADDRESS)"
    )
    parser.add_argument(
        "--namespace", default=os.environ.get("TEMPORAL_NAMESPACE", "default"), help="Temporal namespace (env TEMPORAL_NAMESPACE)"
    )
    parser.add_argument(
        "--task-queue", default=os.environ.get("TGP_TASK_QUEUE", DEFAULT_TASK_QUEUE), help="task queue (env TGP_TASK_QUEUE)"
    )


async def run_worker(args: argparse.Namespace) -> None:
    from tgp.temporal import connect, ensure_search_attributes
    from workers.main import WorkerConfig, build_activities, ensure_sweeper_schedule, make_worker

    client = await connect(args.address, args.namespace)
    await ensure_search_attributes(client)
    await ensure_sweeper_schedule(client, args.task_queue)
    async with AsyncExitStack() as stack:
        activities = await build_activities(WorkerConfig.from_env(), stack)
        worker = make_worker(client, activities, task_queue=args.task_queue)
        print(f"tgp worker polling {args.task_queue!r} on {args.address} (namespace {args.namespace})", file=sys.stderr)
        await worker.run()


async def run_bridge(args: argparse.Namespace) -> None:
    from activities.cluster import KubernetesCluster
    from crd_bridge.bridge import Bridge
    from tgp.temporal import connect

    client = await connect(args.address, args.namespace)
    kube_url = os.environ.get("TGP_KUBE_URL")
    async with KubernetesCluster.from_url(kube_url) if kube_url else KubernetesCluster.from_kubeconfig(os.environ.get("KUBECONFIG")) as cluster:
        print(f"tgp bridge watching GPUNodeClasses, GPUNodePools, pods and nodes; signalling {args.task_queue!r} on {args.address}", file=sys.stderr)
        await Bridge(client, cluster, task_queue=args.task_queue).run()


async def run_codec_server(args: argparse.Namespace) -> None:
    from tgp import codec as payload_codec

    codec = payload_codec.EncryptionCodec.from_env()
    if codec is None:
        raise ConfigError(
            f"set {payload_codec.PAYLOAD_KEYS_ENV} (the worker's keys) for the codec server to decrypt with; see docs/security.md"
        )
    await payload_codec.run_codec_server(
        codec,
        host=args.host,
        port=args.port,
        token=payload_codec.codec_token_from_env(),
        cors_origins=args.cors_origin or [payload_codec.DEFAULT_UI_ORIGIN],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tgp", description="Ephemeral GPU nodes for Kubernetes, run as Temporal workflows.")
    sub = parser.add_subparsers(dest="command", required=True)

    worker = sub.add_parser("worker", help="run a worker hosting tgp's workflows and activities")
    _temporal_flags(worker)

    bridge = sub.add_parser("bridge", help="watch GPUNodeClass/GPUNodePool/pods/nodes and drive the workflows")
    _temporal_flags(bridge)

    offers = sub.add_parser("offers", help="live, price-sorted offers across the configured providers")
    from tgp.offers_cli import add_arguments

    add_arguments(offers)

    demo = sub.add_parser("demo", help="one full node lifecycle on a simulated cloud and cluster, with the Web UI")
    demo.add_argument("--port", type=int, default=7233, help="Temporal dev server port (Web UI on port+1000)")
    demo.add_argument("--boot-delay", type=float, default=3.0, help="seconds a simulated instance takes to boot")
    demo.add_argument("--job-seconds", type=float, default=20.0, help="how long the demo's GPU pod runs on the node")
    demo.add_argument("--idle-seconds", type=float, default=15.0, help="idle timeout of the demo node")
    demo.add_argument("--exit-when-done", action="store_true", help="stop when the node's life ends instead of keeping the Web UI up")

    codec = sub.add_parser(
        "codec-server", help="decrypt payloads for the Web UI and `temporal --codec-endpoint` (keys: TGP_PAYLOAD_KEYS)"
    )
    codec.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond loopback only with TGP_CODEC_TOKEN)")
    codec.add_argument("--port", type=int, default=8081, help="port to listen on")
    codec.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="Web UI origin allowed to call it, repeatable (default http://localhost:8233, the dev server's UI)",
    )

    args = parser.parse_args(argv)
    configure_logging()
    try:
        if args.command == "worker":
            asyncio.run(run_worker(args))
        elif args.command == "offers":
            from tgp.offers_cli import run_offers

            return asyncio.run(run_offers(args))
        elif args.command == "bridge":
            asyncio.run(run_bridge(args))
        elif args.command == "demo":
            from tgp.demo import run_demo

            return asyncio.run(run_demo(args))
        elif args.command == "codec-server":
            asyncio.run(run_codec_server(args))
    except TgpError as exc:
        print(f"tgp: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
