"""The model side of bench/scale.py: the random production-size checkpoints, their FLOP and byte arithmetic (the
physical limits), the measured bf16 matmul rate, and the transformers peer (a StaticCache and generate's compiled
decode step)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
SHAPES: dict[str, dict[str, Any]] = {
    "llama8b": dict(
        vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131_072, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128_000, eos_token_id=128_001,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256},
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # Qwen3-8B: q/k RMSNorm per head, no RoPE scaling (its native 32K; 40,960 positions)
    "qwen3_8b": dict(
        arch="qwen3", vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151_643,
        eos_token_id=151_645,
    ),
    "tiny_qwen3": dict(
        arch="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # Gemma 3 12B's text model: 48 layers, five sliding-window (1,024) layers to each global one, heads of 256,
    # linear RoPE scaling x8 on the global layers, tied embeddings
    "gemma3_12b": dict(
        arch="gemma3_text", vocab_size=262_208, hidden_size=3840, intermediate_size=15_360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, max_position_embeddings=131_072,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=1024, sliding_window_pattern=6, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
    ),
    "tiny_gemma3": dict(
        arch="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=32, sliding_window_pattern=6, query_pre_attn_scalar=32, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
    ),
}  # fmt: skip


# -- the model ------------------------------------------------------------------------------------


def hf_config(shape: str) -> Any:
    """The transformers config of `shape` (its `arch`: llama by default, qwen3, gemma3_text)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    fields = dict(SHAPES[shape])
    arch = fields.pop("arch", "llama")
    if arch == "gemma3_text":  # transformers 5 spells the 5:1 pattern as layer_types
        pattern = fields.pop("sliding_window_pattern")
        fields["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(fields["num_hidden_layers"])
        ]
    return {"llama": LlamaConfig, "qwen3": Qwen3Config, "gemma3_text": Gemma3TextConfig}[arch](**fields)


def write_random_llama(directory: Path, shape: str, device: torch.device, seed: int = 0) -> None:
    """Seeded random weights of `shape` (bf16, initialised on `device`; a Llama, Qwen3 or Gemma 3 text model)
    saved as an HF directory with a word-level tokenizer over the whole vocabulary."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM

    cfg = hf_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval().save_pretrained(str(directory))
    del model
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = HFTokenizer(WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "unk_token": "t3"})
    )


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the limits need: parameter counts and the attention shape."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    params: int  # every parameter
    embed: int  # the input embedding table's (one row read a token)
    tied: bool = False  # the output head is the input table
    local_layers: int = 0  # sliding-window layers (Gemma 3), each attending the last `window` keys
    window: int = 0

    @classmethod
    def of(cls, shape: str) -> Shape:
        s = SHAPES[shape]
        arch = s.get("arch", "llama")
        h, i, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
        q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
        norms = {"llama": 2 * h, "qwen3": 2 * h + 2 * s["head_dim"], "gemma3_text": 4 * h + 2 * s["head_dim"]}[arch]
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + norms
        embed = s["vocab_size"] * h
        head = 0 if s["tie_word_embeddings"] else embed
        local = 0
        if arch == "gemma3_text":
            local = layers - layers // s["sliding_window_pattern"]
        return cls(
            layers,
            s["num_attention_heads"],
            s["num_key_value_heads"],
            s["head_dim"],
            h,
            s["vocab_size"],
            layers * per_layer + embed + head + h,
            embed,
            bool(s["tie_word_embeddings"]),
            local,
            s.get("sliding_window", 0) if local else 0,
        )

    @property
    def body(self) -> int:
        """The parameters every token multiplies: all but the input table and the output head."""
        return self.params - self.embed - (0 if self.tied else self.embed)

    def prefill_flops(self, tokens: int, past: int = 0) -> float:
        """Projections of `tokens` new tokens (the head for one row) + causal attention over past + tokens
        (a sliding-window layer: over at most `window` keys a query)."""
        linear = 2 * self.body * tokens + 2 * self.embed
        t_all = past + tokens
        full = 2 * self.heads * self.head_dim * (t_all**2 - past**2)  # QK^T and PV, causal
        local = 0
        if self.local_layers:  # 2 products x 2 FLOPs x the keys each query sees
            seen = sum(min(p + 1, self.window) for p in range(past, t_all))
            local = 4 * self.heads * self.head_dim * seen
        return float(linear + (self.layers - self.local_layers) * full + self.local_layers * local)

    def kv_bytes(self, tokens: int, elem: int = 2) -> int:
        """K/V bytes of a sequence of `tokens` (a sliding-window layer keeps its last `window`)."""
        per_token = 2 * self.kv_heads * self.head_dim * elem
        kept = (self.layers - self.local_layers) * tokens + self.local_layers * min(tokens, self.window)
        return per_token * kept

    def decode_bytes(self, contexts: list[int]) -> float:
        """One decode step of these sequences: every weight once (the input table's one row aside; a tied head
        reads the table) + their K/V."""
        return 2.0 * (self.body + self.embed) + sum(self.kv_bytes(c) for c in contexts)


def matmul_tflops(device: torch.device) -> float:
    """bf16 8192^3 products on random data: median TFLOP/s of 10 after 3 warm-ups (0 off CUDA)."""
    if device.type != "cuda":
        return 0.0
    n = 8192
    a, b = (
        torch.randn(n, n, device=device, dtype=torch.bfloat16),
        torch.randn(n, n, device=device, dtype=torch.bfloat16),
    )
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


class _Times:
    """A generate streamer: when each step's tokens are there (synchronising the device)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []  # type: ignore[var-annotated]
        self.tokens: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        if len(self.times) > 1:  # the first put is the prompt
            self.tokens.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


@torch.inference_mode()
def peer_generate(
    model, prompts: list[list[int]], new_tokens: int, device: torch.device, warm_tokens: int = 8
) -> dict[str, Any]:  # type: ignore[no-untyped-def]  # noqa: E501
    """One batched greedy generate over a StaticCache of exactly prompt + new_tokens positions (generate
    compiles its decode step for a static cache on CUDA), after an untimed one of `warm_tokens` new tokens over
    the same cache (the compilation, and the recompilation once the mask's length varies, happen there):
    ttft_s, wall_s, decode_tok_s (the batch's, after the first token), max_step_s (a step far over the median
    would be a compilation inside the timed run), tokens (the first sequence's)."""
    from transformers import StaticCache

    ids = torch.tensor(prompts, device=device)
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
    out: dict[str, Any] = {}
    for n_new in (min(warm_tokens, new_tokens), new_tokens):
        cache.reset()
        times = _Times(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            streamer=times,
            past_key_values=cache,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
        )
        steps = [b - a for a, b in zip(times.times[1:], times.times[2:], strict=False)]
        out = dict(
            ttft_s=times.times[1] - t0,
            wall_s=times.times[-1] - t0,
            decode_tok_s=(n_new - 1) * len(prompts) / max(times.times[-1] - times.times[1], 1e-9),
            max_step_s=max(steps, default=0.0),
            median_step_s=statistics.median(steps) if steps else 0.0,
            tokens=[t[0] for t in times.tokens],
        )
    return out
