"""Constrained decoding and the logits processors: the torch bitmask against xgrammar's own, penalties and
log-probabilities with exact numbers, and a tiny random model whose constrained answers always follow the
schema (alone, beside greedy sequences that stay reference-exact, and with decode bursts on)."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from services.common.tokenizer import Tokenizer
from services.engine.step.grammar import GrammarError, GrammarSpec, apply_token_bitmask, compiler_for
from services.engine.step.sampling import InvalidRequestError, Row, SamplingParams, process, sample_batch
from services.engine.step.sequence import Done, FinishReason
from tests.engine.helpers import drain, events_of, greedy, make_engine, reference_greedy, run_until_done, tiny_model
from tests.engine.schema_gen import random_schema

VOCAB = 49152


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, seed=3)


def test_torch_bitmask_equals_xgrammars_apply() -> None:
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 100, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=g, dtype=torch.int32)
    ours = apply_token_bitmask(logits, bitmask)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours[0, 0]) == (not bitmask[0, 0] & 1)


def test_penalties_are_the_documented_formulas() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    row = Row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), None, [3], [0, 0, 2])
    assert process(logits, row).tolist() == [2.0 - 0.5 - 0.5, -1.0, 0.5 - 0.25 - 0.5, 3.0]
    rep = Row(SamplingParams(repetition_penalty=2.0), None, [3], [1])
    assert process(logits, rep).tolist() == [2.0, -2.0, 0.5, 1.5]


def test_logprobs_are_the_log_softmax_and_top_is_sorted() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    [s] = sample_batch(logits, [Row(params, None)])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert s.token == 1 and math.isclose(s.logprob, float(expected[1]), rel_tol=1e-6)
    assert [t for t, _ in s.top] == [1, 2] and math.isclose(s.top[1][1], float(expected[2]), rel_tol=1e-6)


def test_bad_values_are_refused_by_name() -> None:
    for params, name in [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(top_logprobs=21, logprobs=True), "top_logprobs"),
        (SamplingParams(top_logprobs=2), "top_logprobs needs logprobs"),
    ]:
        with pytest.raises(InvalidRequestError, match=name):
            params.validate(VOCAB)


def test_an_invalid_schema_is_a_grammar_error(smol_tokenizer: Tokenizer) -> None:
    compiler = compiler_for(smol_tokenizer, VOCAB)
    with pytest.raises(GrammarError, match="not valid JSON"):
        compiler.matcher(GrammarSpec("json_schema", "{not json"))
    with pytest.raises(GrammarError, match="kind"):
        compiler.matcher(GrammarSpec("yaml", ""))


def _bounded(schema: dict) -> dict:
    """The schema with every free string at most 6 characters: a random model would fill an unbounded string
    until max_tokens (valid, but never finished)."""
    if schema.get("type") == "string" and "enum" not in schema:
        return {**schema, "maxLength": min(schema.get("maxLength", 6), 6)}
    if schema.get("type") == "object":
        return {**schema, "properties": {k: _bounded(v) for k, v in schema["properties"].items()}}
    if schema.get("type") == "array":
        return {**schema, "items": _bounded(schema["items"])}
    return schema


def _constrained(schema: dict, max_tokens: int = 160, temperature: float = 0.0) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, max_tokens=max_tokens, seed=1, grammar=GrammarSpec("json_schema", json.dumps(schema))
    )


def _text(engine, seq) -> tuple[str, Done]:
    events = events_of(seq)
    _, done = drain(events)
    assert isinstance(done, Done)
    return "".join(e.text for e in events[:-1]), done


@pytest.mark.parametrize("decode_burst", [1, 4])
def test_random_model_follows_schemas_beside_exact_greedy_sequences(model, smol_tokenizer, decode_burst) -> None:
    """A random model never writes JSON by itself: every answer that parses and validates is the mask's doing.
    A greedy sequence in the same steps stays the reference's (the mask is per row)."""
    engine = make_engine(model, smol_tokenizer, num_slots=256, max_context=512, decode_burst=decode_burst)
    schemas = [_bounded(random_schema(i)) for i in range(3)]
    prompt = smol_tokenizer.encode("Reply in JSON.")
    seqs = [engine.submit(f"c{i}", prompt, _constrained(s, temperature=0.7 * (i % 2))) for i, s in enumerate(schemas)]
    plain = engine.submit("plain", prompt, greedy(12))
    run_until_done(engine, [*seqs, plain])
    for seq, schema in zip(seqs, schemas, strict=True):
        text, done = _text(engine, seq)
        assert done.finish_reason is FinishReason.STOP, (text, done)
        jsonschema.validate(json.loads(text), schema)
    tokens, _ = drain(events_of(plain))
    assert tokens == reference_greedy(model, prompt, 12)


def test_json_object_grammar_gives_an_object(model, smol_tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=256, max_context=512)
    params = SamplingParams(temperature=0.0, max_tokens=120, grammar=GrammarSpec("json_object"))
    seq = engine.submit("o", smol_tokenizer.encode("JSON:"), params)
    run_until_done(engine, [seq])
    text, done = _text(engine, seq)
    assert isinstance(json.loads(text), dict)  # finished, or closed by the budget (a random model fills strings)
    assert done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_grammar_with_ignore_eos_is_refused(model, smol_tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    params = SamplingParams(temperature=0.0, ignore_eos=True, grammar=GrammarSpec("json_object"))
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        engine.submit("x", [5, 6], params)
