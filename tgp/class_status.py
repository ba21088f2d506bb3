"""What a GPUNodeClass says about itself: its conditions, from what its validation found and what
each pass's look at its provider accounts found (`AccountProblem`: a credentials Secret gone, an
account blocked for rejected credentials), and which of them are also Warning Events. Pure; the
class workflow (workflows/node_class.py) calls it, the class activities build the problems."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Literal

from tgp.conditions import condition_list, quoted
from tgp.crds import Condition, GPUNodeClassStatus
from tgp.messages import Ledger
from tgp.types import CredentialsRef, Model

Wanted = tuple[str, str, str]
CREDENTIALS = "CredentialsAvailable"
ACCOUNTS = "ProviderAccountsAvailable"
# The error types that block a provider account (tgp.offers.SCOPE_OF_CAUSE), in words: a
# condition quotes one of these, never the provider's own text.
ACCOUNT_CAUSES = {
    "AuthError": "the provider refused the credentials",
    "PermissionDenied": "the credentials may not buy (permission, billing or an account quota)",
}


class AccountProblem(Model):
    """One provider account of a class that cannot be used now, in words that name the provider
    and the Secret (namespace/name, never its contents)."""

    reason: Literal["CredentialsMissing", "ProviderAccountBlocked"]
    provider: str
    message: str


def credentials_missing(provider: str, ref: CredentialsRef, *, key_only: bool) -> AccountProblem:
    """The class's `credentialsRef` Secret for `provider` (or its key) is gone."""
    where = f"Secret {ref.namespace}/{ref.name}"
    gone = f"{where} has no key {ref.key!r}" if key_only else f"{where} does not exist"
    return AccountProblem(
        reason="CredentialsMissing",
        provider=provider,
        message=f"providers[{provider}].credentialsRef: {gone}; re-create it: no node can be bought; running nodes stay "
        "terminable by any worker with the key tgp kept of their account (Secrets tgp-kept-..., docs/security.md)",
    )


def account_blocked(provider: str, ref: CredentialsRef | None, cause: str) -> AccountProblem:
    """`provider`'s account of the class is blocked on this worker for `cause` (an error type)."""
    whose = f"Secret {ref.namespace}/{ref.name}" if ref is not None else "the worker's own key (no credentialsRef)"
    code = f"{cause} ({ACCOUNT_CAUSES[cause]})" if cause in ACCOUNT_CAUSES else "an authentication or permission error"
    return AccountProblem(
        reason="ProviderAccountBlocked",
        provider=provider,
        message=f"provider {provider} with {whose} answered {code}: new nodes skip it until the block lifts; fix the credentials or "
        "the account's standing",
    )


def class_conditions(problems: Sequence[str] | None, accounts: Sequence[AccountProblem], ledger: Ledger) -> dict[str, Wanted]:
    """Ready, CredentialsAvailable and ProviderAccountsAvailable. Ready is False while a
    credentials Secret is missing (CredentialsMissing, with any other problem) or the class is not
    valid (InvalidSpec); a blocked account keeps it True (the block lifts by itself, and other
    providers still serve) and is named in its message."""
    missing = [a.message for a in accounts if a.reason == "CredentialsMissing"]
    blocked = [a.provider for a in accounts if a.reason == "ProviderAccountBlocked"]
    wanted: dict[str, Wanted] = {
        CREDENTIALS: ("False", "CredentialsMissing", "; ".join(missing)) if missing else ("True", "Found", ""),
        ACCOUNTS: (
            ("False", "ProviderAccountBlocked", "; ".join(a.message for a in accounts if a.reason == "ProviderAccountBlocked"))
            if blocked
            else ("True", "Usable", "")
        ),
    }
    if missing:
        # Validation names the same Secrets (once it has run since): each said once.
        gone = tuple(f"providers[{a.provider}].credentialsRef:" for a in accounts if a.reason == "CredentialsMissing")
        ready = ("False", "CredentialsMissing", "; ".join([*missing, *(p for p in problems or [] if not p.startswith(gone))]))
    elif problems:
        ready = ("False", "InvalidSpec", "; ".join(problems))
    else:
        message = f"{len(ledger.reservations)} nodes hold ${ledger.hourly_cost}/h of the budget"
        ready = ("True", "Valid", message + (f"; account blocked: {quoted(blocked)} ({ACCOUNTS})" if blocked else ""))
    return {"Ready": ready, **wanted}


def class_status(
    *,
    generation: int | None,
    problems: Sequence[str] | None,
    accounts: Sequence[AccountProblem],
    ledger: Ledger,
    now: datetime,
    previous: Mapping[str, Condition],
) -> tuple[GPUNodeClassStatus, str | None]:
    """The class's status, and the message of its CredentialsMissing Warning Event when that
    condition turned False or changed since `previous` (once, when it changes). Ready repeats it;
    a blocked account is told by the launch that blocked it (activities/node.py,
    `mark_offer_unavailable`, with that launch's error), so it is no Event here."""
    conditions = condition_list(class_conditions(problems, accounts, ledger), generation, now, dict(previous))
    credentials = next(c for c in conditions if c.type == CREDENTIALS)
    warning = credentials.message if _turned_false(previous.get(CREDENTIALS), credentials) else None
    status = GPUNodeClassStatus(observed_generation=generation, conditions=conditions, nodes=len(ledger.reservations), hourly_cost=ledger.hourly_cost)
    return status, warning


def _turned_false(old: Condition | None, new: Condition) -> bool:
    """Whether `new` is False and says something `old` did not."""
    return new.status == "False" and (old is None or old.status != "False" or old.reason != new.reason or old.message != new.message)
