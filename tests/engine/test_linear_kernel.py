"""The decode-sized projection kernel (kernels/layer/linear_triton.py) against F.linear, its torch reference.

On the CPU it runs under TRITON_INTERPRET=1 (tests/conftest.py); on CUDA (`-m gpu`) compiled.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.engine.helpers import device_or_skip

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _params() -> list[object]:
    out = [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.bfloat16, id="cpu-bf16")]
    for dtype in (torch.float32, torch.bfloat16):
        out.append(pytest.param("cuda", dtype, marks=pytest.mark.gpu, id=f"cuda-{dtype}"))
    return out


@pytest.mark.parametrize(("where", "dtype"), _params())
@pytest.mark.parametrize(
    ("m", "n", "k", "bias"),
    [(1, 96, 80, False), (3, 40, 72, True), (16, 160, 512, False), (17, 48, 96, False), (32, 40, 72, True),
     (64, 96, 160, False)],
)  # fmt: skip
def test_matches_f_linear(where: str, dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    """Odd N and K (masked tails), several rows (tiles of 16, 32 and 64 rows: 17 pads to 32), a bias; x with a
    row stride wider than K."""
    from services.engine.kernels.layer.linear_triton import linear, linear_reference

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
    from services.engine.kernels.layer.linear_triton import MAX_COLS, MAX_ROWS, config, linear, supported

    w = torch.zeros(64, 32)
    assert supported(torch.zeros(MAX_ROWS, 32), w)
    assert not supported(torch.zeros(MAX_ROWS + 1, 32), w)  # a prefill chunk: cuBLAS
    assert not supported(torch.zeros(1, 32, dtype=torch.bfloat16), w)  # mixed dtypes
    assert not supported(torch.zeros(1, 64)[:, ::2], w)  # K not unit-stride
    assert not supported(torch.zeros(1, 32), torch.zeros(MAX_COLS + 1, 32))  # a vocabulary head
    assert not supported(torch.zeros(0, 32), w)
    with pytest.raises(ValueError, match="linear kernel"):
        linear(torch.zeros(MAX_ROWS + 1, 32), w)
    # enough programs for a skinny product: 640 outputs in blocks of 16, 4,096 in blocks of 32; a long K over
    # few columns splits in programs of 256 (at most 8), a short K or many columns do not
    assert [config(n, k)[0] for n, k in ((640, 1024), (4096, 640), (16384, 640))] == [16, 32, 64]
    splits = [config(n, k)[4] for n, k in ((640, 2048), (640, 1024), (1536, 640), (4096, 2048), (640, 8192))]
    assert splits == [8, 1, 1, 1, 8]


def test_wider_tiles_keep_their_stages_inside_shared_memory() -> None:
    """16, 32 or 64 rows a tile; a 64-row gated bf16 tile of 64 x 128 keeps 4 of 6 stages, fp32 fewer."""
    from services.engine.kernels.layer.linear_triton import SMEM_BUDGET, block_rows, stages_for

    assert [block_rows(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert stages_for(6, 16, 64, 128, gated=True, itemsize=2) == 6  # 36 KiB a stage: the decode kernel as it was
    assert stages_for(6, 64, 64, 128, gated=True, itemsize=2) == 4
    assert stages_for(6, 64, 64, 256, gated=True, itemsize=4) == 2  # never fewer than two
    for m in (16, 32, 64):
        for n, k, gated in ((32, 128, False), (64, 128, True), (64, 256, False)):
            stages = stages_for(6, m, n, k, gated, 2)
            assert stages == 2 or stages * (m + n * (1 + gated)) * k * 2 <= SMEM_BUDGET


def test_routed_rows_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVMEM_LINEAR_ROWS caps the rows the engine's projections send to the kernel (an A/B switch against
    cuBLAS); a value outside 1..MAX_ROWS is refused by name."""
    from services.engine.kernels.layer import linear_triton as lt

    w = torch.zeros(64, 32)
    try:
        for raw, rows, want in (("", 64, True), ("16", 16, True), ("16", 17, False), ("64", 64, True)):
            monkeypatch.setenv(lt.ROWS_ENV, raw)
            lt.routed_rows.cache_clear()
            assert lt.routes(torch.zeros(rows, 32), w) is want
        monkeypatch.setenv(lt.ROWS_ENV, "65")
        lt.routed_rows.cache_clear()
        with pytest.raises(ValueError, match=lt.ROWS_ENV):
            lt.routes(torch.zeros(1, 32), w)
    finally:
        monkeypatch.delenv(lt.ROWS_ENV)
        lt.routed_rows.cache_clear()


@pytest.mark.parametrize(("where", "dtype"), _params())
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_gated_matches_projection_then_activation(where: str, dtype: torch.dtype, activation: str) -> None:
    """[gate | up] in one launch with act(gate) * up as the epilogue: odd I and K, several rows."""
    from services.engine.kernels.layer.linear_triton import linear_gated, linear_gated_reference

    device = device_or_skip(where)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 72, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(2 * 88, 72, generator=g) / 72**0.5).to(device=device, dtype=dtype)
    got = linear_gated(x, weight, activation)
    want = linear_gated_reference(x, weight, activation)
    assert got.shape == (5, 88) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="gated"):
        linear_gated(x, weight, "relu")


@pytest.mark.parametrize(("where", "dtype"), _params())
@pytest.mark.parametrize(("split_k", "k"), [(2, 512), (4, 1000), (4, 600)])
def test_split_k_sums_its_partials(where: str, dtype: torch.dtype, split_k: int, k: int) -> None:
    """K over 2 or 4 programs per column block, the last to arrive summing (kernels/layer/arrivals.py), twice in a
    row (the counters reset); K 600 in four splits of 256 is three (the split count follows K); a bias."""
    from services.engine.kernels.layer import arrivals
    from services.engine.kernels.layer.linear_triton import linear, linear_reference

    device = device_or_skip(where)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, k, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(80, k, generator=g) / k**0.5).to(device=device, dtype=dtype)
    b = torch.randn(80, generator=g).to(device=device, dtype=dtype)
    want = linear_reference(x.float(), weight.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for _ in range(2):
        got = linear(x, weight, b, cfg=(16, 128 if k < 1000 else 64, 4, 2, split_k))
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    counts = arrivals.counters(device, 5)
    assert counts is not None and not counts.any()


@pytest.mark.gpu
def test_split_k_on_two_streams_at_once_counts_its_own_arrivals() -> None:
    """Split-K launches on two streams at once (two engines in one process) each count their own partials:
    every result is the reference's (shared counters would let one launch's last arrival sum too early)."""
    from services.engine.kernels.layer.linear_triton import linear, linear_reference

    device = device_or_skip("cuda")
    g = torch.Generator(device=device).manual_seed(1)
    weight = torch.randn(640, 2048, generator=g, device=device, dtype=torch.bfloat16) / 2048**0.5
    xs = [torch.randn(1, 2048, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2)]
    linear(xs[0], weight)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    outs: list[list[torch.Tensor]] = [[], []]
    for _ in range(100):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[i].append(linear(xs[i], weight))
    torch.cuda.synchronize()
    for i in range(2):
        want = linear_reference(xs[i].float(), weight.float())
        for got in outs[i]:
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("where", "dtype"), _params())
@pytest.mark.parametrize(("m", "split_k"), [(1, 1), (5, 1), (40, 1), (3, 4)])
def test_residual_is_summed_in_the_epilogue_in_place(where: str, dtype: torch.dtype, m: int, split_k: int) -> None:
    """residual + x @ W^T + b in one launch, written over the residual (split K: by the last program to arrive)."""
    from services.engine.kernels.layer.linear_triton import linear, linear_reference

    device = device_or_skip(where)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 600, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(80, 600, generator=g) / 600**0.5).to(device=device, dtype=dtype)
    b = torch.randn(80, generator=g).to(device=device, dtype=dtype)
    residual = torch.randn(m, 80, generator=g).to(device=device, dtype=dtype)
    want = linear_reference(x, weight, b, residual=residual).float()
    got = linear(x, weight, b, cfg=(16, 128, 4, 2, split_k), residual=residual)
    assert got.data_ptr() == residual.data_ptr()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="residual"):
        linear(x, weight, residual=torch.zeros(m, 81, device=device, dtype=dtype))


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_project_add_is_the_sum_in_the_products_epilogue(where: str) -> None:
    """models/llama.project_add: residual + layer(x). On CUDA, 8 rows take the skinny kernel with the residual
    in its epilogue and 100 rows without a bias cuBLAS's addmm_, both in the residual's memory; a 100-row
    product with a bias, and every product on the torch tier of the CPU, give a new tensor."""
    from torch import nn

    from services.engine.models.llama import _skinny, project_add

    device = device_or_skip(where)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(3)
    for rows, bias in ((100, False), (8, False), (8, True), (100, True)):
        layer = nn.Linear(96, 80, bias=bias).to(device=device, dtype=dtype)
        x = torch.randn(rows, 96, generator=g).to(device=device, dtype=dtype)
        residual = torch.randn(rows, 80, generator=g).to(device=device, dtype=dtype)
        before = residual.clone()
        want = before.float() + F.linear(x.float(), layer.weight.float(), layer.bias.float() if bias else None)
        got = project_add(layer, x, residual)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        in_place = _skinny(x, layer.weight) is not None or (device.type == "cuda" and not bias)
        assert (got.data_ptr() == residual.data_ptr()) is in_place
        if not in_place:
            assert torch.equal(residual, before)
