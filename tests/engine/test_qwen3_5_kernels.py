"""fla-core's gated delta rule (CUDA) against the torch reference (kernels/layer/gated_delta.py): varlen prefill with
initial states (chunk_gated_delta_rule) and one-token steps (fused_recurrent_gated_delta_rule), at the
Qwen3.5-9B linear layers' head shape (16 key heads, 32 value heads, 128 dims)."""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels import select_tier, use_tier
from services.engine.kernels.layer.gated_delta import fla_gated_delta_rule, reference_gated_delta_rule

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


def test_decode_graphs_replay_as_the_eager_runner() -> None:
    """The decode runner with qwen3_5's steps captured in CUDA graphs (KVMEM_RECURRENT_GRAPHS=1) answers as the
    same runner run eagerly, token for token, over two requests in turn (the second reuses the captured graphs
    and its state slot); the graphs were replayed, not only captured."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla")
    from bench.qwen3_5_h200 import build, our_engine, speed_prompt, time_ours

    dev = torch.device("cuda")
    use_tier(select_tier(dev))
    _, ours = build("tiny", dev)
    vocab, ctx, decode = ours.config.vocab_size, 640, 24
    answers: dict[str, list[list[int]]] = {}
    for kind in ("graphs", "runner"):
        engine = our_engine(ours, ctx, decode, dev, kind)
        try:
            answers[kind] = [
                time_ours(engine, speed_prompt(vocab, ctx, decode, trial), decode, dev, f"{kind}{trial}")["tokens"]
                for trial in range(2)
            ]
            runner = engine.runner.decode
            assert runner is not None
            if kind == "graphs":
                assert runner.num_captures >= 1 and runner.num_replays >= 2 * decode - 4, vars(runner)
            else:
                assert runner.num_captures == 0 and runner.num_eager > 0
        finally:
            engine.stop()
    assert answers["graphs"] == answers["runner"]
