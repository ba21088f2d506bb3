"""Activities of the class workflow (GPUNodeClass): its budget ledger's calls, which node
workflows make, and the validation of a class (its providers, Secrets and boot template)."""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Mapping

from pydantic import BaseModel, ConfigDict
from temporalio import activity

from activities.accounts import AccountActivities, ProviderRegistry
from activities.ports import CloudProvider, Cluster
from activities.boot.checks import TemplateReport, class_check_settings, template_report
from activities.boot.render import (
    JOIN_VARIABLES,
    BootSettings,
    default_template,
    shipped_template,
    template_uses,
)
from activities.boot.renders import RendersBusy, bounded
from activities.errors import temporal_errors
from activities.ledger import LedgerBatcher, LedgerCall
from tgp.messages import Grant
from tgp.capabilities import capability_problems
from tgp.class_status import AccountProblem, account_blocked, credentials_missing
from tgp.crds import GPUNodeClassSpec, login_server_problems
from tgp.errors import TgpError, TransientError
from tgp.pools import provider_credentials
from tgp.types import BlockScope, CredentialsRef
from tgp.secrets import class_reference_problem
from activities.tailnets.servers import address_problem, allows_internal, bound_server_problem

class ValidateClassInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    spec: GPUNodeClassSpec
    operator_namespace: str = "tgp-system"


async def _template_report(
    owner: str, field: str, template: str, settings: BootSettings | None = None, payload_kinds: Mapping[str, list[str]] | None = None
) -> TemplateReport:
    """A class template's problems, each naming `field`, and the variables it reads: one
    bounded child process, in the renders' queue under the class's share (renders.bounded).
    template_report reports rather than raises; anything that still raises is a problem of the
    class too, never a failed activity (which would leave the class without a status); a full
    queue is a TransientError (the validation is retried)."""
    try:
        report = await bounded(owner, template_report, template, settings, payload_kinds)
    except RendersBusy as exc:
        raise TransientError(f"cannot check the template now: {exc}") from None
    except Exception as exc:  # noqa: BLE001
        report = TemplateReport(problems=[f"could not be checked ({type(exc).__name__}: {str(exc)[:300]})"])
    return report.model_copy(update={"problems": [f"{field}: {m}" for m in report.problems]})


@functools.cache
def _shipped_uses(name: str) -> frozenset[str]:
    """The variables a shipped template reads (ours, so inspected once per process)."""
    return frozenset(template_uses(shipped_template(name)))


async def boot_problems(spec: GPUNodeClassSpec, payload_kinds: Mapping[str, list[str]], owner: str = "") -> list[str]:
    """The problems of the template each node of the class would boot with: the class's own,
    else the shipped default for each provider's boot payload kind (`payload_kinds`: kind ->
    providers), trial-rendered with the class's settings, so a class whose every node would
    fail at launch is not Ready."""
    settings = class_check_settings(
        kubernetes_version=spec.kubernetes_version,
        login_server=spec.tailscale_config.login_server,
        tags=spec.tailscale_config.tags,
        accept_routes=spec.tailscale_config.accept_routes,
    )
    problems: list[str] = []
    templates: list[tuple[str, str]] = []  # (what, text)
    # The class's own bootstrapTemplate must be a payload its providers boot (cloud-init, a script, env).
    own_kinds: Mapping[str, list[str]] | None = None
    if spec.talos_config is not None:
        templates.append(("talosConfig.machineConfigTemplate", spec.talos_config.machine_config_template))
    elif spec.bootstrap_template is not None:
        templates.append(("bootstrapTemplate", spec.bootstrap_template))
        own_kinds = payload_kinds
    else:
        for kind, names in sorted(payload_kinds.items()):
            default = default_template(kind)
            which = f"provider{'s' if len(names) > 1 else ''} {', '.join(names)}"
            if default is None:
                if kind != "env":  # env: the built-in payload, no template
                    problems.append(
                        f"bootstrapTemplate: {which} boot{'s' if len(names) == 1 else ''} with a {kind} payload and tgp ships no "
                        "default template for it; "
                        "set bootstrapTemplate (see docs/bootstrap.md)"
                    )
                continue
            text = shipped_template(default)
            if spec.kubernetes_version is None and "KubernetesVersion" in await bounded(owner, _shipped_uses, default):
                problems.append(
                    f"kubernetesVersion: the default Ubuntu boot template ({default}, used by {which} without a "
                    "bootstrapTemplate) needs it; set it to the control plane's version, e.g. 1.34.1"
                )
                settings = settings.model_copy(update={"kubernetes_version": "1.34.1"})  # check the rest all the same
            templates.append((f"the default boot template {default} (used by {which})", text))
    for what, text in templates:
        report = await _template_report(owner, what, text, settings, own_kinds if what == "bootstrapTemplate" else None)
        problems += report.problems
        join = report.uses & JOIN_VARIABLES  # none when it does not parse (reported above)
        if join and not spec.join_secret_ref:
            problems.append(
                f"joinSecretRef: {what} uses the cluster join material ({', '.join(sorted(join))}) but the class sets "
                "no joinSecretRef; create the join Secret and reference it (see docs/bootstrap.md)"
            )
    return problems


def tailnet_problems(spec: GPUNodeClassSpec, worker_tailnets: Collection[str] | None) -> list[str]:
    """Whether the class's nodes can join a tailnet: a loginServer that is a URL, and a backend
    this worker has when the class brings no credentials of its own (oauthSecretRef). A class
    naming Headscale on a worker without it used to be Ready and buy nothing."""
    ts = spec.tailscale_config
    problems = []
    if ts.login_server is not None:
        problems += [f"tailscaleConfig.loginServer: {p}" for p in login_server_problems(ts.login_server)]
    backend = "headscale" if ts.login_server else "tailscale"
    if worker_tailnets is not None and not ts.oauth_secret_ref and backend not in worker_tailnets:
        how = (
            "HEADSCALE_URL and HEADSCALE_API_KEY on the worker, or tailscaleConfig.oauthSecretRef (a Secret with key api-key)"
            if backend == "headscale"
            else "TS_OAUTH_CLIENT_ID and TS_OAUTH_CLIENT_SECRET on the worker, or tailscaleConfig.oauthSecretRef "
            "(a Secret with keys client-id and client-secret)"
        )
        have = ", ".join(sorted(worker_tailnets)) or "none"
        problems.append(f"tailscaleConfig: the class's nodes join {backend}, which this worker has no credentials for (it has: {have}); set {how}")
    return problems


class NodeClassActivities(AccountActivities):
    def __init__(
        self,
        *,
        cluster: Cluster,
        providers: Mapping[str, CloudProvider],
        registry: ProviderRegistry | None = None,
        tailnets: Collection[str] | None = None,
        ledger: LedgerBatcher | None = None,
    ) -> None:
        """`tailnets`: the tailnet backends the worker itself has (tailscale, headscale); None
        leaves a class's tailnet backend unchecked."""
        super().__init__(cluster=cluster, providers=providers, registry=registry)
        self.tailnets = None if tailnets is None else frozenset(tailnets)
        self.ledger = ledger or LedgerBatcher()  # shared with the node activities (workers.main)

    @activity.defn
    async def settle_reservation(self, call: LedgerCall) -> Grant:
        """Tell the class ledger the price a node is about to pay; it may refuse. Sent together
        with the other settlements this worker makes meanwhile (LedgerBatcher)."""
        return await self.ledger.settle(call)

    @activity.defn
    async def release_reservation(self, call: LedgerCall) -> None:
        """Give the node's slot and $/h back to the class budget (batched like the settlements)."""
        await self.ledger.release(call)

    @activity.defn
    async def validate_class(self, inp: ValidateClassInput) -> list[str]:
        """What is wrong with a GPUNodeClass, each problem saying what to fix. Reads the Secrets
        it references (never returning their contents)."""
        problems: list[str] = []
        payload_kinds: dict[str, list[str]] = {}
        with temporal_errors():
            for p in inp.spec.providers:
                if not p.enabled:
                    continue
                if p.name not in self.providers and p.credentials_ref is None:
                    problems.append(f"provider {p.name} has no credentialsRef and is not configured on the worker")
                ref = None
                if p.credentials_ref is not None and (own := class_reference_problem(p.credentials_ref.name, f"providers[{p.name}].credentialsRef")):
                    problems.append(own)
                elif p.credentials_ref is not None:
                    ns = p.credentials_ref.namespace or inp.operator_namespace
                    found = await self._check_secret_key(ns, p.credentials_ref.name, p.credentials_ref.key, f"providers[{p.name}].credentialsRef")
                    problems += found
                    if not found:
                        ref = CredentialsRef(namespace=ns, name=p.credentials_ref.name, key=p.credentials_ref.key)
                # What the adapter nodes of this class would use can do (a Vast.ai adapter with
                # VAST_VM=true rents VMs), else the provider's table entry.
                if ref is not None:
                    # Nodes still running on a key the Secret no longer holds (another account?).
                    try:
                        current = self.registry.account(await self.registry.get(p.name, ref))
                    except TgpError:
                        current = None
                    problems += self.registry.account_problems(p.name, ref, current)
                caps = await self.registry.capabilities(p.name, ref)
                if caps is not None:
                    # spotAllowed permits spot, it does not require it: only node-ness and Talos matter.
                    problems += capability_problems(p.name, caps, wants_talos=inp.spec.talos_config is not None, wants_spot=False)
                    payload_kinds.setdefault(caps.boot_payload, []).append(p.name)
            # The template every node would boot with, the shipped default included. Off the
            # event loop: a check renders in a child process for up to a few seconds.
            problems += await boot_problems(inp.spec, payload_kinds, owner=inp.name)
            ts = inp.spec.tailscale_config
            problems += tailnet_problems(inp.spec, self.tailnets)
            if inp.spec.join_secret_ref and (own := class_reference_problem(inp.spec.join_secret_ref, "joinSecretRef")):
                problems.append(own)
            if ts.oauth_secret_ref and (own := class_reference_problem(ts.oauth_secret_ref, "tailscaleConfig.oauthSecretRef")):
                problems.append(own)
            elif ts.oauth_secret_ref:
                keys = ("api-key",) if ts.login_server else ("client-id", "client-secret")
                for key in keys:
                    problems += await self._check_secret_key(inp.operator_namespace, ts.oauth_secret_ref, key, "tailscaleConfig.oauthSecretRef")
                if ts.login_server:
                    problems += await self._headscale_server_problems(inp.operator_namespace, ts.oauth_secret_ref, ts.login_server)
        return problems

    @activity.defn
    async def account_problems(self, inp: ValidateClassInput) -> list[AccountProblem]:
        """Each pass's look at the class's provider accounts (cheap, unlike `validate_class`):
        a `credentialsRef` Secret, or its key, gone; an account this worker has blocked for an
        authentication or permission error (tgp.offers.block_for), until the block lifts.
        Secrets are named by namespace/name; a block is quoted by its error type only."""
        refs = provider_credentials(inp.spec)
        blocks = [b for b in self.registry.offers.unavailable.blocks() if b.scope is BlockScope.ACCOUNT]
        found: list[AccountProblem] = []
        with temporal_errors():
            for p in inp.spec.providers:
                ref = refs.get(p.name)
                if not p.enabled or (ref is not None and class_reference_problem(ref.name, "credentialsRef")):
                    continue  # tgp's own Secrets are never read for a class (validate_class says so)
                data = await self.cluster.read_secret(ref.namespace, ref.name) if ref is not None else {}
                if ref is not None and (data is None or ref.key not in data):
                    found.append(credentials_missing(p.name, ref, key_only=data is not None))
                found += [account_blocked(p.name, ref, b.cause) for b in blocks if b.provider == p.name and b.account == ref]
        return found

    async def _headscale_server_problems(self, namespace: str, name: str, login_server: str) -> list[str]:
        """Whether the class's Headscale API key may go to its loginServer: the Secret names that
        server, and it is not internal unless the worker allows it (activities/tailnets/servers.py)."""
        data = await self.cluster.read_secret(namespace, name)
        bound = bound_server_problem(data, login_server, f"Secret {namespace}/{name}") if data is not None else None
        where = address_problem(login_server, allow_internal=allows_internal(os.environ))
        return [f"tailscaleConfig.oauthSecretRef: {bound}"] * (bound is not None) + [f"tailscaleConfig.loginServer: {where}"] * (where is not None)

    async def _check_secret_key(self, namespace: str, name: str, key: str, field: str) -> list[str]:
        data = await self.cluster.read_secret(namespace, name)
        if data is None:
            return [f"{field}: Secret {namespace}/{name} does not exist; create it or fix the reference"]
        if key not in data:
            return [f"{field}: Secret {namespace}/{name} has no key {key!r} (keys: {', '.join(sorted(data)) or 'none'})"]
        return []

    def all(self) -> list[object]:
        return [self.settle_reservation, self.release_reservation, self.validate_class, self.account_problems]
