"""Money by ids (tgp.node.remembered): what a node's state keeps of every instance it may have
bought, over any order of sightings."""

from __future__ import annotations

from hypothesis import given, strategies as st

from tgp.node import remembered
from tgp.types import InstanceRef

NAMES = st.sampled_from(["tgp-n-1", "tgp-n-2", "tgp-n-3"])
IDS = st.lists(st.sampled_from(["i-1", "i-2", "i-3", "i-4"]), max_size=3, unique=True)
REFS = st.builds(lambda name, ids, rec: InstanceRef(provider="p", instance_name=name, known_ids=sorted(ids), instance_id=rec), NAMES, IDS, st.none() | st.sampled_from(["i-1", "i-2"]))


@given(st.lists(REFS, max_size=12), NAMES)
def test_one_entry_per_name_and_ids_are_only_ever_added(sightings: list[InstanceRef], current_name: str) -> None:
    seen: list[InstanceRef] = []
    current: InstanceRef | None = InstanceRef(provider="p", instance_name=current_name)
    for ref in sightings:
        before = {k.instance_name: set(k.known_ids) for k in seen}
        seen, current = remembered(seen, current, ref)
        names = [k.instance_name for k in seen]
        assert len(names) == len(set(names)), "two entries for one name"
        after = {k.instance_name: set(k.known_ids) for k in seen}
        assert all(before[n] <= after[n] for n in before), "an id was forgotten"
        assert set(ref.known_ids) <= after[ref.instance_name]
        entry = next(k for k in seen if k.instance_name == current_name) if current_name in after else None
        assert current is not None and (entry is None or set(current.known_ids) == set(entry.known_ids)), "the current instance lost its ids"
