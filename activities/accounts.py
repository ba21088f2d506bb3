"""Cloud adapters per class account: one adapter per (provider, Secret key), built from the key
the GPUNodeClass references (`providers[].credentialsRef`), read when an activity needs it.

A NodeRequest carries only the reference (tgp.types.CredentialsRef: namespace, name, key);
the activity reads the Secret through the Cluster port, and the adapter built from it is kept
for as long as the Secret's resourceVersion stays the same. A rotated key (a new
resourceVersion) gets a new adapter at the next activity; the replaced one is closed once the
calls that may still hold it are done (`retire_after`). So two classes meant for two accounts
each bill their own account, and a rotated key is picked up without restarting the worker.

A node keeps the account it was bought with until it ends. Its InstanceRef carries `account`,
the fingerprint of the key that bought it (`account_of`); when the Secret holds another key
since, the registry looks the node's instance up with the Secret's current key first (a
rotation: the same account) and, when that key does not see it, with the key it was bought with
(a switch to another account): kept open in this process (an adapter replaced by a new key is
not closed but kept, bounded, `MAX_KEPT_ACCOUNTS`), found under any key of the Secret, or kept
for every worker (below). A key that answers 401 (revoked) sees nothing. An instance no key can
reach is an error that says what to do, never "gone" (which would abandon a billing instance),
and the class's validation says that its Secret names another account than running nodes were
bought with (`account_problems`).

What a worker needs to end what it bought is kept durably and for every replica, never in
workflow history: before a launch buys with a class's key (`for_purchase`), the key is kept in a
Secret of tgp's own, `tgp-system/tgp-kept-<provider>-<account>` (activities/kept_accounts.py).
With the class's Secret deleted or its key removed, any worker (this one, a restarted one, the
other replica) reaches a node's instance with the key of its recorded account: the adapter it
still has open, else the kept one. Never to buy: a purchase needs the class's Secret, and its
absence is an error that names it (and the class says CredentialsMissing, naming it). A node
bought before keys were kept has its key kept at its first look with the Secret's key. The
sweeper forgets a kept key once its account holds no tgp instance (`KeptAccounts.forget_unused`).

A provider the class gives no credentialsRef for uses the worker's own adapter, built from
its environment (activities/clouds/registry.py `providers_from_env`): what `tgp offers`
and the demo use.

Tailnets likewise (`TailnetRegistry`): a class's tailscaleConfig.oauthSecretRef (keys client-id
and client-secret for Tailscale, api-key and login-server for Headscale) gets its own adapter,
rebuilt when the Secret changes; without one, the worker's own tailnet (TS_OAUTH_CLIENT_ID/...,
HEADSCALE_...). A Headscale key goes only to the server its Secret names, never to an internal
address unless the operator allows it (activities/tailnets/servers.py). No class reaches tgp's
own Secrets (`tgp-...`, tgp.secrets.class_reference_problem).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog
from pydantic import SecretStr

from activities.tailnets.headscale import HeadscaleTailnet
from activities.ports import Cluster, CloudProvider, Tailnet
from activities.tailnets.tailscale import DEFAULT_BASE_URL as TAILSCALE_API_URL
from activities.tailnets.tailscale import TailscaleTailnet
from activities.clouds.registry import build_provider, static_capabilities
from activities.kept_accounts import Build, KeptAccounts, account_of, close_adapter
from activities.account_reach import AccountUnavailable, BoughtWith, SharedLookups
from activities.name_lists import LookupsByAccount
from activities.offer_cache import OfferCache
from tgp.capabilities import ProviderCapabilities
from tgp.errors import AuthError, ConfigError, PermissionDenied, TgpError
from activities.tailnets.servers import GuardedTransport, address_problem, allows_internal, bound_server_problem
from tgp.secrets import class_reference_problem, register_process
from tgp.types import CredentialsRef, TailnetRef

__all__ = ["RETIRE_AFTER", "ProviderRegistry", "TailnetRegistry", "VersionedAdapters", "account_of", "secret_value"]

log = structlog.get_logger("tgp.credentials")

# How long an adapter replaced by a rotated key stays open: the longest call that may still
# hold it (a launch waiting behind a provider's pacer) ends within the launch stage budget.
RETIRE_AFTER = timedelta(minutes=15)

# Adapters of keys a Secret no longer holds, kept open for the nodes bought with them.
MAX_KEPT_ACCOUNTS = 32
# How long a node reached with another key than its Secret's counts as running, for the class.
ACCOUNT_SEEN_FOR = timedelta(hours=1)


class SecretMissing(ConfigError):
    """A class's Secret, or its key, is not there (deleted, or the key renamed)."""


def secret_value(data: Mapping[str, bytes], key: str, where: str, *, secret: bool = True) -> SecretStr:
    """The text of `key` in a Secret's data (whitespace stripped: `kubectl create secret
    --from-file` keeps the file's newline). Raises ConfigError naming the Secret and key.
    `secret=False` for a value that is not secret (an OAuth client id): not scrubbed."""
    raw = data.get(key)
    if raw is None:
        raise SecretMissing(f"{where} has no key {key!r} (keys: {', '.join(sorted(data)) or 'none'})")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"key {key!r} of {where} is not UTF-8 text") from None
    if not text:
        raise ConfigError(f"key {key!r} of {where} is empty")
    if secret:
        register_process(text)  # kept out of every message and log line (tgp.secrets)
    return SecretStr(text)


@dataclass
class _Entry:
    version: str
    digest: bytes  # of the Secret's data: a new resourceVersion with the same data keeps the adapter
    adapter: Any


def _digest(data: Mapping[str, bytes]) -> bytes:
    h = hashlib.sha256()
    for k in sorted(data):
        h.update(k.encode() + b"\0" + hashlib.sha256(data[k]).digest())
    return h.digest()


class VersionedAdapters:
    """Adapters built from Secrets, each kept while its Secret's resourceVersion stays the same.

    `get(key, namespace, name, build)` reads the Secret now; when its resourceVersion is the one
    the cached adapter was built from, that adapter is returned, else `build(data)` makes a new
    one and the old one is closed after `retire_after`. `aclose()` closes everything."""

    def __init__(
        self, cluster: Cluster, *, retire_after: timedelta = RETIRE_AFTER, on_replaced: Callable[[Any], None] | None = None
    ) -> None:
        """`on_replaced(adapter)`, when given, takes over an adapter a new Secret replaced
        (instead of closing it after `retire_after`)."""
        self.cluster = cluster
        self.retire_after = retire_after
        self.on_replaced = on_replaced
        self.last_data: dict[Any, Mapping[str, bytes]] = {}
        self._entries: dict[Any, _Entry] = {}
        self._retiring: dict[asyncio.Task[None], Any] = {}
        self.builds = 0  # adapters built so far (for tests and metrics)

    async def get(self, key: Any, namespace: str, name: str, build: Callable[[Mapping[str, bytes]], Any], *, what: str) -> Any:
        # tgp's own Secrets are never read for a class (tgp.secrets.class_reference_problem).
        if (problem := class_reference_problem(name, what)) is not None:
            raise ConfigError(problem)
        secret = await self.cluster.read_secret_versioned(namespace, name)
        if secret is None:
            raise SecretMissing(f"Secret {namespace}/{name} does not exist: create it or fix the GPUNodeClass's {what}")
        self.last_data[key] = secret.data
        entry = self._entries.get(key)
        if entry is not None and entry.version == secret.resource_version and secret.resource_version:
            return entry.adapter
        digest = _digest(secret.data)
        if entry is not None and entry.digest == digest:
            entry.version = secret.resource_version  # rewritten, not changed: keep tokens and state
            return entry.adapter
        adapter = build(secret.data)
        self.builds += 1
        # No await since the lookup above: nothing else replaced the entry meanwhile.
        old = self._entries.get(key)
        self._entries[key] = _Entry(secret.resource_version, digest, adapter)
        if old is not None and old.adapter is not adapter:
            log.info("credentials_rotated", secret=f"{namespace}/{name}", what=what)
            if self.on_replaced is not None:
                self.on_replaced(old.adapter)
            else:
                self._retire(old.adapter)
        return adapter

    def current(self, key: Any) -> Any | None:
        """The adapter last built for `key`, whatever its Secret says now."""
        entry = self._entries.get(key)
        return entry.adapter if entry is not None else None

    def _retire(self, adapter: Any) -> None:
        async def later() -> None:
            await asyncio.sleep(self.retire_after.total_seconds())
            await close_adapter(adapter)

        task = asyncio.get_running_loop().create_task(later())
        self._retiring[task] = adapter
        task.add_done_callback(lambda t: self._retiring.pop(t, None))

    async def aclose(self) -> None:
        retiring = list(self._retiring.items())
        self._retiring.clear()
        for task, adapter in retiring:
            task.cancel()
            await close_adapter(adapter)
        entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            await close_adapter(entry.adapter)


class ProviderRegistry:
    """The cloud adapter for (provider, class credentials): see the module docstring.

    `fallback` is the worker's own adapters by provider name (from its environment); it is used
    as given (not copied), so adapters added to it later are found. `env` supplies the
    adapters' options (TGP_<PROVIDER>_API_URL, VAST_VM, LAMBDA_SSH_KEY_NAME, ...)."""

    def __init__(
        self,
        *,
        cluster: Cluster,
        env: Mapping[str, str] | None = None,
        fallback: dict[str, CloudProvider] | None = None,
        build: Build = build_provider,
        retire_after: timedelta = RETIRE_AFTER,
        offers: OfferCache | None = None,
        kept: KeptAccounts | None = None,
    ) -> None:
        """`kept`: where the keys bought with are kept for every worker (default: tgp-system,
        through `cluster`; activities.kept_accounts)."""
        self.env = dict(env or {})
        self.fallback = fallback if fallback is not None else {}
        self._build = build
        self.kept = kept if kept is not None or cluster is None else KeptAccounts(cluster, build=build, env=self.env)
        # The pricing cache, keyed like the adapters by account: shared by whoever shares this
        # registry (the worker's node, pool and class activities).
        self.offers = offers or OfferCache()
        # Launches' look-ups by name, one listing in flight per account (activities.name_lists).
        self.lookups = LookupsByAccount()
        self._adapters = VersionedAdapters(cluster, retire_after=retire_after, on_replaced=self._keep_open)
        # Which account (key fingerprint) and Secret each adapter built here bills, and its key.
        self._accounts: dict[int, tuple[tuple[str, CredentialsRef], str]] = {}
        self._keys: dict[int, SecretStr] = {}
        # Adapters of keys their Secret no longer holds: (provider, ref, account) -> adapter.
        self._kept: OrderedDict[tuple[str, CredentialsRef, str], CloudProvider] = OrderedDict()
        # Accounts other than their Secret's current key that nodes were reached on, and when.
        self._seen: dict[tuple[str, CredentialsRef], dict[str, float]] = {}

    @property
    def builds(self) -> int:
        return self._adapters.builds

    def account(self, adapter: CloudProvider) -> str | None:
        """The account (key fingerprint) `adapter` bills, when it was built from a class Secret."""
        found = self._accounts.get(id(adapter))
        return found[1] if found else None

    async def list_offers(self, adapter: CloudProvider) -> Any:
        """`adapter`'s offers through the pricing cache of its account (activities.offer_cache):
        a Listing, stale (with why) while listings fail, bounded."""
        return await self.offers.offers(adapter.name, self.account(adapter), adapter.list_offers)

    def sharing_lookups(self, adapter: CloudProvider) -> CloudProvider:
        """`adapter` whose look-ups by name share listings with its account's other look-ups
        (activities.name_lists: never an older view than the caller's own). Not for an
        instance reached across an account switch (`BoughtWith`): its look-up by name falls
        back to the key the instance was bought with, which a shared listing would skip."""
        if isinstance(adapter, BoughtWith):
            return adapter
        return SharedLookups(adapter, self.lookups)  # type: ignore[return-value]

    def _keep_open(self, adapter: Any) -> None:
        """An adapter whose Secret now holds another key: kept open for the nodes it bought."""
        found = self._accounts.get(id(adapter))
        if found is None:
            self._adapters._retire(adapter)
            return
        (name, ref), account = found
        self._kept[(name, ref, account)] = adapter
        self._kept.move_to_end((name, ref, account))
        while len(self._kept) > MAX_KEPT_ACCOUNTS:
            _, evicted = self._kept.popitem(last=False)
            self._accounts.pop(id(evicted), None)
            self._keys.pop(id(evicted), None)
            self._adapters._retire(evicted)

    def account_problems(self, name: str, credentials: CredentialsRef, current: str | None) -> list[str]:
        """What the class should say about nodes running on another key than its Secret's
        `current` one (seen within ACCOUNT_SEEN_FOR)."""
        cutoff = time.monotonic() - ACCOUNT_SEEN_FOR.total_seconds()
        others = sorted(a for a, at in self._seen.get((name, credentials), {}).items() if at >= cutoff and a != current)
        if not others:
            return []
        where = f"Secret {credentials.namespace}/{credentials.name}"
        return [
            f"providers[{name}].credentialsRef: {where} (key {credentials.key!r}) now names another account than running nodes were "
            f"bought with (keys {', '.join(others)}); they keep the account they were bought with until they end: keep the old key "
            "in the Secret (under any key name) until then, or tgp cannot reach and end them"
        ]

    def configured(self) -> list[str]:
        """Providers the worker itself has a key for."""
        return sorted(self.fallback)

    async def get(self, name: str, credentials: CredentialsRef | None = None, account: str | None = None) -> CloudProvider:
        """The adapter that bills `credentials`' account, or the worker's own without them.
        `account`: the key fingerprint an instance was bought with; when the Secret holds
        another key now, an adapter that reaches that account (see the module docstring)."""
        try:
            current = await self._current(name, credentials)
        except SecretMissing:
            # The Secret went while nodes bought with it run: they stay terminable with the key
            # of their account this worker has open, or the one kept for every worker
            # (activities.kept_accounts; never in history). Never for a purchase (no account).
            kept = self._kept_for(name, credentials, account) or await self._kept_durably(name, credentials, account)
            if kept is None:
                raise
            log.warning("credentials_secret_missing_using_kept_key", provider=name, secret=f"{credentials.namespace}/{credentials.name}", account=account)
            return kept
        if credentials is None or account is None:
            return current
        if self.account(current) == account:
            await self._keep_key(current, strict=False)  # a node bought before keys were kept: from now on
            return current
        bought_with = (
            self._kept.get((name, credentials, account))
            or self._from_secret(name, credentials, account)
            or await self._kept_durably(name, credentials, account)
        )

        def elsewhere() -> None:
            # The Secret's key does not see the instance, the key that bought it does: the
            # Secret names another account now.
            self._seen.setdefault((name, credentials), {})[account] = time.monotonic()

        def unreachable() -> AccountUnavailable:
            elsewhere()
            return AccountUnavailable(
                f"this node's instance was bought with another key ({account}) than Secret {credentials.namespace}/{credentials.name} "
                f"holds now under {credentials.key!r}, which does not see it, and this worker no longer has that key: put it back in "
                "the Secret (under any key name) so tgp can reach the instance and end it"
            )

        return BoughtWith(current, bought_with, elsewhere, unreachable)  # type: ignore[return-value]

    def _kept_for(self, name: str, credentials: CredentialsRef | None, account: str | None) -> CloudProvider | None:
        """An adapter of `account` this worker still has open: the Secret's last one, or one kept
        after a rotation. None without credentials or account (nothing was bought with a key)."""
        if credentials is None or account is None:
            return None
        last = self._adapters.current((name, credentials))
        if last is not None and self.account(last) == account:
            return last
        return self._kept.get((name, credentials, account))

    async def _kept_durably(self, name: str, credentials: CredentialsRef | None, account: str | None) -> CloudProvider | None:
        """An adapter with the key of `account` kept for every worker (activities.kept_accounts),
        held open here like a rotated one. None without credentials or account, or none kept."""
        if credentials is None or account is None or self.kept is None:
            return None
        adapter = await self.kept.adapter(name, account)
        if adapter is None:
            return None
        self._accounts[id(adapter)] = ((name, credentials), account)
        self._keep_open(adapter)
        return adapter

    async def for_purchase(self, name: str, credentials: CredentialsRef | None) -> CloudProvider:
        """The adapter a launch buys with (`get`'s), its class key kept for every worker first
        (activities.kept_accounts): whatever it buys stays terminable by any worker, after a
        restart and with its Secret gone. Raises when the key cannot be kept."""
        adapter = await self.get(name, credentials)
        if credentials is not None:
            try:
                await self._keep_key(adapter, strict=True)
            except (AuthError, PermissionDenied) as exc:
                # The Kubernetes API's refusal, not the provider account's (tgp.offers.block_for).
                raise ConfigError(
                    f"cannot keep the key of {credentials} for the nodes it buys ({type(exc).__name__}): grant the worker "
                    "get, create and patch on Secrets in its namespace (deploy/, docs/security.md); nothing was bought"
                ) from None
        return adapter

    async def _keep_key(self, adapter: CloudProvider, *, strict: bool) -> None:
        """Keep the key `adapter` was built with from a class Secret, or refresh it (at most
        every REFRESH_EVERY): raising when `strict` (before a purchase), else logging."""
        found, key = self._accounts.get(id(adapter)), self._keys.get(id(adapter))
        if self.kept is None or found is None or key is None:
            return
        (name, ref), account = found
        await (self.kept.keep if strict else self.kept.keep_quietly)(name, key, account, ref)

    def _from_secret(self, name: str, credentials: CredentialsRef, account: str) -> CloudProvider | None:
        """An adapter for the key of `account` if the Secret holds it under any of its keys."""
        data = self._adapters.last_data.get((name, credentials)) or {}
        for raw in data.values():
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                continue
            if text and account_of(text) == account:
                register_process(text)
                adapter = self._build(name, SecretStr(text), self.env)
                if adapter is None:
                    return None
                self._accounts[id(adapter)] = ((name, credentials), account)
                self._keep_open(adapter)
                return adapter
        return None

    async def _current(self, name: str, credentials: CredentialsRef | None) -> CloudProvider:
        if credentials is None:
            try:
                return self.fallback[name]
            except KeyError:
                raise ConfigError(
                    f"provider {name!r} is not configured on this worker (configured: {', '.join(self.configured()) or 'none'}): "
                    f"give it a credentialsRef in the GPUNodeClass, or the worker its key"
                ) from None

        def build(data: Mapping[str, bytes]) -> CloudProvider:
            key = secret_value(data, credentials.key, f"Secret {credentials.namespace}/{credentials.name}")
            adapter = self._build(name, key, self.env)
            if adapter is None:
                raise ConfigError(f"provider {name!r} cannot be configured on this worker (for {name}, set TGP_SIMULATED_CLOUD_URL)")
            self._accounts[id(adapter)] = ((name, credentials), account_of(key))
            self._keys[id(adapter)] = key
            return adapter

        return await self._adapters.get((name, credentials), credentials.namespace, credentials.name, build, what=f"providers[{name}].credentialsRef")

    async def capabilities(self, name: str, credentials: CredentialsRef | None = None) -> ProviderCapabilities | None:
        """What the adapter the class would use can do (a Vast.ai adapter with VAST_VM=true
        is a VM); the static table when no adapter can be built here."""
        try:
            return (await self.get(name, credentials)).capabilities
        except TgpError:
            return static_capabilities(name, self.env)

    async def aclose(self) -> None:
        """Close the adapters built from class credentials (not the worker's own)."""
        kept, self._kept = list(self._kept.values()), OrderedDict()
        for adapter in kept:
            await close_adapter(adapter)
        await self._adapters.aclose()


class TailnetRegistry:
    """The tailnet adapter for (backend, class tailnet Secret): see the module docstring.

    `fallback` is the worker's own tailnets by backend name (used as given, not copied); `env`
    supplies TGP_TAILSCALE_API_URL, HEADSCALE_USER and TGP_TAILNET_ALLOW_INTERNAL (whether a
    class's Headscale server may be on an internal address)."""

    def __init__(
        self,
        *,
        cluster: Cluster,
        env: Mapping[str, str] | None = None,
        fallback: dict[str, Tailnet] | None = None,
        retire_after: timedelta = RETIRE_AFTER,
    ) -> None:
        self.env = dict(env or {})
        self.fallback = fallback if fallback is not None else {}
        self._adapters = VersionedAdapters(cluster, retire_after=retire_after)

    @property
    def builds(self) -> int:
        return self._adapters.builds

    async def get(self, backend: str, ref: TailnetRef | None = None) -> Tailnet:
        """The class's own tailnet adapter (its Secret read now), or the worker's own."""
        if ref is None:
            try:
                return self.fallback[backend]
            except KeyError:
                raise ConfigError(
                    f"tailnet backend {backend!r} is not configured on this worker (configured: {', '.join(sorted(self.fallback)) or 'none'}); "
                    "set tailscaleConfig.oauthSecretRef in the GPUNodeClass, or TS_OAUTH_CLIENT_ID/TS_OAUTH_CLIENT_SECRET (Tailscale) "
                    "or HEADSCALE_URL/HEADSCALE_API_KEY (Headscale) on the worker"
                ) from None
        where = f"Secret {ref.namespace}/{ref.name}"

        def build(data: Mapping[str, bytes]) -> Tailnet:
            if backend == "headscale":
                url = ref.login_server
                if not url:
                    raise ConfigError("a Headscale tailnet needs tailscaleConfig.loginServer in the GPUNodeClass")
                internal = allows_internal(self.env)
                problem = bound_server_problem(data, url, where) or address_problem(url, allow_internal=internal)
                if problem is not None:
                    raise ConfigError(f"tailscaleConfig: {problem}")
                return HeadscaleTailnet(
                    base_url=url,
                    api_key=secret_value(data, "api-key", where),
                    user=self.env.get("HEADSCALE_USER"),
                    secret_ref=where,
                    transport=None if internal else GuardedTransport(),
                )
            return TailscaleTailnet(
                base_url=self.env.get("TGP_TAILSCALE_API_URL", TAILSCALE_API_URL),
                client_id=secret_value(data, "client-id", where, secret=False).get_secret_value(),
                client_secret=secret_value(data, "client-secret", where),
                secret_ref=where,
            )

        return await self._adapters.get((backend, ref), ref.namespace, ref.name, build, what="tailscaleConfig.oauthSecretRef")

    async def aclose(self) -> None:
        """Close the adapters built from class Secrets (not the worker's own)."""
        await self._adapters.aclose()


class AccountActivities:
    """Base of the activities that reach clouds through a class's own account (its providers'
    credentialsRef, read via the cluster) or, without one, the worker's adapters (`providers`)."""

    def __init__(self, *, cluster: Cluster, providers: Mapping[str, CloudProvider], registry: ProviderRegistry | None = None) -> None:
        self.cluster = cluster
        self.providers = dict(providers)
        self.registry = registry or ProviderRegistry(cluster=cluster, fallback=self.providers)
