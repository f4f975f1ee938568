"""Flash-decoding attention over fp8 pool rows (uint8: fp32 scale + e4m3fn codes, read in place) against the
reference over their dequantised rows, in both dot modes (fp16 operands, the default, and bf16).

On the CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); on CUDA (`-m gpu`) compiled.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch

from tests.engine.decode_attention_cases import Inputs, inputs
from tests.engine.helpers import device_or_skip

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _fp8_stores(x: Inputs) -> tuple[torch.Tensor, torch.Tensor, Inputs]:
    """The inputs' K/V rows quantised to fp8 rows (kv_formats.py), and the inputs with their dequantised rows
    (what the gather path attends)."""
    from services.engine.kv.kv_formats import parse_format

    fmt = parse_format("fp8")
    k8, v8 = fmt.quantize(x.k_store), fmt.quantize(x.v_store)
    deq = x._replace(k_store=fmt.dequantize(k8, x.q.dtype), v_store=fmt.dequantize(v8, x.q.dtype))
    return k8, v8, deq


@pytest.fixture(params=["fp16", "bf16"])
def fp8_dot(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each operand mode of the fp8 rows' dots (KVMEM_FP8_DOT, read once per process by dat.fp8_dot)."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    monkeypatch.setenv("KVMEM_FP8_DOT", request.param)
    dat.fp8_dot.cache_clear()
    yield request.param
    dat.fp8_dot.cache_clear()


FP16_UNIT = 2.0**-11  # fp16's unit roundoff


def _fp16_weight_tolerance(v: torch.Tensor) -> float:
    """The fp16 path's error against the fp32 reference when q is exact in fp16: each weight exp2(s - m) *
    v_scale (<= 1.07) is rounded to fp16 once, off by at most FP16_UNIT of itself (normal) or 2^-25 (subnormal),
    so the output, a weighted mean of the rows, moves by at most FP16_UNIT * max |v| plus W * 2^-25 * max |v|
    (the sums l are >= 2^-log2(v_scale)); 2^-10 * max |v| covers both up to W = 16K."""
    return 2.0**-10 * float(v.abs().max())


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    ("batch", "heads", "width", "dtype"),
    [(2, (4, 1), 256, torch.float32), (1, (8, 2), 1024, torch.bfloat16), (2, (4, 1), 1216, torch.float32)],
)  # 1216 rows: past SHORT_WIDTH, the 128-row steps (FP8_BLOCK_ROWS), the last one half masked
@pytest.mark.parametrize("block_rows", ["64", "128"])  # KVMEM_FP8_BLOCK_ROWS: the loop steps past SHORT_WIDTH
def test_fp8_rows_match_the_reference_over_their_dequantised_rows(
    where: str,
    batch: int,
    heads: tuple[int, int],
    width: int,
    dtype: torch.dtype,
    fp8_dot: str,
    block_rows: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An fp8 pool layer (uint8 rows: fp32 scale + e4m3fn codes) read in place, the scales applied to the scores
    and the probabilities: the reference's output over the dequantised rows, split and merged or direct. bf16
    dots: exact on the CPU (fp32 dots there). fp16 dots: q and the weights rounded to fp16 as on the GPU; with q
    exact in fp16, within the weights' rounding (_fp16_weight_tolerance)."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    x = inputs(batch, heads, 64, width, dtype, device_or_skip(where), seed=width)
    if fp8_dot == "fp16":
        x = x._replace(q=x.q.half().to(dtype))
    k8, v8, deq = _fp8_stores(x)
    assert dat.supported(k8, fp8=True) and not dat.supported(k8)
    want = dat.decode_attention_reference(*deq)
    monkeypatch.setenv("KVMEM_FP8_BLOCK_ROWS", block_rows)
    dat.fp8_block_rows.cache_clear()
    try:
        assert dat.block_rows(width, fp8=True) == (int(block_rows) if width > dat.SHORT_WIDTH else 32)
        got = dat.decode_attention(x.q, k8, v8, x.rows, x.key_pos, x.q_pos, x.scale, fp8=True)
    finally:
        dat.fp8_block_rows.cache_clear()
    assert got.dtype == dtype
    if dtype != torch.float32 or where != "cpu":
        tol = 2e-2  # a bf16 output, or tensor-core dots with bf16 probabilities
    else:
        tol = 2e-5 if fp8_dot == "bf16" else _fp16_weight_tolerance(deq.v_store)
    torch.testing.assert_close(got.float(), want.float(), rtol=0 if fp8_dot == "fp16" else tol, atol=tol)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("values", ["spread", "tiny"])
def test_fp8_fp16_dots_over_rows_far_from_one(where: str, values: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp16 dots where fp16's range matters: rows whose largest |value| (a code of 448) spans 1e-7..1e4 from
    row to row, with zero rows, and queries of |q| up to ~100 ("spread": peaked softmaxes whose weights mix
    scales eleven orders apart), and a long sequence of value rows at 1e-6..1e-5 ("tiny": p * v_scale alone
    would sit in fp16's subnormals, 4e-11 for a weight of 1/1024: the running max of s + log2 v_scale keeps the
    weights near 1). Within the fp16 rounding of the weights of the fp32 reference, per sequence."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    monkeypatch.setenv("KVMEM_FP8_DOT", "fp16")
    dat.fp8_dot.cache_clear()
    device = device_or_skip(where)
    g = torch.Generator().manual_seed(5)
    batch, (hq, hkv), d, width = 2, (8, 2), 64, 512 if values == "spread" else 2048
    num_rows = batch * width + 64

    def rows_at(low: float, high: float) -> torch.Tensor:  # each row's magnitude log-uniform in [low, high]
        mag = torch.exp(
            torch.empty(num_rows, hkv, 1).uniform_(
                float(torch.log(torch.tensor(low))), float(torch.log(torch.tensor(high))), generator=g
            )
        )
        return torch.randn(num_rows, hkv, d, generator=g) * mag  # fmt: skip

    if values == "spread":
        k_store, v_store = rows_at(1e-7, 1e4), rows_at(1e-7, 1e4)
        k_store[::37] = 0.0
        v_store[::41] = 0.0
        q = torch.randn(batch, hq, d, generator=g) * torch.tensor([0.1, 30.0])[:, None, None]
    else:
        k_store, v_store = rows_at(0.5, 2.0), rows_at(1e-6, 1e-5)
        q = torch.randn(batch, hq, d, generator=g) * 0.1  # a flat softmax: ~1/W a weight
    rows = torch.stack([torch.randperm(num_rows - 1, generator=g)[:width] + 1 for _ in range(batch)])
    key_pos = torch.arange(width).expand(batch, -1).contiguous()
    q_pos = torch.tensor([width - 1, width // 3])
    x = Inputs(q.half().float().to(device), k_store.to(device), v_store.to(device), rows.to(device), key_pos.to(device),
               q_pos.to(device), d**-0.5)  # fmt: skip
    k8, v8, deq = _fp8_stores(x)
    want = dat.decode_attention_reference(*deq)
    got = dat.decode_attention(x.q, k8, v8, x.rows, x.key_pos, x.q_pos, x.scale, fp8=True)
    assert got.isfinite().all()
    slack = 4.0 if device.type == "cuda" else 1.0  # tensor-core sums in another order, exp2 approximate
    if values == "tiny":  # each output element within 2^-10 of the reference's weighted mean of |v|: the bound itself
        bound = dat.decode_attention_reference(*deq._replace(v_store=deq.v_store.abs()))
        assert ((got - want).abs() <= slack * 2.0**-10 * bound).all(), ((got - want).abs() / bound).max()
    for b in range(batch):
        tol = slack * _fp16_weight_tolerance(deq.v_store[x.rows[b]])
        torch.testing.assert_close(got[b], want[b], rtol=0, atol=tol)
    dat.fp8_dot.cache_clear()


def test_fp8_rows_off_sixteen_byte_alignment_keep_the_gather_path() -> None:
    """The fp8 kernels load the codes 16 bytes at a time (attention_tiles.load_kv tells the compiler every row
    starts on 16 bytes): a layer whose rows do not (a base off by 4, or a row of 4 + D bytes) is not theirs, in
    either kernel."""
    from services.engine.kernels.attention import decode_attention_triton as dat
    from services.engine.kernels.attention import prefill_attention_triton as pat

    rows, heads, width = 64, 2, 16 + 32
    aligned = torch.zeros(rows, heads, width, dtype=torch.uint8)
    assert aligned.data_ptr() % 16 == 0  # torch's allocations are 64-byte aligned
    off = torch.zeros(rows * heads * width + 16, dtype=torch.uint8)
    start = (-off.data_ptr()) % 16 + 4  # 4 bytes past a 16-byte boundary: still 4-aligned
    off = off[start : start + rows * heads * width].view(rows, heads, width)
    q = torch.zeros(16, 4, 32, dtype=torch.bfloat16)
    assert dat.supported(aligned, fp8=True) and pat.supported(q, aligned, fp8=True)
    assert not dat.supported(off, fp8=True) and not pat.supported(q, off, fp8=True)
