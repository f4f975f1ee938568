"""The planner's ladder against a toy model (tokens = words; it reads the TEXT of a map prompt).

The toy is the planner's unit-test double, like the fake guard is the app's: what each level does
with the calls, budgets, concurrency, checking and reducing is exact here; the real model runs in
tests/e2e/test_planner_e2e.py.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence

import pytest

from services.gateway.errors import GatewayError
from services.gateway.planner.backend import CallResult
from services.gateway.planner.plan import Level, Limits, PlannerSettings, PlanRequest, Progress, Refusal
from services.gateway.planner.planner import Planner
from services.gateway.planner.prompts import EXTRACT_INSTRUCTION, REDUCE_INSTRUCTION
from services.gateway.planner.refusals import PREFIX
from services.gateway.planner.task import Message

pytestmark = pytest.mark.anyio

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go."


def words(text: str) -> int:
    return len(text.split())


def shard_text(prompt: str) -> str:
    match = re.search(r"TEXT:\n(.*)\n\nQUESTION:", prompt, re.S)
    return match.group(1) if match else ""


def passkey_answer(prompt: str) -> str:
    match = re.search(r"pass key is (\d+)", shard_text(prompt))
    return f"ANSWER: {match.group(1)} | EVIDENCE: the pass key is {match.group(1)}" if match else "NOT FOUND"


class Toy:
    """Backend double: counts words (+4 per message), answers with `answer(prompt)`, records calls."""

    def __init__(self, answer: Callable[[str], str] = passkey_answer, prompt_tokens: int = 0) -> None:
        self.answer = answer
        self.prompt_tokens = prompt_tokens
        self.calls: list[tuple[str, int, int]] = []  # (call id, prompt tokens, max tokens)
        self.counted_prompt = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail_on: str = ""

    async def count_prompt(self) -> int:
        self.counted_prompt += 1
        return self.prompt_tokens

    async def count_chat(self, messages: Sequence[Message]) -> int:
        return sum(words(m.content) + 4 for m in messages)

    async def count_text(self, text: str) -> int:
        return max(1, words(text))

    async def complete(self, messages: Sequence[Message], max_tokens: int, call_id: str) -> CallResult:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)
            if call_id == self.fail_on:
                raise GatewayError(503, "service_unavailable", "engine down", None, "unavailable")
            prompt_tokens = await self.count_chat(messages)
            self.calls.append((call_id, prompt_tokens, max_tokens))
            text = self.answer(messages[-1].content)
            return CallResult(text, prompt_tokens, words(text), 0, "resident", False, "toy-0")
        finally:
            self.in_flight -= 1


def haystack(num_sentences: int, key: str | None = None, at: float = 0.5) -> str:
    sentences = [FILLER] * (num_sentences // 4)
    if key is not None:
        sentences.insert(int(at * len(sentences)), f"The pass key is {key}. Remember it.")
    return " ".join(sentences)


def chat(document: str, question: str = "What is the pass key?", **fields: object) -> PlanRequest:
    messages = (Message("user", f"{document}\n\n{question}"),)
    return PlanRequest(
        policy=str(fields.pop("policy", "shard")),
        max_calls=int(fields.pop("max_calls", 32)),
        messages=messages,
        **fields,
    )  # type: ignore[arg-type]


def planner(toy: Toy, pool: int = 300, max_context: int | None = None, **settings: int | str) -> Planner:
    return Planner(toy, PlannerSettings(**settings), Limits(pool, max_context or pool))  # type: ignore[arg-type]


# ---------------------------------------------------------------- decide


async def test_small_prompt_is_L1_without_counting() -> None:
    toy = Toy(prompt_tokens=10_000)
    decision = await planner(toy, pool=4096).decide(chat("short text", "Q?"))
    assert decision.level is Level.L1 and decision.prefill_policy == "" and toy.counted_prompt == 0
    assert (decision.report.over_pool, decision.report.prompt_tokens) == (False, 0)


async def test_counted_prompt_under_the_pool_is_L1() -> None:
    toy = Toy(prompt_tokens=200)
    decision = await planner(toy, pool=400).decide(chat(haystack(300)))
    assert decision.level is Level.L1 and toy.counted_prompt == 1 and decision.report.prompt_tokens == 200
    assert decision.report.answer_reserve_tokens == 128


@pytest.mark.parametrize("policy", ["sparse", "exact"])
async def test_sparse_and_exact_go_to_the_engine_as_one_call(policy: str) -> None:
    decision = await planner(Toy(prompt_tokens=5000), pool=1024, max_context=8192).decide(
        chat(haystack(300), policy=policy)
    )
    assert (decision.level, decision.prefill_policy, decision.report.over_pool) == (Level.L1, policy, True)


async def test_refuse_policy_is_L3_without_calls() -> None:
    toy = Toy(prompt_tokens=5000)
    p = planner(toy, pool=1024)
    decision = await p.decide(chat(haystack(300), policy="refuse", max_tokens=64))
    answer = await p.run(decision)
    assert answer.report.level is Level.L3 and answer.report.refusal is Refusal.OVER_POOL
    assert answer.text.startswith(f"{PREFIX}: the prompt (5000 tokens) plus room for the answer (64)")
    assert toy.calls == [] and answer.usage.prompt_tokens == 0


@pytest.mark.parametrize(
    ("request_", "why"),
    [
        (PlanRequest(policy="shard", max_calls=8, num_prompt_token_ids=5000), "token ids"),
        (
            PlanRequest(
                policy="shard", max_calls=8, messages=(Message("user", "x " * 3000 + "\n\nQ?"),), has_tools=True
            ),
            "tools",
        ),
        (PlanRequest(policy="shard", max_calls=8, messages=(Message("user", "x " * 3000),)), "own paragraph"),
    ],
)
async def test_unsplittable_requests_are_refused(request_: PlanRequest, why: str) -> None:
    decision = await planner(Toy(prompt_tokens=5000)).decide(request_)
    assert decision.level is Level.L3 and decision.report.refusal is Refusal.NOT_SPLITTABLE
    assert why in decision.report.refusal_message


# ---------------------------------------------------------------- L2 lookup


async def run(p: Planner, request: PlanRequest, progress: list[Progress] | None = None):  # type: ignore[no-untyped-def]
    async def on_progress(step: Progress) -> None:
        assert progress is not None
        progress.append(step)

    decision = await p.decide(request)
    assert decision.level is Level.L2
    return await p.run(decision, on_progress if progress is not None else None)


async def test_passkey_found_in_one_shard() -> None:
    toy = Toy(prompt_tokens=1300)
    steps: list[Progress] = []
    answer = await run(planner(toy, pool=300), chat(haystack(1000, "48213", at=0.7)), steps)
    r = answer.report
    assert answer.text == "48213"
    assert (r.level, r.map, r.reduce, r.unverified, r.num_dropped) == (Level.L2, "model", "single", [], 0)
    assert r.num_shards >= 4 and r.num_calls == r.num_shards == len(toy.calls)
    assert [e.quote for e in r.evidence] == ["The pass key is 48213."]
    assert all(prompt + max_tokens <= 300 for _, prompt, max_tokens in toy.calls)  # every call fits the pool
    assert answer.usage.prompt_tokens == sum(c[1] for c in toy.calls) and answer.engine_replica == "toy-0"
    assert [(s.phase, s.done) for s in steps] == [("map", k) for k in range(r.num_shards + 1)]


async def test_the_same_value_from_two_shards_agrees() -> None:
    document = haystack(500, "777") + "\n\n" + haystack(500, "777")
    answer = await run(planner(Toy(prompt_tokens=1300)), chat(document))
    assert answer.text == "777" and answer.report.reduce == "agreement" and len(answer.report.evidence) == 2


async def test_different_values_are_a_disagreement() -> None:
    document = haystack(500, "111") + "\n\n" + haystack(500, "222")
    answer = await run(planner(Toy(prompt_tokens=1300)), chat(document))
    r = answer.report
    assert (r.level, r.refusal) == (Level.L3, Refusal.DISAGREEMENT)
    assert '"111"' in answer.text and '"222"' in answer.text and answer.text.startswith(PREFIX)


async def test_no_shard_with_evidence_is_L3_and_inventions_are_dropped() -> None:
    toy = Toy(lambda prompt: "ANSWER: 99999 | EVIDENCE: the pass key is 99999", prompt_tokens=1300)
    answer = await run(planner(toy), chat(haystack(1000)))
    r = answer.report
    assert (r.level, r.refusal, r.num_dropped) == (Level.L3, Refusal.NO_EVIDENCE, r.num_shards)
    assert f"none of the {r.num_shards} parts" in answer.text


async def test_call_budget_smaller_than_the_shards_is_L3_before_any_call() -> None:
    toy = Toy(prompt_tokens=1300)
    answer = await run(planner(toy), chat(haystack(1000, "1"), max_calls=2))
    assert (answer.report.refusal, toy.calls) == (Refusal.BUDGET_EXHAUSTED, [])
    assert f"needs at least {answer.report.num_shards} model calls" in answer.text


async def test_map_concurrency_is_limited_by_setting_and_by_the_pool() -> None:
    toy = Toy(prompt_tokens=5000)
    await run(planner(toy, pool=300, map_concurrency=8), chat(haystack(1000, "5")))
    assert toy.max_in_flight == 1 and len(toy.calls) > 3  # a shard call takes most of a 300-token pool
    toy = Toy(prompt_tokens=5000)
    p = Planner(toy, PlannerSettings(map_concurrency=3), Limits(kv_capacity=3000, max_context=300))
    await run(p, chat(haystack(1000, "5")))
    assert toy.max_in_flight == 3


async def test_a_failing_call_fails_the_request_and_cancels_the_rest() -> None:
    toy = Toy(prompt_tokens=5000)
    toy.fail_on = "map1"
    p = Planner(toy, PlannerSettings(map_concurrency=4), Limits(kv_capacity=3000, max_context=300))
    with pytest.raises(GatewayError, match="engine down"):
        await run(p, chat(haystack(1000, "5")))
    await asyncio.sleep(0.05)
    assert toy.in_flight == 0


async def test_frame_too_large() -> None:
    request = PlanRequest(
        policy="shard",
        max_calls=8,
        messages=(Message("system", "rule " * 250), Message("user", haystack(1000) + "\n\nWhat is the key?")),
    )
    answer = await run(planner(Toy(prompt_tokens=1500), pool=300), request)
    assert answer.report.refusal is Refusal.FRAME_TOO_LARGE and "leaving no room" in answer.text


# ---------------------------------------------------------------- reduce by the model, L2z


def free_text(prompt: str) -> str:
    if REDUCE_INSTRUCTION in prompt:
        return "The weather is mild all year."
    text = shard_text(prompt)
    return "ANSWER: " + text.split(". ")[0] if "weather" in text else "NOT FOUND"


def weather_doc(num_paragraphs: int) -> str:
    towns = ["Arden", "Brill", "Calder", "Dunmore", "Elgin", "Fenwick", "Garth", "Hollin"]
    paragraphs = [f"The weather in {towns[k % len(towns)]} is mild in spring. {FILLER}" for k in range(num_paragraphs)]
    return "\n\n".join(paragraphs)


async def test_free_text_answers_are_reduced_by_the_model_and_flagged() -> None:
    toy = Toy(free_text, prompt_tokens=1300)
    answer = await run(planner(toy, pool=300), chat(weather_doc(20), "How is the weather?"))
    r = answer.report
    assert answer.text == "The weather is mild all year."
    assert (r.level, r.reduce, r.num_rounds, r.unverified) == (Level.L2, "model", 1, ["free_text", "model_reduce"])
    assert r.num_calls == r.num_shards + 1 and toy.calls[-1][0] == "reduce1"


async def test_reduce_input_over_the_pool_is_resharded_L2z() -> None:
    toy = Toy(free_text, prompt_tokens=5000)
    p = planner(toy, pool=200, map_max_tokens=16, reduce_max_tokens=32)
    answer = await run(p, chat(weather_doc(60), "How is the weather?"))
    r = answer.report
    assert (r.level, r.reduce) == (Level.L2Z, "model") and r.num_rounds >= 2
    reduce_calls = [c for c in toy.calls if c[0].startswith("reduce")]
    assert len(reduce_calls) > 1 and reduce_calls[-1][0] == f"reduce{r.num_rounds}"
    assert all(prompt + max_tokens <= 200 for _, prompt, max_tokens in toy.calls)


async def test_budget_spent_during_the_reduce_is_L3() -> None:
    toy = Toy(free_text, prompt_tokens=5000)
    p = planner(toy, pool=200, map_max_tokens=16, reduce_max_tokens=32)
    decision = await p.decide(chat(weather_doc(60), "How is the weather?"))
    decision.report.max_calls = 24  # enough for the map (about 20 shards), not for two reduce rounds
    answer = await p.run(decision)
    assert answer.report.num_shards < 24
    assert answer.report.refusal is Refusal.BUDGET_EXHAUSTED and "reducing the partial answers" in answer.text


# ---------------------------------------------------------------- aggregations

LOG = "".join(
    f"2026-03-{i % 28 + 1:02d} job={100 + i} user={['ann', 'bob', 'cy'][i % 3]} "
    f"status={'FAILED' if i % 5 == 2 else 'OK'} bytes={10 * i}\n"
    for i in range(200)
)


async def test_literal_aggregation_is_exact_in_code_without_calls() -> None:
    toy = Toy(prompt_tokens=3000)
    answer = await run(planner(toy), chat("Jobs of the cluster:\n\n" + LOG, "What is the total bytes of FAILED jobs?"))
    expected = sum(10 * i for i in range(200) if i % 5 == 2)
    r = answer.report
    assert answer.text == f"The sum of bytes over the 40 records matching status=FAILED is {expected}."
    assert (r.level, r.map, r.reduce, r.num_calls, toy.calls) == (Level.L2, "literal", "sum", 0, [])
    assert r.num_shards > 1 and r.aggregate == {
        "kind": "sum", "criteria": "status=FAILED", "field": "bytes", "value": str(expected), "num_records": 40,
    }  # fmt: skip


async def test_semantic_aggregation_counts_checked_extractions_and_is_flagged() -> None:
    def extract(prompt: str) -> str:
        assert EXTRACT_INSTRUCTION in prompt
        lines = [ln for ln in shard_text(prompt).splitlines() if "user=bob status=FAILED" in ln]
        return "\n".join([*lines, "2026-01-01 job=1 user=bob status=FAILED bytes=1"])  # + one invention

    toy = Toy(extract, prompt_tokens=3000)
    answer = await run(planner(toy, pool=600), chat(LOG, "How many jobs of bob were slow?"))
    r = answer.report
    expected = sum(1 for i in range(200) if i % 5 == 2 and i % 3 == 1)
    assert answer.text == f"{expected} records that the model found to match the question."
    assert (r.map, r.reduce, r.unverified, r.num_dropped) == ("extract", "count", ["extraction_recall"], r.num_shards)
    assert r.aggregate is not None and "'slow'" in str(r.aggregate["not_literal"])
