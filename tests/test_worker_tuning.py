"""The worker's workflow cache (issue 20): sized for 1,000 resting nodes within 300 MB, and
settable for a deployment that wants another trade of memory against replays."""

from __future__ import annotations

import pytest

from tgp.errors import ConfigError
from workers.main import WORKFLOW_CACHE, WORKFLOW_CACHE_ENV, workflow_cache

# What a cached node workflow costs (issue 20, measured on e9a7c55) and what the worker may use
# for 1,000 nodes, of which the process itself takes about 175 MB with a few workflows
# (make bench, docs/benchmarks.md).
MB_PER_CACHED_NODE = 0.29
RSS_TARGET_MB, PROCESS_MB = 300, 180


def test_the_default_cache_fits_the_memory_target() -> None:
    assert PROCESS_MB + WORKFLOW_CACHE * MB_PER_CACHED_NODE < RSS_TARGET_MB
    assert WORKFLOW_CACHE < 1_000  # the SDK's default, which held every resting node


def test_the_cache_size_comes_from_the_environment() -> None:
    assert workflow_cache({}) == WORKFLOW_CACHE
    assert workflow_cache({WORKFLOW_CACHE_ENV: "0"}) == 0
    assert workflow_cache({WORKFLOW_CACHE_ENV: " 2000 "}) == 2000
    with pytest.raises(ConfigError, match=WORKFLOW_CACHE_ENV):
        workflow_cache({WORKFLOW_CACHE_ENV: "lots"})
