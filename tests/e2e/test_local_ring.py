"""Local rings end to end: a tiny random Gemma 3 (sliding window 16 tokens, 2 of 6 layers global) served by
the real stack (gateway, cache guard, engine, kvstore, redis), prompts sent as token ids. Turn 2 of a
conversation reuses turn 1's pages and takes its parked local ring; a third request that shares only
turn 1's prompt fills its ring from the host copies of the prompt's last pages. Every answer equals the
dense reference computed here."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from deploy.launcher import LaunchConfig, Stack
from services.engine.models.loader import load_model
from tests.conftest import free_port
from tests.engine.helpers import reference_greedy

VOCAB = 512
WINDOW = 16


def write_tiny_gemma(directory: Path) -> None:
    """A seeded random Gemma 3 text model (transformers' format) with a word-level tokenizer `t0 .. t511`."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    s, f = "sliding_attention", "full_attention"
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=[s, s, f, s, s, f], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(11)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # logits far apart: greedy tokens do not depend on summation order
    model.save_pretrained(str(directory), safe_serialization=True)
    tok = HFTokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "unk_token": "t3"})
    )


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-gemma")
    write_tiny_gemma(directory)
    return directory


@pytest.fixture(scope="module")
def gemma_stack(gemma_dir: Path) -> Iterator[Stack]:
    cfg = LaunchConfig(model=str(gemma_dir), port=free_port(), host_kv_mib=64,
                       max_context=1024, kv_capacity=1024, ready_timeout_s=300)  # fmt: skip
    stack = Stack(cfg, echo=False)
    stack.start()
    yield stack
    stack.stop()


def _ids(text: str) -> list[int]:
    """The completion's token ids (the word-level vocabulary decodes to `t<id>` words)."""
    return [int(word[1:]) for word in text.split()]


def test_turns_reuse_pages_and_local_rings(gemma_stack: Stack, gemma_dir: Path) -> None:
    _, model = load_model(gemma_dir, torch.device("cpu"), torch.float32)
    client = openai.OpenAI(base_url=f"{gemma_stack.url}/v1", api_key="none", max_retries=0, timeout=300)
    served = client.models.list().data[0].id
    rng = random.Random(5)
    prompt = [rng.randrange(10, VOCAB) for _ in range(300)]  # 4 whole pages of 64 and a tail

    def ask(ids: list[int], n: int) -> tuple[list[int], int]:
        r = client.completions.create(model=served, prompt=ids, max_tokens=n, temperature=0)  # token ids in
        details = r.usage.prompt_tokens_details
        assert r.usage.prompt_tokens == len(ids), r.usage
        return _ids(r.choices[0].text), (details.cached_tokens if details is not None else 0) or 0

    answer, cached = ask(prompt, 8)
    assert answer == reference_greedy(model, prompt, 8)
    assert cached == 0
    turn2 = prompt + answer + [rng.randrange(10, VOCAB) for _ in range(20)]
    got, cached = ask(turn2, 8)
    assert got == reference_greedy(model, turn2, 8)
    assert cached == len(prompt) + len(answer) - 1  # the parked ring: every token turn 1 computed (>= 99%)
    other = prompt + [rng.randrange(10, VOCAB) for _ in range(30)]  # shares turn 1's prompt only
    got, cached = ask(other, 6)
    assert got == reference_greedy(model, other, 6)
    assert cached == 256  # the prompt's 4 whole pages; the ring filled from their host copies
