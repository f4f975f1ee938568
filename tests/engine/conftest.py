"""Engine test fixtures: the real SmolLM2 tokenizer (loaded once), the Triton tier on the CPU."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from services.common.model_files import resolve_model_path
from services.common.tokenizer import Tokenizer, load_tokenizer
from services.engine import kernels


@pytest.fixture(scope="session")
def smol_tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model_path("embedded:smollm2"))


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
