"""The Kubernetes API's failures as tgp's typed errors (activities/kube/cluster.py's `_call`).

Messages name the action and say what to fix. They quote the API server's own Status message
(the cluster's, not a provider's), shortened, and never credentials or a raw response body,
because they reach workflow history."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kubernetes.aio.client.exceptions import ApiException

from tgp.errors import AuthError, ConfigError, PermissionDenied, TgpError, TransientError

SYSTEM = "Kubernetes API"
# Longest server message quoted in an error.
MESSAGE_LIMIT = 300


def api_error(action: str, exc: ApiException) -> TgpError:
    """A failed call to `action` as tgp's typed error: 401 AuthError, 403 PermissionDenied,
    429/5xx TransientError (with the server's Retry-After), 409 and 404 TransientError, 400/422
    ConfigError; each says what to check."""
    status = exc.status or 0
    message = server_message(exc)
    if status == 401:
        return AuthError(
            f"{SYSTEM} rejected the credentials (401) to {action}: check the kubeconfig or the worker's "
            "service-account token (expired or revoked?)"
        )
    if status == 403:
        return PermissionDenied(
            f"{SYSTEM} refused to {action} (403): {message}; grant the worker's service account this "
            "permission in its ClusterRole"
        )
    if status == 429 or status >= 500 or status == 0:
        return TransientError(f"{SYSTEM}: {action} answered {status}: {message}", retry_after=_retry_after(exc))
    if status == 409:
        return TransientError(f"{SYSTEM}: {action} conflicted with another writer (409): {message}")
    if status in (400, 422):
        return ConfigError(f"{SYSTEM} rejected the request to {action} ({status}): {message}")
    if status == 404:
        return TransientError(f"{SYSTEM}: {action}: not found (404): {message}")
    return TgpError(f"{SYSTEM}: {action} answered {status}: {message}")


def _status_body(exc: ApiException) -> Mapping[str, Any]:
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, Mapping) else {}


def server_message(exc: ApiException) -> str:
    """The API's own explanation (a Status message and its causes), shortened."""
    body = _status_body(exc)
    message = str(body.get("message") or exc.reason or "")
    causes = [str(c.get("message")) for c in (body.get("details") or {}).get("causes") or [] if c.get("message")]
    if causes:
        message = f"{message} ({'; '.join(causes)})"
    return message[:MESSAGE_LIMIT]


def names_the_pod(exc: ApiException) -> bool:
    """Whether a 404 from the eviction endpoint is about the pod (gone) rather than the endpoint."""
    details = _status_body(exc).get("details") or {}
    return details.get("kind") in ("pods", "pod")


def _retry_after(exc: ApiException) -> float | None:
    headers = exc.headers or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
