"""Structured logging: structlog events with the workflow id, pool, node and provider bound."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(level: str | None = None) -> None:
    """Key=value logs to stderr (JSON when TGP_LOG_FORMAT=json), level from TGP_LOG_LEVEL."""
    name = (level or os.environ.get("TGP_LOG_LEVEL", "WARNING")).upper()
    renderer = (
        structlog.processors.JSONRenderer()
        if os.environ.get("TGP_LOG_FORMAT") == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    logging.basicConfig(level=name, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(name)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
