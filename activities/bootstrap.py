"""Boot payloads: what a bought machine runs first to join the tailnet and the cluster.

Rendered inside the launch activity, next to the freshly minted auth key, and handed straight
to the provider: a payload is never returned, logged or stored.
"""

from __future__ import annotations

from pydantic import SecretStr

from tgp.errors import ConfigError
from tgp.types import BootPayload


def render_boot_payload(kind: str, *, hostname: str, auth_key: SecretStr, login_server: str | None = None) -> BootPayload:
    """Build the payload of `kind` for `hostname`.

    `env` is the container-style payload (KEY=VALUE lines, what the simulated cloud and
    container-only providers take): the variables the Tailscale container/extension reads.
    """
    if kind == "env":
        lines = [f"TS_AUTHKEY={auth_key.get_secret_value()}", f"TS_HOSTNAME={hostname}"]
        if login_server:
            lines.append(f"TS_EXTRA_ARGS=--login-server={login_server}")
        return BootPayload(kind=kind, content="\n".join(lines) + "\n", hostname=hostname)
    raise ConfigError(f"boot payload kind {kind!r} is not supported yet; supported: env")
