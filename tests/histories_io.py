"""The saved histories of the current code (tests/histories/*.json.gz): recorded by the
lifecycle tests under `make histories`, replayed by tests/test_replay.py. Gzipped: the whole set
stays under 1 MB in the repo."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

from temporalio.client import WorkflowHistory

HISTORIES = Path(__file__).parent / "histories"


def save_history(name: str, history: WorkflowHistory) -> None:
    """Keep `history` as tests/histories/<name>.json.gz when recording (`make histories`)."""
    if not os.environ.get("TGP_RECORD_HISTORIES"):
        return
    HISTORIES.mkdir(exist_ok=True)
    (HISTORIES / f"{name}.json.gz").write_bytes(gzip.compress(history.to_json().encode(), mtime=0))


def read_history(path: Path) -> WorkflowHistory:
    return WorkflowHistory.from_json(path.name, gzip.decompress(path.read_bytes()).decode())
