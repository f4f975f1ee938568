"""The engine's own forward pass for the Llama family: Llama/SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens are flattened: the model sees N tokens with their positions and never knows how many
sequences they belong to; the AttentionBackend does the per-sequence bookkeeping.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.engine.kernels import triton_module
from services.engine.kv.attention import AttentionBackend
from services.engine.models.config import ModelConfig

if TYPE_CHECKING:
    from services.engine.kernels.attention.decode_attention_triton import Partials
    from services.engine.kernels.layer.block_triton import BlockWeights

logger = logging.getLogger(__name__)


def fused_kernels(x: Tensor) -> ModuleType | None:
    """The fused Triton norm kernels (kernels/layer/norm_triton.py) when the kernel tier is Triton and x is on
    that tier's device (CUDA, or the CPU under the interpreter in tests); None: the torch code."""
    return triton_module("layer.norm_triton", x.device)


def _skinny(x: Tensor, weight: Tensor) -> ModuleType | None:
    """kernels/layer/linear_triton.py when it takes x @ weight^T (a decode-sized x on the Triton tier: `routes`)."""
    kernels = triton_module("layer.linear_triton", x.device)
    return kernels if kernels is not None and kernels.routes(x, weight) else None


def project(layer: nn.Linear, x: Tensor) -> Tensor:
    """layer(x); a decode-sized x (kernels/layer/linear_triton.py: at most 64 rows) on the Triton tier takes the
    skinny-product kernel, which reads the weight at a higher share of the bandwidth than cuBLAS."""
    kernels = _skinny(x, layer.weight)
    if kernels is not None:
        return kernels.linear(x, layer.weight, layer.bias)  # type: ignore[no-any-return]
    return layer(x)  # type: ignore[no-any-return]


@functools.cache
def residual_epilogue() -> bool:
    """Whether project_add sums in the product's epilogue: not with KVMEM_RESIDUAL_EPILOGUE=0 (the product,
    then an add launch: A/B runs). Decided once."""
    on = os.environ.get("KVMEM_RESIDUAL_EPILOGUE", "1") != "0"
    logger.info("residual sum in the projections' epilogue: %s", "on" if on else "off (KVMEM_RESIDUAL_EPILOGUE=0)")
    return on


def project_add(layer: nn.Linear, x: Tensor, residual: Tensor) -> Tensor:
    """residual + layer(x), the sum in the product's epilogue where the GPU computes it, written over the
    residual (the residual stream is the caller's to give up):
    - a decode-sized x: the skinny kernel's epilogue (kernels/layer/linear_triton.py `residual`);
    - else, on CUDA without a bias: cuBLAS with the residual as C and beta 1 (`addmm_`), instead of an add
      launch that reads both and writes a third tensor (3 x 64 MiB an 8K-token chunk of the 8B shape, twice a
      layer).
    Either way the sum is rounded once from fp32 rather than after the product too. Elsewhere (the CPU, a
    bias on cuBLAS, a residual of another layout): residual + project(layer, x), a new tensor."""
    weight = layer.weight
    fits = (
        residual_epilogue()
        and residual.dim() == 2
        and residual.is_contiguous()
        and residual.shape == (x.shape[0], weight.shape[0])
        and residual.dtype == x.dtype == weight.dtype
    )
    kernels = _skinny(x, weight)
    if fits and kernels is not None:
        return kernels.linear(x, weight, layer.bias, residual=residual)  # type: ignore[no-any-return]
    if fits and kernels is None and residual.is_cuda and layer.bias is None:
        return residual.addmm_(x, weight.t())
    return residual + (kernels.linear(x, weight, layer.bias) if kernels is not None else layer(x))


def vocab_head(hidden: Tensor, weight: Tensor, argmax: bool) -> tuple[Tensor, Tensor | None]:
    """hidden [M, H] @ weight [V, H]^T -> (fp32 logits [M, V], with `argmax` their argmax [M], else None). One
    row on the Triton tier takes kernels/layer/head_triton.py (the product, the cast and the argmax in one launch),
    eager and captured steps alike, so that both see the same logits; else cuBLAS, the cast, torch.argmax."""
    kernel = triton_module("layer.head_triton", hidden.device)
    if kernel is not None and kernel.enabled() and kernel.supported(hidden, weight):
        return kernel.head(hidden, weight, argmax)  # type: ignore[no-any-return]
    logits = F.linear(hidden, weight).float()
    return logits, torch.argmax(logits, dim=-1) if argmax else None


def block_kernel(x: Tensor, layers: int) -> ModuleType | None:
    """kernels/layer/block_triton.py when a forward of x may run each of its `layers` layers' second half in one
    launch: one row (a decode step of one sequence) on the Triton tier, the kernel on, and barrier counters
    for every launch (`ready`); None: the launches."""
    kernel = triton_module("layer.block_triton", x.device) if x.shape[0] == 1 else None
    if kernel is None or not kernel.enabled() or not kernel.ready(x.device, layers):
        return None
    return kernel


class RMSNorm(nn.Module):
    """RMSNorm in float32, scaled in the input dtype (as transformers does it)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        kernels = fused_kernels(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps, gemma=False)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """[D/2] float32 inverse frequencies, with llama3 or llama.cpp freq-factor scaling if any."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    assert scaling["rope_type"] == "freq_factors", scaling["rope_type"]
    return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)


def _llama3_scaled(inv_freq: Tensor, scaling: dict[str, float]) -> Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, a smooth blend in between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotation of N tokens: the whole cos / signed-sin tables [P, D] and the tokens' positions [N]
    (int64). The fused q/k norm + RoPE kernel reads each token's rows itself (no gather launches); the
    torch path takes them gathered once (`rows`)."""

    cos: Tensor
    sin: Tensor
    positions: Tensor

    @functools.cached_property
    def rows(self) -> tuple[Tensor, Tensor]:
        """cos, sin [N, 1, D] of the tokens (broadcast over heads): apply_rope's."""
        return self.cos[self.positions].unsqueeze(1), self.sin[self.positions].unsqueeze(1)


class RotaryEmbedding(nn.Module):
    """cos / signed-sin tables [max_positions, D], built lazily on the model's device, indexed by position.

    The tables hold cos(f) twice and (-sin(f), sin(f)), so rotating half-split pairs is
    x * cos + roll(x, D/2) * sin: four kernels, and bit-for-bit transformers' rotate_half form.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None

    def forward(self, positions: Tensor, dtype: torch.dtype) -> Rope:
        """positions: [N] int64 -> their Rope."""
        if self._cos is None or self._cos.device != positions.device or self._cos.dtype != dtype:
            self._build(positions.device, dtype)
        assert self._cos is not None and self._sin is not None
        return Rope(self._cos, self._sin, positions)

    def _build(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(self.config).to(device)  # [D/2]
        t = torch.arange(self.config.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        self._cos = torch.cat((cos, cos), dim=-1).to(dtype)  # [P, D]
        self._sin = torch.cat((-sin, sin), dim=-1).to(dtype)  # [P, D]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [N, H, D] rotated in halves (HF / neox layout); cos, sin: [N, 1, D] from RotaryEmbedding."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    """Fused qkv projection, optional q/k RMSNorm, RoPE, the backend's attention, o_proj."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        qkv_size = config.q_size + 2 * config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: Tensor, rope: Rope, attn: AttentionBackend, residual: Tensor | None = None) -> Tensor:
        """o_proj(attention(x)), plus `residual` when given (`project_add`: it may be overwritten)."""
        out = self.attend(project(self.qkv_proj, x), rope, attn)
        assert isinstance(out, Tensor)
        return project(self.o_proj, out) if residual is None else project_add(self.o_proj, out, residual)

    def attend(self, qkv: Tensor, rope: Rope, attn: AttentionBackend, partial: bool = False) -> Tensor | Partials:
        """The projected qkv [N, q_size + 2 kv_size] -> the attention output before o_proj [N, q_size]
        (`partial`: the backend's unmerged Partials where it has them, for the block kernel)."""
        n, num_qk_heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        qkv = qkv.view(n, num_qk_heads + self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([num_qk_heads, self.num_kv_heads], dim=1)  # qk: [N, Hq + Hkv, D]; v: [N, Hkv, D]
        kernels = fused_kernels(qkv)
        if kernels is not None:  # one launch: the q/k norm (when the model has one) and RoPE
            sink = attn.kv_sink(self.layer_idx)  # the K/V rows written in that launch too
            q_norm, k_norm = self.q_norm, self.k_norm
            normed = q_norm is not None and k_norm is not None
            qk = kernels.qk_norm_rope(
                qkv, q_norm.weight if q_norm is not None and normed else None,
                k_norm.weight if k_norm is not None and normed else None,
                rope.cos, rope.sin, q_norm.eps if q_norm is not None and normed else 0.0,
                self.num_heads, self.num_kv_heads, gemma=False, kv_sink=sink, positions=rope.positions,
            )  # fmt: skip
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            out = attn.attend(self.layer_idx, q, k, v, self.scale, stored=sink is not None, partial=partial)
            return out.reshape(n, -1) if isinstance(out, Tensor) else out
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = apply_rope(qk, *rope.rows)  # q and k rotated together
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # q: [N, Hq, D]; k: [N, Hkv, D]
        out = attn.attend(self.layer_idx, q, k, v, self.scale, partial=partial)  # out: [N, Hq, D]
        return out.reshape(n, -1) if isinstance(out, Tensor) else out


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "gelu_tanh": gelu_tanh}


class MLP(nn.Module):
    """Gated MLP with a fused gate/up projection: SwiGLU by default (Gemma passes "gelu_tanh").

    On the Triton tier a decode-sized x takes the gated projection kernel (activation and product in its
    epilogue: kernels/layer/linear_triton.py); a longer x the fused activation-and-product kernel when
    norm_triton has one (`<act>_mul`); else torch."""

    def __init__(self, config: ModelConfig, act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = act
        self.activation = ACTIVATIONS[act]

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """down(act(gate(x)) * up(x)), plus `residual` when given (`project_add`: it may be overwritten)."""
        linear = _skinny(x, self.gate_up_proj.weight)
        if linear is not None:
            return self._down(linear.linear_gated(x, self.gate_up_proj.weight, self.act), residual)
        gate_up = project(self.gate_up_proj, x)  # [N, 2I]
        kernels = fused_kernels(x)
        fused = getattr(kernels, f"{self.act}_mul", None) if kernels is not None else None
        if fused is not None and gate_up.dim() == 2:
            return self._down(fused(gate_up), residual)  # activation and product: one launch
        gate, up = gate_up.chunk(2, dim=-1)  # [N, I] each
        return self._down(self.activation(gate) * up, residual)

    def _down(self, h: Tensor, residual: Tensor | None) -> Tensor:
        return project(self.down_proj, h) if residual is None else project_add(self.down_proj, h, residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, rope: Rope, attn: AttentionBackend) -> Tensor:
        """x + attention, then + MLP: each sum the epilogue of its last product on the GPU (`project_add`; x, the
        residual stream, is overwritten there)."""
        x = self.self_attn(self.input_layernorm(x), rope, attn, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm; `logits` applies the (possibly tied) head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # parameters come from the loader: skip nn.Embedding's random init (slow on meta tensors)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """input_ids, positions: [N] -> final-normed hidden states [N, hidden]."""
        x = self.embed_tokens(input_ids)  # x: [N, hidden]
        rope = self.rotary(positions, x.dtype)
        layers = cast(list[DecoderLayer], list(self.layers))
        blocks = self._blocks(x, layers)
        if blocks is not None:  # one row on the Triton tier: each layer's second half in one launch
            kernel, weights = blocks
            h = layers[0].input_layernorm(x)
            qkv = project(layers[0].self_attn.qkv_proj, h)
            partial = kernel.merges()  # the block merges the attention's partials itself
            for layer, w in zip(layers, weights, strict=True):
                x, h, qkv = kernel.block(layer.self_attn.attend(qkv, rope, attn, partial), x, w)
            return h
        for layer in layers:
            x = layer(x, rope, attn)
        return self.norm(x)

    def _blocks(self, x: Tensor, layers: list[DecoderLayer]) -> tuple[ModuleType, list[BlockWeights]] | None:
        """(kernels/layer/block_triton.py, each layer's BlockWeights) when the block kernel takes this forward
        (`block_kernel`, no o_proj bias, every layer `supported`); else None."""
        kernel = block_kernel(x, len(layers))
        if kernel is None or any(layer.self_attn.o_proj.bias is not None for layer in layers):
            return None
        weights = []
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].self_attn.qkv_proj if i + 1 < len(layers) else None
            w = kernel.BlockWeights(
                o=layer.self_attn.o_proj.weight, post_attn=None, pre_ffn=layer.post_attention_layernorm.weight,
                gate_up=layer.mlp.gate_up_proj.weight, down=layer.mlp.down_proj.weight, post_ffn=None,
                next_norm=(layers[i + 1].input_layernorm if nxt is not None else self.norm).weight,
                qkv=nxt.weight if nxt is not None else None, qkv_bias=nxt.bias if nxt is not None else None,
                eps=layer.post_attention_layernorm.eps, gemma=False, act=layer.mlp.act,
            )  # fmt: skip
            if not kernel.supported(x, w):
                return None
            weights.append(w)
        return kernel, weights

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [M, hidden] -> float32 logits [M, vocab]."""
        return self.head(hidden, argmax=False)[0]

    def head(self, hidden: Tensor, argmax: bool) -> tuple[Tensor, Tensor | None]:
        """hidden: [M, hidden] -> (float32 logits [M, vocab], with `argmax` their argmax [M]) (`vocab_head`)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_head(hidden, weight, argmax)
