"""The Tailscale API v2 behind the `Tailnet` port: OAuth client credentials, single-use
ephemeral tagged auth keys, and the devices they create.

One adapter, one `httpx.AsyncClient`; tests point `base_url` at `sim.tailscale.FakeTailscale`.
Every request goes through `HttpAdapter._call` (timeout, bounded retry on 429/5xx). The OAuth
client secret, the access token and minted keys are held as `SecretStr` and scrubbed from every
error message: messages reach workflow history.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import httpx
import structlog
from pydantic import SecretStr

from activities.fresh_reads import FreshReads
from activities.tailnets.listing import DeviceListing
from activities.ports import AuthKey
from tgp.errors import AuthError, ConfigError, PermissionDenied, TgpError, TransientError
from activities.http import DEFAULT_TIMEOUT, HttpAdapter, Sleep, json_items, json_object
from activities.http_errors import Fixes, error_detail
from tgp.secrets import register_process
from tgp.types import TailnetDevice

__all__ = ["DEFAULT_BASE_URL", "TailscaleTailnet", "key_description"]

log = structlog.get_logger(__name__)

DEFAULT_BASE_URL = "https://api.tailscale.com"
SYSTEM = "Tailscale API"
TOKEN_PATH = "/api/v2/oauth/token"

# Tailscale's docs say to cache the 1 h token until about expires_in - 5 min; refreshing early
# keeps a token from expiring between our check and the server's.
TOKEN_REFRESH_MARGIN = timedelta(minutes=5)
# Tailscale's rules for a key description: at most 50 characters, alphanumeric, hyphen, space.
DESCRIPTION_MAX_LEN = 50
DESCRIPTION_PREFIX = "tgp "
_DESCRIPTION_UNSAFE = re.compile(r"[^A-Za-z0-9-]")


def key_description(hostname: str) -> str:
    """The description of every auth key minted for `hostname`: deterministic, so
    `revoke_keys_for` finds the keys again, and within Tailscale's rules (<= 50 characters of
    letters, digits, hyphen and space).

    A hostname that fits unchanged gives `tgp <hostname>`; a longer one, or one with other
    characters, is shortened and gets a space and a hash of the full name, so two hostnames
    never share a description.
    """
    if not hostname:
        raise ConfigError("a tailnet hostname must not be empty")
    clean = _DESCRIPTION_UNSAFE.sub("-", hostname)
    plain = DESCRIPTION_PREFIX + clean
    if clean == hostname and len(plain) <= DESCRIPTION_MAX_LEN:
        return plain
    digest = hashlib.sha256(hostname.encode()).hexdigest()[:8]
    room = DESCRIPTION_MAX_LEN - len(DESCRIPTION_PREFIX) - 1 - len(digest)
    return f"{DESCRIPTION_PREFIX}{clean[:room]} {digest}"


class TailscaleTailnet(HttpAdapter):
    """`Tailnet` over the Tailscale API v2 with an OAuth client (scopes `auth_keys` and
    `devices:core`, write).

    Use as `async with TailscaleTailnet(client_id=..., client_secret=SecretStr(...)) as tn:`,
    or call `aclose()`. A client passed in is used as is and not closed here.
    """

    system = SYSTEM

    def __init__(
        self,
        *,
        client_id: str,
        client_secret: SecretStr,
        base_url: str = DEFAULT_BASE_URL,
        tailnet: str = "-",
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        secret_ref: str = "the Tailscale OAuth Secret",
    ) -> None:
        """`sleep` and `clock` are seams for tests (retry waits, token lifetime);
        `secret_ref` names where the credentials came from, for error messages."""
        if not client_id:
            raise ConfigError(f"Tailscale OAuth client id is empty: set the `client_id` key of {secret_ref}")
        if not client_secret.get_secret_value():
            raise ConfigError(f"Tailscale OAuth client secret is empty: set the `client_secret` key of {secret_ref}")
        register_process(client_secret)  # kept out of every message and log line (tgp.secrets)
        fixes = Fixes(
            auth=(
                f"check the `client_id` ({client_id!r}) and `client_secret` keys of {secret_ref}: the OAuth client "
                "must still exist, and its secret starts with tskey-client-"
            ),
            denied="the OAuth client needs write access on the `auth_keys` and `devices:core` scopes",
            not_found=f"check the tailnet name {tailnet!r} ('-' means the tailnet of the OAuth client) and the base URL {base_url!r}",
        )
        super().__init__(fixes=fixes, base_url=base_url, client=client, transport=transport, timeout=timeout, sleep=sleep)
        self._client_id = client_id
        self._client_secret = client_secret
        self._tailnet = tailnet
        self._clock = clock
        self._token: SecretStr | None = None
        self._token_valid_until = 0.0
        self._token_lock = asyncio.Lock()
        # The device listing, shared by the joins that look meanwhile (never an older view).
        self._device_reads: FreshReads[DeviceListing] = FreshReads(self._all_devices)

    def __repr__(self) -> str:
        return f"TailscaleTailnet(base_url={self._base_url!r}, tailnet={self._tailnet!r}, client_id={self._client_id!r})"

    # --- the Tailnet port -------------------------------------------------------------

    async def mint_auth_key(self, *, hostname: str, tags: list[str], expiry: timedelta, ephemeral: bool = True) -> AuthKey:
        """Mint a single-use, pre-authorized key carrying `tags`, described by
        `key_description(hostname)`; `ephemeral` (the class's tailscaleConfig.ephemeral) makes
        its device leave the tailnet once offline. Raises PermissionDenied when the OAuth
        client may not use one of the tags."""
        if not tags:
            # Keys minted by an OAuth client belong to the tailnet, so Tailscale requires tags.
            raise ConfigError(
                f"cannot mint a tailnet key for {hostname} without tags: keys minted by an OAuth client "
                "must carry the client's tags or tags it owns (set tailnetTags)"
            )
        seconds = int(expiry.total_seconds())
        if seconds <= 0:
            raise ConfigError(f"auth key expiry must be positive, got {expiry}")
        body = {
            "capabilities": {
                "devices": {
                    "create": {"reusable": False, "ephemeral": ephemeral, "preauthorized": True, "tags": list(tags)}
                }
            },
            "expirySeconds": seconds,
            "description": key_description(hostname),
        }
        response = await self._call("POST", self._keys_path(), json=body, ok=(400, 403))
        if response.status_code in (400, 403):
            raise self._mint_refused(response, tags)
        data = json_object(response, system=SYSTEM)
        key_id, secret = data.get("id"), data.get("key")
        if not isinstance(key_id, str) or not isinstance(secret, str):
            raise self._error(TransientError, f"{SYSTEM}: key creation answered without an id or key")
        log.info("tailnet.key_minted", key_id=key_id, hostname=hostname, tags=list(tags), expiry_s=seconds)
        return AuthKey(key_id=key_id, secret=SecretStr(secret))

    async def revoke_auth_key(self, key_id: str) -> None:
        """Revoke the key; a key already gone (404) counts as revoked."""
        response = await self._call("DELETE", f"{self._keys_path()}/{quote(key_id, safe='')}", ok=(404,))
        log.info("tailnet.key_revoked", key_id=key_id, already_gone=response.status_code == 404)

    async def revoke_keys_for(self, hostname: str) -> int:
        """Revoke every key minted for `hostname` that is still usable (not revoked, not
        spent or expired); returns how many were revoked."""
        description = key_description(hostname)
        response = await self._call("GET", self._keys_path(), params={"all": "true"})
        revoked = 0
        for entry in json_items(response, "keys", system=SYSTEM):
            key_id = entry.get("id")
            if not isinstance(key_id, str):
                continue
            details: dict[str, Any] | None = entry
            if "description" not in entry:
                # The list may carry only ids; the key itself has the description.
                details = await self._get_key(key_id)
            if details is None or details.get("description") != description or not _key_usable(details):
                continue
            gone = await self._call("DELETE", f"{self._keys_path()}/{quote(key_id, safe='')}", ok=(404,))
            if gone.status_code != 404:
                revoked += 1
        log.info("tailnet.keys_revoked_for", hostname=hostname, revoked=revoked)
        return revoked

    async def find_device(self, hostname: str, tags: list[str], *, within: float = 0.0) -> TailnetDevice | None:
        """The device called `hostname` carrying all of `tags`; when several match (a node
        re-registered before the old ephemeral device was removed), the connected, newest one.
        From a listing begun after this call, or at most `within` seconds before it (FreshReads)."""
        wanted = set(tags)
        listing = await self._device_reads.read(within=within)
        matches = [d for d in listing.named(hostname) if wanted <= set(d.get("tags") or [])]
        if not matches:
            return None
        return _device(max(matches, key=lambda d: (bool(d.get("connectedToControl")), str(d.get("created") or ""))))

    async def list_devices(self, tags: list[str]) -> list[TailnetDevice]:
        """Every device carrying all of `tags` (the sweeper looks for ones without a node)."""
        wanted = set(tags)
        return [_device(d) for d in (await self._device_reads.read()).devices if wanted <= set(d.get("tags") or [])]

    async def _all_devices(self) -> DeviceListing:
        response = await self._call("GET", f"/api/v2/tailnet/{quote(self._tailnet, safe='')}/devices")
        return DeviceListing.of(json_items(response, "devices", system=SYSTEM), lambda d: (d.get("hostname"),))

    async def delete_device(self, device_id: str) -> None:
        """Delete the device; one already gone (404) counts as deleted."""
        response = await self._call("DELETE", f"/api/v2/device/{quote(device_id, safe='')}", ok=(404,))
        log.info("tailnet.device_deleted", device_id=device_id, already_gone=response.status_code == 404)

    # --- requests ---------------------------------------------------------------------

    def _keys_path(self) -> str:
        return f"/api/v2/tailnet/{quote(self._tailnet, safe='')}/keys"

    async def _get_key(self, key_id: str) -> dict[str, Any] | None:
        response = await self._call("GET", f"{self._keys_path()}/{quote(key_id, safe='')}", ok=(404,))
        return None if response.status_code == 404 else json_object(response, system=SYSTEM)

    async def _call(self, method: str, path: str, *, ok: Iterable[int] = (), **kwargs: Any) -> httpx.Response:
        """`HttpAdapter._call` with the OAuth access token. A 401 on a cached token gets one
        fresh token and one more try (the token may have been revoked or outlived our clock)."""
        token, fresh = await self._bearer()
        try:
            return await super()._call(method, path, ok=ok, bearer=token, **kwargs)
        except AuthError:
            if fresh:
                raise
        log.info("tailnet.token_rejected", path=path)
        token, _ = await self._bearer(stale=token)
        return await super()._call(method, path, ok=ok, bearer=token, **kwargs)

    async def _bearer(self, stale: SecretStr | None = None) -> tuple[SecretStr, bool]:
        """The cached access token, or a new one when it is near expiry or equals `stale`.
        Returns (token, fetched_now). The lock makes concurrent callers share one fetch."""
        async with self._token_lock:
            if self._token is not None and self._clock() < self._token_valid_until and self._token != stale:
                return self._token, stale is not None
            self._token = None
            token, lifetime = await self._fetch_token()
            margin = min(TOKEN_REFRESH_MARGIN.total_seconds(), lifetime / 2)
            self._token = token
            self._token_valid_until = self._clock() + lifetime - margin
            log.info("tailnet.token_fetched", expires_in_s=lifetime)
            return token, True

    async def _fetch_token(self) -> tuple[SecretStr, float]:
        form = {
            "client_id": self._client_id,
            "client_secret": self._client_secret.get_secret_value(),
            "grant_type": "client_credentials",
        }
        # Without an access token (this is how one is got): every refusal means the client credentials.
        response = await super()._call("POST", TOKEN_PATH, ok=(400, 401, 403), data=form)
        if response.status_code >= 400:
            raise self._auth_error(response)
        data = json_object(response, system=SYSTEM)
        token = data.get("access_token")
        if not isinstance(token, str) or not token:
            raise self._error(TransientError, f"{SYSTEM}: the OAuth token response carried no access_token")
        try:
            lifetime = float(data.get("expires_in") or 3600)
        except (TypeError, ValueError):
            lifetime = 3600.0
        return SecretStr(token), lifetime

    # --- answers and errors -----------------------------------------------------------

    def _mint_refused(self, response: httpx.Response, tags: list[str]) -> TgpError:
        # Tailscale's message sorts the refusal and names which tags; it is never quoted (it may
        # echo the request): only tgp's own tags and the status are.
        said = error_detail(response)
        if "tag" in said.lower() or response.status_code == 403:
            named = [t for t in tags if t in said] or list(tags)
            listed = ", ".join(named)
            return self._error(
                PermissionDenied,
                f"Tailscale refused to mint a key with tag(s) {listed} ({response.status_code}: {self._answer(response)}): "
                f"the OAuth client {self._client_id!r} must own {listed}: in the tailnet policy's tagOwners "
                f"list the client's tag as an owner of {listed} (or give the client that tag), request all "
                "of the client's own tags, and give the client write on the `auth_keys` scope",
            )
        return self._error(ConfigError, f"{SYSTEM} rejected the auth key request ({response.status_code}: {self._answer(response)})")

    def _secrets(self) -> list[str]:
        """What must never reach a message: the OAuth client secret and the access token."""
        return [s.get_secret_value() for s in (self._client_secret, self._token) if s is not None]


def _key_usable(entry: dict[str, Any]) -> bool:
    """Whether a key from the list can still register a device."""
    revoked = entry.get("revoked")
    # Go encodes a zero time as 0001-01-01T00:00:00Z; treat that as "not revoked".
    if revoked and not str(revoked).startswith("0001-"):
        return False
    return not entry.get("invalid")


def _device(raw: dict[str, Any]) -> TailnetDevice:
    return TailnetDevice(
        device_id=str(raw.get("nodeId") or raw.get("id")),
        hostname=str(raw.get("hostname") or ""),
        addresses=list(raw.get("addresses") or []),
        tags=list(raw.get("tags") or []),
        connected=bool(raw.get("connectedToControl")),
    )
