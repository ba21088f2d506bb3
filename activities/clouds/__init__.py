"""The cloud providers' adapters (activities.ports.CloudProvider), and what their listings share."""

from __future__ import annotations

from collections.abc import Collection


def listed(name: str, prefix: str, names: Collection[str] | None) -> bool:
    """Whether a listing's entry called `name` is asked for: its name starts with `prefix`, and
    with `names`, is one of them. Tested on the provider's raw entry, before it is read into an
    Instance, so a look-up by names reads only its own names out of a large account."""
    return name.startswith(prefix) and (names is None or name in names)
