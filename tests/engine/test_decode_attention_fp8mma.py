"""Flash-decoding over fp8 rows on fp8 tensor cores (kernels/attention/decode_attention_fp8mma.py, KVMEM_FP8_DOT=mma):
against the reference over the dequantised rows, its two-term e4m3 operands, its kept queries and partials.

On the CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py; its fp8 products in fp32, exact); on CUDA
(`-m gpu`) compiled, where its dots are wgmma e4m3 instructions.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch

from tests.engine.decode_attention_cases import inputs
from tests.engine.helpers import device_or_skip
from tests.engine.test_decode_attention_fp8 import _fp8_stores

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from services.engine.kernels.attention import decode_attention_fp8mma as mma

    @triton.jit
    def _two_terms_kernel(x_ptr, hi_ptr, lo_ptr, N: tl.constexpr, INTERPRETED: tl.constexpr):  # type: ignore[no-untyped-def]
        i = tl.arange(0, N)
        hi, lo = mma._two_terms(tl.load(x_ptr + i), INTERPRETED)
        tl.store(hi_ptr + i, hi.to(tl.float32))
        tl.store(lo_ptr + i, lo.to(tl.float32))


@pytest.fixture(autouse=True)
def mma_mode(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from services.engine.kernels.attention import decode_attention_triton as dat

    monkeypatch.setenv("KVMEM_FP8_DOT", "mma")
    dat.fp8_dot.cache_clear()
    yield
    dat.fp8_dot.cache_clear()


def _mma_tolerance(v: torch.Tensor) -> float:
    """The two-term operands' error against the fp32 reference: q and the weights each carry ~8 significant bits
    (e4m3's 4, then its rounding error's 4), so scores move by ~2^-9 of |q||k| and each weight by ~2^-9 of itself;
    the output, a weighted mean of the value rows, by a few 2^-9 of max |v|. 2^-7 * max |v| bounds that with room
    for a peaked softmax (the cases' |q| ~ 2 sqrt(D)); a masked row or a wrong split is off by O(max |v|)."""
    return 2.0**-7 * float(v.abs().max())


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    ("batch", "heads", "head_dim", "width", "dtype"),
    [
        (2, (4, 1), 64, 256, torch.float32),
        (1, (8, 2), 64, 1024, torch.bfloat16),
        (2, (4, 1), 64, 1216, torch.float32),  # the last 128-row step half masked
        (3, (32, 8), 128, 2112, torch.bfloat16),  # the 8B shape's heads, several splits
        (2, (16, 8), 128, 640, torch.float32),  # G = 2 (Gemma 3 12B): 6 of the 8 heads of a tile padding
    ],
)
def test_mma_rows_match_the_reference_over_their_dequantised_rows(
    where: str, batch: int, heads: tuple[int, int], head_dim: int, width: int, dtype: torch.dtype
) -> None:
    """Scattered rows in shuffled order, gaps, padding and future keys (decode_attention_cases.inputs): the
    reference's attention over the dequantised rows, within the two-term operands' rounding."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    device = device_or_skip(where)
    x = inputs(batch, heads, head_dim, width, dtype, device, seed=width + head_dim)
    k8, v8, deq = _fp8_stores(x)
    want = dat.decode_attention_reference(*deq).float()
    got = dat.decode_attention(x.q, k8, v8, x.rows, x.key_pos, x.q_pos, x.scale, fp8=True)
    assert got.dtype == dtype and got.isfinite().all()
    tol = _mma_tolerance(deq.v_store) + (2e-2 if dtype == torch.bfloat16 else 0.0)  # + the output's rounding
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("partial", [False, True])
def test_mma_keeps_the_queries_and_gives_the_same_partials(where: str, partial: bool) -> None:
    """keep_q / keep_pos as the fp16 kernel keeps them (q copied exactly where keep_pos < 0 or equals q_pos), sorted
    keys (a window bucket's padding skipped), and the partials merged by the reference equal to the output."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    device = device_or_skip(where)
    x = inputs(4, (8, 2), 64, 512, torch.bfloat16, device, seed=12)
    order = torch.argsort(x.key_pos, dim=1)  # sorted_keys: positions never decrease along a row list
    x = x._replace(rows=torch.gather(x.rows, 1, order), key_pos=torch.gather(x.key_pos, 1, order))
    k8, v8, deq = _fp8_stores(x)
    keep_pos = x.q_pos + torch.tensor([0, 0, 1, -1], device=device)
    keep_pos[0] = -1
    before = torch.randn(4, 8, 64, device=device).to(torch.bfloat16)
    kept = before.clone()
    got = dat.decode_attention(
        x.q, k8, v8, x.rows, x.key_pos, x.q_pos, x.scale, partial=partial, keep_q=kept, keep_pos=keep_pos,
        sorted_keys=True, fp8=True,
    )  # fmt: skip
    keep = (keep_pos < 0) | (x.q_pos == keep_pos)
    assert torch.equal(kept, torch.where(keep[:, None, None], x.q, before))
    if partial:
        assert isinstance(got, dat.Partials) and got.num_splits > 1
        got = dat.merge_reference(got)
    want = dat.decode_attention_reference(*deq).float()
    torch.testing.assert_close(got.float(), want, rtol=0, atol=_mma_tolerance(deq.v_store) + 2e-2)


def test_fp8_dot_takes_mma() -> None:
    """KVMEM_FP8_DOT takes mma beside fp16 and bf16, and nothing else."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    assert dat.fp8_dot() == "mma"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVMEM_FP8_DOT", "fp8")
        dat.fp8_dot.cache_clear()
        with pytest.raises(ValueError, match="fp16, bf16 or mma"):
            dat.fp8_dot()
    dat.fp8_dot.cache_clear()


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_terms_round_to_e4m3_as_torch_does(where: str) -> None:
    """The kernel's e4m3 rounding (interpreted: its own arithmetic; compiled: the hardware conversion) equals
    torch's float8_e4m3fn cast on values across e4m3's range, ties and subnormals included, and the second term
    is the first's rounding error rounded."""
    device = device_or_skip(where)
    g = torch.Generator().manual_seed(3)
    grid = torch.tensor([2.0**e * (1 + m / 8) for e in range(-9, 9) for m in range(8)])[:-1]  # e4m3 values to 448
    ties = (grid[:-1] + grid[1:]) / 2  # halfway between neighbours: to even
    mags = torch.exp(torch.empty(3000).uniform_(-9 * 0.6931, 8.7 * 0.6931, generator=g))
    x = torch.cat((grid, ties, mags, torch.tensor([0.0, 447.9, 440.0, 2.0**-10, 3 * 2.0**-11])))
    x = torch.cat((x, -x))
    n = triton.next_power_of_2(x.numel())
    x = torch.cat((x, torch.zeros(n - x.numel()))).to(device)
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    _two_terms_kernel[(1,)](x, hi, lo, N=n, INTERPRETED=mma.INTERPRETED)
    want_hi = x.to(torch.float8_e4m3fn).float()
    assert torch.equal(hi, want_hi)
    assert torch.equal(lo, (x - want_hi).to(torch.float8_e4m3fn).float())
