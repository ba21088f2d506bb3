"""The keys that bought nodes, kept in Secrets of tgp's own, so that any worker can end them.

A GPUNodeClass's `credentialsRef` Secret may go (deleted, or its key renamed) while nodes bought
with its key run. Those instances bill until they are terminated, and only a key of the account
that bought them can terminate them. So before a worker buys with a class's key it keeps that key
(`KeptAccounts.keep`) in a Secret of tgp's own namespace (tgp-system), one per key:

    tgp-kept-<provider>-<account>      account: the key's fingerprint (`account_of`)
    labels       tgp.io/kept-account=<account>, tgp.io/provider=<provider>, managed-by tgp
    annotations  tgp.io/used-at (when a worker last used the key for a purchase or a Secret
                 naming it), tgp.io/kept-from (which class Secret it came from)
    data         provider, key (nothing else)

A registry that cannot read a class's Secret (activities/accounts.py, `ProviderRegistry.get`)
reaches an instance, by the account its InstanceRef records, with the kept key: look-ups,
describe, terminate. Never a purchase: a purchase reads the class's Secret, and its absence is an
error that names it. The kept key lives in the API server, not in a worker's memory, so a
restarted worker or another replica ends what any worker bought. It never enters workflow
history, logs, status or Events: those carry the account (a fingerprint) and Secret names only.
No GPUNodeClass can name a kept Secret (they are `tgp-...`, tgp.secrets.class_reference_problem).

When a kept key goes (`forget_unused`, run by the sweeper): once no worker has used it for
UNUSED_FOR (its `tgp.io/used-at`) and a listing of its account with it shows no live instance
named `tgp-...`. Every purchase with a key refreshes its used-at at most REFRESH_EVERY before
(`keep`), and buys within LAUNCH_TIMEOUT, so an instance bought with a key unused for UNUSED_FOR
already shows in such a listing (after the provider's consistency window). The delete is
conditional on the resourceVersion the sweep read: a worker that refreshed it meanwhile keeps it.
A key its provider refuses (revoked) or whose account cannot be listed is kept: what it may still
hold cannot be told (a small Secret left is far cheaper than an instance left billing); the
operator deletes it once the account is known empty (docs/security.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta

import structlog
from pydantic import SecretStr

from activities.clouds.registry import build_provider
from activities.listing import list_account
from activities.ports import CloudProvider, Cluster
from tgp.errors import ConfigError, TgpError
from tgp.secrets import OWN_SECRET_PREFIX, register_process
from tgp.types import LAUNCH_TIMEOUT, OPERATOR_NAMESPACE, CredentialsRef

__all__ = ["KEPT_PREFIX", "LABEL_KEPT", "REFRESH_EVERY", "UNUSED_FOR", "KeptAccounts", "account_of", "close_adapter", "kept_name"]

log = structlog.get_logger("tgp.credentials")

KEPT_PREFIX = f"{OWN_SECRET_PREFIX}kept-"
LABEL_KEPT = "tgp.io/kept-account"
LABEL_PROVIDER = "tgp.io/provider"
ANNOTATION_USED = "tgp.io/used-at"
ANNOTATION_FROM = "tgp.io/kept-from"
# How often one worker refreshes a key's used-at: a write per key per worker this often at most.
REFRESH_EVERY = timedelta(minutes=10)
# Unused this long, a key may go: past REFRESH_EVERY + LAUNCH_TIMEOUT + a consistency window
# (3 min), with room for the clocks of two replicas to differ.
UNUSED_FOR = timedelta(hours=2)
# Instances of tgp's are named tgp-<node>-<attempt> (tgp.types.instance_name).
INSTANCE_PREFIX = "tgp-"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

assert UNUSED_FOR > REFRESH_EVERY + LAUNCH_TIMEOUT + timedelta(minutes=30)

Build = Callable[[str, SecretStr | None, Mapping[str, str]], CloudProvider | None]


def account_of(key: SecretStr | str) -> str:
    """A key's fingerprint: which key (so which account) bought an instance. 64 bits of its
    SHA-256, which tells keys apart and gives nothing of a high-entropy key away."""
    text = key.get_secret_value() if isinstance(key, SecretStr) else key
    return "key-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def kept_name(provider: str, account: str) -> str:
    """The Secret that keeps the key of `account` for `provider`."""
    name = f"{KEPT_PREFIX}{provider}-{account}"
    if not _DNS_LABEL.match(provider) or not _DNS_LABEL.match(account) or len(name) > 253:
        raise ConfigError(f"cannot name a Secret for provider {provider!r} and account {account!r}")
    return name


class KeptAccounts:
    """The kept keys of one tgp installation: in `namespace` (the worker's own), through the
    Cluster port; adapters built from them with `build` and `env` (as ProviderRegistry builds)."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        namespace: str = OPERATOR_NAMESPACE,
        build: Build = build_provider,
        env: Mapping[str, str] | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.env = dict(env or {})
        self.now = now
        self._build = build
        # When this process last wrote each kept Secret (time.monotonic()), and one write at a
        # time per Secret: a burst of launches with one key writes it once.
        self._refreshed: dict[str, float] = {}
        self._writing: dict[str, asyncio.Lock] = {}

    async def keep(self, provider: str, key: SecretStr, account: str, source: CredentialsRef) -> None:
        """Keep `key` (of `account`, read from `source`) before it buys, or refresh its used-at
        (at most every REFRESH_EVERY per worker). Raises TgpError when it cannot be kept: a
        purchase must not go ahead with a key no other worker could end it with."""
        name = kept_name(provider, account)
        async with self._writing.setdefault(name, asyncio.Lock()):
            last = self._refreshed.get(name)
            if last is not None and time.monotonic() - last < REFRESH_EVERY.total_seconds():
                return
            used = {ANNOTATION_USED: self.now().isoformat(timespec="seconds")}
            if not await self.cluster.annotate_secret(self.namespace, name, used):
                labels = {LABEL_KEPT: account, LABEL_PROVIDER: provider, "app.kubernetes.io/managed-by": "tgp"}
                why = {ANNOTATION_FROM: f"{source.namespace}/{source.name} ({source.key})", **used}
                data = {"provider": provider.encode(), "key": key.get_secret_value().encode()}
                if not await self.cluster.create_secret(self.namespace, name, data, labels=labels, annotations=why):
                    await self.cluster.annotate_secret(self.namespace, name, used)  # made meanwhile by another worker
                log.info("account_key_kept", provider=provider, account=account, secret=f"{self.namespace}/{name}")
            self._refreshed[name] = time.monotonic()

    async def keep_quietly(self, provider: str, key: SecretStr, account: str, source: CredentialsRef) -> None:
        """`keep` for an instance already bought (one of an earlier release, or observed): a
        failure is logged, never raised, so the node's own call goes on."""
        try:
            await self.keep(provider, key, account, source)
        except TgpError as exc:
            log.warning("account_key_not_kept", provider=provider, account=account, error=str(exc), error_type=type(exc).__name__)

    async def adapter(self, provider: str, account: str) -> CloudProvider | None:
        """An adapter with the kept key of `account`, or None when none is kept (or it is not
        that account's: a Secret changed by hand is not trusted)."""
        data = await self.cluster.read_secret(self.namespace, kept_name(provider, account))
        key = _key_in(data, provider, account)
        return self._build(provider, key, self.env) if key is not None else None

    async def forget_unused(self) -> list[str]:
        """Delete the kept keys nothing can need any more (see the module docstring); the names
        of the Secrets deleted. A key that cannot be checked is kept and logged."""
        forgotten: list[str] = []
        now = self.now()
        for secret in await self.cluster.list_secrets(self.namespace, LABEL_KEPT):
            provider = secret.data.get("provider", b"").decode("utf-8", "replace")
            account = secret.name.removeprefix(f"{KEPT_PREFIX}{provider}-")
            key = _key_in(secret.data, provider, account)
            used = _when(secret.annotations.get(ANNOTATION_USED))
            if key is None or (used is not None and now - used < UNUSED_FOR):
                continue  # not one tgp wrote as it writes them, or used lately
            adapter = self._build(provider, key, self.env)
            if adapter is None:
                continue  # its provider is not configured on this worker: cannot be checked
            try:
                live = await list_account(adapter, INSTANCE_PREFIX, account=account)
            except Exception as exc:  # noqa: BLE001 - any failure (a revoked key's 401 too): cannot tell, keep it
                log.warning("kept_account_unchecked", provider=provider, account=account, secret=secret.name, error_type=type(exc).__name__)
                continue
            finally:
                await close_adapter(adapter)
            if live:
                continue
            if await self.cluster.delete_secret(self.namespace, secret.name, resource_version=secret.resource_version):
                log.info("account_key_forgotten", provider=provider, account=account, secret=f"{self.namespace}/{secret.name}")
                forgotten.append(secret.name)
                self._refreshed.pop(secret.name, None)
        return forgotten


def _key_in(data: Mapping[str, bytes] | None, provider: str, account: str) -> SecretStr | None:
    """The key a kept Secret holds, when it is `provider`'s and of `account`."""
    if not data or data.get("provider", b"").decode("utf-8", "replace") != provider:
        return None
    try:
        text = data.get("key", b"").decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if not text or account_of(text) != account:
        return None
    register_process(text)  # kept out of every message and log line (tgp.secrets)
    return SecretStr(text)


def _when(text: str | None) -> datetime | None:
    """An annotation's time (UTC when it names no offset), or None when there is none to read."""
    try:
        when = datetime.fromisoformat(text) if text else None
    except ValueError:
        return None
    return when.replace(tzinfo=UTC) if when is not None and when.tzinfo is None else when


async def close_adapter(adapter: object) -> None:
    """Close an adapter that has `aclose` (every HTTP one); a failure is logged, never raised."""
    close = getattr(adapter, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception as exc:  # noqa: BLE001 - a failed close leaks a connection pool, nothing more
            log.warning("adapter_close_failed", adapter=type(adapter).__name__, error=str(exc))
