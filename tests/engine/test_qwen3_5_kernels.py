"""fla-core's gated delta rule (CUDA) against the torch reference (kernels/gated_delta.py): varlen prefill with
initial states (chunk_gated_delta_rule) and one-token steps (fused_recurrent_gated_delta_rule), at the
Qwen3.5-9B linear layers' head shape (16 key heads, 32 value heads, 128 dims)."""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels import select_tier, use_tier
from services.engine.kernels.gated_delta import fla_gated_delta_rule, reference_gated_delta_rule

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("lengths", [[300, 1, 77], [1, 1, 1, 1]])
def test_fla_matches_the_reference(lengths: list[int]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla")
    dev = torch.device("cuda")
    use_tier(select_tier(dev))
    gen = torch.Generator(device=dev).manual_seed(0)
    n, hk, hv, d = sum(lengths), 16, 32, 128
    q = torch.randn(n, hk, d, device=dev, generator=gen).bfloat16()
    k = torch.randn(n, hk, d, device=dev, generator=gen).bfloat16()
    v = torch.randn(n, hv, d, device=dev, generator=gen).bfloat16()
    g = -torch.rand(n, hv, device=dev, generator=gen) * 0.5
    beta = torch.rand(n, hv, device=dev, generator=gen).bfloat16()
    h0 = torch.randn(len(lengths), hv, d, d, device=dev, generator=gen) * 0.1
    out, final = fla_gated_delta_rule(q, k, v, g, beta, h0, lengths)
    ref_out, ref_final = reference_gated_delta_rule(q, k, v, g, beta, h0, lengths)
    assert out.shape == ref_out.shape and final.shape == ref_final.shape
    scale = ref_out.float().abs().max().item()
    assert (out.float() - ref_out.float()).abs().max().item() <= 2e-2 * scale  # bf16 inputs, fp32 states
    assert (final - ref_final).abs().max().item() <= 2e-2 * ref_final.abs().max().item()
