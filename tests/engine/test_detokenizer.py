"""Detokenizer: deltas add up to the text, stop strings are cut and never leak, UTF-8 is held back."""

from __future__ import annotations

from services.common.tokenizer import Tokenizer
from services.engine.step.detokenizer import Detokenizer


def _stream(tok: Tokenizer, text: str, stop: tuple[str, ...]) -> tuple[list[str], Detokenizer]:
    ids = tok.encode(text)
    d = Detokenizer(tok, stop)
    deltas = []
    for i in range(1, len(ids) + 1):
        deltas.append(d.update(ids[:i]))
        if d.matched_stop is not None:
            break
    deltas.append(d.flush())
    return deltas, d


def test_deltas_concatenate_to_the_decoded_text(smol_tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語"
    deltas, d = _stream(smol_tokenizer, text, ())
    assert "".join(deltas) == text
    assert d.matched_stop is None


def test_stop_string_is_cut_and_never_emitted(smol_tokenizer: Tokenizer) -> None:
    deltas, d = _stream(smol_tokenizer, "alpha beta END gamma", (" END",))
    assert "".join(deltas) == "alpha beta"
    assert d.matched_stop == " END"
    assert all("END" not in x for x in deltas)


def test_prefix_of_a_stop_string_is_held_then_released(smol_tokenizer: Tokenizer) -> None:
    deltas, d = _stream(smol_tokenizer, "one two three", ("two four",))
    assert d.matched_stop is None
    assert "".join(deltas) == "one two three"


def test_earliest_of_several_stop_strings_wins(smol_tokenizer: Tokenizer) -> None:
    deltas, d = _stream(smol_tokenizer, "a b c d e f", ("e", "c"))
    assert "".join(deltas) == "a b "
    assert d.matched_stop == "c"


def test_incomplete_utf8_is_held_back(smol_tokenizer: Tokenizer) -> None:
    ids = smol_tokenizer.encode("✓")
    assert len(ids) > 1, "the check needs a character split across tokens"
    d = Detokenizer(smol_tokenizer, ())
    assert d.update(ids[:1]) == ""
    assert d.update(ids) == "✓"


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, token_ids: list[int]) -> str:
        self.lengths.append(len(token_ids))
        return self.tok.decode(token_ids)


def test_long_output_decodes_a_few_tokens_per_update(smol_tokenizer: Tokenizer) -> None:
    """Constant work per token: a 2,000-token output is never decoded whole, and the deltas still add up."""
    text = ("Grüße, 世界! The 42nd line ✓ ends here.\n" * 120)[:4000]
    ids = smol_tokenizer.encode(text)
    assert len(ids) > 1000
    counting = _CountingTokenizer(smol_tokenizer)
    d = Detokenizer(counting, ("NEVER",))  # type: ignore[arg-type]
    deltas = [d.update(ids[:i]) for i in range(1, len(ids) + 1)]
    deltas.append(d.flush())
    assert "".join(deltas) == text
    assert max(counting.lengths) <= 8, max(counting.lengths)
