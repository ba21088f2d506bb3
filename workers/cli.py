"""`tgp` command line.

Processes: `worker`, `bridge`, `codec-server`. Operator verbs: `offers`, `plan`, `status`,
`evict`, `rollout` (Worker Versioning: `status`, `promote`, `build-id`), `temporal setup`. Plugins add commands through the `tgp.commands` entry points: the
simulated world (`sim/`, the tgp-sim distribution a clone installs) adds `demo` and `dev`.

Exit status: 0 done; 2 the input or the environment is wrong, and the one-line message says
what to fix; 1 an unexpected error (a traceback follows: please report it); 130 interrupted;
`tgp rollout status --build B` exits 3 while build B is not drained (scripts wait on it).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from datetime import timedelta
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, NoReturn

from tgp.errors import ConfigError, TgpError
from tgp.types import DEFAULT_TASK_QUEUE
from workers.logs import configure_logging
from workers.memory import limit_malloc_arenas, settle_gc, trim_every, with_heap_trimmed

if TYPE_CHECKING:
    from workers.temporal import TemporalSettings

# Entry points of this group add commands: each is called with the subparsers object, adds its
# parsers and sets `run` as their default: "module:function" naming an `async (args) -> int`, imported
# only when that command runs (so every other command starts without it).
COMMANDS_GROUP = "tgp.commands"
# How long a worker stopped by SIGTERM lets running activities finish: under the Deployment's
# terminationGracePeriodSeconds (30 s by default), with room to close connections.
SHUTDOWN_GRACE = timedelta(seconds=20)
# Commands whose process ends without interpreter teardown (they hold Temporal clients).
_HARD_EXIT = {"worker", "bridge", "status", "evict", "rollout", "temporal", "demo", "dev"}
# `tgp rollout status --build B` while B still has runs pinned to it.
NOT_DRAINED = 3


def _temporal_flags(parser: argparse.ArgumentParser) -> None:
    """Connection flags; each overrides the temporal CLI's variable of the same meaning."""
    group = parser.add_argument_group("Temporal connection (flags override the environment; see docs/security.md)")
    group.add_argument("--address", help="Temporal frontend host:port (env TEMPORAL_ADDRESS, default localhost:7233)")
    group.add_argument("--namespace", help="Temporal namespace (env TEMPORAL_NAMESPACE, default default)")
    group.add_argument(
        "--tls", action=argparse.BooleanOptionalAction, default=None,
        help="TLS with the system CAs (env TEMPORAL_TLS); on by itself when any --tls-* option or an API key is set",
    )
    group.add_argument("--tls-cert-path", help="client certificate for mutual TLS, PEM (env TEMPORAL_TLS_CLIENT_CERT_PATH)")
    group.add_argument("--tls-key-path", help="its private key, PEM (env TEMPORAL_TLS_CLIENT_KEY_PATH)")
    group.add_argument("--tls-ca-path", help="CA that signed the server's certificate, PEM (env TEMPORAL_TLS_SERVER_CA_CERT_PATH)")
    group.add_argument("--tls-server-name", help="name to expect in the server's certificate (env TEMPORAL_TLS_SERVER_NAME)")
    group.add_argument("--api-key", help="API key, e.g. Temporal Cloud's; prefer env TEMPORAL_API_KEY (a flag shows in `ps`)")
    parser.add_argument(
        "--task-queue", default=os.environ.get("TGP_TASK_QUEUE", DEFAULT_TASK_QUEUE), help="task queue (env TGP_TASK_QUEUE)"
    )


def _temporal_settings(args: argparse.Namespace) -> TemporalSettings:
    from workers.temporal import TemporalSettings

    flags = ("address", "namespace", "tls", "tls_cert_path", "tls_key_path", "tls_ca_path", "tls_server_name", "api_key")
    return TemporalSettings.from_env(os.environ, **{name: getattr(args, name) for name in flags})


async def run_worker(args: argparse.Namespace) -> None:
    from activities.metrics import METRICS_PORT_ENV, WORKER_METRICS_PORT, metrics_port, sdk_metrics
    from workers.temporal import connect, ensure_search_attributes
    from workers.main import WorkerConfig, build_activities, ensure_fleet_look, ensure_sweeper_schedule, make_worker, watch_sweeps
    from activities.kube.connection import load_client_classes
    from workers.metrics import start_worker_metrics

    load_client_classes()
    settings = _temporal_settings(args)
    port = metrics_port(os.environ, WORKER_METRICS_PORT)
    sdk = sdk_metrics("tgp-worker") if port is not None else None
    client = await connect(settings, runtime=sdk.runtime if sdk else None)
    await ensure_search_attributes(client)
    await ensure_sweeper_schedule(client, args.task_queue)
    from workers import rollout, versioning

    version = versioning.deployment_config()  # a bad TGP_WORKER_VERSIONING or TGP_BUILD_ID stops the start here
    async with AsyncExitStack() as stack:
        activities = await build_activities(WorkerConfig.from_env(), stack)
        if port is not None and await start_worker_metrics(
            client, stack, port=port, unavailable=lambda: len(activities.node.unavailable.keys()), forward=sdk.url if sdk else None
        ):
            print(f"tgp worker metrics on :{port}/metrics ({METRICS_PORT_ENV}=0 turns them off)", file=sys.stderr)
        watcher = asyncio.create_task(watch_sweeps(client))  # tgp_sweep_overdue and its log error
        stack.callback(watcher.cancel)
        # SIGTERM (how Kubernetes stops the pod) lets running activities finish for up to
        # SHUTDOWN_GRACE, inside the Deployment's 30 s grace period; what is still running
        # then is cancelled and retried on another worker (a launch adopts what it bought).
        worker = make_worker(client, activities, task_queue=args.task_queue, graceful_shutdown_timeout=SHUTDOWN_GRACE)
        # Only a worker that can run it takes the fleet look to its task queue (after its
        # configuration is known good): one that exits on a bad setting must not move it away.
        await ensure_fleet_look(client, args.task_queue)
        build = ""
        if version is not None:
            build = f" as build {version.version.build_id} of worker deployment {versioning.DEPLOYMENT_NAME!r}"
            # A new installation's first build becomes current by itself; later ones by promote.
            first = asyncio.create_task(rollout.become_current_if_first(client, version.version.build_id))
            stack.callback(first.cancel)
        print(f"tgp worker polling {args.task_queue!r} on {settings.describe()}{build}", file=sys.stderr)
        settle_gc()  # started: the collector set for the long run (workers.memory)
        await worker.run()


async def run_bridge(args: argparse.Namespace) -> None:
    from activities.kube.cluster import KubernetesCluster
    from activities.kube.connection import load_client_classes
    from crd_bridge.bridge import Bridge
    from activities.metrics import BRIDGE_METRICS_PORT, METRICS_PORT_ENV, metrics_port, sdk_metrics, serve_metrics_or_log
    from workers.temporal import connect

    load_client_classes()
    settings = _temporal_settings(args)
    kube_url = os.environ.get("TGP_KUBE_URL")
    async with KubernetesCluster.from_url(kube_url) if kube_url else KubernetesCluster.from_kubeconfig(os.environ.get("KUBECONFIG")) as cluster:
        # Unusable credentials are one line, before anything else is started or printed.
        await cluster._client()
        port = metrics_port(os.environ, BRIDGE_METRICS_PORT)
        sdk = sdk_metrics("tgp-bridge") if port is not None else None
        client = await connect(settings, runtime=sdk.runtime if sdk else None)
        served = await serve_metrics_or_log(port, forward=sdk.url if sdk else None) if port is not None else None  # until the process ends
        if served is not None:
            print(f"tgp bridge metrics on :{port}/metrics ({METRICS_PORT_ENV}=0 turns them off)", file=sys.stderr)
        print(f"tgp bridge watching GPUNodeClasses, GPUNodePools, pods and nodes; signalling {args.task_queue!r} on {settings.describe()}", file=sys.stderr)
        settle_gc()
        await Bridge(client, cluster, task_queue=args.task_queue).run()


async def run_ops(args: argparse.Namespace) -> int:
    """`tgp plan`, `tgp status`, `tgp evict`, `tgp temporal setup`."""
    if args.command == "plan":
        from workers import plan

        print(await plan.plan(args.pool, limit=args.limit))
        return 0
    from workers import ops

    from workers.temporal import connect, ensure_search_attributes

    settings = _temporal_settings(args)
    client = await connect(settings)
    if args.command == "status":
        print(await (ops.node_status(client, args.node) if args.node else ops.status(client)))
    elif args.command == "rollout":
        from workers import rollout, versioning

        if args.rollout_command == "promote":
            print(await rollout.promote(client, args.build))
        else:
            text, drained = await rollout.rollout_status(client, args.build)
            print(text)
            return 0 if drained or args.build is None else NOT_DRAINED
    elif args.command == "evict":
        print(await ops.evict(client, args.node, args.reason))
    else:
        await ensure_search_attributes(client)
        print(f"tgp's search attributes are registered on {settings.describe()}")
    return 0


async def run_codec_server(args: argparse.Namespace) -> None:
    from workers import codec as payload_codec

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
        allowed_hosts=args.allowed_host,
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line: every subcommand, each --help opening with what it does."""
    parser = argparse.ArgumentParser(prog="tgp", description="Ephemeral GPU nodes for Kubernetes, run as Temporal workflows.")
    sub = parser.add_subparsers(dest="command", required=True)

    worker = sub.add_parser(
        "worker",
        help="run a worker hosting tgp's workflows and activities",
        description="Run a worker hosting tgp's workflows and activities. With TGP_WORKER_VERSIONING=on it polls as "
        "one build (TGP_BUILD_ID, else `tgp rollout build-id`) of worker deployment 'tgp', every run pinned to its "
        "build (docs/workflow-versioning.md).",
    )
    _temporal_flags(worker)

    bridge = sub.add_parser(
        "bridge",
        help="watch GPUNodeClass/GPUNodePool/pods/nodes and drive the workflows",
        description="Run the CRD bridge: watch GPUNodeClasses, GPUNodePools, pods and nodes in the cluster of "
        "KUBECONFIG (or TGP_KUBE_URL) and turn what changes into signals to the pool and node workflows.",
    )
    _temporal_flags(bridge)

    offers = sub.add_parser(
        "offers",
        help="live, price-sorted offers across the configured providers",
        description="List the GPU offers the configured providers sell now, cheapest first, filtered by GPU type, "
        "region, price and provider. API keys come from the environment or from a Kubernetes Secret (--secret).",
    )
    from workers.offers_args import add_arguments

    add_arguments(offers)

    plan = sub.add_parser(
        "plan",
        help="dry run for a GPUNodePool (or all): the offer a new node would get and why each other was not chosen, "
        "and what disruption would do now (drift, underutilized, cheaper offers), the savings and what holds each back",
        description="Show, without buying anything, what tgp would do for a GPUNodePool (or every pool) now: the "
        "offer a new node would get and why each other offer was not chosen, and what disruption would do (drift, "
        "underutilized, cheaper offers), with the savings and what holds each back. Reads the cluster of KUBECONFIG.",
    )
    plan.add_argument("pool", nargs="?", help="the GPUNodePool, NAMESPACE/NAME (or NAME in default); unset = every pool")
    plan.add_argument("--limit", type=int, default=20, help="offers to list besides the chosen one")

    status = sub.add_parser(
        "status",
        help="running GPU nodes by pool: phase, provider, $/h, age, cost so far, build; or one node's stages",
        description="List the running GPU nodes by pool: phase, provider, $/h, age, cost so far and the build each "
        "runs on, and how many runs are still on an older build; or, given a Node name, that node's stages.",
    )
    status.add_argument("node", nargs="?", help="a Node name: its stages, when and why")
    _temporal_flags(status)

    evict = sub.add_parser(
        "evict",
        help="drain and terminate a GPU node now (the `evict` signal)",
        description="Drain a GPU node now and terminate it (the node workflow's `evict` signal): its pods are "
        "evicted through the Eviction API, then its instance, tailnet device and Node are removed.",
    )
    evict.add_argument("node", help="the Node name")
    evict.add_argument("--reason", default="manual", help="recorded as the node's end reason")
    _temporal_flags(evict)

    rollout = sub.add_parser(
        "rollout",
        help="Worker Versioning: is an old build drained, make a build current, this code's build id",
        description="Roll a new build of the worker out beside the old one (Worker Versioning; docs/workflow-versioning.md).",
    )
    rollout_sub = rollout.add_subparsers(dest="rollout_command", required=True)
    rollout_status = rollout_sub.add_parser(
        "status",
        help="each build's state: current, draining (runs still pinned, and by when they move) or drained",
        description="Say whether an old build's workers may stop: the server's drainage status of each build of worker "
        "deployment 'tgp' (or of --build), the runs still pinned to it and when they reach their next safe point. "
        f"With --build: exit status 0 when drained, {NOT_DRAINED} while not.",
    )
    rollout_status.add_argument("--build", help="only this build; exit status 0 once it is drained")
    _temporal_flags(rollout_status)
    promote = rollout_sub.add_parser(
        "promote",
        help="make a build current: new runs start on it, the others' runs move to it at their safe points",
        description="Make BUILD the current build of worker deployment 'tgp': new runs start on it and every run "
        "pinned to another build moves to it at its next safe point. Refused until BUILD's workers poll.",
    )
    promote.add_argument("build", help="the build id (its worker Deployment's label tgp.io/build)")
    _temporal_flags(promote)
    rollout_sub.add_parser(
        "build-id",
        help="print this code's build id",
        description="Print the build id this installation's workers poll as: TGP_BUILD_ID, else the package "
        "version and a hash of the workflow source (what names the image's worker Deployment).",
    )

    temporal = sub.add_parser(
        "temporal", help="Temporal housekeeping", description="Prepare a Temporal namespace for tgp (`tgp temporal setup`)."
    )
    temporal_sub = temporal.add_subparsers(dest="temporal_command", required=True)
    setup = temporal_sub.add_parser(
        "setup",
        help="register tgp's search attributes on the namespace (once per namespace)",
        description="Register tgp's search attributes (TgpPool, TgpPhase and the others the Web UI filters and "
        "`tgp status` read) on the Temporal namespace. Once per namespace; running it again changes nothing.",
    )
    _temporal_flags(setup)

    for command in entry_points(group=COMMANDS_GROUP):
        command.load()(sub)

    codec = sub.add_parser(
        "codec-server",
        help="decrypt payloads for the Web UI and `temporal --codec-endpoint` (keys: TGP_PAYLOAD_KEYS)",
        description="Serve the Temporal codec endpoint that decrypts tgp's encrypted payloads (keys from "
        "TGP_PAYLOAD_KEYS) for the Web UI and `temporal --codec-endpoint` (docs/security.md).",
    )
    codec.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond loopback only with TGP_CODEC_TOKEN)")
    codec.add_argument("--port", type=int, default=8081, help="port to listen on")
    codec.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="Web UI origin allowed to call it, repeatable (default http://localhost:8233, the dev server's UI)",
    )
    codec.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name clients use to reach it (the Host header), repeatable; loopback names and --host always "
        "work, others are refused (DNS rebinding); needs TGP_CODEC_TOKEN",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `tgp` command line; returns the exit status (module docstring)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("demo", "dev") and argv[0] not in sub.choices:
        print(
            f"tgp: `tgp {argv[0]}` runs on the simulated world, which production installs do not carry: "
            "run `make demo` in a clone of tgp (it installs sim/ as tgp-sim)",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_args(argv)
    configure_logging()
    if args.command in _HARD_EXIT:
        _exit_without_finalizing(_run(args))
    return _run(args)


def _exit_without_finalizing(code: int) -> NoReturn:
    """End a process that used a Temporal client without interpreter teardown: the SDK's Rust
    threads can outlive the event loop and abort the process during finalization ("Fatal
    Python error: PyGILState_Release", temporalio/sdk-python#300), printing a dump after the
    one-line error and turning exit status 2 into 134."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


async def _until_terminated(main: Coroutine[Any, Any, None]) -> None:
    """Run a long-lived command; SIGTERM cancels it as Ctrl-C does, so that it stops the way
    it would on Ctrl-C (the worker finishes or hands back its activities, the bridge closes its
    watches) and the process exits 0 instead of dying at once."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        await main
    except asyncio.CancelledError:
        if not terminated:
            raise
        print("tgp: stopped on SIGTERM", file=sys.stderr)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _run(args: argparse.Namespace) -> int:
    try:
        if hasattr(args, "run"):  # a command of a plugin (COMMANDS_GROUP): "module:function", imported now
            module, _, function = args.run.partition(":")
            return asyncio.run(getattr(importlib.import_module(module), function)(args))
        if args.command in ("worker", "bridge"):
            limit_malloc_arenas()  # before the first thread (workers.memory)
            trim = trim_every()  # a bad value stops the start, saying what to fix
            long_lived = run_worker(args) if args.command == "worker" else run_bridge(args)
            asyncio.run(_until_terminated(with_heap_trimmed(long_lived, trim)))
        elif args.command == "offers":
            from workers.offers_cli import run_offers

            return asyncio.run(run_offers(args))
        elif args.command == "rollout" and args.rollout_command == "build-id":
            from workers.versioning import build_id

            print(build_id())
        elif args.command in ("plan", "status", "evict", "rollout", "temporal"):
            return asyncio.run(run_ops(args))
        elif args.command == "codec-server":
            asyncio.run(run_codec_server(args))
    except TgpError as exc:
        print(f"tgp: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
