"""The real embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF): our loader and forward vs transformers'.

Both dequantise the same Q4_1 file to identical float32 weights, so only the order of float
operations differs. Tolerance: max |logit difference| < 5e-4 on logits of magnitude ~35
(measured: 5e-5 on CPU, 7e-5 on CUDA fp32).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.model_files import resolve_model_path
from services.common.tokenizer import load_tokenizer
from services.engine.kv.attention import ContiguousKV
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.loader import load_model

ATOL = 5e-4
NUM_NEW = 16
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, torch.nn.Module, torch.Tensor]:
    """(ours, transformers', prompt ids), loaded once for the module."""
    path = resolve_model_path("embedded:smollm2")
    ids = torch.tensor(load_tokenizer(path).encode(CHAT))
    _, ours = load_model(path, torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return ours, hf.eval(), ids


def test_config_matches_transformers(models: tuple) -> None:
    ours, hf, _ = models
    cfg, ref = ours.config, hf.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.intermediate_size) == (ref.vocab_size, ref.intermediate_size)
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"] == 100000.0
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings) == (1, 2, 8192)


def test_chat_prompt_logits_match_transformers(models: tuple) -> None:
    ours, hf, ids = models
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0].float()
        got = ours.logits(ours(ids, torch.arange(len(ids)), ContiguousKV(ours.config.num_layers)))
    assert got.shape == expected.shape == (len(ids), 49152)
    assert expected.abs().max() > 10  # real logits, far beyond the tolerance
    assert (got - expected).abs().max().item() < ATOL


def test_greedy_16_tokens_match_transformers(models: tuple) -> None:
    ours, hf, ids = models
    with torch.inference_mode():
        out = hf.generate(ids[None], max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=2)
    expected = out[0, len(ids) :].tolist()
    assert len(expected) == NUM_NEW  # the poem does not end within 16 tokens
    assert our_greedy(ours, ids, NUM_NEW) == expected


def our_greedy(model: LlamaForCausalLM, ids: torch.Tensor, num_new: int) -> list[int]:
    """Greedy decoding: one prefill, then one token per step through ContiguousKV."""
    kv = ContiguousKV(model.config.num_layers)
    tokens: list[int] = []
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), kv)[-1:]
        for i in range(num_new):
            tokens.append(int(model.logits(hidden).argmax(-1)))
            hidden = model(torch.tensor(tokens[-1:]), torch.tensor([len(ids) + i]), kv)
    return tokens
