"""The gated delta rule of Qwen3.5's linear-attention layers, over a step's sequences (varlen, one state each).

On CUDA (Triton tier) flash-linear-attention's kernels (`fla-core`): chunk_gated_delta_rule for prefill
steps, fused_recurrent_gated_delta_rule for steps of one token per sequence. Everywhere else the torch
reference below, the same algorithm as transformers' torch_chunk_gated_delta_rule (chunks of 64, prefill)
and torch_recurrent_gated_delta_rule (one token), so that CPU logits match transformers closely. Both take
q, k [N, Hk, Dk], v [N, Hv, Dv] (the step's tokens, sequences one after another), g and beta [N, Hv],
initial states [B, Hv, Dk, Dv] float32, and return (out [N, Hv, Dv] in v's dtype, final states float32).
q and k are L2-normalised inside and q scaled by Dk^-1/2; Hv is a multiple of Hk (grouped value heads).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from services.engine.kernels import active_tier

logger = logging.getLogger(__name__)

CHUNK = 64


@functools.cache
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def uses_fla(device: torch.device) -> bool:
    """fla's kernels run this step: CUDA, the Triton tier and fla-core installed."""
    if device.type != "cuda" or not fla_installed():
        return False
    return active_tier().backend == "triton"


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial: Tensor, lengths: list[int]
) -> tuple[Tensor, Tensor]:
    """The step's output and each sequence's final state (module docstring); `lengths`: tokens per sequence."""
    if uses_fla(q.device):
        return fla_gated_delta_rule(q, k, v, g, beta, initial, lengths)
    return reference_gated_delta_rule(q, k, v, g, beta, initial, lengths)


def fla_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial: Tensor, lengths: list[int]
) -> tuple[Tensor, Tensor]:
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))  # splits of the conv output: strided views
    if all(n == 1 for n in lengths):  # one token per sequence: batch them, T = 1
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        out, final = fused_recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g=g[:, None].float(), beta=beta[:, None],
            initial_state=initial.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return out[:, 0], final
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)
    out, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None].float(), beta=beta[None], initial_state=initial.contiguous(),
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.to(q.device), cu_seqlens_cpu=cu,
    )  # fmt: skip
    return out[0], final


def reference_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial: Tensor, lengths: list[int]
) -> tuple[Tensor, Tensor]:
    """Per sequence: the recurrent form for one token, the chunked form otherwise (transformers' torch code)."""
    outs, finals, start = [], [], 0
    for i, n in enumerate(lengths):
        s = slice(start, start + n)
        fn = _recurrent if n == 1 else _chunked
        o, h = fn(q[s], k[s], v[s], g[s], beta[s], initial[i])
        outs.append(o)
        finals.append(h)
        start += n
    return torch.cat(outs).to(v.dtype), torch.stack(finals)


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """[T, H, D] inputs -> float32 [Hv, T, D] (q, k repeated onto the value heads, L2-normalised, q scaled)."""
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v, beta, g = (x.transpose(0, 1).to(torch.float32).contiguous() for x in (q, k, v, beta, g))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [Hv, T, D], g/beta [Hv, T]
    h = h0.to(torch.float32).clone()  # [Hv, Dk, Dv]
    out = torch.zeros_like(v)
    for t in range(q.shape[1]):
        h = h * g[:, t].exp()[:, None, None]
        kv_mem = (h * k[:, t, :, None]).sum(dim=-2)  # [Hv, Dv]
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        h = h + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (h * q[:, t, :, None]).sum(dim=-2)
    return out.transpose(0, 1), h


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    length = q.shape[1]
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    heads = q.shape[0]
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(heads, -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(heads, -1, CHUNK).cumsum(-1)  # [Hv, C, L]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    h = h0.to(torch.float32).clone()
    out = torch.zeros_like(new_values)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ h
        out[:, i] = q[:, i] @ h + intra[:, i] @ v_new
        h = h * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, out.shape[-1])[:, :length]
    return out.transpose(0, 1), h
