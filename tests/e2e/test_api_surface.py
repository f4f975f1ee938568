"""End to end through the real stack with the openai SDK: tool calls (forced, parallel, streamed, tool_choice none
and auto), the malformed tool-call guard, response_format json_object / json_schema, logprobs, n > 1 sharing the
prompt's pages, penalties, batched completions, 404 model_not_found, /v1/models/{id}, the OpenAPI document, and
context_length_exceeded on every route.

The stack renders with deploy/templates/smollm2-agent.jinja (Hermes `<tool_call>` blocks; SmolLM2's own template
renders no tools) and decodes greedy requests in bursts of 4, so constrained requests run beside bursts."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from bench.guard_replay import AGENT_TEMPLATE
from deploy.launcher import LaunchConfig, Stack
from services.common import auth
from services.common.protos import engine_pb2 as pb
from services.common.protos import engine_pb2_grpc as pb_grpc
from tests.conftest import free_port

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                       "required": ["zone"], "additionalProperties": False},
    },
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    os.environ["KVMEM_DECODE_BURST"] = "4"
    cfg = LaunchConfig(
        port=free_port(), host_kv_mib=128, max_context=1024, kv_capacity=4096,
        chat_template=str(AGENT_TEMPLATE), ready_timeout_s=300,
    )  # fmt: skip
    s = Stack(cfg, echo=False)  # its own redis
    try:
        s.start()
    finally:
        os.environ.pop("KVMEM_DECODE_BURST", None)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=300)


def _args(call) -> dict:  # noqa: ANN001
    return json.loads(call.function.arguments)


def test_named_tool_choice_is_a_call_whose_arguments_match_the_schema(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(_args(call), WEATHER["function"]["parameters"])


def test_required_calls_stream_as_deltas_name_first(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0.8, seed=5,
        max_tokens=200, stream=True,  # three parallel calls, 121 tokens (at 80 the budget closes them: "length")
    )  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    pieces: dict[int, list] = {}
    for d in deltas:
        for tc in d.delta.tool_calls or []:
            pieces.setdefault(tc.index, []).append(tc)
    assert pieces and deltas[-1].finish_reason == "tool_calls"
    for parts in pieces.values():
        first = parts[0]
        assert first.id.startswith("call_") and first.function.name in ("get_weather", "get_time")
        assert all(p.function.name is None for p in parts[1:])
        args = json.loads("".join(p.function.arguments or "" for p in parts))
        schema = (WEATHER if first.function.name == "get_weather" else TIME)["function"]["parameters"]
        jsonschema.validate(args, schema)
    assert not "".join(d.delta.content or "" for d in deltas).strip()  # nothing of the calls went out as text


def test_tool_choice_none_and_auto(client: openai.OpenAI) -> None:
    none = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=24
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    try:
        auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=40)
    except openai.UnprocessableEntityError as exc:  # the guard caught a broken shell: typed, with an example
        assert exc.code == "malformed_tool_call"
        return
    message = auto.choices[0].message
    if message.tool_calls:  # whatever the model chose, a call is well-formed and matches its schema
        assert auto.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(_args(message.tool_calls[0]), WEATHER["function"]["parameters"])
    else:
        assert "<tool_call>" not in message.content


def test_a_forced_call_never_cut_off_by_max_tokens(client: openai.OpenAI) -> None:
    """tool_choice required makes the answer a call, so its budget is checked: max_tokens 6 is below the shortest
    call (a 400 naming max_tokens and that length, before anything is generated); one token more than that
    length, the call is closed by the budget: complete, its arguments match the schema, finish_reason "length"
    (not "tool_calls": a call the budget closed is not to be run as is), streamed the same."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=6
        )
    found = re.search(r"max_tokens 6 is below the (\d+) tokens", exc.value.message)
    assert found, exc.value.message
    budget = int(found.group(1)) + 1
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=budget
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens <= budget, choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(_args(call), WEATHER["function"]["parameters"])
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=budget,
        stream=True,
    )  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    assert deltas[-1].finish_reason == "length"
    args = "".join(tc.function.arguments or "" for d in deltas for tc in d.delta.tool_calls or [])
    assert json.loads(args) == _args(call)


def test_json_schema_with_a_small_budget_is_closed_valid(client: openai.OpenAI) -> None:
    """A free string the model would fill far past max_tokens: the budget closes the document, which parses and
    validates, finish_reason "length"; streamed, the same text."""
    schema = {"type": "object", "properties": {"story": {"type": "string"}, "moral": {"type": "string"}},
              "required": ["story", "moral"], "additionalProperties": False}  # fmt: skip
    q = [{"role": "user", "content": "Tell a long story about a dragon, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "story", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=q, temperature=0, max_tokens=16, response_format=fmt)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens <= 16, choice
    doc = json.loads(choice.message.content)
    jsonschema.validate(doc, schema)
    assert doc["story"]  # the model's own words, cut where the closing had to start
    stream = client.chat.completions.create(
        model=MODEL, messages=q, temperature=0, max_tokens=16, response_format=fmt, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].finish_reason == "length"


def test_response_format_json_schema_and_json_object(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 24}, "population_millions": {"type": "number"},
                       "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["capital", "population_millions", "languages"], "additionalProperties": False,
    }  # fmt: skip
    q = [{"role": "user", "content": "Describe France as JSON."}]
    r = client.chat.completions.create(
        model=MODEL, messages=q, temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "country", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    stream = client.chat.completions.create(
        model=MODEL, messages=q, temperature=0, max_tokens=80, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "country", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    obj = client.chat.completions.create(
        model=MODEL, messages=q, temperature=0, max_tokens=60, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError):  # a schema the grammar library refuses: typed, not free text
        client.chat.completions.create(
            model=MODEL, messages=q, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )  # fmt: skip


def test_greedy_answers_beside_a_constrained_one_are_their_answers_alone(client: openai.OpenAI) -> None:
    """Decode bursts of 4 (the stack's setting): greedy requests running beside a constrained one (which takes their
    steps off the burst path) answer exactly what they answer alone; the constrained answer still validates."""
    from concurrent.futures import ThreadPoolExecutor

    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 60, "maxLength": 80}},
              "required": ["story"], "additionalProperties": False}  # fmt: skip
    prompts = [[{"role": "user", "content": f"Count from {k} to {k + 9}."}] for k in (1, 20)]

    def plain(q: list) -> str:  # type: ignore[type-arg]
        r = client.chat.completions.create(model=MODEL, messages=q, temperature=0, max_tokens=24)
        return r.choices[0].message.content or ""

    def constrained() -> str:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell a story as JSON."}], temperature=0, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}},
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content or ""

    alone = [plain(q) for q in prompts]
    with ThreadPoolExecutor(3) as pool:
        odd = pool.submit(constrained)
        beside = [f.result() for f in [pool.submit(plain, q) for q in prompts]]
        jsonschema.validate(json.loads(odd.result()), schema)
    assert beside == alone and all(alone)


def test_logprobs_chat_and_completions(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy: the chosen is the most likely
    c = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0


def test_logprob_bytes_are_the_tokens_own_bytes(client: openai.OpenAI) -> None:
    """🙂 is two SmolLM2 tokens, F0 9F | 99 82: the first alone decodes to a replacement character, and its
    logprob's bytes are its own two bytes (logit_bias makes it the answer), not that character's UTF-8."""
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=1, logprobs=True, top_logprobs=1,
        logit_bias={"10813": 100},
    )  # fmt: skip
    [item] = r.choices[0].logprobs.content
    assert item.bytes == [0xF0, 0x9F] and item.top_logprobs[0].bytes == [0xF0, 0x9F]
    assert item.token == "\ufffd"


def test_n_choices_share_the_prompt_pages(client: openai.OpenAI, stack: Stack) -> None:
    long_q = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper. " * 12}]
    with auth.channel(f"127.0.0.1:{stack.ports['engine']}", secret=stack.secret) as channel:
        engine = pb_grpc.EngineStub(channel)
        before = engine.GetStats(pb.GetStatsRequest()).cached_tokens_total
        r = client.chat.completions.create(model=MODEL, messages=long_q, n=3, temperature=0.9, seed=11, max_tokens=8)
        cached = engine.GetStats(pb.GetStatsRequest()).cached_tokens_total - before
    assert [c.index for c in r.choices] == [0, 1, 2]
    prompt = r.usage.prompt_tokens
    assert cached >= 2 * ((prompt - 1) // 64 * 64)  # choices 1 and 2 reused every full page of choice 0's prompt
    assert r.usage.completion_tokens == sum(1 for _ in r.choices) * 8 or r.usage.completion_tokens <= 24
    stream = client.chat.completions.create(model=MODEL, messages=ASK, n=2, temperature=0, max_tokens=6, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] and texts[0]  # greedy: the same answer twice


def test_penalties_change_a_repetitive_answer(client: openai.OpenAI) -> None:
    prompt = "one two one two one two one two"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    penalised = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, frequency_penalty=2.0, presence_penalty=1.0
    )
    rep = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"repetition_penalty": 1.8}
    )
    assert penalised.choices[0].text != plain.choices[0].text and rep.choices[0].text != plain.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, presence_penalty=3.0)


def test_batched_prompts_are_the_single_answers(client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "Two plus two is"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_unknown_model_models_by_id_and_openapi(client: openai.OpenAI, stack: Stack) -> None:
    for call in (
        lambda: client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2),
        lambda: client.completions.create(model="gpt-4o", prompt="x", max_tokens=2),
        lambda: client.models.retrieve("gpt-4o"),
    ):
        with pytest.raises(openai.NotFoundError) as exc:
            call()
        assert exc.value.code == "model_not_found"
    assert client.models.retrieve(MODEL).id == MODEL
    doc = httpx.get(f"{stack.url}/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "422", "429", "503"} <= set(chat)
    assert httpx.get(f"{stack.url}/docs").status_code == 200


def test_context_length_exceeded_on_every_route(client: openai.OpenAI) -> None:
    long = "word " * 1500  # over max_context 1024, under the 4096-token pool: the engine refuses it
    calls = [
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=4),
        lambda: list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=4, stream=True)),
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], n=2,
                                               max_tokens=4),
        lambda: client.completions.create(model=MODEL, prompt=long, max_tokens=4),
        lambda: client.completions.create(model=MODEL, prompt=["hi", long], max_tokens=4),
        lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=4,
            response_format={"type": "json_object"}),
    ]  # fmt: skip
    for call in calls:
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert exc.value.code == "context_length_exceeded", exc.value
