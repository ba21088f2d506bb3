"""Typed errors that adapters raise; the activity layer maps them to Temporal retry behaviour.

Messages must say what to fix and must never contain a secret (they reach workflow history):
every secret registered with `tgp.secrets` is scrubbed from a message when the error is made.
"""

from __future__ import annotations

from tgp.secrets import scrub


class TgpError(Exception):
    """Base of every error an adapter raises on purpose."""

    retryable: bool = True

    def __init__(self, *args: object) -> None:
        super().__init__(*(scrub(a) if isinstance(a, str) else a for a in args))


class TransientError(TgpError):
    """Rate limit, 5xx, timeout: try again later, honouring `retry_after` when the API gave one."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TerminationStuck(TransientError):
    """A terminate was answered, but reading the instance still shows it running (or it came
    back): keep terminating and reading; the node shows TerminationStuck meanwhile."""


class CapacityError(TgpError):
    """The provider has no capacity for this offer now: fail over to the next offer."""

    retryable = False


class OfferRefused(TgpError):
    """The provider refused this one offer (the type is not sold in that region, the ask was
    withdrawn, the bid or a per-type limit is not met, ...) while the class itself is fine:
    mark the offer unavailable and fail over to the next. Distinct from ConfigError, which
    would fail on every offer and so ends the node."""

    retryable = False


class QuotaExceeded(TgpError):
    """The account may launch no more of this GPU type on this provider (a per-type quota or
    limit, in any region): fail over to another GPU type or provider. Distinct from
    PermissionDenied, which stops the whole account."""

    retryable = False


class LaunchFailed(TgpError):
    """The instance could not be started (it failed or vanished while booting)."""

    retryable = False


class AuthError(TgpError):
    """Credentials were rejected; retrying cannot help until the user fixes them."""

    retryable = False


class PermissionDenied(TgpError):
    """Credentials work but may not do this (for example an OAuth client using a tag it does
    not own)."""

    retryable = False


class ConfigError(TgpError):
    """Bad user input (a missing Secret, an unknown provider, ...)."""

    retryable = False
