"""HeadscaleTailnet against FakeHeadscale over real HTTP on loopback.

Time is a controllable clock shared by the adapter (key expiration it asks for) and the fake
(key expiry); retry waits are recorded, never slept.
"""

from __future__ import annotations

import asyncio

import logging
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import structlog
from pydantic import SecretStr

from activities.http_wire import default_tls
from activities.tailnets.headscale import HeadscaleTailnet
from activities.ports import Tailnet
from tgp.errors import AuthError, ConfigError, TransientError
from sim.headscale import FakeHeadscale, RegistrationRejected

API_KEY = "hskey-api-abcdef123456-S3cretApiKeyNeverLogged"
TAGS = ["tag:gpu-node"]
HOUR = timedelta(hours=1)
EPOCH = datetime(2026, 9, 1, 12, 0, tzinfo=timezone.utc)


class Clock:
    def __init__(self) -> None:
        self.at = EPOCH

    def now(self) -> datetime:
        return self.at

    def advance(self, delta: timedelta) -> None:
        self.at += delta


class Sleeps(list[float]):
    """Records retry waits instead of sleeping."""

    async def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
async def hs(clock: Clock) -> AsyncIterator[FakeHeadscale]:
    async with FakeHeadscale(api_keys=[API_KEY], users=["tgp", "other"], now=clock.now) as fake:
        yield fake


def make_tailnet(hs: FakeHeadscale, clock: Clock, sleeps: Sleeps, *, user: str | None = "1", api_key: str = API_KEY) -> HeadscaleTailnet:
    return HeadscaleTailnet(
        base_url=hs.url,
        api_key=SecretStr(api_key),
        user=user,
        sleep=sleeps,
        now=clock.now,
        secret_ref="Secret tgp-system/headscale",
    )


@pytest.fixture
async def tailnet(hs: FakeHeadscale, clock: Clock, sleeps: Sleeps) -> AsyncIterator[HeadscaleTailnet]:
    async with make_tailnet(hs, clock, sleeps) as adapter:
        yield adapter


def test_satisfies_port(tailnet: HeadscaleTailnet) -> None:
    port: Tailnet = tailnet
    assert port is tailnet
    assert API_KEY not in repr(tailnet)


# --- key minting -------------------------------------------------------------------------


async def test_mint_sends_single_use_ephemeral_tagged_key_for_the_user_id(
    tailnet: HeadscaleTailnet, hs: FakeHeadscale
) -> None:
    key = await tailnet.mint_auth_key(hostname="gpu-a100-x7k2", tags=TAGS, expiry=HOUR)

    sent = [r for r in hs.requests if r.method == "POST" and r.path == "/api/v1/preauthkey"]
    assert len(sent) == 1
    assert sent[0].json == {
        "user": "1",
        "reusable": False,
        "ephemeral": True,
        "expiration": "2026-09-01T13:00:00Z",
        "aclTags": ["tag:gpu-node"],
    }
    stored = hs.keys[key.key_id]
    assert key.secret.get_secret_value() == stored.secret and stored.secret.startswith("hskey-auth-")
    assert stored.user is not None and stored.user.name == "tgp"
    assert stored.secret not in repr(key)


async def test_user_name_is_resolved_to_its_id_once(hs: FakeHeadscale, clock: Clock, sleeps: Sleeps) -> None:
    async with make_tailnet(hs, clock, sleeps, user="other") as tailnet:
        await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
        await tailnet.mint_auth_key(hostname="gpu-2", tags=TAGS, expiry=HOUR)
    lookups = [r for r in hs.requests if r.path == "/api/v1/user"]
    assert len(lookups) == 1 and lookups[0].query == {"name": "other"}
    assert [r.json["user"] for r in hs.requests if r.path == "/api/v1/preauthkey" and r.method == "POST"] == ["2", "2"]


async def test_unknown_user_is_a_config_error(hs: FakeHeadscale, clock: Clock, sleeps: Sleeps) -> None:
    async with make_tailnet(hs, clock, sleeps, user="nobody") as tailnet:
        with pytest.raises(ConfigError, match="'nobody' does not exist"):
            await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    async with make_tailnet(hs, clock, sleeps, user="42") as tailnet:
        # 0.29 answers 500 "user not found": not worth Temporal's retries.
        with pytest.raises(ConfigError, match="'42' does not exist"):
            await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    assert hs.keys == {}


async def test_tag_only_keys_without_a_user(hs: FakeHeadscale, clock: Clock, sleeps: Sleeps) -> None:
    async with make_tailnet(hs, clock, sleeps, user=None) as tailnet:
        key = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
        with pytest.raises(ConfigError, match="tags or a user"):
            await tailnet.mint_auth_key(hostname="gpu-1", tags=[], expiry=HOUR)
    created = next(r for r in hs.requests if r.method == "POST" and r.path == "/api/v1/preauthkey")
    assert "user" not in created.json and hs.keys[key.key_id].user is None


@pytest.mark.parametrize("tag", ["gpu-node", "tag:GPU", "tag:gpu node"])
async def test_invalid_tags_are_refused_before_calling(tailnet: HeadscaleTailnet, hs: FakeHeadscale, tag: str) -> None:
    with pytest.raises(ConfigError, match="tag:"):
        await tailnet.mint_auth_key(hostname="gpu-1", tags=[tag], expiry=HOUR)
    assert hs.requests == []


# --- retries and errors --------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 500, 502, 503])
async def test_rate_limits_and_server_errors_are_retried(
    tailnet: HeadscaleTailnet, hs: FakeHeadscale, sleeps: Sleeps, status: int
) -> None:
    hs.fail("/api/v1/preauthkey", status, times=2, retry_after=1, method="POST")
    key = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    assert key.key_id in hs.keys
    assert sleeps == [1.0, 1.0]  # Retry-After honoured, never actually slept


async def test_persistent_outage_is_transient_and_scrubbed(tailnet: HeadscaleTailnet, hs: FakeHeadscale, sleeps: Sleeps) -> None:
    hs.fail("/api/v1/node", 503, times=10, message=f"backend down near hskey-auth-0123-leakedkey and {API_KEY}")
    with pytest.raises(TransientError) as caught:
        await tailnet.find_device("gpu-1", TAGS)
    message = str(caught.value)
    assert "503" in message and "leakedkey" not in message and API_KEY not in message
    assert len(sleeps) == 2  # three attempts in the call, then Temporal's retry policy


async def test_wrong_api_key_is_an_auth_error(hs: FakeHeadscale, clock: Clock, sleeps: Sleeps, caplog: pytest.LogCaptureFixture) -> None:
    wrong = "hskey-api-abcdef123456-WrongKeyValue"
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as events:
        async with make_tailnet(hs, clock, sleeps, api_key=wrong) as tailnet:
            with pytest.raises(AuthError) as caught:
                await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    message = str(caught.value)
    assert "401" in message and "Secret tgp-system/headscale" in message and "apikeys create" in message
    assert caught.value.retryable is False and sleeps == []
    for text in (message, caplog.text, str(events)):
        assert wrong not in text


# --- nodes ---------------------------------------------------------------------------------


async def test_node_is_found_after_register(tailnet: HeadscaleTailnet, hs: FakeHeadscale) -> None:
    key = await tailnet.mint_auth_key(hostname="gpu-a100-x7k2", tags=TAGS, expiry=HOUR)
    assert await tailnet.find_device("gpu-a100-x7k2", TAGS) is None

    node = hs.register(key.secret.get_secret_value(), "gpu-a100-x7k2")
    device = await tailnet.find_device("gpu-a100-x7k2", TAGS)
    assert device is not None
    assert device.device_id == node.id
    assert device.addresses == node.ip_addresses and device.addresses[0].startswith("100.64.")
    assert device.tags == TAGS and device.connected is True
    assert await tailnet.find_device("gpu-a100-x7k2", ["tag:other"]) is None
    assert await tailnet.find_device("gpu-other", TAGS) is None

    # Single-use: the key cannot register a second machine.
    with pytest.raises(RegistrationRejected, match="already used"):
        hs.register(key.secret.get_secret_value(), "gpu-a100-x7k2")


async def test_find_prefers_the_online_newest_node(tailnet: HeadscaleTailnet, hs: FakeHeadscale, clock: Clock) -> None:
    first = hs.register((await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)).secret.get_secret_value(), "gpu-1")
    clock.advance(timedelta(minutes=5))
    second = hs.register((await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)).secret.get_secret_value(), "gpu-1")
    assert second.given_name != "gpu-1"  # Headscale de-duplicates the DNS name
    device = await tailnet.find_device("gpu-1", TAGS)
    assert device is not None and device.device_id == second.id
    second.online = False
    device = await tailnet.find_device("gpu-1", TAGS)
    assert device is not None and device.device_id == first.id


async def test_delete_twice_is_fine(tailnet: HeadscaleTailnet, hs: FakeHeadscale) -> None:
    key = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    node = hs.register(key.secret.get_secret_value(), "gpu-1")
    await tailnet.delete_device(node.id)
    assert hs.nodes == {}
    await tailnet.delete_device(node.id)  # 404 = already deleted
    assert [r.status for r in hs.requests if r.method == "DELETE"] == [200, 404]


# --- revoking ------------------------------------------------------------------------------


@pytest.mark.parametrize("missing_status", [200, 404])  # 0.28/0.29 and 0.30 answers for a missing key
async def test_revoke_expires_the_key_and_a_missing_key_counts_as_revoked(
    tailnet: HeadscaleTailnet, hs: FakeHeadscale, missing_status: int
) -> None:
    hs.missing_key_status = missing_status
    key = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    await tailnet.revoke_auth_key(key.key_id)
    assert [r.json for r in hs.requests if r.path == "/api/v1/preauthkey/expire"] == [{"id": key.key_id}]
    with pytest.raises(RegistrationRejected, match="expired"):
        hs.register(key.secret.get_secret_value(), "gpu-1")
    await tailnet.revoke_auth_key("9999")  # never existed


async def test_revoke_keys_for_expires_only_this_hosts_usable_keys(tailnet: HeadscaleTailnet, hs: FakeHeadscale) -> None:
    spent = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    hs.register(spent.secret.get_secret_value(), "gpu-1")
    unused = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    other = await tailnet.mint_auth_key(hostname="gpu-2", tags=TAGS, expiry=HOUR)

    assert await tailnet.revoke_keys_for("gpu-1") == 1
    expired = [r.json["id"] for r in hs.requests if r.path == "/api/v1/preauthkey/expire"]
    assert expired == [unused.key_id]
    assert await tailnet.revoke_keys_for("gpu-1") == 0
    # The other host's key still works.
    hs.register(other.secret.get_secret_value(), "gpu-2")


async def test_revoke_keys_for_after_a_restart_finds_nothing(hs: FakeHeadscale, clock: Clock, sleeps: Sleeps) -> None:
    # Headscale keys carry no hostname: a new process cannot find the old one's keys
    # (documented; the workflow revokes by the key ids it recorded instead).
    async with make_tailnet(hs, clock, sleeps) as before:
        key = await before.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    async with make_tailnet(hs, clock, sleeps) as after:
        assert await after.revoke_keys_for("gpu-1") == 0
        await after.revoke_auth_key(key.key_id)
    assert hs.keys[key.key_id].expired(clock.now())


async def test_expiring_a_key_that_no_longer_exists_is_done_at_once(tailnet: HeadscaleTailnet, hs: FakeHeadscale, sleeps: Sleeps) -> None:
    # 0.28/0.29 expire with an UPDATE by id: a missing id answers 200, not an error to retry.
    await tailnet.revoke_auth_key("9999")
    expires = [r for r in hs.requests if r.path == "/api/v1/preauthkey/expire"]
    assert [(r.json, r.status) for r in expires] == [({"id": "9999"}, 200)]
    assert sleeps == []


# --- older servers ---------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "owner"), [("0.27", "1"), ("0.25", "tgp")])
@pytest.mark.parametrize("user", ["tgp", "1"])
async def test_servers_before_0_28_get_their_own_key_shapes(clock: Clock, sleeps: Sleeps, version: str, owner: str, user: str) -> None:
    async with FakeHeadscale(api_keys=[API_KEY], users=["tgp"], now=clock.now, version=version) as hs:
        async with make_tailnet(hs, clock, sleeps, user=user) as tailnet:
            key = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
            spare = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
            assert [r.json["user"] for r in hs.requests if r.method == "POST" and r.path == "/api/v1/preauthkey"] == [owner, owner]

            # Nodes carry the key's tags as forcedTags before 0.28.
            node = hs.register(key.secret.get_secret_value(), "gpu-1")
            device = await tailnet.find_device("gpu-1", TAGS)
            assert device is not None and device.device_id == node.id and device.tags == TAGS

            # Expired by user and whole key, read from the user's key list.
            await tailnet.revoke_auth_key(spare.key_id)
            assert [r.json for r in hs.requests if r.path == "/api/v1/preauthkey/expire"] == [
                {"user": owner, "key": spare.secret.get_secret_value()}
            ]
            with pytest.raises(RegistrationRejected, match="expired"):
                hs.register(spare.secret.get_secret_value(), "gpu-1")
            await tailnet.revoke_auth_key("9999")  # never existed: nothing to expire
            assert await tailnet.revoke_keys_for("gpu-1") == 0  # one spent, one expired
    # The server's key API was worked out once.
    assert sum(1 for r in hs.requests if r.method == "GET" and r.path == "/api/v1/preauthkey" and not r.query) == 1
    assert sleeps == []


async def test_a_server_before_0_28_without_a_user_is_refused_with_what_to_do(clock: Clock, sleeps: Sleeps) -> None:
    async with FakeHeadscale(api_keys=[API_KEY], users=["tgp"], now=clock.now, version="0.27") as hs:
        async with make_tailnet(hs, clock, sleeps, user=None) as tailnet:
            with pytest.raises(ConfigError) as caught:
                await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    message = str(caught.value)
    assert "older than 0.28" in message and "user" in message and hs.url in message and API_KEY not in message
    assert hs.keys == {}


async def test_an_outage_while_probing_is_not_taken_for_an_old_server(tailnet: HeadscaleTailnet, hs: FakeHeadscale) -> None:
    hs.fail("/api/v1/preauthkey", 500, method="GET", message="database is locked")
    with pytest.raises(TransientError, match="answered 500"):
        await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    key = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
    await tailnet.revoke_auth_key(key.key_id)
    assert [r.json for r in hs.requests if r.path == "/api/v1/preauthkey/expire"] == [{"id": key.key_id}]


# --- 0.23/0.24: expiring a spent or expired key is refused (issue 17, item 14) --------------


@pytest.mark.parametrize("version", ["0.23", "0.24"])
async def test_an_old_server_refuses_to_expire_a_spent_or_expired_key_with_a_500(clock: Clock, version: str) -> None:
    # What the fake answers, as 0.23/0.24 do (ValidatePreAuthKey before the expiry); 0.25 expires it.
    async with FakeHeadscale(api_keys=[API_KEY], users=["tgp"], now=clock.now, version=version) as hs:
        async with httpx.AsyncClient(verify=default_tls(), base_url=hs.url, headers={"Authorization": f"Bearer {API_KEY}"}) as api:
            made = [(await api.post("/api/v1/preauthkey", json={"user": "tgp", "expiration": "2099-01-01T00:00:00Z"})).json()["preAuthKey"] for _ in range(2)]
            hs.register(made[0]["key"], "gpu-1")
            hs.keys[made[1]["id"]].expiration = clock.now()
            used = await api.post("/api/v1/preauthkey/expire", json={"user": "tgp", "key": made[0]["key"]})
            expired = await api.post("/api/v1/preauthkey/expire", json={"user": "tgp", "key": made[1]["key"]})
    assert (used.status_code, used.json()["message"]) == (500, "AuthKey has already been used")
    assert (expired.status_code, expired.json()["message"]) == (500, "AuthKey expired")


async def test_0_25_expires_a_spent_key(clock: Clock) -> None:
    async with FakeHeadscale(api_keys=[API_KEY], users=["tgp"], now=clock.now, version="0.25") as hs:
        async with httpx.AsyncClient(verify=default_tls(), base_url=hs.url, headers={"Authorization": f"Bearer {API_KEY}"}) as api:
            key = (await api.post("/api/v1/preauthkey", json={"user": "tgp"})).json()["preAuthKey"]
            hs.register(key["key"], "gpu-1")
            assert (await api.post("/api/v1/preauthkey/expire", json={"user": "tgp", "key": key["key"]})).status_code == 200


@pytest.mark.parametrize("version", ["0.23", "0.24"])
async def test_revoking_a_spent_or_expired_key_on_0_23_or_0_24_is_done_at_once(clock: Clock, sleeps: Sleeps, version: str) -> None:
    # The node's cleanup revokes the key it joined with: spent by then. On e9a7c55 that 500 was
    # retried for ever, so the node never finished (its Node object and class slot leaked).
    async with FakeHeadscale(api_keys=[API_KEY], users=["tgp"], now=clock.now, version=version) as hs:
        async with make_tailnet(hs, clock, sleeps, user="tgp") as tailnet:
            joined = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
            hs.register(joined.secret.get_secret_value(), "gpu-1")
            await tailnet.revoke_auth_key(joined.key_id)

            stale = await tailnet.mint_auth_key(hostname="gpu-2", tags=TAGS, expiry=HOUR)
            clock.advance(2 * HOUR)
            await tailnet.revoke_auth_key(stale.key_id)

            # Spent between the list and the expiry: the server's refusal is the answer.
            raced = await tailnet.mint_auth_key(hostname="gpu-3", tags=TAGS, expiry=HOUR)
            entry = next(k for k in await tailnet._list_keys() if str(k["id"]) == raced.key_id)
            hs.register(raced.secret.get_secret_value(), "gpu-3")
            assert await tailnet._expire_key(raced.key_id, entry) is False
    assert sleeps == [], "a refusal that cannot change was retried"


async def test_another_500_while_expiring_on_0_24_is_still_an_error(clock: Clock, sleeps: Sleeps) -> None:
    async with FakeHeadscale(api_keys=[API_KEY], users=["tgp", "other"], now=clock.now, version="0.24") as hs:
        async with make_tailnet(hs, clock, sleeps, user="tgp") as tailnet:
            key = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
            entry = next(k for k in await tailnet._list_keys() if str(k["id"]) == key.key_id)
            hs.keys[key.key_id].user = hs.users["2"]  # the server now says "user mismatch"
            # An error, not "done"; its text quotes no server words (docs/security.md).
            with pytest.raises(TransientError, match="expiring a pre-auth key answered 500") as raised:
                await tailnet._expire_key(key.key_id, entry)
            assert "mismatch" not in str(raised.value)


@pytest.mark.parametrize("version", ["0.23", "0.24", "0.25", "0.26", "0.27", "0.28", "0.29"])
@pytest.mark.parametrize("state", ["unused", "used", "expired", "used-after-listing", "gone"])
async def test_revoking_any_key_on_any_supported_version_ends_at_once_and_leaves_it_unusable(
    clock: Clock, sleeps: Sleeps, version: str, state: str
) -> None:
    # Every version x every state a key can be in when a node's cleanup revokes it: the revoke
    # returns without a retry, and nothing can join with the key afterwards.
    async with FakeHeadscale(api_keys=[API_KEY], users=["tgp"], now=clock.now, version=version) as hs:
        async with make_tailnet(hs, clock, sleeps, user="tgp") as tailnet:
            key = await tailnet.mint_auth_key(hostname="gpu-1", tags=TAGS, expiry=HOUR)
            secret = key.secret.get_secret_value()
            entry = next(k for k in await tailnet._list_keys() if str(k["id"]) == key.key_id)
            if state in ("used", "used-after-listing"):
                hs.register(secret, "gpu-1")
            elif state == "expired":
                clock.advance(2 * HOUR)
            elif state == "gone":
                del hs.keys[key.key_id]
            if state == "used-after-listing":
                await tailnet._expire_key(key.key_id, entry)  # the list said usable; the server knows better
            else:
                await tailnet.revoke_auth_key(key.key_id)
    assert sleeps == [], f"{state} key on {version}: a refusal that cannot change was retried"
    with pytest.raises(RegistrationRejected):
        hs.register(secret, "gpu-2")


async def test_joins_looking_at_once_share_one_node_listing(tailnet: HeadscaleTailnet, hs: FakeHeadscale) -> None:
    """40 joining nodes look for their devices at once: one `GET /api/v1/node` in flight at a
    time (activities.fresh_reads), each caller answered for its own hostname."""
    for i in range(0, 40, 2):
        key = await tailnet.mint_auth_key(hostname=f"gpu-{i}", tags=TAGS, expiry=HOUR)
        hs.register(key.secret.get_secret_value(), f"gpu-{i}")
    before = sum(1 for r in hs.requests if r.method == "GET" and r.path == "/api/v1/node")
    found = await asyncio.gather(*(tailnet.find_device(f"gpu-{i}", TAGS) for i in range(40)))
    assert [d is not None for d in found] == [i % 2 == 0 for i in range(40)]
    assert sum(1 for r in hs.requests if r.method == "GET" and r.path == "/api/v1/node") - before <= 2
