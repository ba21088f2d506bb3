"""The launch's boot payload: the class's join Secret read and its template rendered (the class's
own in a bounded child process), a failure told to the class's admin and not to the tenant."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any

from activities.boot.render import (
    JoinSecrets,
    TemplateError,
    join_secrets_from_secret,
    render_boot_payload,
    template_error_for_admin,
    template_join_keys,
)
from activities.boot.renders import RendersBusy, bounded
from activities.node.base import NodeBase, T
from tgp.errors import ConfigError, TransientError
from tgp.secrets import class_reference_problem, known_secrets
from tgp.types import BootPayload, LaunchInput


async def _bounded(inp: LaunchInput, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn` (a blocking template inspection or render) in the renders' queue, under the share
    of the node's class (renders.bounded); a full queue is a TransientError (retried)."""
    try:
        return await bounded(inp.boot.node_class or inp.pool, fn, *args, **kwargs)
    except RendersBusy as exc:
        raise TransientError(f"cannot render the boot template now: {exc}") from None


async def _at_once(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn` (a render of no class template: microseconds) here, as an awaitable step."""
    return fn(*args, **kwargs)


def _whose(inp: LaunchInput) -> str:
    return f"GPUNodeClass {inp.boot.node_class}" if inp.boot.node_class else "the GPUNodeClass"


class Boot(NodeBase):
    """The boot payload's steps of `launch_instance`."""

    async def _join_secrets(self, inp: LaunchInput) -> JoinSecrets | None:
        """The cluster join material from the class's join Secret, read now and kept in memory
        (None: the class references none). Which keys it must hold comes from the template,
        inspected in a bounded child process (the worker never parses a template). One of tgp's own
        Secrets (tgp.secrets.class_reference_problem) is refused unread."""
        ref, template = inp.boot.join_secret, inp.boot.template
        if not ref:
            return None
        required = await _bounded(inp, template_join_keys, template) if template else ()
        namespace, _, name = ref.partition("/")
        failed: ConfigError | None = None
        try:
            # The read itself refuses tgp's own Secrets, whatever validated the class before.
            if (own := class_reference_problem(name, "joinSecretRef")) is not None:
                raise ConfigError(own)
            data = await self.cluster.read_secret(namespace, name)
            if data is None:
                raise ConfigError(f"join Secret {ref} does not exist: create it or fix the GPUNodeClass's joinSecretRef (see docs/bootstrap.md)")
            encoded = {k: base64.b64encode(v).decode() for k, v in data.items()}
            return join_secrets_from_secret(encoded, secret_ref=f"Secret {ref}", required=required)
        except ConfigError as exc:
            failed = exc
        # The Secret's name and keys are the class admin's business, not the tenant's (whose
        # LaunchFailed Event carries this error): they go to the class's Events.
        await self._tell_class(inp, "JoinSecretInvalid", f"node {inp.node_name} could not be launched: {failed}")
        raise ConfigError(
            f"the join Secret of {_whose(inp)} is missing or incomplete; the class's admin sees which in its Events (reason JoinSecretInvalid)"
        )

    async def _tell_class(self, inp: LaunchInput, reason: str, message: str) -> None:
        """A Warning Event on the node's GPUNodeClass, for its admin (best effort)."""
        await self._warn_class(inp.boot.node_class, reason, message)

    async def _render_boot(self, inp: LaunchInput, kind: str, **kwargs: Any) -> BootPayload:
        """The boot payload. The class's own template renders in a bounded child process waited
        for off the event loop, in the renders' queue under the class's share (renders.bounded);
        without one (env, or tgp's shipped cloud-init/Talos template) it renders here, in
        microseconds, with no queue: a burst's launches no longer wait one by one per class. A
        template that fails is the class's fault, reported as `_class_template` says."""
        if kwargs.get("template") is None:
            return await self._class_template(inp, _at_once(render_boot_payload, kind, **kwargs))
        return await self._class_template(inp, _bounded(inp, render_boot_payload, kind, **kwargs))

    async def _class_template(self, inp: LaunchInput, step: Awaitable[T]) -> T:
        """`step`'s result; when the class's template fails (TemplateError), its text (which may
        quote a value made of a secret: a sliced, upper-cased join token) goes, scrubbed, to the
        class's admin as a Warning Event on the GPUNodeClass, and the error raised (what the
        node's history, the pool's LaunchFailed Event and the tenant see) says only that the
        class's template failed, and on which line."""
        failed: TemplateError | None = None
        try:
            return await step
        except TemplateError as exc:
            failed = exc
        # Raised outside the handler: the new error has neither cause nor context to show.
        assert failed is not None
        detail = template_error_for_admin(str(failed), inp.boot.template or "", known_secrets())
        await self._tell_class(inp, "TemplateFailed", f"the boot template failed for node {inp.node_name}: {detail}")
        raise TemplateError(
            f"the boot template of {_whose(inp)} failed for this node; the class's admin sees why in its Events (reason TemplateFailed)",
            line=failed.line,
        )

    # --- select offer ----------------------------------------------------------------------
