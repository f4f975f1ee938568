"""The engine's own forward pass for Qwen3.5 hybrid text models (qwen3_5: dense), after transformers'
modeling_qwen3_5.py.

Layers are either Gated DeltaNet (linear attention: a fused in-projection, a short causal depthwise conv
with SiLU, the gated delta rule over each sequence's recurrent state, a gated RMSNorm, out_proj) or gated
full attention (q/k RMSNorm, partial RoPE on the first rotary_dim dims, the backend's attention, the output
times sigmoid of a per-head gate from q_proj). RMSNorms are zero-centred ((1 + w), float32) except the
linear layers' gated norm (w, as transformers). Only the full-attention layers carry K/V: they go through the
AttentionBackend under their KV layer index (ModelConfig.kv_layers: the pool holds those layers only); the
linear layers read and write the step's RecurrentBatch (recurrent_state.py). Tokens are flattened as in
llama.py; the batch says which tokens belong to which sequence.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.engine.kernels.layer.gated_delta import gated_delta_rule
from services.engine.kv.attention import AttentionBackend
from services.engine.models.config import ModelConfig
from services.engine.models.gemma3 import GemmaRMSNorm
from services.engine.models.llama import MLP, Rope, RotaryEmbedding, apply_rope, project, vocab_head

if TYPE_CHECKING:
    from collections.abc import Callable

    from services.engine.kv.recurrent_state import RecurrentBatch

logger = logging.getLogger(__name__)


class GatedRMSNorm(nn.Module):
    """weight * norm(x) (cast to x's dtype first) * silu(gate) in float32, back to x's dtype (transformers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Linear attention: in_proj -> (qkv, z, b, a); causal conv over qkv; the gated delta rule; norm(out, z)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        shape = config.linear
        assert shape is not None
        self.shape = shape
        self.linear_idx = shape.layers.index(layer_idx)  # its index in RecurrentStates
        conv_dim, value_dim, hv = shape.conv_dim, shape.value_dim, shape.num_v_heads
        self.splits = [conv_dim, value_dim, hv, hv]
        self.in_proj = nn.Linear(config.hidden_size, sum(self.splits), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, shape.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(shape.v_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, config.hidden_size, bias=False)

    def forward(self, x: Tensor, batch: RecurrentBatch) -> Tensor:
        s = self.shape
        n = x.shape[0]
        mixed, z, b, a = project(self.in_proj, x).split(self.splits, dim=-1)
        mixed = self._conv(mixed, batch)  # [N, conv_dim], SiLU applied
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = q.reshape(n, s.num_k_heads, s.k_head_dim)
        k = k.reshape(n, s.num_k_heads, s.k_head_dim)
        v = v.reshape(n, s.num_v_heads, s.v_head_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        ssm = batch.states.ssm[self.linear_idx]
        initial = ssm[batch.slots] * (~batch.fresh).to(torch.float32)[:, None, None, None]
        out, final = gated_delta_rule(q, k, v, g, beta, initial, batch.lengths)
        _write_back(ssm, batch, final)
        out = self.norm(out.reshape(-1, s.v_head_dim), z.reshape(-1, s.v_head_dim)).reshape(n, -1)
        return project(self.out_proj, out)

    def _conv(self, mixed: Tensor, batch: RecurrentBatch) -> Tensor:
        """The causal depthwise conv of each sequence over its conv state then its new inputs; the new conv
        state (the last K - 1 inputs) is written back. mixed: [N, C] -> SiLU(conv) [N, C]."""
        conv = batch.states.conv[self.linear_idx]  # [S, C, K - 1]
        prev = conv[batch.slots] * (~batch.fresh).to(conv.dtype)[:, None, None]  # [B, C, K - 1]
        weight = self.conv_weight[:, None, :]  # [C, 1, K]
        width = self.shape.conv_kernel - 1
        if all(n == 1 for n in batch.lengths):  # a decode step: every sequence's window at once
            window = torch.cat((prev, mixed[:, :, None].to(prev.dtype)), dim=-1)  # [B, C, K]
            out = F.conv1d(window.to(weight.dtype), weight, groups=weight.shape[0])[:, :, 0]  # [B, C]
            _write_back(conv, batch, window[:, :, 1:])
            return F.silu(out).to(mixed.dtype)
        outs, states, start = [], [], 0
        for i, n in enumerate(batch.lengths):
            seq = torch.cat((prev[i], mixed[start : start + n].T.to(prev.dtype)), dim=-1)  # [C, K - 1 + n]
            outs.append(F.conv1d(seq[None].to(weight.dtype), weight, groups=weight.shape[0])[0].T)  # [n, C]
            states.append(seq[:, -width:])
            start += n
        _write_back(conv, batch, torch.stack(states))
        return F.silu(torch.cat(outs)).to(mixed.dtype)


def _write_back(store: Tensor, batch: RecurrentBatch, values: Tensor) -> None:
    """store[slot of row i] = values[i] for the rows whose state is kept."""
    rows = batch.keep_rows
    if rows is None:
        store[batch.slots] = values.to(store.dtype)
    elif rows.numel():
        store[batch.slots[rows]] = values[rows].to(store.dtype)


class GatedAttention(nn.Module):
    """Fused q(+gate)/k/v projection, q/k norm, partial RoPE, the backend's attention, output gate, o_proj."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.kv_idx = config.kv_layers.index(layer_idx)  # the layer's index in the KV pool
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        assert config.rotary_dim is not None
        self.rotary_dim = config.rotary_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * config.q_size + 2 * config.kv_size, bias=False)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: Tensor, rope: Rope, attn: AttentionBackend) -> Tensor:
        n, d = x.shape[0], self.head_dim
        qg, k, v = project(self.qkv_proj, x).split(
            [2 * self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1
        )
        q, gate = qg.view(n, self.num_heads, 2 * d).chunk(2, dim=-1)  # [N, H, D] each (per head: query, gate)
        q = self.q_norm(q)
        k = self.k_norm(k.view(n, self.num_kv_heads, d))
        v = v.reshape(n, self.num_kv_heads, d)
        r = self.rotary_dim
        qk = torch.cat((q, k), dim=1)
        qk = torch.cat((apply_rope(qk[..., :r], *rope.rows), qk[..., r:]), dim=-1)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = attn.attend(self.kv_idx, q.contiguous(), k.contiguous(), v, self.scale)
        assert isinstance(out, Tensor)
        out = out.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))
        return project(self.o_proj, out)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        assert config.linear is not None
        self.is_linear = layer_idx in config.linear.layers
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = GatedAttention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, rope: Rope, attn: AttentionBackend, batch: RecurrentBatch) -> Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, batch) if self.is_linear else self.self_attn(h, rope, attn))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5ForCausalLM(nn.Module):
    """Embedding, hybrid decoder layers, final norm; `logits` applies the (possibly tied) head."""

    recurrent = True  # forward takes the step's RecurrentBatch

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.architecture == "qwen3_5" and config.rotary_dim is not None, config.architecture
        self.config = config
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(dataclasses.replace(config, head_dim=config.rotary_dim))
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend, batch: RecurrentBatch | None = None
    ) -> Tensor:
        """input_ids, positions: [N] -> final-normed hidden states [N, hidden]; `batch`: the step's recurrent
        states (required: the linear layers have nowhere else to keep theirs)."""
        if batch is None:
            raise ValueError("qwen3_5 needs the step's RecurrentBatch (the linear layers' state)")
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer in cast(list[Qwen3_5DecoderLayer], list(self.layers)):
            x = layer(x, rope, attn, batch)
        return cast(Tensor, self.norm(x))

    def logits(self, hidden: Tensor) -> Tensor:
        return self.head(hidden, argmax=False)[0]

    def head(self, hidden: Tensor, argmax: bool) -> tuple[Tensor, Tensor | None]:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_head(hidden, weight, argmax)


def qwen3_5_tensors(
    config: ModelConfig, get: Callable[[str], Tensor], need: Callable[..., Tensor]
) -> Iterator[tuple[str, Tensor]]:
    """Our parameter names and tensors from transformers' names (`need(get, name)` raises for a missing one)."""
    assert config.linear is not None
    yield "embed_tokens.weight", need(get, "model.embed_tokens.weight")
    yield "norm.weight", need(get, "model.norm.weight")
    if not config.tie_word_embeddings:
        yield "lm_head.weight", need(get, "lm_head.weight")
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield ours + f"{norm}.weight", need(get, hf + f"{norm}.weight")
        gate_up = [need(get, hf + f"mlp.{p}_proj.weight") for p in ("gate", "up")]
        yield ours + "mlp.gate_up_proj.weight", torch.cat(gate_up)
        yield ours + "mlp.down_proj.weight", need(get, hf + "mlp.down_proj.weight")
        if i in config.linear.layers:
            la, mine = hf + "linear_attn.", ours + "linear_attn."
            parts = [need(get, la + f"in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")]
            yield mine + "in_proj.weight", torch.cat(parts)
            yield mine + "conv_weight", need(get, la + "conv1d.weight").reshape(config.linear.conv_dim, -1)
            for name in ("dt_bias", "A_log"):
                yield mine + name, need(get, la + name)
            yield mine + "norm.weight", need(get, la + "norm.weight")
            yield mine + "out_proj.weight", need(get, la + "out_proj.weight")
        else:
            sa, mine = hf + "self_attn.", ours + "self_attn."
            yield mine + "qkv_proj.weight", torch.cat([need(get, sa + f"{p}_proj.weight") for p in "qkv"])
            yield mine + "o_proj.weight", need(get, sa + "o_proj.weight")
            for norm in ("q_norm", "k_norm"):
                yield mine + f"{norm}.weight", need(get, sa + f"{norm}.weight")


def qwen3_5_from_gguf(config: ModelConfig, hf_name: str, array: np.ndarray) -> np.ndarray:
    """A `qwen35` GGUF tensor (float32, torch's dim order) as transformers names and holds it: llama.cpp's
    converter (convert_hf_to_gguf: Qwen3NextModel, _LinearAttentionVReorderBase) stores zero-centred norm
    weights as 1 + w (not the linear layers' gated norm), A_log as -exp(A_log), the conv weight squeezed, and,
    when there are more value heads than key heads, the value heads of every linear-layer tensor in tiled
    order (v0 of each key head, then v1 of each, ...) instead of grouped by key head."""
    shape = config.linear
    assert shape is not None
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        array = array - np.float32(1.0)
    if ".linear_attn." not in hf_name:
        return array
    if hf_name.endswith(".A_log"):
        array = np.log(-array)
    k, per_k = shape.num_k_heads, shape.num_v_heads // shape.num_k_heads
    if per_k > 1:
        v_rows = 2 * shape.key_dim  # q and k come first in in_proj_qkv and the conv's channels
        if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            array = np.concatenate([array[:v_rows], _grouped(array[v_rows:], 0, k, per_k, shape.v_head_dim)])
        elif hf_name.endswith("in_proj_z.weight"):
            array = _grouped(array, 0, k, per_k, shape.v_head_dim)
        elif hf_name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
            array = _grouped(array, 0, k, per_k, 1)
        elif hf_name.endswith("out_proj.weight"):
            array = _grouped(array, 1, k, per_k, shape.v_head_dim)
    if hf_name.endswith("conv1d.weight"):
        array = array.reshape(array.shape[0], 1, -1)  # transformers' Conv1d weight [C, 1, K]
    return np.ascontiguousarray(array)


def _grouped(array: np.ndarray, axis: int, num_k: int, per_k: int, head_dim: int) -> np.ndarray:
    """Value heads along `axis` from tiled order [per_k, num_k, head_dim] to grouped [num_k, per_k, head_dim]."""
    shape = array.shape
    split = (*shape[:axis], per_k, num_k, head_dim, *shape[axis + 1 :])
    return np.swapaxes(array.reshape(split), axis, axis + 1).reshape(shape)
