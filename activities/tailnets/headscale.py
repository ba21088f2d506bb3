"""Headscale (0.23 to 0.29) behind the `Tailnet` port: single-use, ephemeral, tagged pre-auth
keys, and the nodes they create.

REST under `/api/v1` with `Authorization: Bearer <API key>` (`headscale apikeys create`). JSON
is protojson: lowerCamelCase, uint64 ids as strings, RFC 3339 timestamps, errors as
`{"code", "message", "details"}`.

The pre-auth key calls changed shape twice (reference/network-bootstrap.md 2.3), so the
adapter finds out once, on first use, which shape the server speaks (`_keys_api`):
* 0.28+: keys are expired by id (`{"id"}`), the list shows every key, `user` is an optional
  numeric id (a key may be owned by its tags alone);
* 0.26-0.27: every key needs a `user`, given as its numeric id; the list needs `?user=`, and
  a key is expired with `{user, key}` (the whole key, which that list shows);
* 0.23-0.25: as 0.26-0.27, but the user is given by name.
It asks by capability, not `/version`, which older servers do not serve: 0.28+ lists keys
without a user, older servers answer "user not found"; of those, 0.26+ accept the user's id.
0.22 and older (nodes were "machines") answer 404 on `/api/v1/node` and are refused.

Headscale keys carry no description, so nothing on the server ties a key to the hostname it
was minted for. `revoke_keys_for` therefore works from an in-process map of the keys this
adapter minted: after a worker restart it finds nothing, and the durable path is
`revoke_auth_key` with the key ids the workflow recorded (LaunchResult.key_id). Unused keys
still expire on their own at the expiry given when minting.

Every request goes through `HttpAdapter._call` (timeout, bounded retry on 429/5xx). The API key is
held as `SecretStr` and scrubbed from every error message, as are minted keys.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote

import httpx
import structlog
from pydantic import SecretStr

from activities.fresh_reads import FreshReads
from activities.tailnets.listing import DeviceListing
from activities.ports import AuthKey
from tgp.errors import ConfigError, TransientError
from activities.http import DEFAULT_TIMEOUT, HttpAdapter, Sleep, json_items, json_object
from activities.http_errors import NOTHING, Fixes, error_detail
from tgp.types import TailnetDevice

__all__ = ["HeadscaleTailnet"]

log = structlog.get_logger(__name__)

SYSTEM = "Headscale API"
# What a message quotes of a Headscale error: nothing but the HTTP status (issue 35 item 13);
# its gRPC code and message are read to sort the answer ("user not found"), never quoted.
QUOTABLE = NOTHING
# Headscale's own rules for an ACL tag (hscontrol validateTag): prefix, lowercase, no spaces.
_TAG = re.compile(r"^tag:[^\sA-Z]+$")
# protojson writes up to nine fractional digits; datetime takes six.
_FRACTION = re.compile(r"(\.\d{6})\d+")

_EPOCH = datetime.min.replace(tzinfo=timezone.utc)
# How 0.23/0.24 refuse to expire a key that cannot register a node any more (500, Unknown).
_KEY_ALREADY_DONE = ("AuthKey has already been used", "AuthKey expired")

# The pre-auth key API generations (see the module docstring), named by the versions speaking them.
KEYS_BY_ID = "0.28+"
KEYS_BY_USER_ID = "0.26-0.27"
KEYS_BY_USER_NAME = "0.23-0.25"


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(_FRACTION.sub(r"\1", value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


class HeadscaleTailnet(HttpAdapter):
    """`Tailnet` over the Headscale v1 REST API.

    `user` owns the keys: a numeric user id, or a user name looked up once. Leave it unset to
    mint keys owned by their tags alone (0.28+). Use as `async with HeadscaleTailnet(...) as hs:`
    or call `aclose()`. A client passed in is used as is and not closed here.
    """

    system = SYSTEM
    quotable = QUOTABLE

    def __init__(
        self,
        *,
        api_key: SecretStr,
        base_url: str,
        user: str | None = None,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        sleep: Sleep = asyncio.sleep,
        now: Callable[[], datetime] = _utcnow,
        secret_ref: str = "the Headscale API key Secret",
    ) -> None:
        """`sleep` and `now` are seams for tests (retry waits, key expiry); `secret_ref` names
        where the API key came from, for error messages."""
        if not api_key.get_secret_value():
            raise ConfigError(f"Headscale API key is empty: set the `apiKey` key of {secret_ref}")
        if not base_url:
            raise ConfigError("Headscale URL is empty: set the login server URL in the GPUNodeClass")
        url = base_url.rstrip("/")
        fixes = Fixes(
            auth=(
                f"check the `apiKey` key of {secret_ref} (make one with `headscale apikeys create`; they expire, "
                "90 days by default)"
            ),
            denied=f"Headscale API keys have no scopes, so look at the proxy or ingress in front of {url!r}",
            not_found=(
                f"check the Headscale URL {url!r} and that the server runs Headscale 0.23 or later "
                "(0.22 and older call nodes machines)"
            ),
        )
        super().__init__(fixes=fixes, base_url=url, api_key=api_key, client=client, transport=transport, timeout=timeout, sleep=sleep)
        self._user = user or None
        self._user_id: str | None = user if user and user.isdigit() else None
        self._user_name: str | None = user if user and not user.isdigit() else None
        # Which pre-auth key API the server speaks; found on first use (`_keys_api`).
        self._api: str | None = None
        self._now = now
        # hostname -> ids of keys minted for it by this process (see the module docstring).
        self._minted: dict[str, list[str]] = {}
        # The node listing, shared by the joins that look meanwhile (never an older view).
        self._node_reads: FreshReads[DeviceListing] = FreshReads(self._all_nodes)

    def __repr__(self) -> str:
        return f"HeadscaleTailnet(base_url={self._base_url!r}, user={self._user!r})"

    @property
    def login_server(self) -> str:
        """The URL nodes pass to `tailscale up --login-server` (the same server)."""
        return self._base_url

    # --- the Tailnet port -------------------------------------------------------------

    async def mint_auth_key(self, *, hostname: str, tags: list[str], expiry: timedelta, ephemeral: bool = True) -> AuthKey:
        """Mint a single-use pre-auth key carrying `tags` as aclTags, owned by the configured
        user (or by the tags alone); `ephemeral` (the class's tailscaleConfig.ephemeral) makes
        the nodes it registers leave once offline. Nodes it registers are tagged nodes."""
        if not hostname:
            raise ConfigError("a tailnet hostname must not be empty")
        bad = [t for t in tags if not _TAG.match(t)]
        if bad:
            raise ConfigError(
                f"Headscale ACL tags must start with 'tag:' and be lowercase without spaces; got {', '.join(map(repr, bad))}"
            )
        if not tags and not self._user:
            raise ConfigError(f"cannot mint a Headscale key for {hostname} without tags or a user: set tailnetTags")
        if expiry <= timedelta(0):
            raise ConfigError(f"auth key expiry must be positive, got {expiry}")
        body: dict[str, Any] = {
            "reusable": False,
            "ephemeral": ephemeral,
            "expiration": _iso(self._now() + expiry),
            "aclTags": list(tags),
        }
        api = await self._keys_api()
        if self._user:
            body["user"] = await self._key_owner(api)
        if self._user:
            response = await self._call_unless_not_found("POST", "/api/v1/preauthkey", json=body, ok=(400,))
        else:
            response = await self._call("POST", "/api/v1/preauthkey", json=body, ok=(400,))
        if response is None:
            # 0.29 reports a missing user as an unmapped error (HTTP 500), which retrying cannot fix.
            raise self._error(
                ConfigError,
                f"Headscale user {self._user!r} does not exist (POST /api/v1/preauthkey answered 500): "
                f"create it with `headscale users create {self._user}`",
            )
        if response.status_code == 400:
            raise self._error(ConfigError, f"Headscale refused the pre-auth key request (400): {self._answer(response)}")
        key = json_object(response, system=SYSTEM).get("preAuthKey")
        key_id = key.get("id") if isinstance(key, dict) else None
        secret = key.get("key") if isinstance(key, dict) else None
        if key_id in (None, "") or not isinstance(secret, str) or not secret:
            raise self._error(TransientError, f"{SYSTEM}: key creation answered without an id or key")
        key_id = str(key_id)
        self._minted.setdefault(hostname, []).append(key_id)
        log.info("tailnet.key_minted", key_id=key_id, hostname=hostname, tags=list(tags), expiry_s=int(expiry.total_seconds()))
        return AuthKey(key_id=key_id, secret=SecretStr(secret))

    async def revoke_auth_key(self, key_id: str) -> None:
        """Expire the key; a key already gone counts as revoked."""
        gone = await self._expire_key(key_id)
        for ids in self._minted.values():
            if key_id in ids:
                ids.remove(key_id)
        log.info("tailnet.key_revoked", key_id=key_id, already_gone=gone)

    async def revoke_keys_for(self, hostname: str) -> int:
        """Expire every still-usable key this process minted for `hostname` (Headscale keys
        carry no name to search by); returns how many were expired."""
        ids = list(self._minted.get(hostname, []))
        if not ids:
            log.info("tailnet.keys_revoked_for", hostname=hostname, revoked=0, known_keys=0)
            return 0
        by_id = {str(k.get("id")): k for k in await self._list_keys()}
        now = self._now()
        revoked = 0
        for key_id in ids:
            entry = by_id.get(key_id)
            if entry is None or not _key_usable(entry, now):
                continue
            if not await self._expire_key(key_id, entry):
                revoked += 1
        # Only forget the keys once every one was dealt with, so a failure can be retried.
        self._minted.pop(hostname, None)
        log.info("tailnet.keys_revoked_for", hostname=hostname, revoked=revoked, known_keys=len(ids))
        return revoked

    async def find_device(self, hostname: str, tags: list[str], *, within: float = 0.0) -> TailnetDevice | None:
        """The node whose hostname (`name`) or DNS name (`givenName`) is `hostname` and that
        carries all of `tags`; of several, the online and newest one. From a listing begun after
        this call, or at most `within` seconds before it (FreshReads)."""
        wanted = set(tags)
        listing = await self._node_reads.read(within=within)
        matches = [n for n in listing.named(hostname) if wanted <= _node_tags(n)]
        if not matches:
            return None
        # Several nodes of one name: an ephemeral predecessor not yet collected. Prefer the live one.
        best = max(matches, key=lambda n: (bool(n.get("online")), _parse_time(n.get("createdAt")) or _EPOCH))
        return _device(best, hostname)

    async def list_devices(self, tags: list[str]) -> list[TailnetDevice]:
        """Every node carrying all of `tags` (the sweeper looks for ones without a GPU node)."""
        wanted = set(tags)
        nodes = (await self._node_reads.read()).devices
        return [_device(n, str(n.get("name") or n.get("givenName") or "")) for n in nodes if wanted <= _node_tags(n)]

    async def _all_nodes(self) -> DeviceListing:
        nodes = json_items(await self._call("GET", "/api/v1/node"), "nodes", system=SYSTEM)
        return DeviceListing.of(nodes, lambda n: (n.get("name"), n.get("givenName")))

    async def delete_device(self, device_id: str) -> None:
        """Delete the node; one already gone (404) counts as deleted."""
        response = await self._call_unless_not_found("DELETE", f"/api/v1/node/{quote(device_id, safe='')}", ok=(404,))
        gone = response is None or response.status_code == 404
        log.info("tailnet.device_deleted", device_id=device_id, already_gone=gone)

    # --- requests ---------------------------------------------------------------------

    async def _expire_key(self, key_id: str, entry: dict[str, Any] | None = None) -> bool:
        """Expire one key by id; True when it no longer existed. 0.28/0.29 answer 200 for a
        missing id (nothing to expire: done), 0.30 answers 404: gone. Before 0.28 the key is
        named by its user and whole key, read from the user's key list (or `entry`)."""
        api = await self._keys_api()
        if api != KEYS_BY_ID:
            if entry is None:
                entry = next((k for k in await self._list_keys() if str(k.get("id")) == key_id), None)
            secret = entry.get("key") if entry else None
            if not isinstance(secret, str) or not secret:
                return True
            if entry is not None and not _key_usable(entry, self._now()):
                return False  # spent or expired: nothing can join with it any more
            owner = await self._key_owner(api)
            response = await self._call(
                "POST", "/api/v1/preauthkey/expire", json={"user": owner, "key": secret}, secrets=[secret], ok=(500,)
            )
            if response.status_code >= 500:
                # 0.23/0.24 validate the key before expiring it: a key used or expired since
                # the list is refused with these words, for good. Either way it is done.
                # The server's words sort the answer; only its code is quoted (they may echo).
                if not any(words in error_detail(response) for words in _KEY_ALREADY_DONE):
                    raise self._error(
                        TransientError, f"{SYSTEM}: expiring a pre-auth key answered {response.status_code}: {self._answer(response)}"
                    )
            return False
        response = await self._call_unless_not_found("POST", "/api/v1/preauthkey/expire", json={"id": key_id}, ok=(404,))
        return response is None or response.status_code == 404

    async def _call_unless_not_found(self, method: str, path: str, *, ok: tuple[int, ...], **kwargs: Any) -> httpx.Response | None:
        """`_call`, but None for a 500 whose words say "not found" (how 0.29 reports a missing
        user, node or key: an unmapped error, which retrying cannot change). The words only sort
        the answer; no error quotes them. Any other 500 is retried as `_call` retries one."""
        response = await self._call(method, path, ok=ok, settles=_says_not_found, **kwargs)
        return None if response.status_code not in ok and _says_not_found(response) else response

    async def _keys_api(self) -> str:
        """Which pre-auth key API the server speaks (KEYS_BY_*), found once by what it accepts.
        A 5xx that does not say "not found" is an outage, not an answer: it is not cached."""
        if self._api is not None:
            return self._api
        probe = await self._call("GET", "/api/v1/preauthkey", ok=(400, 500))
        if probe.status_code < 300:
            self._api = KEYS_BY_ID
        else:
            self._require_user_not_found(probe)
            if not self._user:
                raise self._error(
                    ConfigError,
                    f"the Headscale server {self._base_url!r} is older than 0.28 (it lists pre-auth keys only per user), "
                    "so every key needs an owner: set HEADSCALE_USER for the worker, or upgrade Headscale to 0.28 or later",
                )
            by_id = await self._call("GET", "/api/v1/preauthkey", params={"user": await self._resolve_user()}, ok=(400, 500))
            if by_id.status_code >= 300:
                self._require_user_not_found(by_id)
            self._api = KEYS_BY_USER_ID if by_id.status_code < 300 else KEYS_BY_USER_NAME
        log.info("tailnet.headscale_api", base_url=self._base_url, preauthkey_api=self._api)
        return self._api

    def _require_user_not_found(self, response: httpx.Response) -> None:
        """An older server refuses a key list without a user it knows with "user not found";
        anything else is not a version answer."""
        if "not found" not in error_detail(response).lower():
            raise self._error(
                TransientError, f"{SYSTEM}: GET /api/v1/preauthkey answered {response.status_code}: {self._answer(response)}"
            )

    async def _key_owner(self, api: str) -> str:
        """The configured user as this server's key calls name it: its name before 0.26, else its id."""
        return await self._resolve_user_name() if api == KEYS_BY_USER_NAME else await self._resolve_user()

    async def _list_keys(self) -> list[dict[str, Any]]:
        """The pre-auth keys this adapter can see: every key (0.28+) or the user's keys."""
        api = await self._keys_api()
        params = {"user": await self._key_owner(api)} if api != KEYS_BY_ID else {}
        return json_items(await self._call("GET", "/api/v1/preauthkey", params=params), "preAuthKeys", system=SYSTEM)

    async def _resolve_user_name(self) -> str:
        """The configured user's name, looked up by id once (for servers before 0.26)."""
        if self._user_name is not None:
            return self._user_name
        user_id = await self._resolve_user()
        for entry in json_items(await self._call("GET", "/api/v1/user"), "users", system=SYSTEM):
            if str(entry.get("id")) == user_id and entry.get("name"):
                self._user_name = str(entry["name"])
                return self._user_name
        raise self._error(ConfigError, f"Headscale user {self._user!r} does not exist: create it with `headscale users create`")

    async def _resolve_user(self) -> str:
        """The numeric id of the configured user, looked up by name once."""
        if self._user_id is not None:
            return self._user_id
        assert self._user is not None
        response = await self._call("GET", "/api/v1/user", params={"name": self._user})
        for entry in json_items(response, "users", system=SYSTEM):
            if entry.get("name") == self._user and entry.get("id") not in (None, ""):
                self._user_id = str(entry["id"])
                return self._user_id
        raise self._error(
            ConfigError, f"Headscale user {self._user!r} does not exist: create it with `headscale users create {self._user}`"
        )


def _node_tags(node: dict[str, Any]) -> set[str]:
    """0.28+ has `tags`; older servers split them into forced/valid tags."""
    tags = node.get("tags")
    if tags is None:
        tags = list(node.get("forcedTags") or []) + list(node.get("validTags") or [])
    return {str(t) for t in tags or []}


def _key_usable(entry: dict[str, Any], now: datetime) -> bool:
    """Whether a listed key can still register a node: not spent (single-use) and not expired."""
    if entry.get("used") and not entry.get("reusable"):
        return False
    expiration = _parse_time(entry.get("expiration"))
    # A zero timestamp (0001-01-01) means no expiration was set.
    return expiration is None or expiration.year <= 1 or expiration > now


def _device(raw: dict[str, Any], hostname: str) -> TailnetDevice:
    return TailnetDevice(
        device_id=str(raw.get("id")),
        hostname=hostname,
        addresses=[str(a) for a in raw.get("ipAddresses") or []],
        tags=sorted(_node_tags(raw)),
        connected=bool(raw.get("online")),
    )


def _says_not_found(response: httpx.Response) -> bool:
    """Whether a 500 is Headscale 0.29's "<object> not found" (its words sort, never quoted)."""
    return response.status_code == 500 and "not found" in error_detail(response).lower()

