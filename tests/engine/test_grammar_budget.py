"""Budget-aware completion of constrained answers (grammar.py): the closing plan's exact text from a schema's start
and from inside a document, the refusal of a budget below the shortest document, a scripted model that never
closes its string getting a valid document of exactly its budget, random logits on 60 of the random schemas at
budgets just above their shortest documents (always valid), and the engine: finish_reason "length" with a valid
document beside a greedy neighbour that stays reference-exact, with decode bursts on and off."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from services.common.tokenizer import Tokenizer
from services.engine.step.grammar import GrammarCompiler, GrammarSpec, compiler_for
from services.engine.step.sampling import InvalidRequestError, Row, SamplingParams, sample_batch
from services.engine.step.sequence import Done, FinishReason
from tests.engine.helpers import drain, events_of, greedy, make_engine, reference_greedy, run_until_done, tiny_model
from tests.engine.schema_gen import random_schema

VOCAB = 49152


def _obj(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


NAME = _obj({"name": {"type": "string"}, "age": {"type": "integer"}}, ["name"])


@pytest.fixture(scope="module")
def compiler(smol_tokenizer: Tokenizer) -> GrammarCompiler:
    return compiler_for(smol_tokenizer, VOCAB)


def _spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def _text(compiler: GrammarCompiler, tokens: list[int]) -> str:
    return b"".join(compiler.token_bytes(t) for t in tokens).decode()


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (NAME, '{"name": ""}'),  # the optional key left out, the shortest string
        (  # optional keys before the required one skipped (a key choice planned both ways); the smallest bound
            _obj(
                {
                    "note": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "level": {"type": "integer", "minimum": 17, "maximum": 40},
                },
                ["level"],
            ),
            '{"level": 17}',
        ),  # fmt: skip
        (
            _obj(
                {
                    "kind": {"type": "string", "enum": ["green", "red"]},
                    "meta": _obj({"ok": {"type": "boolean"}}, ["ok"]),
                },
                ["kind", "meta"],
            ),
            '{"kind": "red", "meta": {"ok": true}}',
        ),  # fmt: skip
        (_obj({"xs": {"type": "array", "items": {"type": "number"}, "minItems": 2}}, ["xs"]), '{"xs": [0, 0]}'),
    ],
)
def test_the_first_plan_is_the_shortest_document(compiler: GrammarCompiler, schema: dict, expected: str) -> None:
    matcher = compiler.matcher(_spec(schema))
    plan = matcher.closing_plan()
    assert plan is not None and _text(compiler, plan) == expected
    assert matcher.set_budget(len(plan)) == len(plan)  # exactly the plan's length fits
    jsonschema.validate(json.loads(expected), schema)


def test_a_plan_from_inside_a_document_closes_what_is_open(compiler, smol_tokenizer) -> None:
    for prefix, closing in [('{"name": "abc', '"}'), ('{"name": "abc", "age": 12', "}")]:
        matcher = compiler.matcher(_spec(NAME))
        for t in smol_tokenizer.encode(prefix):
            assert matcher.accept(t)
        plan = matcher.closing_plan()
        assert plan is not None and _text(compiler, plan) == closing


def test_a_budget_below_the_shortest_document_is_refused(compiler: GrammarCompiler) -> None:
    matcher = compiler.matcher(_spec(NAME))
    with pytest.raises(InvalidRequestError, match=r"max_tokens 5 is below the 6 tokens"):
        matcher.set_budget(5)


def _decode(compiler, schema: dict, budget: int, logits_of) -> tuple[list[int], bool]:  # noqa: ANN001
    """Sample `budget` tokens (or up to the stop token) through sample_batch with the budget left on each row."""
    spec = _spec(schema)
    matcher = compiler.matcher(spec)
    matcher.set_budget(budget)
    params = SamplingParams(temperature=0.0, max_tokens=budget, grammar=spec)
    out: list[int] = []
    while len(out) < budget:
        [s] = sample_batch(logits_of(len(out)), [Row(params, None, [], out, matcher, budget - len(out))])
        assert matcher.accept(s.token)  # the engine's _append: free for the token steer returned
        if matcher.is_terminated:  # the stop token
            break
        out.append(s.token)
    return out, matcher.closed_by_budget


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(6, '{"name": ""}'), (7, '{"name": ""}'), (11, '{"name": ""}'), (12, '{"name": "a"}'),
     (40, '{"name": "' + "a" * 29 + '"}')],
)  # fmt: skip
def test_a_model_that_never_closes_its_string_gets_a_document_of_exactly_its_budget(compiler, budget, expected) -> None:
    """The scripted model wants "a" most and every other token alike (argmax ties: the lowest id), so it spells
    `{"name": "` in 10 single-character tokens and then writes a's forever. Steered, the answer is exactly
    `budget` tokens: below 12 the plan (`{"name": ""}`, 6 tokens) takes over before the string opens; from 12 on
    the a's run until the closing `"}` (one token) just fits."""
    a_id = next(i for i in range(VOCAB) if compiler.token_bytes(i) == b"a")
    logits = torch.zeros(1, VOCAB)
    logits[0, a_id] = 10.0
    out, closed = _decode(compiler, _obj({"name": {"type": "string"}}, ["name"]), budget, lambda _: logits)
    assert _text(compiler, out) == expected and len(out) == budget and closed


def test_a_framed_grammar_complete_when_the_budget_ends_gets_a_stop_token_not_another_call(compiler) -> None:
    """Parallel calls (prefix, suffix, separator, up to 3): a model that always wants the separator, with a budget
    that fits one call and not two, ends with the stop token after the first call (the plan from a complete
    document is empty: the answer stops there, finish_reason length), never a second call's start."""
    schema = _obj({"a": {"type": "integer", "minimum": 0, "maximum": 9}}, ["a"])
    spec = GrammarSpec("json_schema", json.dumps(schema), prefix="<c>", suffix="</c>", separator="\n", max_repeats=3)
    matcher = compiler.matcher(spec)
    first = matcher.closing_plan()
    assert first is not None and _text(compiler, first) == '<c>{"a": 0}</c>'
    newline = next(i for i in range(VOCAB) if compiler.token_bytes(i) == b"\n")
    budget = len(first) + 8  # the model's own spelling of one call (15 tokens) and a few more: not a second call
    matcher.set_budget(budget)
    params = SamplingParams(temperature=0.0, max_tokens=budget, grammar=spec)
    logits = torch.zeros(1, VOCAB)
    logits[0, newline] = 10.0
    out: list[int] = []
    while not matcher.is_terminated and len(out) < budget:
        [s] = sample_batch(logits, [Row(params, None, [], out, matcher, budget - len(out))])
        assert matcher.accept(s.token)
        out.append(s.token)
    assert out[-1] in compiler.matcher(spec)._matcher.stop_token_ids and len(out) < budget, len(out)
    text = _text(compiler, out[:-1])
    assert text.startswith("<c>") and text.endswith("</c>") and text.count("<c>") == 1, text
    assert matcher.closed_by_budget


def test_random_logits_on_random_schemas_always_end_valid_within_the_budget(compiler) -> None:
    """Random logits (a model that wanders anywhere the grammar allows) on 60 random schemas, each with a budget
    between its shortest document and 30 tokens more: every answer parses and validates, none is longer than its
    budget, and most were closed by the budget (the wanderer rarely finishes by itself)."""
    closed_count = 0
    for i in range(60):
        schema = random_schema(i)
        shortest = compiler.matcher(_spec(schema)).set_budget(10_000)
        budget = shortest + random.Random(i).randint(0, 30)
        g = torch.Generator().manual_seed(i)
        out, closed = _decode(compiler, schema, budget, lambda _, g=g: torch.randn(1, VOCAB, generator=g))
        assert len(out) <= budget
        jsonschema.validate(json.loads(_text(compiler, out)), schema)
        closed_count += closed
    assert closed_count >= 30


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, seed=3)


@pytest.mark.parametrize("decode_burst", [1, 4])
def test_engine_closes_unbounded_strings_at_max_tokens_beside_exact_greedy(model, smol_tokenizer, decode_burst) -> None:
    """A random model fills free strings forever: with max_tokens 24 each constrained answer ends "length" with a
    document that parses and validates, in at most 24 tokens; the greedy neighbour stays the reference's."""
    engine = make_engine(model, smol_tokenizer, num_slots=256, max_context=512, decode_burst=decode_burst)
    schemas = [
        NAME,
        _obj({"meta": _obj({"note": {"type": "string"}}, ["note"]), "level": {"type": "integer"}}, ["meta", "level"]),
        _obj({"tags": {"type": "array", "items": {"type": "string"}}}, ["tags"]),
    ]
    prompt = smol_tokenizer.encode("Reply in JSON.")
    seqs = [
        engine.submit(
            f"c{i}", prompt, SamplingParams(temperature=0.7 * (i % 2), seed=1, max_tokens=24, grammar=_spec(s))
        )
        for i, s in enumerate(schemas)
    ]
    obj = engine.submit("o", prompt, SamplingParams(temperature=0.0, max_tokens=9, grammar=GrammarSpec("json_object")))
    plain = engine.submit("plain", prompt, greedy(12))
    run_until_done(engine, [*seqs, obj, plain])
    for seq, schema in [*zip(seqs, schemas, strict=True), (obj, {"type": "object"})]:
        events = events_of(seq)
        tokens, done = drain(events)
        assert isinstance(done, Done), done
        assert done.finish_reason is FinishReason.LENGTH or seq is obj, done  # json_object may be `{}` at once
        text = "".join(e.text for e in events[:-1])
        jsonschema.validate(json.loads(text), schema)
        assert len(tokens) <= seq.max_tokens
    tokens, _ = drain(events_of(plain))
    assert tokens == reference_greedy(model, prompt, 12)


def test_engine_refuses_a_budget_below_the_shortest_document(model, smol_tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    params = SamplingParams(temperature=0.0, max_tokens=3, grammar=_spec(NAME))
    with pytest.raises(InvalidRequestError, match="max_tokens 3"):
        engine.submit("x", [5, 6], params)
