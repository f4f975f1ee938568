"""The tokenizer built from a GGUF must reproduce its own vocabulary, or loading it fails with TokenizerError.

transformers 5.17's converter built Gemma 3's tokenizer as a Unigram over its BPE merge ranks ("quick" -> "qu"
"ick"): the model then reads text it never saw, and every answer measured with it was wrong. A faithful
tokenizer is stood in for by SmolLM2's (embedded), a broken one by the same vocabulary with its merges dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as FastTokenizer

from services.common import tokenizer as tokenizer_mod
from services.common.model_files import resolve_model_path
from services.common.tokenizer import (
    ROUNDTRIP_MIN,
    TokenizerError,
    check_vocabulary,
    load_tokenizer,
    vocabulary_roundtrip,
)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, FastTokenizer]:
    path = resolve_model_path("embedded:smollm2")
    return path, load_tokenizer(path).backend


@pytest.fixture()
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty tokenizer cache of the test's own (KVMEM_CACHE_DIR)."""
    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    return tmp_path


def without_merges(backend: FastTokenizer) -> FastTokenizer:
    """The same vocabulary with no BPE merges: every word falls apart into single characters."""
    spec = json.loads(backend.to_str())
    spec["model"]["merges"] = []
    return FastTokenizer.from_str(json.dumps(spec))


def test_a_faithful_tokenizer_reproduces_its_vocabulary(smollm2: tuple[Path, FastTokenizer]) -> None:
    path, backend = smollm2
    same, tried = vocabulary_roundtrip(backend)
    assert tried > 1000
    assert same == tried
    check_vocabulary(backend, path)  # does not raise


def test_a_tokenizer_that_splits_its_own_pieces_is_refused(smollm2: tuple[Path, FastTokenizer]) -> None:
    path, backend = smollm2
    broken = without_merges(backend)
    same, tried = vocabulary_roundtrip(broken)
    assert same < ROUNDTRIP_MIN * tried
    with pytest.raises(TokenizerError, match=rf"encodes only {same} of {tried}.*transformers"):
        check_vocabulary(broken, path)


def test_a_broken_cached_conversion_is_refused_too(smollm2: tuple[Path, FastTokenizer], own_cache: Path) -> None:
    """A cache written by an older converter (or by hand) is checked as a fresh conversion is."""
    path, backend = smollm2
    cache = tokenizer_mod._cache_dir(path)
    cache.mkdir(parents=True)
    without_merges(backend).save(str(cache / "tokenizer.json"))
    info = load_tokenizer(path).info  # not read from this cache: built and checked, then cached over it
    assert json.loads((cache / "info.json").read_text())["eos_token_ids"] == list(info.eos_token_ids)
    without_merges(backend).save(str(cache / "tokenizer.json"))  # now both files exist: the cache is read
    with pytest.raises(TokenizerError):
        load_tokenizer(path)


def test_the_cache_is_keyed_by_the_converters_version(
    smollm2: tuple[Path, FastTokenizer], own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = smollm2
    here = tokenizer_mod._cache_dir(path)
    monkeypatch.setattr(tokenizer_mod, "_transformers_version", lambda: "5.17.0")
    assert tokenizer_mod._cache_dir(path) != here
