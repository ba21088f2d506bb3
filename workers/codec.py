"""Payload encryption, defence in depth behind "secrets never reach history": an AES-GCM
`PayloadCodec` whose keys come from `TGP_PAYLOAD_KEYS`, and the codec server through which the
Web UI and `temporal --codec-endpoint` show decrypted payloads.

Wire format (the scheme of Temporal's encryption sample): `data` is a 12-byte random nonce
followed by the AES-GCM ciphertext of the whole serialized original `Payload`; metadata
`encoding=binary/encrypted` and `encryption-key-id=<id>`, so keys can rotate. The key id is
also GCM's associated data (`associated_data`), binding the ciphertext to the id it names;
payloads written before that (no associated data) still decrypt in the worker (a node's history
lives for months), never through the codec server (`strict()`): there, a payload whose tag does
not cover its key id could be a relabelled one. Search attributes never pass through a codec:
they stay plaintext.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import os
import re
import sys
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

from aiohttp import hdrs, web
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.converter import PayloadCodec

from tgp.errors import ConfigError

PAYLOAD_KEYS_ENV = "TGP_PAYLOAD_KEYS"
CODEC_TOKEN_ENV = "TGP_CODEC_TOKEN"
ENCODING = b"binary/encrypted"
KEY_ID_METADATA = "encryption-key-id"
# AES-256; the 96-bit nonce is the size GCM is specified for (random nonces are safe at it for
# far more payloads than one key will ever encrypt here).
KEY_BYTES = 32
NONCE_BYTES = 12
# Where `temporal server start-dev` serves the Web UI.
DEFAULT_UI_ORIGIN = "http://localhost:8233"
GENERATE_KEY = """python -c "import os,base64;print('k1:'+base64.b64encode(os.urandom(32)).decode())\""""

# Ids travel in payload metadata and in error messages. At most 40 characters and no '=', so a
# 32-byte key in base64 (44 characters, '='-padded) can never pass for an id and be quoted.
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,40}")


def associated_data(key_id: str) -> bytes:
    """What AES-GCM authenticates beside the ciphertext: the key id the payload names. So a
    payload relabelled with another configured id fails to decrypt even where that id holds
    the same key material, instead of being read under a name it was not written with."""
    return f"tgp-payload;{KEY_ID_METADATA}={key_id}".encode()


class PayloadDecryptError(ConfigError):
    """An encrypted payload that the configured keys cannot decrypt."""


@dataclass(frozen=True)
class PayloadKey:
    """One AES-256 key and the id written beside every payload it encrypts."""

    id: str
    secret: bytes = field(repr=False)


def parse_payload_keys(value: str) -> list[PayloadKey]:
    """Parse `id:base64key[,id:base64key...]`; the first key encrypts, every key decrypts.
    Raises ConfigError saying what to fix (never quoting key material)."""
    if not value.strip():
        raise ConfigError(
            f"{PAYLOAD_KEYS_ENV} is set but empty: unset it to run without payload encryption, "
            f"or give id:base64key entries (generate one with {GENERATE_KEY})"
        )
    keys: list[PayloadKey] = []
    for n, entry in enumerate(value.split(","), start=1):
        where = f"entry {n} of {PAYLOAD_KEYS_ENV}"
        entry = entry.strip()
        key_id, sep, encoded = entry.partition(":")
        key_id, encoded = key_id.strip(), encoded.strip()
        if not sep or not encoded:
            raise ConfigError(f"{where} is not id:base64key (generate one with {GENERATE_KEY})")
        if not _KEY_ID.fullmatch(key_id):
            raise ConfigError(f"{where} has a bad key id: use 1-40 of A-Z a-z 0-9 . _ - before the ':'")
        try:
            secret = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"key {key_id!r} in {PAYLOAD_KEYS_ENV} is not valid standard base64") from None
        if len(secret) != KEY_BYTES:
            raise ConfigError(
                f"key {key_id!r} in {PAYLOAD_KEYS_ENV} is {len(secret)} bytes; it must be {KEY_BYTES} "
                f"(generate one with {GENERATE_KEY})"
            )
        if any(k.id == key_id for k in keys):
            raise ConfigError(f"key id {key_id!r} appears twice in {PAYLOAD_KEYS_ENV}: give each key its own id")
        keys.append(PayloadKey(key_id, secret))
    return keys


class EncryptionCodec(PayloadCodec):
    """AES-GCM payload codec. Encrypts with the first key; decrypts with whichever known key
    the payload names, so a new key can go first while old histories stay readable. Payloads
    that are not encrypted pass through decode unchanged."""

    def __init__(self, keys: Sequence[PayloadKey], *, accept_legacy: bool = True) -> None:
        """`accept_legacy`: also decrypt payloads written before the key id was bound (no
        associated data): the worker must, for old histories; the codec server does not."""
        if not keys:
            raise ConfigError(f"payload encryption needs at least one key in {PAYLOAD_KEYS_ENV}")
        self._keys = list(keys)
        self.accept_legacy = accept_legacy
        self.key_ids = [k.id for k in keys]
        self._encrypt_id = keys[0].id
        self._ciphers = {k.id: AESGCM(k.secret) for k in keys}

    def strict(self) -> EncryptionCodec:
        """The same keys, decrypting only payloads whose tag covers their key id."""
        return EncryptionCodec(self._keys, accept_legacy=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> EncryptionCodec | None:
        """The codec for `TGP_PAYLOAD_KEYS`, or None when it is not set."""
        value = env.get(PAYLOAD_KEYS_ENV)
        return None if value is None else cls(parse_payload_keys(value))

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        cipher = self._ciphers[self._encrypt_id]
        out = []
        for payload in payloads:
            nonce = os.urandom(NONCE_BYTES)
            out.append(
                Payload(
                    metadata={"encoding": ENCODING, KEY_ID_METADATA: self._encrypt_id.encode()},
                    data=nonce + cipher.encrypt(nonce, payload.SerializeToString(), associated_data(self._encrypt_id)),
                )
            )
        return out

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self._decrypt(p) if p.metadata.get("encoding") == ENCODING else p for p in payloads]

    def _decrypt(self, payload: Payload) -> Payload:
        key_id = payload.metadata.get(KEY_ID_METADATA, b"").decode(errors="replace")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise PayloadDecryptError(
                f"payload was encrypted with key id {key_id[:40]!r}, which {PAYLOAD_KEYS_ENV} lacks "
                f"(it has {', '.join(self.key_ids)}): add that key back, after the current one"
            )
        data = payload.data
        nonce, sealed = data[:NONCE_BYTES], data[NONCE_BYTES:]
        try:
            try:
                plain = cipher.decrypt(nonce, sealed, associated_data(key_id))
            except InvalidTag:
                if not self.accept_legacy:
                    raise
                # Written before the key id was bound (no associated data). A payload written
                # since cannot pass this way: its tag covers the associated data.
                plain = cipher.decrypt(nonce, sealed, None)
            return Payload.FromString(plain)
        except (InvalidTag, ValueError, DecodeError):
            raise PayloadDecryptError(
                f"payload encrypted with key id {key_id!r} does not decrypt with the key {PAYLOAD_KEYS_ENV} "
                "has under that id: the key was replaced under the same id (give a new key a new id "
                "and keep the old one), the payload was altered"
                + ("" if self.accept_legacy else ", or it was written before key ids were bound (the worker still reads those)")
            ) from None


def codec_token_from_env(env: Mapping[str, str] = os.environ) -> str | None:
    """The bearer token the codec server requires (`TGP_CODEC_TOKEN`), or None when unset."""
    token = env.get(CODEC_TOKEN_ENV)
    if token is not None and not token.strip():
        raise ConfigError(f"{CODEC_TOKEN_ENV} is set but empty: unset it or give the token callers must send")
    return None if token is None else token.strip()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# What one request to the codec server may carry and take: a history page of payloads decodes in
# well under this; more is refused before it is read (413), and a body that trickles in is cut
# off (408), so a caller cannot hold the server's memory or a connection for long.
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_PAYLOADS = 10_000
BODY_TIMEOUT_SECONDS = 10.0


# Host names a loopback server answers to. A request naming any other host reached it through
# DNS rebinding (a web page's own name re-pointed at 127.0.0.1), not from the Web UI or the CLI.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def _host_name(host_header: str) -> str:
    """`Host` without its port, lower-cased; IPv6 literals without their brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def build_codec_server(
    codec: PayloadCodec,
    *,
    token: str | None = None,
    cors_origins: Sequence[str] = (DEFAULT_UI_ORIGIN,),
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout: float = BODY_TIMEOUT_SECONDS,
) -> web.Application:
    """The codec server contract of the Web UI and the `temporal` CLI: `POST /encode` and
    `POST /decode` (also under `/{namespace}/`) take and return JSON `Payloads`. With a token,
    every POST must carry `Authorization: Bearer <token>`; preflights need none (browsers send
    no credentials with them).

    Hardening against web pages in the operator's browser: a `Host` outside `allowed_hosts`
    ("*" allows any) is refused (DNS rebinding); a POST body must be `application/json`, which
    a cross-origin page can only send after a CORS preflight that we answer for the configured
    origins only (a "simple" `text/plain` or form POST skips the preflight); and `/encode`,
    which would let anyone make payloads that workers accept as genuine, needs the token —
    without one it is off.

    Bounded: a body over `max_body_bytes` (by its Content-Length, or as it is read) is refused
    with 413, one that takes longer than `body_timeout` to arrive with 408, more than
    MAX_PAYLOADS payloads with 413; any body that is not JSON Payloads answers a 400 that
    quotes none of it. An EncryptionCodec decrypts only payloads whose tag covers their key id
    (`EncryptionCodec.strict`)."""
    if isinstance(codec, EncryptionCodec):
        codec = codec.strict()
    allowed = set(cors_origins)
    expected = f"Bearer {token}".encode() if token else None
    hosts = {_host_name(h) for h in allowed_hosts}

    def allow_origin(request: web.Request, headers: MutableMapping[str, str]) -> None:
        origin = request.headers.get(hdrs.ORIGIN)
        if origin in allowed:
            headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
            headers[hdrs.ACCESS_CONTROL_ALLOW_METHODS] = "POST, OPTIONS"
            headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = "content-type, x-namespace, authorization"
            # The UI's "include cross-origin credentials" setting needs this.
            headers[hdrs.ACCESS_CONTROL_ALLOW_CREDENTIALS] = "true"
            headers[hdrs.VARY] = "Origin"

    @web.middleware
    async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
        # Errors carry CORS headers too, or the browser hides the 401/400 behind a CORS error.
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            allow_origin(request, exc.headers)
            raise
        allow_origin(request, response.headers)
        return response

    @web.middleware
    async def host(request: web.Request, handler: Handler) -> web.StreamResponse:
        name = _host_name(request.headers.get(hdrs.HOST, ""))
        if "*" not in hosts and name not in hosts:
            raise web.HTTPMisdirectedRequest(
                text=f"codec server: Host {name[:100]!r} is not one it serves; add it with --allowed-host\n"
            )
        return await handler(request)

    @web.middleware
    async def bearer(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != hdrs.METH_OPTIONS:
            if expected is None and request.path.endswith("/encode"):
                raise web.HTTPUnauthorized(
                    text=f"codec server: /encode needs {CODEC_TOKEN_ENV}; it is off on a server without one\n",
                    headers={hdrs.WWW_AUTHENTICATE: "Bearer"},
                )
            given = request.headers.get(hdrs.AUTHORIZATION, "").encode()
            if expected is not None and not hmac.compare_digest(given, expected):
                raise web.HTTPUnauthorized(text="codec server: missing or wrong bearer token\n", headers={hdrs.WWW_AUTHENTICATE: "Bearer"})
            if request.content_type != "application/json":
                raise web.HTTPUnsupportedMediaType(
                    text=f"codec server: send Content-Type: application/json, not {request.content_type[:100]!r}\n"
                )
        return await handler(request)

    async def read_body(request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=max_body_bytes, actual_size=request.content_length, text=f"codec server: body over {max_body_bytes} bytes\n")
        try:
            async with asyncio.timeout(body_timeout):
                return await request.read()
        except TimeoutError:
            raise web.HTTPRequestTimeout(text=f"codec server: the body did not arrive within {body_timeout:g} s\n") from None

    def endpoint(convert: Callable[[Sequence[Payload]], Awaitable[list[Payload]]]) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            raw = await read_body(request)
            try:
                payloads = json_format.Parse(raw.decode("utf-8"), Payloads())
            except Exception:  # noqa: BLE001 - whatever the parser says would quote the body
                raise web.HTTPBadRequest(text="codec server: body is not JSON Payloads ({\"payloads\": [...]})\n") from None
            if len(payloads.payloads) > MAX_PAYLOADS:
                raise web.HTTPRequestEntityTooLarge(
                    max_size=MAX_PAYLOADS, actual_size=len(payloads.payloads), text=f"codec server: more than {MAX_PAYLOADS} payloads\n"
                )
            try:
                converted = await convert(payloads.payloads)
            except PayloadDecryptError as exc:
                raise web.HTTPBadRequest(text=f"codec server: {exc}\n") from None
            except Exception:  # noqa: BLE001 - a payload the codec cannot read is the caller's
                raise web.HTTPBadRequest(text="codec server: a payload could not be converted\n") from None
            return web.json_response(text=json_format.MessageToJson(Payloads(payloads=converted)))

        return handle

    async def preflight(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application(middlewares=[cors, host, bearer], client_max_size=max_body_bytes)
    for prefix in ("", "/{namespace}"):
        app.router.add_post(f"{prefix}/encode", endpoint(codec.encode))
        app.router.add_post(f"{prefix}/decode", endpoint(codec.decode))
    app.router.add_route(hdrs.METH_OPTIONS, "/{tail:.*}", preflight)
    return app


_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


async def run_codec_server(
    codec: PayloadCodec,
    *,
    host: str,
    port: int,
    token: str | None,
    cors_origins: Sequence[str],
    allowed_hosts: Sequence[str] = (),
) -> None:
    """Serve `build_codec_server` until cancelled. Refuses to listen beyond loopback without a
    token: whoever can reach it can decrypt every payload. It answers to the loopback names,
    the address it listens on and `allowed_hosts` (the names clients use to reach it)."""
    if token is None and host not in _LOOPBACK:
        raise ConfigError(f"set {CODEC_TOKEN_ENV} to serve the codec server on {host}: it decrypts every payload")
    if token is None and set(allowed_hosts) - set(LOOPBACK_HOSTS):
        raise ConfigError(f"set {CODEC_TOKEN_ENV} to answer to --allowed-host names other than loopback")
    names = [*LOOPBACK_HOSTS, *([host] if host not in ("0.0.0.0", "::", "") else []), *allowed_hosts]
    app = build_codec_server(codec, token=token, cors_origins=cors_origins, allowed_hosts=names)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        auth = "bearer token required" if token else f"no token ({CODEC_TOKEN_ENV} unset)"
        url = f"http://{host}:{port}"
        ui = "sends no bearer token: see docs/security.md" if token else f"temporal server start-dev --ui-codec-endpoint {url}"
        cli = f"temporal workflow show --codec-endpoint {url}" + (' --codec-auth "Bearer $TGP_CODEC_TOKEN"' if token else "")
        print(
            f"tgp codec server on {url} ({auth}); CORS for {', '.join(cors_origins)}\n  Web UI: {ui}\n  CLI:    {cli} -w ...",
            file=sys.stderr,
        )
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
