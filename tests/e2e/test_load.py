"""A shortened run of the load test (issue 10; the full one is ``bench/load.py``: 200 streams for 60 s): 50
concurrent Generate streams for 12 s (plus the streams still open then) against the session server, mixed lengths,
random cancels and deadlines. No unexpected status, bounded RSS growth after warm-up, every KV block free at the
end."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import sys

import pytest

from support import REPO_ROOT

pytestmark = pytest.mark.e2e

RSS_GROWTH_LIMIT_MIB = 64   # the whole test process (server, clients, pytest): allocator noise, not a leak


@pytest.fixture(scope="module")
def load():
    path = REPO_ROOT / "bench" / "load.py"
    spec = importlib.util.spec_from_file_location("pagedserve_bench_load", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_load_has_no_unexpected_errors_flat_rss_and_frees_every_block(server, load):
    cfg = load.LoadConfig(concurrency=50, duration_s=12.0, max_prompt_tokens=48, max_new_tokens=24, seed=1)
    report = asyncio.run(load.run_load(server.target, cfg, os.getpid()))   # the server runs in this process
    print(f"\n{report.summary()}")
    assert report.errors == {}, report.summary()
    assert report.requests >= cfg.concurrency and report.outcomes.get("OK", 0) > 0
    assert report.outcomes.get("CANCELLED", 0) > 0, "the workload cancels some streams"
    assert report.blocks_free == report.blocks_total, report.summary()
    assert not server.engine.has_unfinished() and not server.app.services.generation.num_live_requests
    assert report.rss_growth_mib < RSS_GROWTH_LIMIT_MIB, report.summary()
