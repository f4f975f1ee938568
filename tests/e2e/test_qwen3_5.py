"""A random-weight Qwen3.5 hybrid (3 Gated DeltaNet layers, 1 full-attention layer) served by the real stack
(gateway, cache guard, engine, kvstore, redis) on the CPU.

With SmolLM2's tokenizer and chat template (bench/tiny_qwen3_5.py): chat, streaming, and turn 2 of a
conversation reusing turn 1's prefix (cached_tokens, up to the last state snapshot) with the answer of a cold
prefill (the same messages from another tenant, whose pages never mix). With a word-level tokenizer (prompts
as token ids): the ring over the full-attention layers with a 512-token pool under a 1,800-token prompt, the
`exact` answer equal to the one-sequence reference, and `sparse` answering flagged unverified."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from bench.tiny_qwen3_5 import write_tiny_qwen3_5
from deploy.launcher import LaunchConfig, Stack
from services.engine.models.loader import load_model
from tests.conftest import free_port
from tests.engine.test_qwen3_5_engine import reference

pytestmark = pytest.mark.slow  # two stacks of their own (~3 min on 2 cores): `make test-slow`

KEY, OTHER = "sk-q35", "sk-q35-other"


def _start(cfg: LaunchConfig) -> Stack:
    os.environ["KVMEM_STATE_INTERVAL_PAGES"] = "1"  # a snapshot every 64-token page (the children inherit it)
    stack = Stack(cfg, echo=False)
    try:
        stack.start()
    finally:
        os.environ.pop("KVMEM_STATE_INTERVAL_PAGES", None)
    return stack


@pytest.fixture(scope="module")
def chat_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = write_tiny_qwen3_5(tmp_path_factory.mktemp("q35-chat"), "smollm2", seed=1)
    stack = _start(LaunchConfig(model=str(directory), port=free_port(), host_kv_mib=64,
                                api_keys=f"q35:{KEY},q35other:{OTHER}", max_context=2048, kv_capacity=4096,
                                ready_timeout_s=300))  # fmt: skip
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def words_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_5(tmp_path_factory.mktemp("q35-words"), "words", seed=2)


@pytest.fixture(scope="module")
def ring_stack(words_dir: Path) -> Iterator[Stack]:
    stack = _start(LaunchConfig(model=str(words_dir), port=free_port(), host_kv_mib=64,
                                max_context=2048, kv_capacity=512, ready_timeout_s=300))  # fmt: skip
    yield stack
    stack.stop()


def _client(stack: Stack, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=300)


def test_chat_streaming_and_turn_two_reuse(chat_stack: Stack) -> None:
    client, other = _client(chat_stack, KEY), _client(chat_stack, OTHER)
    model = client.models.list().data[0].id
    system = "You are terse. " + " ".join(f"Rule {i}: keep every answer short." for i in range(30))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
    first = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=12)
    text = first.choices[0].message.content
    assert first.usage.completion_tokens == 12 and first.usage.prompt_tokens > 256
    stream = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Now say goodbye."}]
    second = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=12)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (first.usage.prompt_tokens // 64) * 64 - 64, (first.usage, second.usage)  # the last snapshot
    assert cached % 64 == 0 and 0 < cached < second.usage.prompt_tokens
    cold = other.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=12)
    assert cold.usage.prompt_tokens_details is None or not cold.usage.prompt_tokens_details.cached_tokens
    assert second.choices[0].message.content == cold.choices[0].message.content


def _ids(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]


def test_ring_over_the_full_attention_layers(ring_stack: Stack, words_dir: Path) -> None:
    _, model = load_model(words_dir, torch.device("cpu"), torch.float32)
    client = _client(ring_stack)
    served = client.models.list().data[0].id
    rng = random.Random(9)
    prompt = [rng.randrange(10, 512) for _ in range(1800)]  # about 3.5 times the 512-token pool
    want = reference(model, prompt, 6)  # type: ignore[arg-type]
    for policy in ("exact", "sparse"):
        r = client.completions.create(model=served, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"kvmem": {"over_pool_policy": policy}})  # fmt: skip
        plan = r.model_extra["kvmem"]["plan"]
        assert plan["prefill_policy"] == policy and bool(plan["unverified"]) is (policy == "sparse")
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 6
        if policy == "exact":
            assert _ids(r.choices[0].text) == want
