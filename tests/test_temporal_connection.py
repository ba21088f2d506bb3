"""Production Temporal: TLS, mutual TLS and API keys for the worker, the bridge and the CLI.

The dev server speaks plaintext gRPC only (`temporal server start-dev` has no TLS flags), so
these tests put a TLS-terminating proxy in front of it (tests/tls_proxy.py) with a throwaway
CA: it requires a client certificate signed by that CA, and it decodes the HTTP/2 request
headers that pass through, so the API key test checks what really went over the wire.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

import pytest
from temporalio import workflow
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.tls_proxy import Pki, authorization, make_pki, tls_proxy
from tgp.errors import ConfigError
from workers.temporal import TemporalConnectError, TemporalSettings, connect
from workers.main import SWEEPER_SCHEDULE_ID

API_KEY = "tgp-test-api-key-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def upstream(env: WorkflowEnvironment) -> str:
    return env.client.service_client.config.target_host


def mtls_env(address: str, pki: Pki, **extra: str) -> dict[str, str]:
    return {
        "TEMPORAL_ADDRESS": address,
        "TEMPORAL_TLS_CLIENT_CERT_PATH": str(pki.client_cert),
        "TEMPORAL_TLS_CLIENT_KEY_PATH": str(pki.client_key),
        "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(pki.ca),
        **extra,
    }


@workflow.defn(name="TlsTestWorkflow", sandboxed=False)
class Hello:
    @workflow.run
    async def run(self, name: str) -> str:
        return f"hello {name}"


# -- over the wire ---------------------------------------------------------------------------------


async def test_mutual_tls_runs_a_workflow_through_a_tls_frontend(temporal: WorkflowEnvironment, pki: Pki) -> None:
    async with tls_proxy(upstream(temporal), pki, require_client_cert=True) as proxy:
        client = await connect(TemporalSettings.from_env(mtls_env(proxy.address, pki)))
        queue = f"tls-{uuid.uuid4().hex[:8]}"
        async with Worker(client, task_queue=queue, workflows=[Hello]):
            result = await client.execute_workflow(Hello.run, "tls", id=f"tls-test-{uuid.uuid4().hex[:8]}", task_queue=queue)
        assert result == "hello tls"
        paths = {r[":path"] for r in proxy.requests}
        assert "/temporal.api.workflowservice.v1.WorkflowService/PollWorkflowTaskQueue" in paths  # the worker too
        assert not authorization(proxy.requests)  # no API key configured, none sent

        # The same frontend refuses a client without a certificate; the error says what to add.
        no_cert = TemporalSettings.from_env({"TEMPORAL_ADDRESS": proxy.address, "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(pki.ca)})
        with pytest.raises(TemporalConnectError, match="may require a client certificate") as err:
            await connect(no_cert)
        assert proxy.address in str(err.value) and "TEMPORAL_TLS_CLIENT_CERT_PATH" in str(err.value)
        # And a plaintext client (the default, for the dev server) is told TLS may be needed.
        with pytest.raises(TemporalConnectError, match=r"plaintext, no TLS\): the server closed the connection: it may require TLS"):
            await connect(TemporalSettings.from_env({"TEMPORAL_ADDRESS": proxy.address}))


async def test_a_wrong_ca_names_the_address_and_the_setting(temporal: WorkflowEnvironment, pki: Pki) -> None:
    async with tls_proxy(upstream(temporal), pki) as proxy:
        wrong = TemporalSettings.from_env(mtls_env(proxy.address, pki, TEMPORAL_TLS_SERVER_CA_CERT_PATH=str(pki.other_ca)))
        with pytest.raises(TemporalConnectError) as err:
            await connect(wrong)
    message = str(err.value)
    assert message.startswith(f"cannot connect to Temporal at {proxy.address}")
    assert f"not signed by a CA in --tls-ca-path / TEMPORAL_TLS_SERVER_CA_CERT_PATH={pki.other_ca}" in message


async def test_the_server_name_is_what_the_certificate_is_checked_against(temporal: WorkflowEnvironment, pki: Pki) -> None:
    async with tls_proxy(upstream(temporal), pki) as proxy:
        with pytest.raises(TemporalConnectError, match="set --tls-server-name / TEMPORAL_TLS_SERVER_NAME to a name it holds"):
            await connect(TemporalSettings.from_env(mtls_env(proxy.address, pki, TEMPORAL_TLS_SERVER_NAME="temporal.example")))
        client = await connect(TemporalSettings.from_env(mtls_env(proxy.address, pki, TEMPORAL_TLS_SERVER_NAME="localhost")))
        await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"))
    assert {r[":authority"] for r in proxy.requests} == {"localhost"}  # SNI and :authority follow it


async def test_an_api_key_goes_out_as_bearer_metadata_on_every_call(temporal: WorkflowEnvironment, pki: Pki) -> None:
    # Temporal Cloud style: server-authenticated TLS plus an API key, no client certificate.
    async with tls_proxy(upstream(temporal), pki, require_client_cert=False) as proxy:
        settings = TemporalSettings.from_env(
            {"TEMPORAL_ADDRESS": proxy.address, "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(pki.ca), "TEMPORAL_API_KEY": API_KEY}
        )
        client = await connect(settings)
        await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"))
    assert len(proxy.requests) >= 2  # GetSystemInfo at connect, then DescribeNamespace
    assert [r.get("authorization") for r in proxy.requests] == [f"Bearer {API_KEY}"] * len(proxy.requests)


async def tgp_cli(*args: str, env: dict[str, str]) -> tuple[int, str]:
    """Run `tgp` in a subprocess (the proxy keeps serving on this event loop meanwhile)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "TGP_", "TS_", "HEADSCALE_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workers.cli", *args, env={**clean, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode or 0, out.decode()


async def test_the_cli_reports_a_wrong_ca_in_one_line_without_the_api_key(temporal: WorkflowEnvironment, pki: Pki) -> None:
    async with tls_proxy(upstream(temporal), pki, require_client_cert=False) as proxy:
        code, out = await tgp_cli(
            "worker", "--address", proxy.address, "--tls-ca-path", str(pki.other_ca), env={"TEMPORAL_API_KEY": API_KEY}
        )
    assert code == 2, out
    assert out.startswith(f"tgp: cannot connect to Temporal at {proxy.address}"), out
    assert "TEMPORAL_TLS_SERVER_CA_CERT_PATH" in out and "API key from TEMPORAL_API_KEY" in out
    assert "Traceback" not in out and API_KEY not in out


async def test_the_worker_cli_connects_with_tls_and_an_api_key_from_the_environment(temporal: WorkflowEnvironment, pki: Pki) -> None:
    existed = True
    try:
        await temporal.client.get_schedule_handle(SWEEPER_SCHEDULE_ID).describe()
    except Exception:
        existed = False
    try:
        async with tls_proxy(upstream(temporal), pki, require_client_cert=False) as proxy:
            env = {"TEMPORAL_ADDRESS": proxy.address, "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(pki.ca), "TEMPORAL_API_KEY": API_KEY}
            code, out = await tgp_cli("worker", "--task-queue", f"tls-{uuid.uuid4().hex[:8]}", env=env)
        # It got through Temporal (search attributes, the sweeper's Schedule) and stopped at the
        # next thing this test does not give it: a tailnet (no provider key is needed: classes
        # may bring their own, providers[].credentialsRef). Its last line: the Schedule's setup may
        # log before it (a sweep another test's worker left on its own queue, ended at a quarter).
        assert code == 2 and out.strip().splitlines()[-1].startswith("tgp: no tailnet configured") and "Traceback" not in out, out
        paths = {r[":path"].rsplit("/", 1)[1] for r in proxy.requests}
        assert {"GetSystemInfo", "ListSearchAttributes", "CreateSchedule"} <= paths, paths
        assert authorization(proxy.requests) == {f"Bearer {API_KEY}"}
        assert API_KEY not in out
    finally:
        if not existed:
            try:
                await temporal.client.get_schedule_handle(SWEEPER_SCHEDULE_ID).delete()
            except Exception:
                pass


# -- settings --------------------------------------------------------------------------------------


def test_settings_use_the_temporal_cli_names_and_flags_override_them(pki: Pki) -> None:
    env = {**mtls_env("temporal.example:7233", pki), "TEMPORAL_NAMESPACE": "prod", "TEMPORAL_TLS_SERVER_NAME": "frontend"}
    settings = TemporalSettings.from_env(env)
    assert (settings.address, settings.namespace, settings.tls_server_name) == ("temporal.example:7233", "prod", "frontend")
    tls = settings.tls_config()
    assert not isinstance(tls, bool)
    assert tls.client_cert == pki.client_cert.read_bytes() and tls.client_private_key == pki.client_key.read_bytes()
    assert tls.server_root_ca_cert == pki.ca.read_bytes() and tls.domain == "frontend"

    flags = TemporalSettings.from_env(env, address="other:7233", namespace=None, tls_ca_path=str(pki.other_ca))
    assert flags.address == "other:7233" and flags.namespace == "prod" and flags.tls_ca_path == str(pki.other_ca)

    assert TemporalSettings.from_env({}).tls_config() is False  # the dev server: plaintext
    assert TemporalSettings.from_env({"TEMPORAL_TLS": "true"}).tls_config() is True  # system CAs
    assert TemporalSettings.from_env({"TEMPORAL_API_KEY": API_KEY}).tls_config() is True  # an API key implies TLS
    inline = TemporalSettings.from_env({"TEMPORAL_TLS_SERVER_CA_CERT_DATA": pki.ca.read_text()}).tls_config()
    assert not isinstance(inline, bool) and inline.server_root_ca_cert == pki.ca.read_bytes()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TEMPORAL_TLS_CLIENT_CERT_PATH": "{cert}"}, "--tls-cert-path / TEMPORAL_TLS_CLIENT_CERT_PATH is set, --tls-key-path / TEMPORAL_TLS_CLIENT_KEY_PATH is not"),
        ({"TEMPORAL_TLS_CLIENT_KEY_DATA": "{key_data}"}, "TEMPORAL_TLS_CLIENT_CERT_PATH is not"),
        ({"TEMPORAL_TLS_SERVER_CA_CERT_PATH": "/nonexistent/ca.pem"}, "cannot read --tls-ca-path / TEMPORAL_TLS_SERVER_CA_CERT_PATH=/nonexistent/ca.pem"),
        ({"TEMPORAL_TLS": "false", "TEMPORAL_TLS_SERVER_CA_CERT_PATH": "{ca}"}, "TEMPORAL_TLS is false but"),
        ({"TEMPORAL_TLS": "maybe"}, "TEMPORAL_TLS must be true or false"),
        ({"TEMPORAL_TLS_DISABLE_HOST_VERIFICATION": "true"}, "not supported: .* TEMPORAL_TLS_SERVER_NAME"),
        (
            {"TEMPORAL_TLS_CLIENT_KEY_PATH": "{key}", "TEMPORAL_TLS_CLIENT_KEY_DATA": "{key_data}"},
            "either --tls-key-path / TEMPORAL_TLS_CLIENT_KEY_PATH or TEMPORAL_TLS_CLIENT_KEY_DATA",
        ),
    ],
)
def test_bad_tls_settings_say_what_to_fix_and_never_quote_the_key(pki: Pki, env: dict[str, str], message: str) -> None:
    key_data = pki.client_key.read_text()
    values = {"cert": str(pki.client_cert), "key": str(pki.client_key), "ca": str(pki.ca), "key_data": key_data}
    with pytest.raises(ConfigError, match=message) as err:
        TemporalSettings.from_env({k: v.format(**values) if v.startswith("{") else v for k, v in env.items()})
    assert "PRIVATE KEY" not in str(err.value)


def test_secrets_stay_out_of_repr_and_describe(pki: Pki) -> None:
    key_data = pki.client_key.read_text()
    settings = TemporalSettings.from_env(
        {
            "TEMPORAL_ADDRESS": "ns.acct.tmprl.cloud:7233",
            "TEMPORAL_API_KEY": API_KEY,
            "TEMPORAL_TLS_CLIENT_CERT_DATA": pki.client_cert.read_text(),
            "TEMPORAL_TLS_CLIENT_KEY_DATA": key_data,
        }
    )
    for text in (repr(settings), str(settings), settings.describe()):
        assert API_KEY not in text and "PRIVATE KEY" not in text
    assert settings.describe() == (
        "ns.acct.tmprl.cloud:7233 (namespace default, TLS verified against system CAs, client certificate inline, "
        "API key from TEMPORAL_API_KEY)"
    )
    assert settings.scrub(f"error near {API_KEY}") == "error near ***"
