"""Engine test fixtures: the real SmolLM2 tokenizer (loaded once), the Triton tier on the CPU, the tests' engines
stopped after each test."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from services.common.model_files import resolve_model_path
from services.common.tokenizer import Tokenizer, load_tokenizer
from services.engine import kernels
from tests.conftest import StartStore


@pytest.fixture(scope="session")
def smol_tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model_path("embedded:smollm2"))


@pytest.fixture
def store_address(start_store: StartStore) -> str:
    """A fresh kvstore (32 MiB of host KV) for one test."""
    return start_store(host_kv_mib=32).address


@pytest.fixture(autouse=True)
def stop_made_engines() -> Iterator[None]:
    """Stop the engines the test itself made with helpers.make_engine (not a module fixture's, made before
    it; stopping twice is harmless): their store clients stop renewing pins when the test's kvstore goes
    away (they logged a failed renewal every 2 s for the rest of the run)."""
    from tests.engine import helpers

    before = len(helpers.made_engines)
    yield
    while len(helpers.made_engines) > before:
        helpers.made_engines.pop().stop()


@pytest.fixture
def triton_tier() -> Iterator[None]:
    """The Triton tier on the CPU (interpreted, tests/conftest.py) for the duration of a test; the tier
    before it afterwards."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    before = kernels.active_tier()
    kernels.use_tier(kernels.KernelTier("triton", "cpu", None, False))
    yield
    kernels.use_tier(before)


@pytest.fixture
def fp8_in_place(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """KVMEM_FP8_ATTENTION=1 for the duration of a test (the attention kernels read fp8 layers in place)."""
    from services.engine.kv import kv_pool

    monkeypatch.setenv("KVMEM_FP8_ATTENTION", "1")
    kv_pool.fp8_in_place.cache_clear()
    yield
    kv_pool.fp8_in_place.cache_clear()
