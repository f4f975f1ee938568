"""End to end through the real stack with the official openai SDK: chat, stream, completions, models,
stop, max_tokens, seed, prefix reuse, errors and auth; pages land in the kvstore by their hash."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch

from deploy.launcher import Stack
from services.common import auth
from services.common.model_files import resolve_model_path
from services.common.pagehash import chain_hashes
from services.common.protos import engine_pb2 as pb
from services.common.protos import engine_pb2_grpc as pb_grpc
from services.common.tokenizer import load_tokenizer
from services.engine.kv.attention import ContiguousKV
from services.engine.models.loader import load_model
from services.kvstore.client import KVStoreClient
from tests.e2e.conftest import API_KEY, OTHER_KEY, TEAM_KEY
from tests.engine.helpers import reference_greedy

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_answers_from_the_real_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 3


def test_stream_reassembles_to_the_same_greedy_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_greedy_decode_in_bursts_is_the_reference_up_to_its_stop(client: openai.OpenAI, stack: Stack) -> None:
    """The stack's engine decodes in bursts of 4 (tests/e2e/conftest.py), each launched before the one before it
    is read (overlapped bursts): a greedy completion equals the model's reference decoding (one sequence,
    contiguous cache) up to the end-of-sequence token, which comes on the first step of a burst: the three
    steps after it, and the burst launched after that one, are dropped."""
    path = resolve_model_path("embedded:smollm2")
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode("Here is a list of the planets of the solar system, in order from the sun:")
    _, model = load_model(path, torch.device("cpu"), torch.float32)
    ref = reference_greedy(model, prompt, 24)
    eos = next(i for i, t in enumerate(ref) if t in tokenizer.info.eos_token_ids)
    assert eos % 4 == 0  # token 1 comes from the prefill, token k + 1 from the burst step at offset k - 1
    with auth.channel(f"127.0.0.1:{stack.ports['engine']}", secret=stack.secret) as channel:
        engine = pb_grpc.EngineStub(channel)
        before = engine.GetStats(pb.GetStatsRequest()).overlapped_steps_total
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        overlapped = engine.GetStats(pb.GetStatsRequest()).overlapped_steps_total - before
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == eos + 1
    assert r.choices[0].text == tokenizer.decode(ref[:eos])
    assert overlapped >= eos // 4 - 1  # every burst after the first was launched before its predecessor was read


def test_completions_with_max_tokens_stops_at_length(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The first five prime numbers are", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.choices[0].text.strip()


def test_stop_string_is_cut(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop"
    assert "Paris" not in r.choices[0].message.content
    assert whole.choices[0].message.content.startswith(r.choices[0].message.content)


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def draw(seed: int) -> str:
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story."}],
            temperature=1.0,
            seed=seed,
            max_tokens=24,
        )
        return r.choices[0].message.content

    assert draw(7) == draw(7)
    assert len({draw(s) for s in (1, 2, 3)}) > 1


def test_resent_history_reuses_cached_pages(client: openai.OpenAI) -> None:
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(40))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8)
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now say goodbye."},
    ]
    second = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 256
    assert cached >= (first.usage.prompt_tokens // 64) * 64
    assert cached < second.usage.prompt_tokens


def test_tenants_share_prefixes_only_when_configured_to(stack: Stack, client: openai.OpenAI) -> None:
    """Prefix pages are namespaced by tenant: the same prompt from another tenant's key reuses nothing
    (its pages hash under another root), while a second key configured with the same tenant name
    (KVMEM_API_KEYS `e2e:key1,e2e:key2`) reuses every full page the first key's request left."""
    prompt = "Inventory of the north warehouse: " + ", ".join(f"bin {i} holds {i * 7 % 13} crates" for i in range(60))

    def cached_and_prompt(key: str) -> tuple[int, int]:
        c = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=120)
        r = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2)
        details = r.usage.prompt_tokens_details
        return (details.cached_tokens if details is not None else 0) or 0, r.usage.prompt_tokens

    first, n = cached_and_prompt(API_KEY)
    assert n > 256 and first < 64  # nobody sent this prompt before
    other, _ = cached_and_prompt(OTHER_KEY)
    assert other == 0
    team, _ = cached_and_prompt(TEAM_KEY)
    assert team >= (n - 1) // 64 * 64


def test_bad_requests_get_openai_errors_and_the_stack_keeps_serving(stack: Stack, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5000)
    assert err.value.status_code == 400
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=5)
    raw = httpx.post(
        f"{stack.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        content=b"{not json",
        timeout=30,
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).choices


def test_missing_or_wrong_key_is_401(stack: Stack) -> None:
    r = httpx.get(f"{stack.url}/v1/models", timeout=30)
    assert r.status_code == 401 and "error" in r.json()
    bad = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{stack.url}/health", timeout=30).status_code == 200


def test_metrics_count_requests(stack: Stack, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    text = httpx.get(f"{stack.url}/metrics", timeout=30).text
    assert "kvmem_gateway_requests_total" in text


def test_engine_pages_are_in_the_kvstore_by_hash(stack: Stack, client: openai.OpenAI) -> None:
    """The prompt's full pages reach the store; their K/V equal an independent recomputation."""
    prompt = list(range(1000, 1000 + 200))  # 3 full pages of 64 + a partial one
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    hashes = chain_hashes(prompt, 64, MODEL, "fp32", namespace="e2e")
    with KVStoreClient(f"127.0.0.1:{stack.ports['kvstore0']}", secret=stack.secret) as store:
        deadline = time.monotonic() + 20  # write-through runs behind the answer
        while not all(loc.found for loc in store.lookup(hashes)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(loc.found for loc in store.lookup(hashes))
        page = store.get_page(hashes[2])
    cfg, model = load_model(resolve_model_path("embedded:smollm2"), torch.device("cpu"), torch.float32)
    kv = ContiguousKV(cfg.num_layers)
    with torch.inference_mode():
        model(torch.tensor(prompt[:192]), torch.arange(192), kv)
    shape = (cfg.num_layers, 2, 64, cfg.num_kv_heads, cfg.head_dim)
    stored = torch.frombuffer(bytearray(page), dtype=torch.float32).view(shape)
    for layer in (0, cfg.num_layers - 1):
        k_ref, v_ref = kv.layer_kv(layer)  # [Hkv, T, D]
        torch.testing.assert_close(stored[layer, 0], k_ref[:, 128:192].transpose(0, 1), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(stored[layer, 1], v_ref[:, 128:192].transpose(0, 1), atol=2e-3, rtol=2e-3)


def test_multi_turn_chat_reuses_at_least_99_percent_of_the_previous_turn(client: openai.OpenAI) -> None:
    """A chat that re-sends its history: turn k+1 reuses the KV of turn k's prompt and answer
    (whole pages by hash, the tail page's rows copied), >= 99% of turn k's tokens."""
    system = "You answer in one short sentence. " + " ".join(f"Fact {i}: item {i} is blue." for i in range(60))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What colour is item 3?"}]
    previous = None
    for follow_up in ("And item 7?", "And item 11?"):
        r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=16)
        if previous is not None:
            previous_tokens = previous.usage.prompt_tokens + previous.usage.completion_tokens
            assert r.usage.prompt_tokens_details.cached_tokens >= 0.99 * previous_tokens, (r.usage, previous.usage)
        previous = r
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": follow_up}]
