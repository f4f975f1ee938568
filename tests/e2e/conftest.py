"""The whole stack as real processes (redis, kvstore, engine, cacheguard, gateway) with the real model."""

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
def stack(redis_url: str) -> Iterator[Stack]:
    """The engines decode greedy requests in bursts of 4 (KVMEM_DECODE_BURST; the CPU default is one step
    per round trip), so every test here also runs decode bursts through the real services."""
    os.environ["KVMEM_DECODE_BURST"] = "4"  # the children inherit the environment
    cfg = LaunchConfig(
        port=free_port(),
        redis_url=redis_url,
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
