"""One listing of a tailnet's devices, indexed once by name.

Every joining node looks for its own device about once a second, in a listing it shares with
the other joins (activities.fresh_reads). Each look used to walk the whole listing, building
every device's tag set: in a burst of 500 joins that was 500 looks a second through up to 500
devices, ~3% of the worker's CPU (issue 37). The index is built once per listing; a look reads
the devices under its name only."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

Device = dict[str, Any]


@dataclass(frozen=True)
class DeviceListing:
    """A tailnet's devices as its API listed them (`devices`), and by each name they go by."""

    devices: list[Device]
    by_name: dict[str, list[Device]]

    @classmethod
    def of(cls, devices: list[Device], names: Callable[[Device], Iterable[object]]) -> DeviceListing:
        """`devices` indexed by every name `names` gives for each (a device listed once under
        each of its names)."""
        by_name: dict[str, list[Device]] = {}
        for device in devices:
            for name in {str(n) for n in names(device) if n}:
                by_name.setdefault(name, []).append(device)
        return cls(devices, by_name)

    def named(self, name: str) -> list[Device]:
        """The devices that go by `name`, in the listing's order."""
        return self.by_name.get(name, [])
