"""attention.sdpa: the engine's masked SDPA (prefill through StepAttention and ContiguousKV, the torch-tier
decode). On CUDA it must not take cuDNN, which builds an execution plan per new shape (bench/RESULTS.md):
checked from the kernels a profiled call launches. Every case compares against attention in fp32."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from services.engine.kv.attention import grouped_sdpa, position_mask, sdpa
from tests.engine.helpers import device_or_skip


def _case(num_new: int, num_keys: int, window: int | None, dtype: torch.dtype, device: torch.device, seed: int):  # type: ignore[no-untyped-def]
    """A prefill chunk's shapes: q [N, 4, 256] over keys [1, T, 256], the chunk the last N positions, with the
    causal (and window) additive mask grouped_sdpa takes ([4 * N, T])."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_new, 4, 256, generator=gen).to(device, dtype)
    k = torch.randn(1, num_keys, 256, generator=gen).to(device, dtype)
    v = torch.randn(1, num_keys, 256, generator=gen).to(device, dtype)
    q_pos = torch.arange(num_keys - num_new, num_keys, device=device)
    allowed = position_mask(q_pos, torch.arange(num_keys, device=device), window).repeat(4, 1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return q, k, v, allowed, mask


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention in fp32: q [N, 4, D] (one KV head), allowed [4 * N, T] in grouped_sdpa's row order."""
    num_new = q.shape[0]
    rows = q.float().permute(1, 0, 2).reshape(4 * num_new, -1)  # row g * N + i: head g, token i
    scores = (rows @ k[0].float().T) / 16.0
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v[0].float()
    return out.view(4, num_new, -1).permute(1, 0, 2)


@pytest.mark.parametrize(
    ("where", "dtype"),
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize(("num_new", "num_keys", "window"), [(96, 160, None), (130, 1000, 512), (1024, 1536, 512)])
def test_grouped_sdpa_matches_fp32_attention(
    where: str, dtype: torch.dtype, num_new: int, num_keys: int, window: int | None
) -> None:
    q, k, v, allowed, mask = _case(num_new, num_keys, window, dtype, device_or_skip(where), seed=num_keys)
    out = grouped_sdpa(q, k, v, mask, 1 / 16)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), _reference(q, k, v, allowed), atol=tol, rtol=tol)


@pytest.mark.gpu
def test_no_cudnn_kernel_and_the_switch_restored() -> None:
    device = device_or_skip("cuda")
    torch.backends.cuda.enable_cudnn_sdp(True)  # torch's default: the engine's call must still avoid it
    q, k, v, allowed, mask = _case(1024, 2112, None, torch.bfloat16, device, seed=3)
    grouped_sdpa(q, k, v, mask, 1 / 16)  # one-time loads outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = grouped_sdpa(q, k, v, mask, 1 / 16)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names and not [n for n in names if "cudnn" in n.lower()], names
    assert torch.backends.cuda.cudnn_sdp_enabled()  # switched back on after the call
    torch.testing.assert_close(out.float(), _reference(q, k, v, allowed), atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError):  # a failing call switches it back on too
        sdpa(q[None, None, :, 0], k[None], v[None], mask, 1 / 16)
    assert torch.backends.cuda.cudnn_sdp_enabled()
