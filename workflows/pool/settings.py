"""The settings the pool gives its running nodes, sent when they change: disruption settings
(`update_timeouts`) and the template's labels and taints (`update_template`, applied in place)."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from tgp.messages import PoolUpdate
    from tgp.pool_plan import TUNABLE, hold_ended, settings_fingerprint, template_fingerprint, template_of
    from tgp.types import TimeoutsUpdate
    from workflows.pool.base import PoolBase
    from workflows.pool.state import SIGNALS_AT_ONCE


class Settings(PoolBase):
    """Keeping the nodes' settings current."""

    async def _sync_timeouts(self, u: PoolUpdate) -> None:
        """Send each running node the pool's current disruption settings when they changed. A
        replacement keeps like a floor node (never idles) until the node it replaces is gone."""
        for n in self._live():
            ended = hold_ended(n, self.state.bound_gpus)
            if ended is not None:
                self.state.nodes[n.workflow_id] = ended
        held = {nom.workflow_id for nom in self.state.nominations.values() if nom.bought}
        sends: list[tuple[str, Any, str]] = []
        # What a node is sent depends only on (floor, held): made once for each in a pass, not
        # once for each node (a pass over a burst's hundreds of nodes).
        made: dict[tuple[bool, bool], tuple[TimeoutsUpdate, str]] = {}
        for node in sorted(self._live(), key=lambda n: n.workflow_id):
            if node.phase not in TUNABLE:
                continue
            replacing = node.replaces is not None and (old := self.state.nodes.get(node.replaces)) is not None and not old.phase.is_final
            kind = (node.floor or replacing, node.workflow_id in held)
            if kind not in made:
                wanted = self._timeouts_for(u, floor=kind[0], held=kind[1])
                made[kind] = (wanted, settings_fingerprint(wanted))
            wanted, fingerprint = made[kind]
            if node.timeouts_sent == fingerprint:
                continue
            if node.hold_ends_when_busy:  # the pool speaks: from now on the node keeps what it is sent
                self._set(node, hold_ends_when_busy=False)
            sends.append((node.workflow_id, wanted, fingerprint))
        await self._signal_nodes("update_timeouts", sends, "timeouts_sent")

    async def _sync_template(self, u: PoolUpdate) -> None:
        """Send each running node the pool's template labels and taints when they changed since
        it last got them (or was started with them): it applies them to its Node in place. A
        node the pool knows nothing of (adopted after a restart) gets them once; it applies only
        a difference."""
        wanted = template_of(u.spec)
        fingerprint = template_fingerprint(wanted)
        sends: list[tuple[str, Any, str]] = [
            (n.workflow_id, wanted, fingerprint)
            for n in sorted(self._live(), key=lambda n: n.workflow_id)
            if n.phase in TUNABLE and n.template_sent != fingerprint
        ]
        await self._signal_nodes("update_template", sends, "template_sent")

    async def _signal_nodes(self, signal: str, sends: list[tuple[str, Any, str]], sent_field: str) -> None:
        """The signals SIGNALS_AT_ONCE at a time in one workflow task, in a fixed order, each
        node's fingerprint recorded as sent (a node that just ended has nothing to update)."""

        async def send(wid: str, arg: Any, fingerprint: str) -> None:
            try:
                await workflow.get_external_workflow_handle(wid).signal(signal, arg)
            except Exception as exc:  # noqa: BLE001 - a node that just ended has nothing to update
                workflow.logger.info("could not send %s to %s: %s", signal, wid, exc)
            self._set(self.state.nodes[wid], **{sent_field: fingerprint})

        for i in range(0, len(sends), SIGNALS_AT_ONCE):
            await asyncio.gather(*(send(wid, arg, fp) for wid, arg, fp in sends[i : i + SIGNALS_AT_ONCE]))
