"""Structured logging: structlog events with the workflow id, pool, node and provider bound.

Every log line is scrubbed of the secrets registered with `tgp.secrets` (and anything shaped
like a tailnet key), whatever its level: structlog events by `scrub_event`, stdlib records
(Temporal's own, httpx's, the workflow logger's) by the record factory `install_record_scrubbing`
puts in place. Payload encryption (TGP_PAYLOAD_KEYS) covers history, not logs; this covers logs.

Lines are JSON objects (one per line) unless stderr is a terminal, where they are readable
key=value text; TGP_LOG_FORMAT=json or console overrides. Stdlib records (Temporal's own, with
the workflow's or activity's details under `temporal_workflow` / `temporal_activity`) are
rendered the same way, so a log pipeline sees one format. Each activity's events carry its
workflow id, activity type, node, pool and provider (`activity_log`, bound once per activity
by the worker's interceptor).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any

import structlog
from temporalio import activity

from tgp.secrets import scrub, scrub_value
from tgp.types import LABEL_PROVIDER

LOG_FORMAT_ENV = "TGP_LOG_FORMAT"
# Extras Temporal's loggers attach to stdlib records: workflow id, run id, activity type, attempt.
_TEMPORAL_EXTRAS = ["temporal_workflow", "temporal_activity"]


def scrub_event(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: every string in the event (the event name, every value, nested
    ones, a formatted exception) scrubbed. Put it after the processors that add values and
    before the renderer."""
    if "exc_info" in event_dict:
        # Render the traceback here, so that the message it ends with is scrubbed too.
        event_dict = structlog.processors.format_exc_info(logger, method_name, event_dict)
    return {key: scrub_value(value) for key, value in event_dict.items()}


def install_record_scrubbing() -> None:
    """Make every stdlib LogRecord scrubbed at creation: its message (with its arguments
    merged in) and the text of its exception. Idempotent."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "tgp_scrubs", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is logging's to report
            return record
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return record

    factory.tgp_scrubs = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


def log_format(env: Mapping[str, str] = os.environ, stream: IO[str] | None = None) -> str:
    """"json" or "console": TGP_LOG_FORMAT when it says which, else console on a terminal and
    JSON everywhere else (a container's log, a file, a pipe)."""
    chosen = env.get(LOG_FORMAT_ENV, "").strip().lower()
    if chosen in ("json", "console"):
        return chosen
    return "console" if (stream or sys.stderr).isatty() else "json"


def stdlib_handler(renderer: Any, stream: IO[str]) -> logging.Handler:
    """A handler rendering stdlib records (Temporal's, httpx's) like structlog events, scrubbed."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso"),
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ExtraAdder(allow=_TEMPORAL_EXTRAS),
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, scrub_event, renderer],
        )
    )
    return handler


def configure_logging(level: str | None = None) -> None:
    """Structured logs to stderr (`log_format` says JSON or key=value), level from TGP_LOG_LEVEL."""
    name = (level or os.environ.get("TGP_LOG_LEVEL", "WARNING")).upper()
    renderer = (
        structlog.processors.JSONRenderer()
        if log_format() == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    logging.basicConfig(level=name, handlers=[stdlib_handler(renderer, sys.stderr)])
    install_record_scrubbing()
    # The Kubernetes client warns about a missing kubeconfig before it raises; tgp turns the
    # error into one line that says what to fix, so the warning would only repeat it.
    logging.getLogger("kubernetes.aio.config.kube_config").setLevel(logging.ERROR)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            scrub_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(name)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def activity_context(workflow_id: str, activity_type: str, args: tuple[Any, ...] | list[Any] = ()) -> dict[str, str]:
    """What to bind to one activity's events: its workflow id and type, and the node, pool and
    provider it concerns (from the workflow id, then from its input)."""
    fields = {"workflow_id": workflow_id, "activity": activity_type}
    kind, _, rest = workflow_id.partition("/")
    if kind == "gpunode" and rest.count("/") >= 2:  # gpunode/<namespace>/<pool>/<node>
        namespace, pool, node = rest.split("/", 2)
        fields |= {"pool": f"{namespace}/{pool}", "node": node}
    elif kind == "gpunodepool":
        fields["pool"] = rest
    elif kind == "gpunodeclass":
        fields["node_class"] = rest
    for arg in args:
        node = _field(arg, "node_name")
        if isinstance(node, str) and "node" not in fields:
            fields["node"] = node
        provider = _provider_of(arg)
        if provider and "provider" not in fields:
            fields["provider"] = provider
    return fields


def _field(arg: Any, name: str) -> Any:
    """A field of an activity's argument: a model, or the plain mapping Temporal's SDK passes
    when an activity is given fewer arguments than it takes (older schedules)."""
    return arg.get(name) if isinstance(arg, dict) else getattr(arg, name, None)


def _provider_of(arg: Any) -> str | None:
    for holder in (arg, _field(arg, "offer"), _field(arg, "instance")):
        provider = _field(holder, "provider")
        if isinstance(provider, str):
            return provider
    labels = _field(arg, "labels")
    return labels.get(LABEL_PROVIDER) if isinstance(labels, dict) else None


@contextmanager
def activity_log(*args: Any) -> Iterator[dict[str, str]]:
    """Bind the running activity's `activity_context` to every structlog event inside the block
    (structlog contextvars: the activity's own task, nothing leaks to others)."""
    info = activity.info()
    fields = activity_context(info.workflow_id or "", info.activity_type, args)
    with structlog.contextvars.bound_contextvars(**fields):
        yield fields
