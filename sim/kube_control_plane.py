"""A real Kubernetes control plane on loopback, for the real-cluster lane of the tests and for
`tgp dev`: etcd + kube-apiserver (RBAC, a static admin token, ServiceAccount tokens), and by
default kube-scheduler and kube-controller-manager, as envtest runs them but with the two
controllers that tgp depends on (scheduling, node lifecycle, disruption budgets, service accounts).

The binaries come from `make kube` (hack/kube: a pinned `k8s.io/kubernetes` built from the Go
module proxy into a cache outside the tree); this module runs what was built and downloads
nothing. It lives in sim/ beside the emulator because it is the emulator's real counterpart: the
tests, `tgp dev` and `make demo` start either through the same kind of handle (a URL and a
kubeconfig).

    python -m sim.kube_control_plane run -- <command>   # the command sees $TGP_TEST_KUBECONFIG
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime as dt
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from activities.http_wire import default_tls

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "hack" / "kube" / "build.sh"
CRD_DIR = REPO / "deploy" / "crds"
BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager")
# Where the built binaries are, when not the cache directory build.sh names.
BIN_DIR_ENV = "TGP_KUBE_BIN_DIR"
KUBECONFIG_ENV = "TGP_TEST_KUBECONFIG"
OWN_CONTROL_PLANE_ENV = "TGP_TEST_OWN_CONTROL_PLANE"
SYSTEM_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})

# A cold apiserver on a loaded 2-core machine installs its bootstrap RBAC and priority levels in
# 10-30 s; two minutes separates slow from broken.
START_TIMEOUT = 120.0
# A CRD is Established within a second or two once its names are accepted.
CRD_TIMEOUT = 60.0
# SIGTERM, then SIGKILL after this long: etcd and the apiserver stop in about a second.
STOP_TIMEOUT = 15.0
_POLL = 0.25
LEFTOVER_TIMEOUT = 90.0
SERVICE_CIDR = "10.0.0.0/24"
_PR_SET_PDEATHSIG = 1
_LOG_TAIL = 3000  # characters of a process's log quoted when it fails to start


class ControlPlaneUnavailable(RuntimeError):
    """The control plane cannot run here (no Go and no built binaries): a lane reports it in
    one line and is skipped, or fails under CI."""


def binary_dir() -> Path:
    """The directory holding the four binaries: $TGP_KUBE_BIN_DIR, else build.sh's cache
    directory (which it prints without building). Raises ControlPlaneUnavailable when any
    binary is missing, saying how to build them."""
    configured = os.environ.get(BIN_DIR_ENV)
    if configured:
        directory = Path(configured)
    else:
        result = subprocess.run(["bash", str(BUILD_SCRIPT), "--dir"], capture_output=True, text=True, check=True)
        directory = Path(result.stdout.strip().splitlines()[-1])
    missing = [b for b in BINARIES if not os.access(directory / b, os.X_OK)]
    if missing:
        raise ControlPlaneUnavailable(
            f"no {', '.join(missing)} in {directory}: run `make kube` (needs Go; builds from the Go module proxy)"
        )
    return directory


@dataclass
class ControlPlane:
    """A running control plane. `kubeconfig` authenticates as the static admin (system:masters)."""

    url: str
    kubeconfig: Path
    admin_token: str
    ca_file: Path
    workdir: Path
    version: str = ""
    processes: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    def http(self, *, timeout: float = 10.0) -> httpx.AsyncClient:
        """An admin client of the API server."""
        return httpx.AsyncClient(
            base_url=self.url, verify=str(self.ca_file), timeout=timeout,
            headers={"Authorization": f"Bearer {self.admin_token}"},
        )

    async def service_account_kubeconfig(
        self, namespace: str, name: str, *, cluster_roles: Sequence[str] = (), path: Path | None = None,
        expiration: dt.timedelta = dt.timedelta(hours=2),
    ) -> Path:
        """A kubeconfig holding a bound token of ServiceAccount `namespace/name` (created if
        absent, bound to `cluster_roles`), as the worker and bridge run in a cluster."""
        async with self.http() as http:
            for kind, url, body in (
                ("Namespace", "/api/v1/namespaces", {"metadata": {"name": namespace}}),
                ("ServiceAccount", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name}}),
            ):
                response = await http.post(url, json={"apiVersion": "v1", "kind": kind, **body})
                if response.status_code not in (201, 409):
                    raise RuntimeError(f"create {kind} {name}: {response.status_code} {response.text[:300]}")
            for role in cluster_roles:
                binding = {
                    "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                    "metadata": {"name": f"{role}-{namespace}-{name}"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                    "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
                }
                response = await http.post("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", json=binding)
                if response.status_code not in (201, 409):
                    raise RuntimeError(f"bind {role} to {name}: {response.status_code} {response.text[:300]}")
            response = await http.post(
                f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                      "spec": {"expirationSeconds": int(expiration.total_seconds())}},
            )
            if response.status_code != 201:
                raise RuntimeError(f"token for {name}: {response.status_code} {response.text[:300]}")
            token = response.json()["status"]["token"]
        target = path or self.workdir / f"kubeconfig-{namespace}-{name}"
        _write_kubeconfig(target, self.url, self.ca_file, token, user=f"{namespace}-{name}")
        return target

    async def apply_crds(self, directory: Path = CRD_DIR) -> None:
        """Create (or replace) every CRD in `directory` and wait until each is Established."""
        names: list[str] = []
        async with self.http() as http:
            for path in sorted(directory.glob("*.yaml")):
                for doc in yaml.safe_load_all(path.read_text()):
                    if not doc or doc.get("kind") != "CustomResourceDefinition":
                        continue
                    name = doc["metadata"]["name"]
                    base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
                    response = await http.post(base, json=doc)
                    if response.status_code == 409:
                        current = (await http.get(f"{base}/{name}")).json()
                        doc["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                        response = await http.put(f"{base}/{name}", json=doc)
                    if response.status_code not in (200, 201):
                        raise RuntimeError(f"install CRD {name}: {response.status_code} {response.text[:500]}")
                    names.append(name)
            for name in names:
                await _until(lambda n=name: _crd_established(http, n), CRD_TIMEOUT, f"CRD {name} Established")

    async def stop(self) -> None:
        for name in reversed(list(self.processes)):
            await _stop_process(self.processes[name])
        self.processes.clear()


@contextlib.asynccontextmanager
async def control_plane(
    bin_dir: Path | None = None,
    *,
    workdir: Path | None = None,
    scheduler: bool = True,
    controller_manager: bool = True,
    crds: bool = True,
) -> AsyncIterator[ControlPlane]:
    """Start etcd and kube-apiserver (and the scheduler and controller-manager unless turned
    off) on free loopback ports, wait for /readyz, install tgp's CRDs; stop everything and
    remove the working directory (unless one was given) when the block exits."""
    bins = bin_dir or binary_dir()
    own_dir = workdir is None
    work = workdir or Path(tempfile.mkdtemp(prefix="tgp-kube-"))
    work.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(24)
    ca_file, serving = _certificates(work)
    sa_key = _service_account_key(work)
    (work / "tokens.csv").write_text(f'{token},tgp-test-admin,tgp-test-admin,"system:masters"\n')
    etcd_port, etcd_peer, api_port = _free_ports(3)
    url = f"https://127.0.0.1:{api_port}"
    plane = ControlPlane(url=url, kubeconfig=work / "kubeconfig", admin_token=token, ca_file=ca_file, workdir=work)
    _write_kubeconfig(plane.kubeconfig, url, ca_file, token, user="tgp-test-admin")
    try:
        plane.processes["etcd"] = await _spawn(work, bins / "etcd", [
            "--name=default", f"--data-dir={work / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}", f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
            "--unsafe-no-fsync",  # a throwaway store: no fsync keeps a loaded disk out of the timings
            "--log-level=warn",
        ])
        async with httpx.AsyncClient(verify=default_tls(), timeout=5.0) as probe:
            await _until(lambda: _ok(probe, f"http://127.0.0.1:{etcd_port}/health"), START_TIMEOUT, "etcd healthy",
                         plane.processes["etcd"], work)
        plane.processes["kube-apiserver"] = await _spawn(work, bins / "kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={serving[0]}", f"--tls-private-key-file={serving[1]}", f"--client-ca-file={ca_file}",
            f"--token-auth-file={work / 'tokens.csv'}", "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa_key}", f"--service-account-signing-key-file={sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true", "--profiling=false",
            "--v=0",
        ])
        async with plane.http(timeout=5.0) as http:
            await _until(lambda: _ok(http, "/readyz"), START_TIMEOUT, "kube-apiserver /readyz",
                         plane.processes["kube-apiserver"], work)
            plane.version = (await http.get("/version")).json().get("gitVersion", "")
        common = [f"--kubeconfig={plane.kubeconfig}", "--leader-elect=false", "--v=0"]
        if controller_manager:
            plane.processes["kube-controller-manager"] = await _spawn(work, bins / "kube-controller-manager", [
                *common, "--secure-port=0", f"--service-account-private-key-file={sa_key}", f"--root-ca-file={ca_file}",
                "--use-service-account-credentials=false", f"--service-cluster-ip-range={SERVICE_CIDR}",
                # No cloud: the node lifecycle controller must not wait for a cloud provider.
                "--controllers=*,-cloud-node-lifecycle,-service,-route",
            ])
        if scheduler:
            plane.processes["kube-scheduler"] = await _spawn(work, bins / "kube-scheduler", [*common, "--secure-port=0"])
        if crds:
            await plane.apply_crds()
        yield plane
    finally:
        await plane.stop()
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


async def _crd_established(http: httpx.AsyncClient, name: str) -> bool:
    response = await http.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    conditions = response.json().get("status", {}).get("conditions") or [] if response.status_code == 200 else []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


async def _ok(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


async def _until(check: Any, timeout: float, what: str, process: asyncio.subprocess.Process | None = None,
                 work: Path | None = None) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if process is not None and process.returncode is not None:
            raise RuntimeError(f"{what}: the process exited with {process.returncode}\n{_log_tail(work, process)}")
        if loop.time() > deadline:
            raise RuntimeError(f"{what} not reached within {timeout:.0f}s\n{_log_tail(work, process)}")
        await asyncio.sleep(_POLL)


def _log_tail(work: Path | None, process: asyncio.subprocess.Process | None) -> str:
    if work is None or process is None:
        return ""
    name = getattr(process, "_tgp_name", "")
    path = work / f"{name}.log"
    return path.read_text(errors="replace")[-_LOG_TAIL:] if path.exists() else ""


def _die_with_parent() -> None:
    """In the child before exec: kill it when the process that started it dies (Linux), so that
    a launcher killed outright leaves no etcd or apiserver behind (SIGKILL: a throwaway control
    plane has nothing to save, and an apiserver whose etcd is gone takes long to stop)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


async def _spawn(work: Path, binary: Path, args: list[str]) -> asyncio.subprocess.Process:
    log = (work / f"{binary.name}.log").open("ab")
    process = await asyncio.create_subprocess_exec(
        str(binary), *args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=work,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    log.close()
    process._tgp_name = binary.name  # type: ignore[attr-defined]
    return process


async def _stop_process(process: asyncio.subprocess.Process) -> None:
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), STOP_TIMEOUT)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _certificates(work: Path) -> tuple[Path, tuple[Path, Path]]:
    """A throwaway CA and a serving certificate for 127.0.0.1/localhost signed by it."""
    now = dt.datetime.now(dt.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tgp-test-ca")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    names = [x509.DNSName("localhost"), x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default.svc"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("10.0.0.1"))]
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = work / "ca.crt", work / "apiserver.crt", work / "apiserver.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(_private_pem(key))
    return ca_file, (cert_file, key_file)


def _service_account_key(work: Path) -> Path:
    path = work / "sa.key"
    path.write_bytes(_private_pem(rsa.generate_private_key(public_exponent=65537, key_size=2048)))
    return path


def _private_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def _write_kubeconfig(path: Path, url: str, ca_file: Path, token: str, *, user: str) -> None:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "tgp-test",
        "clusters": [{"name": "tgp-test", "cluster": {"server": url, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "tgp-test", "context": {"cluster": "tgp-test", "user": user}}],
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)


async def leftovers(plane: ControlPlane, prefix: str = "tgp-test-") -> list[str]:
    """What tests left behind: any Namespace but the system ones, Nodes named `prefix...`, and
    any Secret outside the system namespaces."""
    found: list[str] = []
    async with plane.http() as http:

        async def none_terminating() -> bool:
            items = (await http.get("/api/v1/namespaces")).json().get("items", [])
            return not any(i["metadata"].get("deletionTimestamp") for i in items)

        # The namespace controller empties a deleted namespace in seconds; what is still there
        # after LEFTOVER_TIMEOUT is reported as left behind.
        with contextlib.suppress(RuntimeError):
            await _until(none_terminating, LEFTOVER_TIMEOUT, "deleted namespaces gone")
        for item in (await http.get("/api/v1/namespaces")).json().get("items", []):
            if item["metadata"]["name"] not in SYSTEM_NAMESPACES:
                found.append(f"Namespace {item['metadata']['name']}")
        for item in (await http.get("/api/v1/nodes")).json().get("items", []):
            if item["metadata"]["name"].startswith(prefix):
                found.append(f"Node {item['metadata']['name']}")
        for item in (await http.get("/api/v1/secrets")).json().get("items", []):
            meta = item["metadata"]
            if meta["namespace"] not in SYSTEM_NAMESPACES - {"default"}:
                found.append(f"Secret {meta['namespace']}/{meta['name']}")
    return found


async def _run(command: list[str], args: argparse.Namespace) -> int:
    try:
        bins = binary_dir()
    except ControlPlaneUnavailable as exc:
        print(f"real-cluster lane: {exc}", flush=True)
        return 3
    # SIGTERM and SIGINT (even when a non-interactive shell ignored it) stop the command and
    # the control plane in order, instead of killing this process outright.
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(stop_signal, main_task.cancel)
    async with control_plane(bins, scheduler=not args.no_scheduler, controller_manager=not args.no_controller_manager) as plane:
        print(f"real control plane: kube-apiserver {plane.version} at {plane.url} (binaries {bins})\n"
              f"kubectl: export KUBECONFIG={plane.kubeconfig}", flush=True)
        env = {**os.environ, KUBECONFIG_ENV: str(plane.kubeconfig), OWN_CONTROL_PLANE_ENV: "1"}
        child = await asyncio.create_subprocess_exec(*command, env=env)
        try:
            code = await child.wait()
        except asyncio.CancelledError:
            await _stop_process(child)
            raise
        left = await leftovers(plane)
        if left:
            print(f"real-cluster lane: tests left behind {len(left)} objects: {', '.join(left[:20])}", flush=True)
            code = code or 1
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.kube_control_plane", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    run = sub.add_parser("run", help="start the control plane, run a command with $TGP_TEST_KUBECONFIG, stop")
    run.add_argument("--no-scheduler", action="store_true")
    run.add_argument("--no-controller-manager", action="store_true")
    run.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run needs a command after --")
    try:
        return asyncio.run(_run(command, args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("real control plane: stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
