"""A local fake of the Headscale 0.29 REST API (`/api/v1`) for the tests and `tgp demo`, served
by aiohttp on loopback so the adapter is exercised over real HTTP.

Shapes and errors follow the real server (reference/network-bootstrap.md 2.x): Bearer API keys
(a missing or wrong one gets a plain-text 401 "Unauthorized"), protojson bodies (lowerCamelCase,
uint64 ids as strings, RFC 3339 times), pre-auth keys whose full secret is returned only on
create and shown as a prefix in the list, users by numeric id, tagged nodes with `online`, and
gRPC-gateway errors `{"code": <grpc code>, "message": ..., "details": []}`. A node that does
not exist answers 404 (0.29 returns gRPC NotFound). A user that does not exist answers 500:
0.29's handlers return that as a plain Go error, which grpc-gateway maps to Unknown/500 (read
from the source, not observed). Expiring or deleting a key id that does not exist answers 200
`{}`: 0.28/0.29 run `UPDATE ... WHERE id = ?` / a delete by id, which match nothing without an
error (hscontrol/db/preauth_keys.go); 0.30 answers 404, which `missing_key_status=404` gives.

`version` ("0.29" by default) makes the fake answer as an older server for the calls whose
shape changed (reference/network-bootstrap.md 2.3): before 0.28 a pre-auth key belongs to a
user (`user` is required; tag-only keys do not exist), the key list needs `?user=` and shows
whole keys (they were stored in plain text), a key is expired with `{user, key}`, and nodes
carry `forcedTags` instead of `tags` and stay owned by the key's user. 0.26-0.27 name the user
by numeric id (a name in `?user=` is a 400 type mismatch); 0.23-0.25 by name. Without a
`user`, the old key list answers 500 "user not found". 0.23 and 0.24 look the key up to expire
through the check a joining node's key gets (hscontrol/db/preauth_keys.go `GetPreAuthKey` ->
`ValidatePreAuthKey`), so expiring a key that was already used or has expired answers 500
"AuthKey has already been used" / "AuthKey expired" (a plain Go error: Unknown/500); from 0.25
the lookup leaves that check to the caller and the expiry succeeds.

Not part of the real API:
* `POST /_fake/register {"authKey": ..., "hostname": ...}` (and `FakeHeadscale.register`):
  what tailscaled does when it joins with a key; it spends a single-use key and creates a node.
* `FakeHeadscale.fail(path, status, times=...)`: the next requests to a path answer 429 or 5xx.
* `FakeHeadscale.keys`, `.nodes`, `.users`, `.requests`: state and a request log for assertions.

    async with FakeHeadscale(api_keys=["hskey-api-abc-s3cret"], users=["tgp"]) as hs:
        tailnet = HeadscaleTailnet(base_url=hs.url, api_key=SecretStr("hskey-api-abc-s3cret"), user="1")
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from sim.fakeserver import Fault, FakeServer, Handler, RecordedRequest

__all__ = ["FakeHeadscale", "FakeNode", "FakePreAuthKey", "FakeRequest", "FakeUser", "RegistrationRejected"]

# gRPC status codes as grpc-gateway reports them in `code`.
GRPC_UNKNOWN = 2
GRPC_INVALID_ARGUMENT = 3
GRPC_NOT_FOUND = 5


def _iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(value: str) -> datetime:
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


class RegistrationRejected(Exception):
    """`register` refused the key (unknown, expired or already used)."""


@dataclass
class FakeUser:
    id: str
    name: str
    created_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "createdAt": _iso(self.created_at),
            "displayName": "",
            "email": "",
            "providerId": "",
            "provider": "",
            "profilePicUrl": "",
        }


@dataclass
class FakePreAuthKey:
    """A pre-auth key as the fake stores it. `secret` is what create returns as `key`."""

    id: str
    secret: str
    user: FakeUser | None
    reusable: bool
    ephemeral: bool
    expiration: datetime | None
    created_at: datetime
    acl_tags: list[str]
    used: bool = False
    body: dict[str, Any] = field(default_factory=dict)

    def expired(self, now: datetime) -> bool:
        return self.expiration is not None and now >= self.expiration

    def to_json(self, *, with_secret: bool = False, version: tuple[int, int] = (0, 29)) -> dict[str, Any]:
        legacy = version < (0, 28)
        data: dict[str, Any] = {
            "id": self.id,
            # Since 0.28 only the create call shows the whole key; lists show its prefix.
            "key": self.secret if with_secret or legacy else self.secret.rsplit("-", 1)[0] + "-***",
            "reusable": self.reusable,
            "ephemeral": self.ephemeral,
            "used": self.used,
            "expiration": _iso(self.expiration) if self.expiration else None,
            "createdAt": _iso(self.created_at),
            "aclTags": list(self.acl_tags),
        }
        if self.user is not None:
            # 0.26 made `user` the whole user; before, it was the user's name.
            data["user"] = self.user.name if version < (0, 26) else self.user.to_json()
        return data


@dataclass
class FakeNode:
    """A node as the fake stores it; `to_json` gives the real API's field names."""

    id: str
    name: str
    given_name: str
    ip_addresses: list[str]
    tags: list[str]
    user: FakeUser | None
    created_at: datetime
    last_seen: datetime
    key: FakePreAuthKey
    online: bool = True

    def to_json(self, version: tuple[int, int] = (0, 29)) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "machineKey": f"mkey:{self.id:0>64}",
            "nodeKey": f"nodekey:{self.id:0>64}",
            "discoKey": f"discokey:{self.id:0>64}",
            "ipAddresses": list(self.ip_addresses),
            "name": self.name,
            "givenName": self.given_name,
            "lastSeen": _iso(self.last_seen),
            "expiry": None,  # tagged nodes do not expire by default
            "preAuthKey": self.key.to_json(version=version),
            "createdAt": _iso(self.created_at),
            "registerMethod": "REGISTER_METHOD_AUTH_KEY",
            "online": self.online,
            "approvedRoutes": [],
            "availableRoutes": [],
            "subnetRoutes": [],
        }
        if version < (0, 28):
            # Before tags became an identity, a key's tags were forced onto a user's node.
            data.update(forcedTags=list(self.tags), validTags=[], invalidTags=[])
        else:
            data["tags"] = list(self.tags)
        if self.user is not None:
            data["user"] = self.user.to_json()
        return data


FakeRequest = RecordedRequest


class FakeHeadscale(FakeServer):
    """The Headscale v1 REST API on 127.0.0.1, port chosen by the OS.

    `api_keys` are the accepted Bearer keys; `users` are created in order with ids "1", "2", ...
    `now` is the clock for key expiry (tests pass a controllable one). `missing_key_status` is
    the status for expiring or deleting a key id that does not exist: 200 like 0.28/0.29, 404
    like 0.30. `version` ("major.minor", e.g. "0.27" or "0.25") answers as that older server.
    """

    def __init__(
        self,
        *,
        api_keys: Iterable[str],
        users: Iterable[str] = ("tgp",),
        now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        missing_key_status: int = 200,
        version: str = "0.29",
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__(host=host)
        major, minor = (int(part) for part in version.split(".")[:2])
        if (major, minor) < (0, 23):
            raise ValueError("the fake speaks Headscale 0.23 and later (0.22 calls nodes machines)")
        self.version = (major, minor)
        self.api_keys = set(api_keys)
        self.now = now
        self.missing_key_status = missing_key_status
        self.users: dict[str, FakeUser] = {}
        for name in users:
            self.add_user(name)
        self.keys: dict[str, FakePreAuthKey] = {}
        self.nodes: dict[str, FakeNode] = {}
        self._key_ids = itertools.count(1)
        self._node_ids = itertools.count(1)

    # --- lifecycle --------------------------------------------------------------------

    def _add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/api/v1/preauthkey", self._create_key)
        r.add_get("/api/v1/preauthkey", self._list_keys)
        r.add_post("/api/v1/preauthkey/expire", self._expire_key)
        r.add_delete("/api/v1/preauthkey", self._delete_key)
        r.add_get("/api/v1/node", self._list_nodes)
        r.add_get("/api/v1/node/{node_id}", self._get_node)
        r.add_delete("/api/v1/node/{node_id}", self._delete_node)
        r.add_get("/api/v1/user", self._list_users)
        r.add_post("/_fake/register", self._register)

    def _middlewares(self) -> list[Middleware]:
        return [self._record, self._inject_faults, self._authenticate]

    # --- test controls ----------------------------------------------------------------

    def add_user(self, name: str) -> FakeUser:
        """Create a user (`headscale users create`); ids count up from 1."""
        user = FakeUser(id=str(len(self.users) + 1), name=name, created_at=self.now())
        self.users[user.id] = user
        return user

    def register(self, auth_key: str, hostname: str) -> FakeNode:
        """Join with `auth_key` as tailscaled would. Raises RegistrationRejected for an
        unknown, expired or already used single-use key."""
        now = self.now()
        key = next((k for k in self.keys.values() if k.secret == auth_key), None)
        if key is None:
            raise RegistrationRejected("invalid authkey")
        if key.expired(now):
            raise RegistrationRejected("authkey expired")
        if key.used and not key.reusable:
            raise RegistrationRejected("authkey already used")
        key.used = True
        n = next(self._node_ids)
        taken = {node.given_name for node in self.nodes.values()}
        given = hostname.lower()
        if given in taken:
            # Headscale keeps DNS names unique by appending a random suffix.
            given = f"{given}-{secrets.token_hex(4)}"
        node = FakeNode(
            id=str(n),
            name=hostname,
            given_name=given,
            ip_addresses=[f"100.64.{n // 256}.{n % 256}", f"fd7a:115c:a1e0::{n:x}"],
            # A tagged key makes a tagged node, owned by its tags rather than the user (0.28+).
            tags=list(key.acl_tags),
            user=None if key.acl_tags and self.version >= (0, 28) else key.user,
            created_at=now,
            last_seen=now,
            key=key,
        )
        self.nodes[node.id] = node
        return node

    # --- middleware -------------------------------------------------------------------

    def _fault_response(self, fault: Fault) -> web.Response:
        """An injected failure (`fail(path, ...)` on the full path, e.g. "/api/v1/node/*"), as a
        gRPC-gateway error body."""
        code = 8 if fault.status == 429 else 14  # RESOURCE_EXHAUSTED, UNAVAILABLE
        return web.json_response({"code": code, "message": fault.message, "details": []}, status=fault.status, headers=fault.headers)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/api/"):
            header = request.headers.get("Authorization", "")
            if not header.startswith("Bearer ") or header.removeprefix("Bearer ") not in self.api_keys:
                # Headscale's HTTP middleware answers in plain text, not the gRPC error shape.
                return web.Response(status=401, text="Unauthorized")
        return await handler(request)

    # --- pre-auth keys ----------------------------------------------------------------

    async def _create_key(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, GRPC_INVALID_ARGUMENT, "invalid JSON body")
        if not isinstance(body, dict):
            return _error(400, GRPC_INVALID_ARGUMENT, "invalid JSON body")
        tags = [str(t) for t in body.get("aclTags") or []]
        for tag in tags:
            if not tag.startswith("tag:"):
                return _error(400, GRPC_INVALID_ARGUMENT, "tag must start with the string 'tag:'")
            if tag.lower() != tag:
                return _error(400, GRPC_INVALID_ARGUMENT, "tag should be lowercase")
            if len(tag.split()) > 1:
                return _error(400, GRPC_INVALID_ARGUMENT, "tags must not contain spaces")
        user_ref = str(body.get("user") or "")
        user: FakeUser | None = None
        if self.version < (0, 28) or (user_ref and user_ref != "0"):
            # Before 0.28 every key belongs to a user.
            user = self._user(user_ref)
            if user is None:
                return _error(500, GRPC_UNKNOWN, "user not found")
        if user is None and not tags:
            return _error(500, GRPC_UNKNOWN, "pre-auth key needs a user or tags")
        expiration = None
        if body.get("expiration"):
            try:
                expiration = _parse_time(str(body["expiration"]))
            except ValueError:
                return _error(400, GRPC_INVALID_ARGUMENT, "invalid value for expiration")
        key_id = str(next(self._key_ids))
        key = FakePreAuthKey(
            id=key_id,
            # Before 0.28 keys were plain random hex, stored as is.
            secret=f"hskey-auth-{secrets.token_hex(6)}-{secrets.token_urlsafe(32)}" if self.version >= (0, 28) else secrets.token_hex(24),
            user=user,
            reusable=bool(body.get("reusable", False)),
            ephemeral=bool(body.get("ephemeral", False)),
            expiration=expiration,
            created_at=self.now(),
            acl_tags=sorted(set(tags)),
            body=body,
        )
        self.keys[key_id] = key
        return web.json_response({"preAuthKey": key.to_json(with_secret=True, version=self.version)})

    async def _list_keys(self, request: web.Request) -> web.Response:
        keys = sorted(self.keys.values(), key=lambda k: int(k.id))
        if self.version < (0, 28):
            # Before 0.28 the list is per user, and `user` is required.
            ref = request.query.get("user", "")
            if self.version >= (0, 26) and ref and not ref.isdigit():
                return _error(400, GRPC_INVALID_ARGUMENT, f'type mismatch, parameter: user, error: strconv.ParseUint: parsing "{ref}": invalid syntax')
            user = self._user(ref)
            if user is None:
                return _error(500, GRPC_UNKNOWN, "user not found")
            keys = [k for k in keys if k.user is user]
        # Since 0.28 the list holds every key, whatever `user` says.
        return web.json_response({"preAuthKeys": [k.to_json(version=self.version) for k in keys]})

    async def _expire_key(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, GRPC_INVALID_ARGUMENT, "invalid JSON body")
        body = body if isinstance(body, dict) else {}
        if self.version < (0, 28):
            # Before 0.28 a key is named by its user and whole key.
            user = self._user(str(body.get("user") or ""))
            if user is None:
                return _error(500, GRPC_UNKNOWN, "user not found")
            key = next((k for k in self.keys.values() if k.secret == body.get("key")), None)
            if key is None:
                return _error(500, GRPC_UNKNOWN, "AuthKey not found")
            if self.version < (0, 25):
                # The key is validated as if a node joined with it, before the user is compared.
                if key.expired(self.now()):
                    return _error(500, GRPC_UNKNOWN, "AuthKey expired")
                if key.used and not key.reusable:
                    return _error(500, GRPC_UNKNOWN, "AuthKey has already been used")
            if key.user is not user:
                return _error(500, GRPC_UNKNOWN, "user mismatch")
        else:
            key = self.keys.get(str(body.get("id") or ""))
        if key is None:
            if self.missing_key_status < 300:
                return web.json_response({})  # an UPDATE that matched no row
            return _error(self.missing_key_status, GRPC_NOT_FOUND, "preauth key not found")
        now = self.now()
        if key.expiration is None or key.expiration > now:
            key.expiration = now
        return web.json_response({})

    async def _delete_key(self, request: web.Request) -> web.Response:
        key = self.keys.pop(request.query.get("id", ""), None)
        if key is None and self.missing_key_status >= 300:
            return _error(self.missing_key_status, GRPC_NOT_FOUND, "preauth key not found")
        return web.json_response({})

    # --- nodes and users --------------------------------------------------------------

    async def _list_nodes(self, request: web.Request) -> web.Response:
        user_name = request.query.get("user")
        nodes = sorted(self.nodes.values(), key=lambda n: int(n.id))
        if user_name:
            if not any(u.name == user_name for u in self.users.values()):
                return _error(500, GRPC_UNKNOWN, "user not found")
            nodes = [n for n in nodes if n.user is not None and n.user.name == user_name]
        return web.json_response({"nodes": [n.to_json(self.version) for n in nodes]})

    async def _get_node(self, request: web.Request) -> web.Response:
        node = self.nodes.get(request.match_info["node_id"])
        if node is None:
            return _error(404, GRPC_NOT_FOUND, "node not found")
        return web.json_response({"node": node.to_json(self.version)})

    async def _delete_node(self, request: web.Request) -> web.Response:
        node = self.nodes.pop(request.match_info["node_id"], None)
        if node is None:
            return _error(404, GRPC_NOT_FOUND, "node not found")
        return web.json_response({})

    async def _list_users(self, request: web.Request) -> web.Response:
        name = request.query.get("name")
        users = [u for u in self.users.values() if not name or u.name == name]
        return web.json_response({"users": [u.to_json() for u in sorted(users, key=lambda u: int(u.id))]})

    # --- simulation hook --------------------------------------------------------------

    async def _register(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, GRPC_INVALID_ARGUMENT, "invalid JSON body")
        auth_key, hostname = (body or {}).get("authKey"), (body or {}).get("hostname")
        if not isinstance(auth_key, str) or not isinstance(hostname, str) or not hostname:
            return _error(400, GRPC_INVALID_ARGUMENT, "authKey and hostname are required")
        try:
            node = self.register(auth_key, hostname)
        except RegistrationRejected as exc:
            return _error(401, 16, str(exc))
        return web.json_response({"node": node.to_json(self.version)})

    def _user(self, ref: str) -> FakeUser | None:
        """The user a request names: by name before 0.26, by numeric id since."""
        if self.version < (0, 26):
            return next((u for u in self.users.values() if u.name == ref), None)
        return self.users.get(ref)


def _error(status: int, code: int, message: str) -> web.Response:
    return web.json_response({"code": code, "message": message, "details": []}, status=status)
