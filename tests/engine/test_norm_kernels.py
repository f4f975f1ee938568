"""Fused RMSNorm and q/k-norm + RoPE Triton kernels against their torch references (the models' modules).

On the CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); on CUDA (`-m gpu`) compiled.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from services.engine import kernels
from services.engine.kv.attention import ContiguousKV
from services.engine.models.config import ModelConfig
from services.engine.models.gemma3 import GemmaRMSNorm
from services.engine.models.llama import RMSNorm, RotaryEmbedding, apply_rope
from tests.engine.helpers import device_or_skip, tiny_gemma, tiny_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _params(where: str) -> list[object]:
    marks = [pytest.mark.gpu] if where == "cuda" else []
    return [pytest.param(where, dtype, marks=marks, id=f"{where}-{dtype}") for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("where", "dtype"), _params("cpu") + _params("cuda"))
@pytest.mark.parametrize("gemma", [True, False])
def test_rms_norm_matches_the_module(where: str, dtype: torch.dtype, gemma: bool) -> None:
    from services.engine.kernels.layer import norm_triton

    device = device_or_skip(where)
    torch.manual_seed(0)
    dim = 48  # not a power of two: the block is masked
    module = (GemmaRMSNorm(dim, 1e-6) if gemma else RMSNorm(dim, 1e-6)).to(device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.normal_(0.0, 0.5)
    base = (torch.randn(5, 7, dim, device=device) * 3).to(dtype)
    strided = base[:, 1:4]  # [5, 3, D] rows not contiguous with each other
    for x in (base[:, 0].contiguous(), strided):
        with torch.no_grad():
            want = module(x)
        got = norm_triton.rms_norm(x, module.weight, 1e-6, gemma=gemma)
        assert got.shape == x.shape and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: two rounding steps (the interpreter truncates)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("where", "dtype"), _params("cpu") + _params("cuda"))
def test_embed_rms_norm_matches_lookup_scale_then_norm(where: str, dtype: torch.dtype) -> None:
    """Gemma's scaled embedding and its first input norm in one launch: ids in any order and repeated."""
    from services.engine.kernels.layer import norm_triton
    from services.engine.models.gemma3 import embed_scale

    device = device_or_skip(where)
    torch.manual_seed(3)
    dim = 48  # not a power of two: the block is masked
    table = torch.randn(20, dim, device=device).to(dtype)
    norm = GemmaRMSNorm(dim, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    ids = torch.tensor([7, 0, 19, 7, 3], device=device)
    scale = embed_scale(dim, dtype)
    x, h = norm_triton.embed_rms_norm(ids, table, scale, norm.weight, 1e-6, gemma=True)
    x_want = torch.nn.functional.embedding(ids, table) * scale
    with torch.no_grad():
        h_want = norm(x_want)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if dtype == torch.float32 or device.type == "cuda":  # rounded as torch rounds (the interpreter truncates bf16)
        assert torch.equal(x, x_want)
    torch.testing.assert_close(x.float(), x_want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(h.float(), h_want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("where", "dtype"), _params("cpu") + _params("cuda"))
@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("heads_per_program", [1, 8])
def test_qk_norm_rope_matches_norms_then_rope(
    where: str, dtype: torch.dtype, gemma: bool, heads_per_program: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode launches take one head a program, prompt chunks ROPE_HEADS (here also for 6 tokens: 6 heads in one
    program of 8, two rows masked)."""
    from services.engine.kernels.layer import norm_triton

    if heads_per_program > 1:
        monkeypatch.setattr(norm_triton, "ROPE_HEADS_FROM", 1)

    device = device_or_skip(where)
    torch.manual_seed(1)
    hq, hkv, dim, n = 4, 2, 32, 6
    norm = GemmaRMSNorm if gemma else RMSNorm
    q_norm, k_norm = norm(dim, 1e-6).to(device, dtype), norm(dim, 1e-6).to(device, dtype)
    with torch.no_grad():
        q_norm.weight.normal_(0.0, 0.5)
        k_norm.weight.normal_(0.0, 0.5)
    cfg = ModelConfig(
        architecture="llama", vocab_size=10, hidden_size=hq * dim, intermediate_size=8, num_layers=1,
        num_heads=hq, num_kv_heads=hkv, head_dim=dim, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, tie_word_embeddings=True, attention_bias=False, qk_norm=True,
        max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    rope = RotaryEmbedding(cfg)(torch.tensor([0, 3, 17, 100, 200, 511], device=device), dtype)
    cos, sin = rope.rows
    qkv = (torch.randn(n, hq + 2 * hkv, dim, device=device) * 2).to(dtype)
    q, k, _ = qkv.split([hq, hkv, hkv], dim=1)
    with torch.no_grad():
        want = apply_rope(torch.cat((q_norm(q), k_norm(k)), dim=1), cos, sin)
    got = norm_triton.qk_norm_rope(qkv, q_norm.weight, k_norm.weight, cos, sin, 1e-6, hq, hkv, gemma=gemma)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # the whole tables read at the positions in the launch: the rows the gather gives
    tabled = norm_triton.qk_norm_rope(
        qkv, q_norm.weight, k_norm.weight, rope.cos, rope.sin, 1e-6, hq, hkv, gemma=gemma, positions=rope.positions
    )
    assert torch.equal(tabled, got)
    if dtype == torch.bfloat16 and device.type == "cuda":  # compiled: no further from the float32 result
        with torch.no_grad():  # than torch's bf16 ops (the interpreter truncates instead of rounding)
            q32, k32 = copy.deepcopy(q_norm).float(), copy.deepcopy(k_norm).float()
            exact = apply_rope(torch.cat((q32(q.float()), k32(k.float())), dim=1), cos.float(), sin.float())
        assert (got.float() - exact).abs().mean() <= (want.float() - exact).abs().mean() * 1.05
    # with a sink: the same output, and k and v written at the rows (write_kv_reference with them)
    from services.engine.kernels.pages.kv_triton import write_kv_reference

    k_store = torch.randn(16, hkv, dim, device=device).to(dtype)
    v_store = torch.randn(16, hkv, dim, device=device).to(dtype)
    k_want, v_want = k_store.clone(), v_store.clone()
    rows = torch.tensor([9, 0, 15, 4, 3, 11], device=device)
    sunk = norm_triton.qk_norm_rope(
        qkv, q_norm.weight, k_norm.weight, cos, sin, 1e-6, hq, hkv, gemma=gemma, kv_sink=(k_store, v_store, rows)
    )
    assert torch.equal(sunk, got)
    write_kv_reference(k_want, v_want, rows, got[:, hq:], qkv[:, hq + hkv :])
    assert torch.equal(k_store, k_want) and torch.equal(v_store, v_want)


@pytest.mark.parametrize(("where", "dtype"), _params("cpu") + _params("cuda"))
@pytest.mark.parametrize("heads_per_program", [1, 8])
def test_rope_alone_matches_apply_rope(
    where: str, dtype: torch.dtype, heads_per_program: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No q/k norm weights (a Llama without q/k norm): RoPE alone, rounded as apply_rope rounds (bit for bit in
    the interpreter's float32; within one rounding on CUDA, where the kernel's products fuse into FMAs), from
    gathered rows or the whole tables, and K/V written to a sink; one head a program (decode) and ROPE_HEADS
    (prompt chunks)."""
    from services.engine.kernels.layer import norm_triton

    if heads_per_program > 1:
        monkeypatch.setattr(norm_triton, "ROPE_HEADS_FROM", 1)
    from services.engine.kernels.pages.kv_triton import write_kv_reference

    device = device_or_skip(where)
    torch.manual_seed(4)
    hq, hkv, dim, n = 4, 2, 32, 5
    cfg = ModelConfig(
        architecture="llama", vocab_size=10, hidden_size=hq * dim, intermediate_size=8, num_layers=1,
        num_heads=hq, num_kv_heads=hkv, head_dim=dim, rms_norm_eps=1e-6, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        tie_word_embeddings=True, attention_bias=False, qk_norm=False, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    rope = RotaryEmbedding(cfg)(torch.tensor([0, 9, 64, 300, 511], device=device), dtype)
    cos, sin = rope.rows
    qkv = (torch.randn(n, hq + 2 * hkv, dim, device=device) * 2).to(dtype)
    want = apply_rope(qkv[:, : hq + hkv], cos, sin)
    got = norm_triton.qk_norm_rope(qkv, None, None, cos, sin, 0.0, hq, hkv, gemma=False)
    if device.type == "cuda":  # FMA contraction in the kernel, separate roundings in apply_rope: one ulp apart
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps * float(want.abs().max()))
    elif dtype == torch.float32:  # the interpreter truncates bf16 instead of rounding; float32 is exact there
        assert torch.equal(got, want)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    tabled = norm_triton.qk_norm_rope(
        qkv, None, None, rope.cos, rope.sin, 0.0, hq, hkv, gemma=False, positions=rope.positions
    )
    assert torch.equal(tabled, got)
    k_store, v_store = (
        torch.randn(8, hkv, dim, device=device).to(dtype),
        torch.randn(8, hkv, dim, device=device).to(dtype),
    )
    k_want, v_want = k_store.clone(), v_store.clone()
    rows = torch.tensor([6, 0, 7, 2, 3], device=device)
    sunk = norm_triton.qk_norm_rope(
        qkv, None, None, cos, sin, 0.0, hq, hkv, gemma=False, kv_sink=(k_store, v_store, rows)
    )
    assert torch.equal(sunk, got)
    write_kv_reference(k_want, v_want, rows, got[:, hq:], qkv[:, hq + hkv :])
    assert torch.equal(k_store, k_want) and torch.equal(v_store, v_want)
    with pytest.raises(AssertionError, match="both"):
        norm_triton.qk_norm_rope(
            qkv, torch.ones(dim, device=device, dtype=dtype), None, cos, sin, 1e-6, hq, hkv, gemma=False
        )


def test_tiny_gemma_forward_with_fused_kernels_matches_torch(
    triton_tier: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.engine.kernels.layer import norm_triton

    calls: dict[str, int] = {}
    for name in ("embed_rms_norm", "add_rms_norm", "qk_norm_rope", "gelu_tanh_mul"):  # the fused path must really run
        real = getattr(norm_triton, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(norm_triton, name, counted)
    from services.engine.kernels.layer import linear_triton

    for name in ("linear", "linear_gated"):
        real = getattr(linear_triton, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(linear_triton, name, counted)
    model = tiny_gemma(64)
    ids = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(70)
    with torch.no_grad():
        fused = model.logits(model(ids[:12], pos[:12], ContiguousKV(6)))
        # the embedding lookup, its scale and the first input norm; per layer two post-norms, each with its
        # residual add and the next norm (the pre-feedforward norm, the next layer's input norm or the final
        # norm); q/k with RoPE (the tables read in the launch); three projections and the gated one (GELU and
        # product in its epilogue) for a decode-sized input
        assert calls == {"embed_rms_norm": 1, "add_rms_norm": 6 * 2, "qk_norm_rope": 6, "linear_gated": 6, "linear": 18}
        calls.clear()
        longer = model.logits(model(ids, pos, ContiguousKV(6)))  # 70 rows (over 64): torch projections, GELU kernel
        assert calls == {"embed_rms_norm": 1, "add_rms_norm": 6 * 2, "qk_norm_rope": 6, "gelu_tanh_mul": 6}
        kernels.use_tier(kernels.select_tier(torch.device("cpu"), "torch"))
        plain = model.logits(model(ids[:12], pos[:12], ContiguousKV(6)))
        plain_longer = model.logits(model(ids, pos, ContiguousKV(6)))
    torch.testing.assert_close(longer, plain_longer, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert not torch.equal(fused, torch.zeros_like(fused))


@pytest.mark.parametrize(("where", "dtype"), _params("cpu") + _params("cuda"))
def test_rms_norm_with_residual_matches_add_after_norm(where: str, dtype: torch.dtype) -> None:
    from services.engine.kernels.layer import norm_triton

    device = device_or_skip(where)
    torch.manual_seed(2)
    module = GemmaRMSNorm(40, 1e-6).to(device, dtype)
    with torch.no_grad():
        module.weight.normal_(0.0, 0.5)
    x = (torch.randn(6, 40, device=device) * 3).to(dtype)
    residual = (torch.randn(6, 40, device=device) * 3).to(dtype)
    want = residual + module.reference(x)
    got = norm_triton.rms_norm(x, module.weight, 1e-6, gemma=True, residual=residual)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("where", "dtype"), _params("cpu") + _params("cuda"))
@pytest.mark.parametrize("gemma", [True, False])
def test_add_rms_norm_matches_add_then_the_next_norm(where: str, dtype: torch.dtype, gemma: bool) -> None:
    from services.engine.kernels.layer import norm_triton

    device = device_or_skip(where)
    torch.manual_seed(3)
    cls = GemmaRMSNorm if gemma else RMSNorm
    first, second = cls(40, 1e-6).to(device, dtype), cls(40, 1e-6).to(device, dtype)
    with torch.no_grad():
        first.weight.normal_(0.0, 0.5)
        second.weight.normal_(1.0, 0.5)
    x = (torch.randn(6, 48, device=device) * 3).to(dtype)[:, :40]  # rows wider than D
    residual = (torch.randn(6, 40, device=device) * 3).to(dtype)
    with torch.no_grad():  # the torch modules (the tier is torch outside the triton_tier fixture)
        want_sum = residual + first(x)
        want_next = second(want_sum)
    got_sum, got_next = norm_triton.add_rms_norm(x, first.weight, residual, second.weight, 1e-6, gemma=gemma)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(got_sum.float(), want_sum.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_next.float(), want_next.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("where", "dtype"), _params("cpu") + _params("cuda"))
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_act_mul_matches_the_activation_then_multiply(where: str, dtype: torch.dtype, act: str) -> None:
    import torch.nn.functional as F

    from services.engine.kernels.layer import norm_triton

    device = device_or_skip(where)
    torch.manual_seed(3)
    inter = 1100  # two blocks, the second partial
    gate_up = (torch.randn(3, 2 * inter, device=device) * 2).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = (F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)) * up
    got = getattr(norm_triton, f"{act}_mul")(gate_up)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_tiny_llama_without_qk_norm_rotates_in_the_fused_launch(
    triton_tier: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Llama without q/k norm on the Triton tier rotates q and k in qk_norm_rope's launch (no weights: RoPE
    alone, one launch a layer), takes silu_mul for its 70-row MLP (SwiGLU in one launch a layer; up to 64 rows
    take the gated projection kernel) and computes what the torch path computes."""
    from services.engine.kernels.layer import norm_triton

    calls: list[bool] = []
    real, real_silu = norm_triton.qk_norm_rope, norm_triton.silu_mul
    silu_rows: list[int] = []

    def counted(qkv, q_weight, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(q_weight is None)
        return real(qkv, q_weight, *args, **kwargs)

    monkeypatch.setattr(norm_triton, "qk_norm_rope", counted)
    monkeypatch.setattr(
        norm_triton, "silu_mul", lambda gate_up: silu_rows.append(gate_up.shape[0]) or real_silu(gate_up)
    )
    model = tiny_model(64)
    assert model.layers[0].self_attn.q_norm is None
    ids = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(70)
    with torch.no_grad():
        fused = model.logits(model(ids, pos, ContiguousKV(2)))
        assert calls == [True, True]  # both layers, without norm weights
        assert silu_rows == [70, 70]
        kernels.use_tier(kernels.select_tier(torch.device("cpu"), "torch"))
        plain = model.logits(model(ids, pos, ContiguousKV(2)))
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
