"""`tgp demo` and `tgp dev` on the command line (the `tgp.commands` entry point of tgp-sim).

Every `tgp` command builds its parser with these, so this module imports nothing heavy: each
command names the function that runs it ("module:function"), which workers/cli.py imports only
when that command runs (`tgp status` does not import the simulated world)."""

from __future__ import annotations

import argparse
import os

PORT_ENV = "TGP_DEMO_PORT"
DEFAULT_PORT = 7233


def default_port() -> int:
    """--port's default: TGP_DEMO_PORT when it is a number, else 7233."""
    value = os.environ.get(PORT_ENV, "")
    return int(value) if value.isdigit() else DEFAULT_PORT


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`tgp demo` and `tgp dev` (the `tgp.commands` entry point of tgp-sim)."""
    demo = sub.add_parser(
        "demo", help="the whole system on a simulated cloud and cluster: kubectl apply -> a GPU node -> scale to zero, with the Web UI",
        description="Run the whole system on this machine without a cloud account: the Temporal dev server (Web UI), "
        "a simulated GPU cloud, tailnet and Kubernetes cluster, a worker and the bridge. It applies examples/ and "
        "tells the story: a pod pending, a node bought and joined, the pod run, the node drained and terminated, "
        "the pool back to zero. Ctrl-C deletes the pool and stops everything.",
    )
    add_port(demo)
    add_boot_delay(demo)
    demo.add_argument("--state-dir", default=".demo", help="where the demo writes its kubeconfig and env (in a folder per port)")
    demo.add_argument("--exit-when-done", action="store_true", help="stop once the pool is back to zero instead of keeping everything up")

    demo.set_defaults(run="sim.demo:run_demo")

    dev = sub.add_parser(
        "dev", help="the demo's processes (Temporal dev server, worker, bridge) against your current kube context",
        description="Run the demo's processes (the Temporal dev server with its Web UI, a worker and the bridge) "
        "against the cluster of your current kube context, and tell the story of its pools, nodes and GPU pods. "
        "Machines come from the simulated cloud unless a provider API key is set. The workflows are kept on disk "
        "and resume with the next `tgp dev`.",
    )
    add_port(dev)
    dev.add_argument(
        "--simulated-cloud", action=argparse.BooleanOptionalAction, default=None,
        help="buy from the simulated cloud (KWOK-style Nodes in your cluster); default: on unless a provider API key is set",
    )
    add_boot_delay(dev)
    dev.add_argument("--state-dir", default=".tgp-dev", help="where the dev server keeps its database (workflows survive a restart)")
    dev.set_defaults(run="sim.dev:run_dev")


def add_port(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=default_port(), help=f"Temporal dev server port (Web UI on port+1000; env {PORT_ENV})")


def add_boot_delay(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--boot-delay", type=float, default=3.0, help="seconds a simulated instance takes to boot")
