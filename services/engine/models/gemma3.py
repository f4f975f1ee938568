"""The engine's own forward pass for Gemma 3 text models (gemma3_text, e.g. Gemma 3 270M).

Differences from the Llama family (models/llama.py), each following transformers' modeling_gemma3.py:
embeddings scaled by sqrt(hidden) rounded to the model dtype; RMSNorm scaled by (1 + weight) in
float32; q/k RMSNorm; four norms per layer (before and after attention and MLP); a GELU-tanh gated
MLP; attention scale query_pre_attn_scalar^-1/2; sliding-window layers (ModelConfig.layer_windows)
with their own RoPE base, global layers with the global base and rope scaling; optional final logit
softcapping. Tokens are flattened as in llama.py; the AttentionBackend gets each layer's window.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from services.engine.kv.attention import AttentionBackend
from services.engine.models.config import ModelConfig
from services.engine.models.llama import (
    MLP,
    Rope,
    RotaryEmbedding,
    apply_rope,
    block_kernel,
    fused_kernels,
    project,
    vocab_head,
)

if TYPE_CHECKING:
    from services.engine.kernels.attention.decode_attention_triton import Partials
    from services.engine.kernels.layer.block_triton import BlockWeights

logger = logging.getLogger(__name__)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, cast back to the input dtype at the end.

    `weight` is stored as transformers stores it (0 means identity); llama.cpp's GGUF stores
    weight + 1 and the loader subtracts the 1, as transformers does.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        kernels = fused_kernels(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps, gemma=True)
        return self.reference(x)

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """residual + self(x) (Gemma's post-norms), one launch with the fused kernels."""
        kernels = fused_kernels(x)
        if kernels is not None and residual.is_contiguous():
            return kernels.rms_norm(x, self.weight, self.eps, gemma=True, residual=residual)
        return residual + self(x)

    def add_then(self, residual: Tensor, x: Tensor, nxt: GemmaRMSNorm) -> tuple[Tensor, Tensor]:
        """(s, nxt(s)) with s = residual + self(x): a post-norm, its residual add and the next pre-norm,
        one launch with the fused kernels."""
        kernels = fused_kernels(x)
        if kernels is not None and residual.is_contiguous() and x.dim() == 2 and x.stride(1) == 1:
            return kernels.add_rms_norm(x, self.weight, residual, nxt.weight, self.eps, gemma=True)  # type: ignore[no-any-return]
        s = self.add_to(residual, x)
        return s, nxt(s)

    def reference(self, x: Tensor) -> Tensor:
        """The torch code (the fused kernel's reference)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


@functools.lru_cache(maxsize=8)
def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded as transformers rounds it: to float32, then to the model dtype."""
    return torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype).item()


class Gemma3Attention(nn.Module):
    """Fused qkv projection, q/k RMSNorm, RoPE (local or global), the backend's windowed attention, o_proj."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window = config.layer_windows[layer_idx]  # None: a global layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        qkv_size = config.q_size + 2 * config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: Tensor, rope: Rope, attn: AttentionBackend) -> Tensor:
        out = self.attend(project(self.qkv_proj, x), rope, attn)
        assert isinstance(out, Tensor)
        return project(self.o_proj, out)

    def attend(self, qkv: Tensor, rope: Rope, attn: AttentionBackend, partial: bool = False) -> Tensor | Partials:
        """The projected qkv [N, q_size + 2 kv_size] -> the attention output before o_proj [N, q_size]
        (`partial`: the backend's unmerged Partials where it has them, for the block kernel)."""
        n = qkv.shape[0]
        qkv = qkv.view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)  # [N, H*, D]
        kernels = fused_kernels(qkv)
        sink = attn.kv_sink(self.layer_idx) if kernels is not None else None
        if kernels is not None:  # norms and RoPE in one launch (and the K/V rows written, with a sink)
            qk = kernels.qk_norm_rope(
                qkv, self.q_norm.weight, self.k_norm.weight, rope.cos, rope.sin, self.q_norm.eps,
                self.num_heads, self.num_kv_heads, gemma=True, kv_sink=sink, positions=rope.positions,
            )  # fmt: skip
        else:
            qk = apply_rope(torch.cat((self.q_norm(q), self.k_norm(k)), dim=1), *rope.rows)  # [N, Hq + Hkv, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # q: [N, Hq, D]; k: [N, Hkv, D]
        out = attn.attend(
            self.layer_idx, q, k, v, self.scale, window=self.window, stored=sink is not None, partial=partial
        )
        return out.reshape(n, -1) if isinstance(out, Tensor) else out


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: x + post_norm(block(pre_norm(x))) for attention, then for the MLP; a layer takes its
    input already normed and returns its output's next norm too (the norms fuse pairwise)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = MLP(config, act="gelu_tanh")
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, x: Tensor, h: Tensor, rope: Rope, attn: AttentionBackend, nxt: GemmaRMSNorm
    ) -> tuple[Tensor, Tensor]:
        """x: the residual stream, h = input_layernorm(x) -> (the new residual, nxt(it)): nxt is the next
        layer's input norm (the final norm after the last layer), so each norm pair is one launch."""
        attended = self.self_attn(h, rope, attn)
        x, h = self.post_attention_layernorm.add_then(x, attended, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm.add_then(x, self.mlp(h), nxt)


class Gemma3ForCausalLM(nn.Module):
    """Scaled embedding, decoder layers, final norm; `logits` applies the (usually tied) head and softcap."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.architecture == "gemma3", config.architecture
        self.config = config
        # parameters come from the loader: skip nn.Embedding's random init (slow on meta tensors)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.layer_is_sliding = tuple(w is not None for w in config.layer_windows)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_global = RotaryEmbedding(config)
        local_theta = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
        self.rotary_local = RotaryEmbedding(dataclasses.replace(config, rope_theta=local_theta, rope_scaling=None))
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """input_ids, positions: [N] -> final-normed hidden states [N, hidden]."""
        table = self.embed_tokens.weight  # [V, hidden]
        scale = embed_scale(self.config.hidden_size, table.dtype)
        layers = cast(list[Gemma3DecoderLayer], list(self.layers))
        first = layers[0].input_layernorm
        kernels = fused_kernels(table)
        if kernels is not None and input_ids.dtype == torch.int64:  # lookup, scale and first norm: one launch
            x, h = kernels.embed_rms_norm(input_ids, table, scale, first.weight, first.eps, gemma=True)
        else:
            x = self.embed_tokens(input_ids) * scale  # x: [N, hidden]
            h = first(x)
        rope = self._rope_tables(positions, x.dtype)
        nxt = [*(layer.input_layernorm for layer in layers[1:]), self.norm]
        blocks = self._blocks(x, nxt)
        if blocks is not None:  # one row on the Triton tier: each layer's second half in one launch
            kernel, weights = blocks
            qkv = project(layers[0].self_attn.qkv_proj, h)
            partial = kernel.merges()  # the block merges the attention's partials itself
            for layer, is_sliding, w in zip(layers, self.layer_is_sliding, weights, strict=True):
                x, h, qkv = kernel.block(layer.self_attn.attend(qkv, rope[is_sliding], attn, partial), x, w)
            return h
        for layer, is_sliding, norm in zip(layers, self.layer_is_sliding, nxt, strict=True):
            x, h = layer(x, h, rope[is_sliding], attn, norm)
        return h

    def _blocks(self, x: Tensor, nxt: list[GemmaRMSNorm]) -> tuple[ModuleType, list[BlockWeights]] | None:
        """(kernels/layer/block_triton.py, each layer's BlockWeights) when the block kernel takes this forward
        (`block_kernel`, no projection biases, every layer `supported`); else None (the launches)."""
        layers = cast(list[Gemma3DecoderLayer], list(self.layers))
        kernel = block_kernel(x, len(layers))
        if kernel is None:
            return None
        if any(m.bias is not None for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)):
            return None
        weights = []
        for i, (layer, norm) in enumerate(zip(layers, nxt, strict=True)):
            nxt_qkv = layers[i + 1].self_attn.qkv_proj.weight if i + 1 < len(layers) else None
            w = kernel.BlockWeights(
                o=layer.self_attn.o_proj.weight, post_attn=layer.post_attention_layernorm.weight,
                pre_ffn=layer.pre_feedforward_layernorm.weight, gate_up=layer.mlp.gate_up_proj.weight,
                down=layer.mlp.down_proj.weight, post_ffn=layer.post_feedforward_layernorm.weight,
                next_norm=norm.weight, qkv=nxt_qkv, qkv_bias=None, eps=layer.post_attention_layernorm.eps, gemma=True,
                act=layer.mlp.act,
            )  # fmt: skip
            if not kernel.supported(x, w):
                return None
            weights.append(w)
        return kernel, weights

    def _rope_tables(self, positions: Tensor, dtype: torch.dtype) -> dict[bool, Rope]:
        """is_sliding -> the tokens' Rope, only for the layer kinds the model has."""
        rotary = {True: self.rotary_local, False: self.rotary_global}
        return {sliding: rotary[sliding](positions, dtype) for sliding in set(self.layer_is_sliding)}

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [M, hidden] -> float32 logits [M, vocab], softcapped if the config says so."""
        return self.head(hidden, argmax=False)[0]

    def head(self, hidden: Tensor, argmax: bool) -> tuple[Tensor, Tensor | None]:
        """hidden: [M, hidden] -> (float32 logits [M, vocab], softcapped if the config says so; with `argmax`
        their argmax [M]) (llama.vocab_head; a softcap is applied to the logits, then the argmax taken)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        cap = self.config.final_logit_softcapping
        if cap is None:
            return vocab_head(hidden, weight, argmax)
        logits = torch.tanh(vocab_head(hidden, weight, False)[0] / cap) * cap
        return logits, torch.argmax(logits, dim=-1) if argmax else None
