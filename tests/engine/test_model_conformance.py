"""Our Llama-family forward pass against transformers' own, on tiny random models of each architecture.

Every parameter (norm weights and biases too) is randomised, so a swapped or missing tensor shows.
Tolerance (fp32, CPU): max |logit difference| < 1e-4; logits here have a spread of several units.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from services.engine.kv.attention import ContiguousKV
from services.engine.models.config import ModelConfig, UnsupportedModelError
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.loader import load_model

ATOL = 1e-4
PROMPT_LEN = 20
CPU = torch.device("cpu")
COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,
)  # fmt: skip


def hf_config(case: str) -> PretrainedConfig:
    """Tiny configs: plain llama, llama with every option on, qwen2 (qkv bias), qwen3 (q/k norm)."""
    if case == "llama":
        return LlamaConfig(**COMMON)
    if case == "llama3_tied_bias":
        return LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True, rope_parameters=LLAMA3_ROPE)
    if case == "qwen2":
        return Qwen2Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert case == "qwen3"
    return Qwen3Config(**COMMON, head_dim=32)  # head_dim != hidden / heads on purpose


CASES = ["llama", "llama3_tied_bias", "qwen2", "qwen3"]


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Weights N(0, 0.2^2), norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2): nothing is trivially 0 or 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)


@pytest.fixture(scope="module", params=CASES)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(case, transformers model, our model, HF directory), both fp32 on CPU, same weights."""
    case = request.param
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(case), dtype=torch.float32).eval()
    randomise_(hf, seed=CASES.index(case))
    path = tmp_path_factory.mktemp(case)
    # a small shard size makes the qwen2 case a sharded checkpoint with an index file
    hf.save_pretrained(path, max_shard_size="100KB" if case == "qwen2" else "50GB")
    _, ours = load_model(path, CPU, torch.float32)
    return case, hf, ours, path


def prompt_ids(n: int = PROMPT_LEN, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def our_logits(model: LlamaForCausalLM, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of every token, fed through one ContiguousKV in chunks of the given sizes."""
    kv = ContiguousKV(model.config.num_layers, initial_capacity=4)  # small: exercises regrowth
    out, start = [], 0
    with torch.inference_mode():
        for size in chunks:
            positions = torch.arange(start, start + size)
            out.append(model.logits(model(ids[start : start + size], positions, kv)))
            start += size
    assert start == len(ids) and kv.num_tokens == len(ids)
    return torch.cat(out)


def hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


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


def test_config_read_from_hf(pair: tuple) -> None:
    case, hf, ours, _ = pair
    cfg = ours.config
    assert cfg.architecture == hf.config.model_type
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 4, 2)
    assert cfg.head_dim == (32 if case == "qwen3" else 16)
    assert cfg.attention_bias == (case in ("qwen2", "llama3_tied_bias"))
    assert cfg.o_proj_bias == (case == "llama3_tied_bias")
    assert cfg.qk_norm == (case == "qwen3")
    assert cfg.tie_word_embeddings == (case == "llama3_tied_bias")
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if case == "llama3_tied_bias" else None)
    assert cfg.rope_theta == (1e6 if case == "qwen2" else 10000.0)


def test_full_prompt_logits_match_transformers(pair: tuple) -> None:
    _, hf, ours, _ = pair
    ids = prompt_ids()
    expected = hf_logits(hf, ids)
    got = our_logits(ours, ids, [PROMPT_LEN])
    assert got.dtype == torch.float32 and got.shape == expected.shape == (PROMPT_LEN, 256)
    assert expected.std() > 1.0  # logits spread far beyond the tolerance
    assert (got - expected).abs().max().item() < ATOL


@pytest.mark.parametrize("chunks", [[12] + [1] * 8, [12, 5, 1, 1, 1], [1] * PROMPT_LEN])
def test_incremental_decoding_matches_full_prompt(pair: tuple, chunks: list[int]) -> None:
    """Prefill then single steps (and a multi-token chunk over a cached prefix) = one full pass."""
    _, hf, ours, _ = pair
    ids = prompt_ids()
    full = our_logits(ours, ids, [PROMPT_LEN])
    stepped = our_logits(ours, ids, chunks)
    assert (stepped - full).abs().max().item() < ATOL
    assert (stepped - hf_logits(hf, ids)).abs().max().item() < ATOL


def test_greedy_generation_matches_transformers(pair: tuple) -> None:
    _, hf, ours, _ = pair
    ids = prompt_ids()
    with torch.inference_mode():
        out = hf.generate(ids[None], max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = out[0, PROMPT_LEN:].tolist()
    assert len(expected) == 16
    assert our_greedy(ours, ids, 16) == expected


def test_later_positions_match_transformers(pair: tuple) -> None:
    """Positions 100..119 (past the llama3 case's original 64, so in its scaled band) still match."""
    _, hf, ours, _ = pair
    ids = prompt_ids(120)
    expected = hf_logits(hf, ids)[100:]
    got = our_logits(ours, ids, [100, 20])[100:]
    assert (got - expected).abs().max().item() < ATOL


# --- GGUF: the same weights written the way llama.cpp writes them -----------------------------------

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: half-split rope rows -> interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, cfg: dict, state: dict[str, np.ndarray]) -> None:
    """A GGUF like llama.cpp's converter makes: 2-D weights Q8_0, 1-D F32, llama q/k permuted."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    for hf_name, w in state.items():
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = cfg["num_attention_heads"] if ".q_proj." in hf_name else cfg["num_key_value_heads"]
            w = llama_cpp_permute(w, heads)
        if w.ndim == 2:
            writer.add_tensor(gguf_name(hf_name), quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            writer.add_tensor(gguf_name(hf_name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q8_round_trip(w: np.ndarray) -> np.ndarray:
    if w.ndim != 2:
        return w
    q8 = gguf.GGMLQuantizationType.Q8_0
    return dequantize(quantize(w, q8), q8).reshape(w.shape)


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3"])
def test_gguf_matches_safetensors_of_the_same_weights(case: str, tmp_path: Path) -> None:
    """GGUF (Q8_0, permuted like llama.cpp) and safetensors of identical weights give the same logits."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(case), dtype=torch.float32).eval()
    randomise_(hf, seed=10 + CASES.index(case))
    state = {n: q8_round_trip(t.numpy()) for n, t in hf.state_dict().items()}
    hf.load_state_dict({n: torch.from_numpy(w) for n, w in state.items()})
    hf.save_pretrained(tmp_path / "hf")
    cfg = hf.config.to_dict()
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    write_gguf(tmp_path / "tiny.gguf", case, cfg, state)

    gguf_cfg, from_gguf = load_model(tmp_path / "tiny.gguf", CPU, torch.float32)
    hf_cfg, from_hf = load_model(tmp_path / "hf", CPU, torch.float32)
    assert gguf_cfg == dataclasses.replace(hf_cfg, rms_norm_eps=gguf_cfg.rms_norm_eps)
    assert gguf_cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)  # GGUF stores float32
    ids = prompt_ids()
    diff = our_logits(from_gguf, ids, [PROMPT_LEN]) - our_logits(from_hf, ids, [PROMPT_LEN])
    assert diff.abs().max().item() < 1e-5


# --- refusals ---------------------------------------------------------------------------------------


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedModelError, match="'gpt2'") as info:
        load_model(tmp_path, CPU, torch.float32)
    assert info.value.architecture == "gpt2"


@pytest.mark.parametrize(
    "change, detail",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"use_sliding_window": True}, "sliding"),
    ],
)
def test_unsupported_options_are_refused(change: dict, detail: str) -> None:
    cfg = LlamaConfig(**COMMON).to_dict()
    cfg.pop("rope_parameters")
    cfg.update(change)
    with pytest.raises(UnsupportedModelError, match=detail):
        ModelConfig.from_hf_config(cfg)
