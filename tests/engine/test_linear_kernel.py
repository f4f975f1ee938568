"""The decode-sized projection kernel (kernels/linear_triton.py) against F.linear, its torch reference.

On the CPU it runs under TRITON_INTERPRET=1 (tests/conftest.py); on CUDA (`-m gpu`) compiled.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.engine.helpers import device_or_skip

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _params() -> list[object]:
    out = [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.bfloat16, id="cpu-bf16")]
    for dtype in (torch.float32, torch.bfloat16):
        out.append(pytest.param("cuda", dtype, marks=pytest.mark.gpu, id=f"cuda-{dtype}"))
    return out


@pytest.mark.parametrize(("where", "dtype"), _params())
@pytest.mark.parametrize(("m", "n", "k", "bias"), [(1, 96, 80, False), (3, 40, 72, True), (16, 160, 512, False)])
def test_matches_f_linear(where: str, dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    """Odd N and K (masked tails), several rows, a bias; x with a row stride wider than K."""
    from services.engine.kernels.linear_triton import linear, linear_reference

    device = device_or_skip(where)
    g = torch.Generator().manual_seed(m * 1000 + n)
    wide = torch.randn(m, k + 8, generator=g).to(device=device, dtype=dtype)
    x = wide[:, :k]  # row stride k + 8
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None
    got = linear(x, weight, b)
    want = linear_reference(x.float(), weight.float(), b.float() if b is not None else None)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_supported_takes_decode_batches_only() -> None:
    from services.engine.kernels.linear_triton import MAX_COLS, MAX_ROWS, config, linear, supported

    w = torch.zeros(64, 32)
    assert supported(torch.zeros(MAX_ROWS, 32), w)
    assert not supported(torch.zeros(MAX_ROWS + 1, 32), w)  # a prefill chunk: cuBLAS
    assert not supported(torch.zeros(1, 32, dtype=torch.bfloat16), w)  # mixed dtypes
    assert not supported(torch.zeros(1, 64)[:, ::2], w)  # K not unit-stride
    assert not supported(torch.zeros(1, 32), torch.zeros(MAX_COLS + 1, 32))  # a vocabulary head
    assert not supported(torch.zeros(0, 32), w)
    with pytest.raises(ValueError, match="linear kernel"):
        linear(torch.zeros(MAX_ROWS + 1, 32), w)
    # enough programs for a skinny product: 640 outputs in blocks of 16, 4,096 in blocks of 32
    assert config(640, 2048)[0] == 16 and config(4096, 640)[0] == 32 and config(16384, 640)[0] == 64
