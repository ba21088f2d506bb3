"""A launch without a class template renders its boot payload at once, in the worker, with the
same escaping as the bounded child (issue 20: every launch queued in the renders' queue, one
slot per class, and a shipped cloud-init/Talos template started a child Python per launch).

A class's own template still renders only in the bounded child, in the queue
(tests/test_template_bounds.py, tests/test_bootstrap.py).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from activities.boot.render import (
    TALOS_WORKER_TEMPLATE,
    UBUNTU_CLOUD_INIT_TEMPLATE,
    BootSettings,
    JoinSecrets,
    TemplateError,
    render_boot_payload,
    render_shipped_template,
    render_template,
    shipped_template,
)
from activities.boot.renders import MAX_CONCURRENT_RENDERS, bounded
from activities.node import NodeActivities
from tests.hostile import HOSTILE_VALUES
from tests.money_env import OFFER
from tests.test_bootstrap import AUTH_KEY, join as join_fixture, settings as settings_fixture, variables  # noqa: F401
from tgp.errors import ConfigError
from tgp.types import LaunchInput

join = join_fixture
boot_settings = settings_fixture


def _outcome(render: Any, template: str, values: dict[str, Any]) -> tuple[str, str]:
    try:
        return "ok", render(template, values)
    except TemplateError as exc:
        return "refused", f"{exc} (line {exc.line})"


FIELDS = ("NodeName", "NodeLabels", "NodeTaints", "TailscaleAuthKey", "NodePool")


@settings(max_examples=12)
@given(
    template=st.sampled_from([UBUNTU_CLOUD_INIT_TEMPLATE, TALOS_WORKER_TEMPLATE]),
    field=st.sampled_from(FIELDS),
    value=st.sampled_from(HOSTILE_VALUES),
)
def test_a_shipped_template_renders_in_the_worker_exactly_as_in_the_child(
    boot_settings: BootSettings, join: JoinSecrets, template: str, field: str, value: str
) -> None:
    """Whatever hostile value a tenant-reachable variable holds, the in-process render of tgp's
    own template gives the child's output byte for byte, or refuses it with the same error."""
    text = shipped_template(template)
    values = variables(boot_settings, join)
    if field == "NodeLabels":
        values[field] = {"team": value, "tgp.io/pool": "p"}
    elif field == "NodeTaints":
        values[field] = [{"key": "k", "value": value, "effect": "NoSchedule"}]
    else:
        values[field] = value
    assert _outcome(lambda _, v: render_shipped_template(template, v), text, values) == _outcome(render_template, text, values)


async def test_a_launch_without_a_class_template_renders_while_the_renders_queue_is_full(
    boot_settings: BootSettings, join: JoinSecrets
) -> None:
    """Every slot of the renders' queue held by slow class templates: a node of a class without
    a template (the shipped cloud-init) still gets its payload, without waiting its turn."""
    gate = threading.Event()
    holders = [asyncio.ensure_future(bounded(f"slow-class-{i}", gate.wait, 60)) for i in range(MAX_CONCURRENT_RENDERS)]
    try:
        activities = NodeActivities(providers={}, tailnets={}, cluster=None)  # type: ignore[arg-type]
        inp = LaunchInput(node_name="gpu-1", attempt=1, offer=OFFER, tailnet_tags=["tag:gpu-node"])
        kwargs: dict[str, Any] = dict(hostname="gpu-1", auth_key=SecretStr(AUTH_KEY), template=None, settings=boot_settings, join=join, node_index=0)
        rendering = asyncio.ensure_future(activities._render_boot(inp, "cloud-init", **kwargs))
        done, _ = await asyncio.wait([rendering, *holders], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert rendering in done, "the render waited in the renders' queue behind other classes' templates"
        assert rendering.result().content == render_boot_payload("cloud-init", **kwargs).content
        assert "#cloud-config" in rendering.result().content
    finally:
        gate.set()
        await asyncio.gather(*holders)


def test_only_a_shipped_template_renders_in_the_worker() -> None:
    with pytest.raises(ConfigError, match="not a template tgp ships"):
        render_shipped_template("{{ 9 ** 9 ** 9 }}", {})


def test_a_class_template_still_renders_in_the_child(boot_settings: BootSettings, join: JoinSecrets) -> None:
    """Given as the class's template, the same text goes to the bounded child: its hostile
    templates are refused there (the in-process path takes only tgp's own files)."""
    with pytest.raises(TemplateError, match="loops ran more than"):
        render_boot_payload(
            "cloud-init",
            hostname="gpu-1",
            auth_key=SecretStr(AUTH_KEY),
            template="{% for a in range(10000) %}{% for b in range(10000) %}x{% endfor %}{% endfor %}",
            settings=boot_settings,
            join=join,
        )
