"""Which cloud adapters a process has, built from its environment.

In production the worker's Deployment loads the provider Secret with `envFrom`, so the key
names are the environment variables below (the same names as the original README's
`tgp-operator-secret`). `tgp offers` reads the same names from the environment or from a
Secret.

These are the worker's own adapters, the fallback for a class that names no key: a
GPUNodeClass's `providers[].credentialsRef` gets an adapter of its own, built with
`build_provider` from the Secret (activities/accounts.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import SecretStr

from activities.ports import CloudProvider
from activities.clouds.lambdalabs import LambdaProvider
from activities.clouds.paperspace import PaperspaceProvider
from activities.clouds.paperspace import CAPABILITIES as PAPERSPACE_CAPABILITIES
from activities.clouds.runpod import RunPodProvider
from activities.clouds.simulated import SimulatedProvider
from activities.clouds.vastai import CONTAINER_CAPABILITIES, VM_CAPABILITIES, VastProvider
from tgp.capabilities import ProviderCapabilities

# Provider -> environment variable (and Secret key) holding its API key.
API_KEY_ENV = {
    "runpod": "RUNPOD_API_KEY",
    "lambdalabs": "LAMBDA_LABS_API_KEY",
    "paperspace": "PAPERSPACE_API_KEY",
    "vastai": "VAST_API_KEY",
    "simulated": "TGP_SIMULATED_CLOUD_API_KEY",
}

CAPABILITIES: dict[str, ProviderCapabilities] = {
    "runpod": RunPodProvider.capabilities,
    "lambdalabs": LambdaProvider.capabilities,
    "paperspace": PAPERSPACE_CAPABILITIES,
    "vastai": CONTAINER_CAPABILITIES,
    "vastai-vm": VM_CAPABILITIES,
    "simulated": SimulatedProvider.capabilities,
}


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").lower() in ("1", "true", "yes")


def static_capabilities(name: str, env: Mapping[str, str]) -> ProviderCapabilities | None:
    """What `name`'s adapter can do when none is built: the table, with the adapter options
    that change it (VAST_VM=true makes Vast.ai adapters rent VMs)."""
    if name == "vastai" and _flag(env, "VAST_VM"):
        return CAPABILITIES["vastai-vm"]
    return CAPABILITIES.get(name)


def build_provider(name: str, api_key: SecretStr | None, env: Mapping[str, str]) -> CloudProvider | None:
    """The adapter for `name` with `api_key`, or None when it cannot be configured here."""
    if name == "simulated":
        url = env.get("TGP_SIMULATED_CLOUD_URL")
        return SimulatedProvider(url, api_key=api_key) if url else None
    if api_key is None:
        return None
    # TGP_<PROVIDER>_API_URL points an adapter elsewhere (a proxy, or a local fake in tests).
    url = env.get(f"TGP_{name.upper()}_API_URL")
    base = {"base_url": url} if url else {}
    if name == "runpod":
        return RunPodProvider(api_key, **base)
    if name == "lambdalabs":
        return LambdaProvider(api_key, ssh_key_name=env.get("LAMBDA_SSH_KEY_NAME", "tgp"), **base)
    if name == "paperspace":
        return PaperspaceProvider(api_key, template_id=env.get("PAPERSPACE_TEMPLATE_ID"), **base)
    if name == "vastai":
        return VastProvider(api_key, vm=_flag(env, "VAST_VM"), **base)
    return None


def providers_from_env(env: Mapping[str, str], only: list[str] | None = None) -> dict[str, CloudProvider]:
    """Every provider whose credentials (or URL, for `simulated`) are in `env`."""
    providers: dict[str, CloudProvider] = {}
    for name, variable in API_KEY_ENV.items():
        if only and name not in only:
            continue
        key = env.get(variable)
        provider = build_provider(name, SecretStr(key) if key else None, env)
        if provider is not None:
            providers[name] = provider
    return providers
