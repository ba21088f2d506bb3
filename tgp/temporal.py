"""Temporal wiring shared by the worker, the bridge, the CLI and the tests."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError, RPCStatusCode
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes

from tgp.codec import EncryptionCodec
from tgp.types import SEARCH_ATTRIBUTES

# Pydantic models (with timedelta, Decimal, datetime) cross the Temporal boundary as JSON.
# Unencrypted: the tests, the demo and replays of tests/histories/ use it as is.
DATA_CONVERTER = pydantic_data_converter

_INDEXED = {"Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD, "Double": IndexedValueType.INDEXED_VALUE_TYPE_DOUBLE}


def search_attribute_keys() -> list[SearchAttributeKey]:  # type: ignore[type-arg]
    """Typed keys of tgp's search attributes (for WorkflowEnvironment.start_local)."""
    make = {"Keyword": SearchAttributeKey.for_keyword, "Double": SearchAttributeKey.for_float}
    return [make[kind](name) for name, kind in SEARCH_ATTRIBUTES.items()]


def dev_server_args() -> list[str]:
    """`--search-attribute Name=Type` flags for `temporal server start-dev`."""
    args: list[str] = []
    for name, kind in SEARCH_ATTRIBUTES.items():
        args += ["--search-attribute", f"{name}={kind}"]
    return args


def data_converter(env: Mapping[str, str] = os.environ) -> DataConverter:
    """The pydantic converter, plus AES-GCM payload encryption when `TGP_PAYLOAD_KEYS` is set
    (see docs/security.md). Failure messages and stack traces then move into an encoded (so
    encrypted) attribute too; otherwise they would reach history in plain text."""
    codec = EncryptionCodec.from_env(env)
    if codec is None:
        return DATA_CONVERTER
    return dataclasses.replace(
        DATA_CONVERTER, payload_codec=codec, failure_converter_class=DefaultFailureConverterWithEncodedAttributes
    )


async def connect(address: str, namespace: str) -> Client:
    """A client (and so its workers) using `data_converter()` of this process's environment."""
    return await Client.connect(address, namespace=namespace, data_converter=data_converter())


async def ensure_search_attributes(client: Client) -> None:
    """Register tgp's search attributes if the namespace lacks them; an unregistered one makes
    every workflow task fail (and retry forever)."""
    try:
        existing = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=client.namespace))
        present = set(existing.custom_attributes)
    except RPCError as exc:
        if exc.status is not RPCStatusCode.UNIMPLEMENTED:  # the time-skipping test server has no list
            raise
        present = set()
    missing = {n: _INDEXED[k] for n, k in SEARCH_ATTRIBUTES.items() if n not in present}
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=client.namespace, search_attributes=missing)
        )
