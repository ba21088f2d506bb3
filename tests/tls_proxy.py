"""A TLS-terminating TCP proxy in front of the dev server, which speaks only plaintext gRPC
(`temporal server start-dev` has no TLS flags). It stands in for a production frontend or
Temporal Cloud: it requires a client certificate signed by its CA (mutual TLS) when asked to,
and reads the HTTP/2 request headers that pass through it, so a test can see what a client
really sent on the wire (the `authorization` metadata of an API key).

The certificates come from a throwaway CA made here with `cryptography`.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import hpack
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# -- a throwaway PKI ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """File paths of a CA, a server certificate for localhost/127.0.0.1 and a client
    certificate, all PEM; `other_ca` is an unrelated CA (a wrong trust root)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    cn: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *, server: bool
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(directory: Path) -> Pki:
    ca, ca_key = _ca("tgp test CA")
    server, server_key = _leaf("localhost", ca, ca_key, server=True)
    client, client_key = _leaf("tgp-worker", ca, ca_key, server=False)
    other, _ = _ca("some other CA")
    return Pki(
        ca=_write_cert(ca, directory / "ca.pem"),
        server_cert=_write_cert(server, directory / "server.pem"),
        server_key=_write_key(server_key, directory / "server-key.pem"),
        client_cert=_write_cert(client, directory / "client.pem"),
        client_key=_write_key(client_key, directory / "client-key.pem"),
        other_ca=_write_cert(other, directory / "other-ca.pem"),
    )


# -- the proxy ------------------------------------------------------------------------------------

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADERS, _CONTINUATION = 0x1, 0x9
_END_HEADERS, _PADDED, _PRIORITY = 0x4, 0x8, 0x20


class _RequestHeaders:
    """Reads the request header blocks out of a client's HTTP/2 byte stream without taking
    part in the protocol: frames are split by their 9-byte headers, HEADERS and CONTINUATION
    payloads go through one HPACK decoder per connection (its dynamic table spans requests)."""

    def __init__(self, sink: list[dict[str, str]]) -> None:
        self._buf = b""
        self._preface = False
        self._block = b""
        self._decoder = hpack.Decoder()
        self._sink = sink

    def feed(self, data: bytes) -> None:
        self._buf += data
        if not self._preface:
            if len(self._buf) < len(_PREFACE):
                return
            assert self._buf.startswith(_PREFACE), "not HTTP/2 (gRPC) traffic"
            self._buf, self._preface = self._buf[len(_PREFACE) :], True
        while len(self._buf) >= 9:
            length = int.from_bytes(self._buf[:3], "big")
            if len(self._buf) < 9 + length:
                return
            kind, flags = self._buf[3], self._buf[4]
            payload, self._buf = self._buf[9 : 9 + length], self._buf[9 + length :]
            if kind == _HEADERS:
                pad = 0
                if flags & _PADDED:
                    pad, payload = payload[0], payload[1:]
                if flags & _PRIORITY:
                    payload = payload[5:]
                self._block = payload[: len(payload) - pad]
            elif kind == _CONTINUATION:
                self._block += payload
            else:
                continue
            if flags & _END_HEADERS:
                self._sink.append({str(k): str(v) for k, v in self._decoder.decode(self._block)})
                self._block = b""


@dataclass
class TlsProxy:
    address: str
    requests: list[dict[str, str]] = field(default_factory=list)  # HTTP/2 request headers seen


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, observer: _RequestHeaders | None) -> None:
    try:
        while data := await reader.read(65536):
            if observer is not None:
                observer.feed(data)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        with suppress(Exception):
            writer.close()


@asynccontextmanager
async def tls_proxy(upstream: str, pki: Pki, *, require_client_cert: bool = True) -> AsyncIterator[TlsProxy]:
    """Listen with TLS on 127.0.0.1 (server certificate for localhost and 127.0.0.1, ALPN h2)
    and forward the decrypted bytes to `upstream` (host:port, plaintext)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    ctx.set_alpn_protocols(["h2"])
    if require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pki.ca)
    host, _, port = upstream.rpartition(":")
    tasks: set[asyncio.Task[None]] = set()
    state = TlsProxy(address="")

    async def serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            _pipe(client_reader, server_writer, _RequestHeaders(state.requests)), _pipe(server_reader, client_writer, None)
        )

    def track(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(serve(reader, writer))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(track, "127.0.0.1", 0, ssl=ctx)
    state.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def authorization(requests: list[dict[str, str]]) -> set[str]:
    """The `authorization` values of every request the proxy saw."""
    return {r["authorization"] for r in requests if "authorization" in r}


__all__ = ["Pki", "TlsProxy", "authorization", "make_pki", "tls_proxy"]
