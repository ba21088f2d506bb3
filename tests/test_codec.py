"""Payload encryption: the AES-GCM codec, its keys from the environment, a real workflow run
whose history holds only ciphertext, and the codec server over HTTP."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import pickle
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import httpx
import pytest
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf import json_format
from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DefaultFailureConverterWithEncodedAttributes, WorkflowSerializationContext
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.http_wire import default_tls
from tests.test_node_lifecycle import readable, temporal_cli
from workers.codec import (
    ENCODING,
    NONCE_BYTES,
    EncryptionCodec,
    PayloadDecryptError,
    build_codec_server,
    codec_token_from_env,
    parse_payload_keys,
    run_codec_server,
)
from tgp.errors import ConfigError
from workers.temporal import DATA_CONVERTER, data_converter


def key_entry(key_id: str) -> str:
    return f"{key_id}:{base64.b64encode(os.urandom(32)).decode()}"


def codec(*entries: str) -> EncryptionCodec:
    return EncryptionCodec(parse_payload_keys(",".join(entries)))


def plain(text: str) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(text).encode())


# -- the codec -----------------------------------------------------------------------------------


async def test_round_trip_encrypts_with_a_fresh_nonce_and_names_the_key() -> None:
    c = codec(key_entry("k1"))
    original = [plain("tskey-marker"), plain("tskey-marker")]
    encoded = await c.encode(original)
    for p in encoded:
        assert p.metadata["encoding"] == ENCODING and p.metadata["encryption-key-id"] == b"k1"
        assert b"tskey-marker" not in p.SerializeToString()
    assert encoded[0].data != encoded[1].data  # random nonce: equal inputs, different ciphertexts
    assert await c.decode(encoded) == original


async def test_unencrypted_payloads_pass_through_decode() -> None:
    c = codec(key_entry("k1"))
    mixed = [plain("old, written before encryption"), *(await c.encode([plain("new")]))]
    assert await c.decode(mixed) == [plain("old, written before encryption"), plain("new")]


async def test_a_payload_from_an_old_key_decodes_after_rotation() -> None:
    old = key_entry("k1")
    before = await codec(old).encode([plain("history from last month")])
    rotated = codec(key_entry("k2"), old)  # new key first: it encrypts, both decrypt
    assert await rotated.decode(before) == [plain("history from last month")]
    [after] = await rotated.encode([plain("x")])
    assert after.metadata["encryption-key-id"] == b"k2"


async def test_an_unknown_key_id_is_a_clear_error() -> None:
    encoded = await codec(key_entry("k1")).encode([plain("x")])
    with pytest.raises(PayloadDecryptError, match=r"key id 'k1', which TGP_PAYLOAD_KEYS lacks \(it has k2\)"):
        await codec(key_entry("k2")).decode(encoded)


async def test_a_different_key_under_the_same_id_is_a_clear_error() -> None:
    encoded = await codec(key_entry("k1")).encode([plain("x")])
    with pytest.raises(PayloadDecryptError, match="replaced under the same id"):
        await codec(key_entry("k1")).decode(encoded)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "set but empty"),
        ("k1", "entry 1 of TGP_PAYLOAD_KEYS is not id:base64key"),
        ("k1:", "entry 1 of TGP_PAYLOAD_KEYS is not id:base64key"),
        (":" + key_entry("k1").split(":")[1], "entry 1 .* bad key id"),
        ("k1:not*base64", "key 'k1' in TGP_PAYLOAD_KEYS is not valid standard base64"),
        ("k1:" + base64.b64encode(b"short").decode(), "is 5 bytes; it must be 32"),
        (key_entry("k1") + "," + key_entry("k1"), "'k1' appears twice"),
    ],
    # Names that do not carry the random keys: every collection (each xdist worker's) agrees.
    ids=["empty", "no-colon", "no-key", "no-id", "not-base64", "short-key", "duplicate-id"],
)
def test_malformed_keys_say_what_to_fix_without_echoing_the_key(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_payload_keys(value)
    secrets = [part.partition(":")[2] for part in value.split(",")]
    assert not [s for s in secrets if s and s in str(err.value)]


def test_a_key_written_without_its_id_is_not_quoted() -> None:
    key = base64.b64encode(os.urandom(32)).decode()
    with pytest.raises(ConfigError) as err:
        parse_payload_keys(f"{key},{key_entry('k2')}")
    assert key not in str(err.value) and key[:20] not in str(err.value)


def test_data_converter_adds_the_codec_only_when_keys_are_set() -> None:
    assert data_converter({}) is DATA_CONVERTER
    encrypted = data_converter({"TGP_PAYLOAD_KEYS": key_entry("k1")})
    assert isinstance(encrypted.payload_codec, EncryptionCodec)
    assert isinstance(encrypted.failure_converter, DefaultFailureConverterWithEncodedAttributes)
    assert encrypted.payload_converter_class is DATA_CONVERTER.payload_converter_class  # still pydantic
    with pytest.raises(ConfigError, match="entry 1 of TGP_PAYLOAD_KEYS"):
        data_converter({"TGP_PAYLOAD_KEYS": "oops"})



def test_the_data_converters_the_sdk_makes_share_one_pydantic_converter_and_its_type_cache() -> None:
    """The SDK makes data converters (dataclasses.replace, with_context) several times for each
    workflow activation; each makes its payload converter anew from the class. They share one,
    with the TypeAdapters it cached, and it converts as Temporal's pydantic converter does."""
    made = dataclasses.replace(DATA_CONVERTER, payload_codec=None)
    inner = made.payload_converter._inner_payload_converter  # type: ignore[attr-defined]
    assert inner is DATA_CONVERTER.payload_converter._inner_payload_converter  # type: ignore[attr-defined]
    value = Greeting(marker="hi")
    [payload] = made.payload_converter.to_payloads([value])
    assert pydantic_data_converter.payload_converter.from_payloads([payload], [Greeting]) == [value]
    assert DATA_CONVERTER.payload_converter.from_payloads([payload], [Greeting]) == [value]
    # A copy for a serialization context, or one unpickled, is that one converter, unchanged.
    context = WorkflowSerializationContext(namespace="default", workflow_id="w")
    assert inner.with_context(context) is inner and pickle.loads(pickle.dumps(inner)) is inner


# -- a real workflow run on the dev server -------------------------------------------------------


class Greeting(BaseModel):
    marker: str
    fail: bool = False


@activity.defn(name="codec_test_greet")
async def greet(greeting: Greeting) -> str:
    if greeting.fail:
        raise ApplicationError(f"cannot greet {greeting.marker}", non_retryable=True)
    return f"hello {greeting.marker}"


# Unsandboxed: the sandbox would re-import this test module and everything it imports.
@workflow.defn(name="CodecTestWorkflow", sandboxed=False)
class GreetWorkflow:
    @workflow.run
    async def run(self, greeting: Greeting) -> str:
        return await workflow.execute_activity(
            greet, greeting, start_to_close_timeout=timedelta(seconds=10), retry_policy=RetryPolicy(maximum_attempts=1)
        )


@asynccontextmanager
async def encrypting_worker(env: WorkflowEnvironment, keys: str) -> AsyncIterator[tuple[Client, str]]:
    config = env.client.config()
    config["data_converter"] = data_converter({"TGP_PAYLOAD_KEYS": keys})
    client = Client(**config)
    task_queue = f"codec-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=task_queue, workflows=[GreetWorkflow], activities=[greet]):
        yield client, task_queue


def exported(env: WorkflowEnvironment, workflow_id: str, *codec_flags: str) -> str:
    return temporal_cli(env, "workflow", "show", "--workflow-id", workflow_id, "--output", "json", *codec_flags).stdout


async def test_history_holds_only_ciphertext_and_the_result_decodes(temporal: WorkflowEnvironment) -> None:
    marker = f"tskey-auth-{uuid.uuid4().hex}"
    keys = key_entry("k1")
    async with encrypting_worker(temporal, keys) as (client, queue):
        wf_id = f"codec-test-{uuid.uuid4().hex[:8]}"
        result = await client.execute_workflow(GreetWorkflow.run, Greeting(marker=marker), id=wf_id, task_queue=queue)
    assert result == f"hello {marker}"

    history = exported(temporal, wf_id)
    assert marker not in readable(history)
    encodings = [
        base64.b64decode(p["metadata"]["encoding"])
        for event in json.loads(history)["events"]
        for p in _payloads(event)
    ]
    # workflow input, activity input, activity result, workflow result
    assert len(encodings) >= 4 and set(encodings) == {ENCODING}

    # The `temporal` CLI shows it decrypted through the codec server.
    c = codec(keys)
    async with TestServer(build_codec_server(c, token="s3cret"), host="127.0.0.1") as server:
        endpoint = str(server.make_url("")).rstrip("/")
        # In a thread: the codec server answers on this test's event loop.
        decoded = await asyncio.to_thread(exported, temporal, wf_id, "--codec-endpoint", endpoint, "--codec-auth", "Bearer s3cret")
    assert marker in readable(decoded)


async def test_a_failure_message_is_encrypted_too(temporal: WorkflowEnvironment) -> None:
    marker = f"tskey-auth-{uuid.uuid4().hex}"
    async with encrypting_worker(temporal, key_entry("k1")) as (client, queue):
        wf_id = f"codec-test-{uuid.uuid4().hex[:8]}"
        with pytest.raises(WorkflowFailureError) as err:
            await client.execute_workflow(GreetWorkflow.run, Greeting(marker=marker, fail=True), id=wf_id, task_queue=queue)
    cause = err.value.cause
    while cause.__cause__ is not None:
        cause = cause.__cause__
    assert str(cause) == f"cannot greet {marker}"  # the client decrypts it
    history = exported(temporal, wf_id)
    assert marker not in readable(history) and "Encoded failure" in history


def _payloads(node: object) -> list[dict[str, dict[str, str]]]:
    """Every Payload (a dict with `metadata` and `data`) in an exported history event."""
    found: list[dict[str, dict[str, str]]] = []
    if isinstance(node, dict):
        if "metadata" in node and "data" in node:
            found.append(node)
        else:
            for value in node.values():
                found += _payloads(value)
    elif isinstance(node, list):
        for value in node:
            found += _payloads(value)
    return found


# -- the codec server ----------------------------------------------------------------------------


@asynccontextmanager
async def codec_server(c: EncryptionCodec, token: str | None) -> AsyncIterator[httpx.AsyncClient]:
    # As the Web UI and the temporal CLI send them (the codec server protocol): JSON bodies.
    async with TestServer(build_codec_server(c, token=token), host="127.0.0.1") as server, httpx.AsyncClient(verify=default_tls(), 
        base_url=str(server.make_url("")), headers={"Content-Type": "application/json"}
    ) as http:
        yield http


def body(payloads: list[Payload]) -> str:
    return json_format.MessageToJson(Payloads(payloads=payloads))


async def test_codec_server_decodes_over_http_with_the_token() -> None:
    c = codec(key_entry("k1"))
    encrypted = await c.encode([plain("tskey-marker")])
    async with codec_server(c, "s3cret") as http:
        for path in ("/decode", "/default/decode"):
            r = await http.post(path, content=body(encrypted), headers={"Authorization": "Bearer s3cret", "X-Namespace": "default"})
            assert r.status_code == 200, r.text
            assert list(json_format.Parse(r.text, Payloads()).payloads) == [plain("tskey-marker")]
        r = await http.post("/encode", content=body([plain("y")]), headers={"Authorization": "Bearer s3cret"})
        [back] = json_format.Parse(r.text, Payloads()).payloads
        assert back.metadata["encoding"] == ENCODING and await c.decode([back]) == [plain("y")]


async def test_codec_server_refuses_a_missing_or_wrong_token() -> None:
    c = codec(key_entry("k1"))
    encrypted = body(await c.encode([plain("tskey-marker")]))
    async with codec_server(c, "s3cret") as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = await http.post("/decode", content=encrypted, headers=headers)
            assert r.status_code == 401 and "tskey-marker" not in r.text


async def test_codec_server_answers_the_web_ui_preflight_and_bad_input() -> None:
    c = codec(key_entry("k1"))
    async with codec_server(c, "s3cret") as http:
        ui = {"Origin": "http://localhost:8233", "Access-Control-Request-Method": "POST"}
        r = await http.options("/default/decode", headers=ui)  # browsers send no token here
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:8233"
        assert {"content-type", "x-namespace"} <= {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
        r = await http.options("/decode", headers={**ui, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers

        auth = {"Authorization": "Bearer s3cret"}
        r = await http.post("/decode", content="not json", headers=auth)
        assert r.status_code == 400
        foreign = await codec(key_entry("k9")).encode([plain("x")])
        r = await http.post("/decode", content=body(foreign), headers=auth)
        assert r.status_code == 400 and "'k9'" in r.text


async def test_codec_server_without_a_token_needs_none() -> None:
    c = codec(key_entry("k1"))
    async with codec_server(c, None) as http:
        r = await http.post("/decode", content=body(await c.encode([plain("x")])))
        assert r.status_code == 200


def test_an_empty_codec_token_is_a_config_error() -> None:
    assert codec_token_from_env({}) is None
    assert codec_token_from_env({"TGP_CODEC_TOKEN": "t"}) == "t"
    with pytest.raises(ConfigError, match="TGP_CODEC_TOKEN is set but empty"):
        codec_token_from_env({"TGP_CODEC_TOKEN": " "})


# -- hardening: key-id binding and the codec server against web pages ----------------------------


async def test_a_payload_relabelled_with_another_configured_key_id_does_not_decrypt() -> None:
    # The same key material under two ids (say, re-added under a new id during a rotation):
    # without binding the id into the ciphertext, a relabelled payload would still decrypt.
    secret = key_entry("k1").split(":", 1)[1]
    c = codec(f"k1:{secret}", f"k2:{secret}", key_entry("k3"))
    [encrypted] = await c.encode([plain("tskey-marker")])
    for other in (b"k2", b"k3"):
        relabelled = Payload()
        relabelled.CopyFrom(encrypted)
        relabelled.metadata["encryption-key-id"] = other
        with pytest.raises(PayloadDecryptError, match="does not decrypt"):
            await c.decode([relabelled])
    assert await c.decode([encrypted]) == [plain("tskey-marker")]


async def test_a_payload_written_before_the_key_id_was_bound_still_decodes() -> None:
    # The earlier format: the same nonce + ciphertext, but no associated data.
    entry = key_entry("k1")
    secret = base64.b64decode(entry.split(":", 1)[1])
    nonce = os.urandom(NONCE_BYTES)
    legacy = Payload(
        metadata={"encoding": ENCODING, "encryption-key-id": b"k1"},
        data=nonce + AESGCM(secret).encrypt(nonce, plain("old history").SerializeToString(), None),
    )
    assert await codec(entry).decode([legacy]) == [plain("old history")]


async def test_codec_server_refuses_a_host_it_does_not_serve() -> None:
    # DNS rebinding: a page on evil.example re-points its name at 127.0.0.1 and calls the codec
    # server "same-origin", so no CORS check stops it; only the Host header tells.
    c = codec(key_entry("k1"))
    encrypted = body(await c.encode([plain("tskey-marker")]))
    async with codec_server(c, None) as http:
        port = http.base_url.port
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}"):
            r = await http.post("/decode", content=encrypted, headers={"Host": host})
            assert r.status_code == 421 and "tskey-marker" not in r.text, (host, r.text)
            r = await http.options("/decode", headers={"Host": host, "Origin": f"http://{host}"})
            assert r.status_code == 421
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}"):
            r = await http.post("/decode", content=encrypted, headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
    async with TestServer(build_codec_server(c, token="t", allowed_hosts=["codec.example"]), host="127.0.0.1") as server:
        async with httpx.AsyncClient(verify=default_tls(), base_url=str(server.make_url(""))) as http:
            ok = {"Authorization": "Bearer t", "Content-Type": "application/json"}
            assert (await http.post("/decode", content=encrypted, headers={**ok, "Host": "codec.example:443"})).status_code == 200
            assert (await http.post("/decode", content=encrypted, headers={**ok, "Host": "localhost"})).status_code == 421


async def test_encode_needs_the_token_and_is_off_without_one() -> None:
    # /encode makes payloads that workers accept as genuine (a forged signal or input).
    c = codec(key_entry("k1"))
    async with codec_server(c, None) as http:
        r = await http.post("/encode", content=body([plain("forged")]))
        assert r.status_code == 401 and "TGP_CODEC_TOKEN" in r.text
        r = await http.post("/default/encode", content=body([plain("forged")]))
        assert r.status_code == 401
        assert (await http.post("/decode", content=body(await c.encode([plain("x")])))).status_code == 200
    async with codec_server(c, "s3cret") as http:
        assert (await http.post("/encode", content=body([plain("y")]))).status_code == 401
        r = await http.post("/encode", content=body([plain("y")]), headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200


async def test_codec_server_refuses_bodies_a_page_can_send_without_a_preflight() -> None:
    # text/plain, form and multipart POSTs are CORS-"simple": a browser sends them cross-site
    # without asking first. JSON needs the preflight, which only configured origins pass.
    c = codec(key_entry("k1"))
    encrypted = body(await c.encode([plain("x")]))
    async with codec_server(c, None) as http:
        for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = await http.post("/decode", content=encrypted, headers={"Content-Type": kind})
            assert r.status_code == 415, (kind, r.text)
        r = await http.post("/decode", content=encrypted, headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200
    async with codec_server(c, "s3cret") as http:
        r = await http.post("/decode", content=encrypted, headers={"Content-Type": "text/plain", "Authorization": "Bearer s3cret"})
        assert r.status_code == 415


async def test_other_host_names_need_the_token() -> None:
    with pytest.raises(ConfigError, match="TGP_CODEC_TOKEN to answer to --allowed-host"):
        await run_codec_server(codec(key_entry("k1")), host="127.0.0.1", port=0, token=None, cors_origins=[], allowed_hosts=["codec.example"])
