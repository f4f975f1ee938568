"""Engine test fixtures: the real SmolLM2 tokenizer (loaded once)."""

from __future__ import annotations

import pytest

from services.common.model_files import resolve_model_path
from services.common.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def smol_tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model_path("embedded:smollm2"))
