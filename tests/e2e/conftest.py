"""The whole stack as real processes (redis, kvstore, engine, cacheguard, gateway) with the real model.

Every stack here starts its own redis-server (LaunchConfig's redis_url empty), never the session's `redis_url`:
two stacks on one redis register their kvstores in one catalog, so one stack's engines spread pages over the
other's kvstore too, which (another internal secret) never takes them: the ring's demotions then wait and answer
429, and one run's sharded requests hung until their 600 s timeout. Serially, only the session stack below
outlived a module's; with the suite split over workers (`make test`: pytest-xdist, a file per worker) any two
may run at once."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from deploy.launcher import LaunchConfig, Stack
from tests.conftest import free_port

API_KEY = "sk-e2e-test"
TEAM_KEY = "sk-e2e-team"  # a second key of tenant e2e: shares its prefixes (configured so)
OTHER_KEY = "sk-e2e-other"  # tenant other: never shares a page with e2e


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The engines decode greedy requests in bursts of 4 (KVMEM_DECODE_BURST; the CPU default is one step
    per round trip), so every test here also runs decode bursts through the real services."""
    os.environ["KVMEM_DECODE_BURST"] = "4"  # the children inherit the environment
    cfg = LaunchConfig(
        port=free_port(),
        api_keys=f"e2e:{API_KEY},other:{OTHER_KEY},e2e:{TEAM_KEY}",
        host_kv_mib=256,
        max_context=2048,
        kv_capacity=4096,
        ready_timeout_s=300,
    )
    s = Stack(cfg, echo=False)
    try:
        s.start()
    finally:
        os.environ.pop("KVMEM_DECODE_BURST", None)
    yield s
    s.stop()
