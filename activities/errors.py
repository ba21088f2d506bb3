"""How tgp's errors reach Temporal: every activity raises through `temporal_errors`, so the
workflow sees the error's type (for retry policies' non-retryable lists), its scrubbed message,
and the retry delay the API asked for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from temporalio.exceptions import ApplicationError

from tgp.errors import TgpError
from tgp.secrets import scrub, scrub_exception


@contextmanager
def temporal_errors(*, always_retry: bool = False) -> Iterator[None]:
    """Re-raise tgp's typed errors as ApplicationErrors Temporal understands.

    `always_retry` is for cleanup: a leaked instance costs money, so even an auth error keeps
    being retried (with the message visible in the Web UI) until the user fixes it.
    """
    try:
        yield
    except TgpError as exc:
        retry_after = getattr(exc, "retry_after", None)
        raise ApplicationError(
            scrub(str(exc)),
            type=type(exc).__name__,
            non_retryable=not (exc.retryable or always_retry),
            next_retry_delay=timedelta(seconds=retry_after) if retry_after else None,
        ) from None
    except Exception as exc:
        # Temporal records any other exception's message (and traceback) as it is.
        if not isinstance(exc, ApplicationError):
            scrub_exception(exc)
        raise
