"""Temporal wiring shared by the worker, the bridge, the CLI and the tests."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import SecretStr

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.runtime import Runtime
from temporalio.service import RPCError, RPCStatusCode, TLSConfig
from temporalio.contrib.pydantic import PydanticPayloadConverter, pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes

from workers.codec import EncryptionCodec
from tgp.errors import ConfigError, TgpError
from tgp.types import SEARCH_ATTRIBUTES


class OnePydanticConverter(PydanticPayloadConverter):
    """Temporal's pydantic payload converter, made once per process.

    The SDK makes a DataConverter, and with it a new payload converter, several times for each
    workflow activation (a data converter for the activation's decoding and one for its
    completion's encoding, one more for each serialization context): ~4% of the worker's CPU in
    a burst, and each new converter started with an empty cache of pydantic TypeAdapters. A
    converter holds nothing of any one run (its options and that cache), so one serves them all."""

    _made: ClassVar[OnePydanticConverter | None] = None

    def __new__(cls) -> OnePydanticConverter:
        if cls._made is None:
            made = super().__new__(cls)
            PydanticPayloadConverter.__init__(made)
            cls._made = made
        return cls._made

    def __init__(self) -> None:
        """Made once, in `__new__`."""

    def with_context(self, context: Any) -> OnePydanticConverter:
        """Itself: none of its converters takes a serialization context, and a copy made for one
        (the SDK's `type(self)()`) would be this very object, its converters then replaced."""
        return self

    def __reduce__(self) -> tuple[type[OnePydanticConverter], tuple[()]]:
        """Unpickled, it is the process's one converter (unpickling must not rewrite its state)."""
        return OnePydanticConverter, ()


# Pydantic models (with timedelta, Decimal, datetime) cross the Temporal boundary as JSON.
# Unencrypted: the tests, the demo and replays of tests/histories/ use it as is.
DATA_CONVERTER = dataclasses.replace(pydantic_data_converter, payload_converter_class=OnePydanticConverter)

_INDEXED = {
    "Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    "Double": IndexedValueType.INDEXED_VALUE_TYPE_DOUBLE,
    "Datetime": IndexedValueType.INDEXED_VALUE_TYPE_DATETIME,
}


def search_attribute_keys() -> list[SearchAttributeKey]:  # type: ignore[type-arg]
    """Typed keys of tgp's search attributes (for WorkflowEnvironment.start_local)."""
    make = {"Keyword": SearchAttributeKey.for_keyword, "Double": SearchAttributeKey.for_float, "Datetime": SearchAttributeKey.for_datetime}
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


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class _Setting:
    env: str
    flag: str | None  # None: environment only (inline secrets on a command line would show in `ps`)

    def __str__(self) -> str:
        return self.env if self.flag is None else f"{self.flag} / {self.env}"


# The temporal CLI's names (`temporal options`), so one environment serves `tgp` and `temporal`.
ADDRESS = _Setting("TEMPORAL_ADDRESS", "--address")
NAMESPACE = _Setting("TEMPORAL_NAMESPACE", "--namespace")
TLS = _Setting("TEMPORAL_TLS", "--tls")
TLS_CERT_PATH = _Setting("TEMPORAL_TLS_CLIENT_CERT_PATH", "--tls-cert-path")
TLS_KEY_PATH = _Setting("TEMPORAL_TLS_CLIENT_KEY_PATH", "--tls-key-path")
TLS_CA_PATH = _Setting("TEMPORAL_TLS_SERVER_CA_CERT_PATH", "--tls-ca-path")
TLS_CERT_DATA = _Setting("TEMPORAL_TLS_CLIENT_CERT_DATA", None)
TLS_KEY_DATA = _Setting("TEMPORAL_TLS_CLIENT_KEY_DATA", None)
TLS_CA_DATA = _Setting("TEMPORAL_TLS_SERVER_CA_CERT_DATA", None)
TLS_SERVER_NAME = _Setting("TEMPORAL_TLS_SERVER_NAME", "--tls-server-name")
API_KEY = _Setting("TEMPORAL_API_KEY", "--api-key")
_UNSUPPORTED = {
    "TEMPORAL_TLS_DISABLE_HOST_VERIFICATION": "the Python SDK always verifies the server's name: set TEMPORAL_TLS_SERVER_NAME "
    "to the name in its certificate instead",
}


class TemporalConnectError(TgpError):
    """Temporal cannot be reached with the configured address, TLS settings or API key."""

    retryable = False


@dataclass(frozen=True)
class TemporalSettings:
    """Where and how to reach Temporal: a self-hosted frontend (plaintext, TLS or mutual TLS)
    or Temporal Cloud (mTLS or an API key). `from_env` reads the temporal CLI's variable names;
    `tgp worker` / `tgp bridge` flags override them. Secret values (the client key, the API
    key) never appear in `repr`, `describe()` or an error message."""

    address: str = "localhost:7233"
    namespace: str = "default"
    tls: bool | None = None  # None: on when any TLS setting or an API key is given
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    tls_ca_path: str | None = None
    tls_cert_data: str | None = None
    tls_key_data: SecretStr | None = field(default=None, repr=False)
    tls_ca_data: str | None = None
    tls_server_name: str | None = None
    api_key: SecretStr | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **overrides: object) -> TemporalSettings:
        """Settings from the environment; `overrides` (flag values, None = not given) win.
        Raises ConfigError naming the setting to fix."""
        for name, why in _UNSUPPORTED.items():
            if env.get(name, "").strip().lower() not in _FALSE:
                raise ConfigError(f"{name} is not supported: {why}")

        def get(setting: _Setting) -> str | None:
            value = (env.get(setting.env) or "").strip()
            return value or None

        tls_env = get(TLS)
        if tls_env is not None and tls_env.lower() not in _TRUE | _FALSE:
            raise ConfigError(f"{TLS.env} must be true or false, not {tls_env!r}")
        key_data, api_key = env.get(TLS_KEY_DATA.env), get(API_KEY)
        values: dict[str, object] = {
            "address": get(ADDRESS) or cls.address,
            "namespace": get(NAMESPACE) or cls.namespace,
            "tls": None if tls_env is None else tls_env.lower() in _TRUE,
            "tls_cert_path": get(TLS_CERT_PATH),
            "tls_key_path": get(TLS_KEY_PATH),
            "tls_ca_path": get(TLS_CA_PATH),
            "tls_cert_data": env.get(TLS_CERT_DATA.env) or None,
            "tls_key_data": SecretStr(key_data) if key_data else None,
            "tls_ca_data": env.get(TLS_CA_DATA.env) or None,
            "tls_server_name": get(TLS_SERVER_NAME),
            "api_key": SecretStr(api_key) if api_key else None,
        }
        for name, value in overrides.items():
            if value is not None:
                values[name] = SecretStr(value) if name == "api_key" and isinstance(value, str) else value
        settings = cls(**values)  # type: ignore[arg-type]
        settings.tls_config()  # fail at start, naming the setting, not at the first RPC
        return settings

    @property
    def uses_tls(self) -> bool:
        if self.tls is not None:
            return self.tls
        return self.api_key is not None or any(
            (self.tls_cert_path, self.tls_key_path, self.tls_ca_path, self.tls_cert_data, self.tls_key_data, self.tls_ca_data, self.tls_server_name)
        )

    def _pem(self, path: str | None, data: str | SecretStr | None, path_setting: _Setting, data_setting: _Setting) -> bytes | None:
        if path and data:
            raise ConfigError(f"set either {path_setting} or {data_setting}, not both")
        if data is not None:
            return (data.get_secret_value() if isinstance(data, SecretStr) else data).encode()
        if path is None:
            return None
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {path_setting}={path}: {exc.strerror or exc}") from None

    def tls_config(self) -> TLSConfig | bool:
        """What `Client.connect(tls=...)` takes: False, True (system roots) or a TLSConfig."""
        given = [
            s for s, v in ((TLS_CERT_PATH, self.tls_cert_path), (TLS_KEY_PATH, self.tls_key_path), (TLS_CA_PATH, self.tls_ca_path),
                           (TLS_CERT_DATA, self.tls_cert_data), (TLS_KEY_DATA, self.tls_key_data), (TLS_CA_DATA, self.tls_ca_data),
                           (TLS_SERVER_NAME, self.tls_server_name))
            if v
        ]
        if not self.uses_tls:
            if given:
                raise ConfigError(f"{TLS} is false but {', '.join(map(str, given))} is set: drop one or the other")
            return False
        cert = self._pem(self.tls_cert_path, self.tls_cert_data, TLS_CERT_PATH, TLS_CERT_DATA)
        key = self._pem(self.tls_key_path, self.tls_key_data, TLS_KEY_PATH, TLS_KEY_DATA)
        if (cert is None) != (key is None):
            have, lack = (TLS_CERT_PATH, TLS_KEY_PATH) if key is None else (TLS_KEY_PATH, TLS_CERT_PATH)
            raise ConfigError(f"mutual TLS needs both a client certificate and its key: {have} is set, {lack} is not")
        ca = self._pem(self.tls_ca_path, self.tls_ca_data, TLS_CA_PATH, TLS_CA_DATA)
        if cert is None and ca is None and self.tls_server_name is None:
            return True
        return TLSConfig(server_root_ca_cert=ca, domain=self.tls_server_name, client_cert=cert, client_private_key=key)

    def describe(self) -> str:
        """For logs and errors: address, namespace and which TLS and auth settings are in use
        (paths and names, never a key)."""
        parts = [f"namespace {self.namespace}"]
        if not self.uses_tls:
            parts.append("plaintext, no TLS")
        else:
            ca = self.tls_ca_path or ("inline CA" if self.tls_ca_data else "system CAs")
            parts.append(f"TLS verified against {ca}")
            if self.tls_server_name:
                parts.append(f"server name {self.tls_server_name}")
            if self.tls_cert_path or self.tls_cert_data:
                parts.append(f"client certificate {self.tls_cert_path or 'inline'}")
        if self.api_key is not None:
            parts.append(f"API key from {API_KEY.env}")
        return f"{self.address} ({', '.join(parts)})"

    def _explain(self, cause: str) -> str:
        """A hint naming the setting to change, for the errors that have one."""
        if "UnknownIssuer" in cause or "BadSignature" in cause:
            where = f"{TLS_CA_PATH}={self.tls_ca_path}" if self.tls_ca_path else (
                f"{TLS_CA_DATA}" if self.tls_ca_data else f"the system CAs ({TLS_CA_PATH} is unset)"
            )
            return f"the server's certificate is not signed by a CA in {where}: point {TLS_CA_PATH} at the CA that signed it"
        if "NotValidForName" in cause:
            return f"the server's certificate is not for that name: set {TLS_SERVER_NAME} to a name it holds"
        if "InvalidCertificate" in cause:
            return f"the server's certificate was refused; check {TLS_CA_PATH} and {TLS_SERVER_NAME}"
        if "Unauthenticated" in cause or "PermissionDenied" in cause:
            return f"the server refused the credentials: check {API_KEY} or the client certificate, and {NAMESPACE}"
        # A server that refuses the client's certificate (or its lack) after the TLS 1.3
        # handshake just closes: the client sees an alert, a missing close_notify, a broken
        # pipe, a reset or a closed connection on its first call, depending on timing.
        closed = any(
            sign in cause for sign in ("close_notify", "CertificateRequired", "BadCertificate", "UnknownCA", "AlertReceived",
                                 "BrokenPipe", "broken pipe", "ConnectionReset", "UnexpectedEof", "connection closed")
        ) or ("call error after connection" in cause and "Transport" in cause)
        if closed and self.uses_tls:
            if self.tls_cert_path or self.tls_cert_data:
                return f"the server closed the connection: it may not accept the client certificate in {TLS_CERT_PATH}"
            return f"the server closed the connection: it may require a client certificate ({TLS_CERT_PATH} and {TLS_KEY_PATH})"
        if closed:
            return f"the server closed the connection: it may require TLS ({TLS_CA_PATH} or {TLS}; {API_KEY} for Temporal Cloud)"
        return f"check {ADDRESS}"

    def scrub(self, text: str) -> str:
        for secret in (self.api_key, self.tls_key_data):
            if secret is not None and secret.get_secret_value():
                text = text.replace(secret.get_secret_value(), "***")
        return text


async def connect(settings: TemporalSettings, *, runtime: Runtime | None = None) -> Client:
    """A client (and so its workers) using `data_converter()` of this process's environment,
    and `runtime` (e.g. one exporting the SDK's metrics) if given. A failure is a
    TemporalConnectError saying which address and which setting to check."""
    tls = settings.tls_config()
    try:
        return await Client.connect(
            settings.address,
            namespace=settings.namespace,
            tls=tls,
            api_key=settings.api_key.get_secret_value() if settings.api_key else None,
            data_converter=data_converter(),
            runtime=runtime,
        )
    except (RuntimeError, RPCError) as exc:
        cause = settings.scrub(str(exc))
        raise TemporalConnectError(
            f"cannot connect to Temporal at {settings.describe()}: {settings._explain(cause)} ({cause})"
        ) from None


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
