"""Flash-decoding attention over pool rows (Triton) against its torch reference, and the reference against
plain attention (a per-head loop and SDPA over repeated K/V).

On the CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), with small shapes; on CUDA
(`-m gpu`) compiled, over the full grid of shapes, and captured in a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

from services.engine.kv.attention import PAD_POS
from tests.engine.decode_attention_cases import Inputs, inputs, tolerance
from tests.engine.helpers import device_or_skip

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _check(x: Inputs, window: int | None, out: torch.Tensor | None = None) -> None:
    from services.engine.kernels.attention import decode_attention_triton as dat

    want = dat.decode_attention_reference(*x, window=window)
    got = dat.decode_attention(*x, window=window, out=out)
    assert got.shape == x.q.shape and got.dtype == (x.q.dtype if out is None else out.dtype)
    tol = tolerance(x.k_store.dtype)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# -- the reference ---------------------------------------------------------------------------------------


def _loop_attention(x: Inputs, window: int | None) -> torch.Tensor:
    """One (sequence, query head) at a time over its visible keys, in float64."""
    batch, num_heads, _ = x.q.shape
    group = num_heads // x.k_store.shape[1]
    out = torch.empty(x.q.shape, dtype=torch.float64)
    for b in range(batch):
        q_pos = int(x.q_pos[b])
        keep = [
            i
            for i, pos in enumerate(x.key_pos[b].tolist())
            if pos <= q_pos and (window is None or pos > q_pos - window)
        ]
        rows = x.rows[b, keep]
        for h in range(num_heads):
            k = x.k_store[rows, h // group].double()  # [N, D]
            v = x.v_store[rows, h // group].double()
            p = torch.softmax(k @ x.q[b, h].double() * x.scale, dim=0)
            out[b, h] = p @ v
    return out


def _sdpa_attention(x: Inputs, window: int | None) -> torch.Tensor:
    """SDPA over the gathered rows with K/V repeated to every query head and a boolean mask."""
    group = x.q.shape[1] // x.k_store.shape[1]
    k = x.k_store[x.rows].float().repeat_interleave(group, dim=2).transpose(1, 2)  # [B, Hq, W, D]
    v = x.v_store[x.rows].float().repeat_interleave(group, dim=2).transpose(1, 2)
    visible = x.key_pos <= x.q_pos[:, None]
    if window is not None:
        visible &= x.key_pos > x.q_pos[:, None] - window
    out = F.scaled_dot_product_attention(x.q.float()[:, :, None], k, v, attn_mask=visible[:, None, None], scale=x.scale)
    return out[:, :, 0]


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("heads", [(4, 1), (8, 2), (2, 2)])
def test_reference_matches_loop_and_sdpa(heads: tuple[int, int], window: int | None) -> None:
    from services.engine.kernels.attention.decode_attention_triton import decode_attention_reference

    x = inputs(3, heads, 32, 128, torch.float32, torch.device("cpu"), seed=7)
    got = decode_attention_reference(*x, window=window)
    torch.testing.assert_close(got.double(), _loop_attention(x, window), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, _sdpa_attention(x, window), rtol=1e-5, atol=1e-5)


def test_reference_keeps_q_dtype_and_sees_only_the_visible_row() -> None:
    from services.engine.kernels.attention.decode_attention_triton import decode_attention_reference

    x = inputs(2, (4, 2), 16, 64, torch.bfloat16, torch.device("cpu"), seed=3)
    got = decode_attention_reference(*x, window=1)  # only the key at q_pos itself
    assert got.dtype == torch.bfloat16
    for b in range(2):
        (col,) = (x.key_pos[b] == x.q_pos[b]).nonzero()[0].tolist()
        want = x.v_store[x.rows[b, col]].repeat_interleave(2, dim=0)  # [Hq, D]
        assert torch.equal(got[b], want)


# -- the kernel --------------------------------------------------------------------------------------------


def _interpreted_blocks(batch: int, num_kv_heads: int, width: int, head_dim: int) -> int:
    """Blocks of 32 rows the interpreter walks (10 to 15 ms each)."""
    return batch * num_kv_heads * width // 32


def _cpu_cases() -> list[object]:
    """Every (heads, dtype, window) once, B / D / W rotating so each value meets several others."""
    cases = []
    combos = itertools.product([(4, 1), (8, 2), (2, 2)], [torch.float32, torch.bfloat16], [None, 96])
    for i, (heads, dtype, window) in enumerate(combos):
        batch, head_dim, width = (1, 3)[i % 2], (64, 256)[(i // 2) % 2], (64, 256, 1024)[i % 3]
        if _interpreted_blocks(batch, heads[1], width, head_dim) > 32:  # keep the CPU run short
            batch = 1
        if _interpreted_blocks(batch, heads[1], width, head_dim) > 32:
            width = 256
        name = f"B{batch}-H{heads[0]}x{heads[1]}-D{head_dim}-W{width}-{str(dtype)[6:]}-win{window}"
        cases.append(pytest.param(batch, heads, head_dim, width, dtype, window, id=name))
    return cases


def _gpu_cases() -> list[object]:
    grid = itertools.product(
        [1, 3], [(4, 1), (8, 2), (2, 2)], [64, 256], [64, 256, 1024], [torch.float32, torch.bfloat16, torch.float16],
        [None, 96],
    )  # fmt: skip
    return [
        pytest.param(b, h, d, w, dt, win, marks=pytest.mark.gpu, id=f"B{b}-H{h[0]}x{h[1]}-D{d}-W{w}-{dt}-win{win}")
        for b, h, d, w, dt, win in grid
    ]


@pytest.mark.parametrize(("batch", "heads", "head_dim", "width", "dtype", "window"), _cpu_cases())
def test_kernel_matches_reference_cpu(
    batch: int, heads: tuple[int, int], head_dim: int, width: int, dtype: torch.dtype, window: int | None
) -> None:
    _check(inputs(batch, heads, head_dim, width, dtype, torch.device("cpu"), seed=width + batch), window)


@pytest.mark.parametrize(("batch", "heads", "head_dim", "width", "dtype", "window"), _gpu_cases())
def test_kernel_matches_reference_cuda(
    batch: int, heads: tuple[int, int], head_dim: int, width: int, dtype: torch.dtype, window: int | None
) -> None:
    _check(inputs(batch, heads, head_dim, width, dtype, device_or_skip("cuda"), seed=width + batch), window)


def _only_one_visible(where: str, last: bool) -> Inputs:
    """Positions 0..W-1 in order; the query sees only the last row (window 1) or only the first (q_pos 0):
    every other split is fully masked."""
    x = inputs(2, (4, 1), 64, 256, torch.float32, device_or_skip(where), seed=11)
    width = x.rows.shape[1]
    key_pos = torch.arange(width, device=x.rows.device).expand(2, width).contiguous()
    q_pos = torch.full((2,), width - 1 if last else 0, dtype=torch.int64, device=x.rows.device)
    return x._replace(key_pos=key_pos, q_pos=q_pos)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("last", [True, False])
def test_only_one_key_visible(where: str, last: bool) -> None:
    from services.engine.kernels.attention.decode_attention_triton import decode_attention

    x = _only_one_visible(where, last)
    got = decode_attention(*x, window=1 if last else None)
    col = x.rows.shape[1] - 1 if last else 0
    want = x.v_store[x.rows[:, col]].expand(-1, 4, -1)  # [B, Hq, D]: the one row's V, every head
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_partial_last_split_and_direct_path(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Splits of up to 512 rows: W 1216 is three splits of 448 rows (64-row steps), the last one ending
    past W (masked); W 256 is one split written by the split kernel itself (no merge)."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    monkeypatch.setattr(dat, "TARGET_PROGRAMS", 1)
    assert dat.split_rows(2, 2, 1216) == 448 and dat.split_rows(2, 2, 256) == 256
    for width in (1216, 256):
        _check(inputs(1, (4, 1), 64, width, torch.float32, device_or_skip(where), seed=width), window=None)


def test_many_splits_are_merged() -> None:
    """W 1088 (17 pages) at B 1: 17 splits of 64 rows, more than one merge block of 16."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    assert dat.split_rows(1, 1, 1088) == 64
    _check(inputs(1, (4, 1), 32, 1088, torch.float32, torch.device("cpu"), seed=5), window=200)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_strided_query_and_given_output(where: str) -> None:
    """q as the query heads of a fused [B, Hq + 2 Hkv, D] projection; the result lands in `out` (a view)."""
    device = device_or_skip(where)
    x = inputs(2, (8, 2), 64, 128, torch.float32, device, seed=9)
    fused = torch.randn(2, 12, 64, device=device)
    fused[:, :8] = x.q
    big = torch.full((2, 10, 64), float("nan"), device=device)
    out = big[:, 1:9]
    from services.engine.kernels.attention.decode_attention_triton import decode_attention

    got = decode_attention(*x._replace(q=fused[:, :8]), window=None, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isnan(big[:, 0]).all() and torch.isnan(big[:, 9]).all()  # nothing written outside `out`
    from services.engine.kernels.attention.decode_attention_triton import decode_attention_reference

    torch.testing.assert_close(big[:, 1:9], decode_attention_reference(*x), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("partial", [False, True])
def test_keeps_a_copy_of_the_queries(where: str, partial: bool) -> None:
    """keep_q: the launch also copies q (strided, bf16, two sequences of 8 query heads over 2 KV heads) into
    keep_q, exactly, once per query head whatever the split count; the attention is unchanged."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    device = device_or_skip(where)
    x = inputs(2, (8, 2), 64, 512, torch.bfloat16, device, seed=11)
    assert 512 // dat.split_rows(2, 2, 512) > 1  # several splits: only the first one's programs copy
    fused = torch.randn(2, 12, 64, device=device, dtype=torch.bfloat16)
    fused[:, :8] = x.q
    kept = torch.full((2, 8, 64), float("nan"), device=device, dtype=torch.bfloat16)
    got = dat.decode_attention(*x._replace(q=fused[:, :8]), window=None, partial=partial, keep_q=kept)
    assert torch.equal(kept, x.q)
    if isinstance(got, dat.Partials):
        got = dat.merge_reference(got)
    want = dat.decode_attention_reference(*x)
    tol = tolerance(torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    with pytest.raises(AssertionError):  # not q's shape
        dat.decode_attention(*x, keep_q=kept[:, :4])


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("partial", [False, True])
def test_keeps_the_queries_of_the_step_at_keep_pos(where: str, partial: bool) -> None:
    """keep_pos [B]: sequence b's q is kept iff keep_pos[b] < 0 or q_pos[b] == keep_pos[b] (a decode burst keeps
    its scoring step's query), the other rows of keep_q left as they were, exactly the SDPA path's
    torch.where (graph_attention._sdpa); several splits, and the attention is unchanged."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    device = device_or_skip(where)
    x = inputs(4, (8, 2), 64, 512, torch.bfloat16, device, seed=12)
    assert 512 // dat.split_rows(4, 2, 512) > 1
    keep_pos = x.q_pos + torch.tensor([0, 0, 1, -1], device=device)
    keep_pos[0] = -1  # every step
    before = torch.randn(4, 8, 64, device=device).to(torch.bfloat16)
    kept = before.clone()
    got = dat.decode_attention(*x, window=None, partial=partial, keep_q=kept, keep_pos=keep_pos)
    keep = (keep_pos < 0) | (x.q_pos == keep_pos)
    assert keep.tolist() == [True, True, False, False]
    assert torch.equal(kept, torch.where(keep[:, None, None], x.q, before))
    if isinstance(got, dat.Partials):
        got = dat.merge_reference(got)
    want = dat.decode_attention_reference(*x)
    tol = tolerance(torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    with pytest.raises(AssertionError):  # keep_pos without keep_q
        dat.decode_attention(*x, keep_pos=keep_pos)


def test_split_rows_is_a_function_of_the_shapes() -> None:
    from services.engine.kernels.attention.decode_attention_triton import split_rows

    assert [split_rows(1, 1, w) for w in (64, 512, 2048, 8192)] == [32, 32, 64, 64]  # one step per split
    assert [split_rows(8, 1, w) for w in (2048, 8192, 65536)] == [64, 256, 512]
    assert split_rows(64, 4, 4096) == 512  # a large batch: few long splits
    assert split_rows(64, 4, 576) == 288 and split_rows(64, 4, 448) == 448  # even splits; one split


def test_fp8_block_rows_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 rows past SHORT_WIDTH in 128-row steps, splits of up to 1,024 rows, by default (a short window still as
    plain rows); KVMEM_FP8_BLOCK_ROWS=64: split as plain ones; anything else is refused."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    dat.fp8_block_rows.cache_clear()
    monkeypatch.setenv("KVMEM_FP8_BLOCK_ROWS", "64")
    try:
        assert dat.block_rows(4096, fp8=True) == 64
        assert dat.split_rows(32, 8, 4096, fp8=True) == dat.split_rows(32, 8, 4096) == 512
        monkeypatch.delenv("KVMEM_FP8_BLOCK_ROWS")
        dat.fp8_block_rows.cache_clear()
        assert dat.block_rows(4096, fp8=True) == 128
        split_rows = dat.split_rows
        assert split_rows(32, 8, 4096, fp8=True) == 1024 and split_rows(1, 8, 32768, fp8=True) == 1024
        assert split_rows(1, 8, 4096, fp8=True) == 128 and split_rows(2, 2, 1216, fp8=True) == 128
        assert split_rows(8, 1, 1024, fp8=True) == split_rows(8, 1, 1024)  # a short window as plain rows
        monkeypatch.setenv("KVMEM_FP8_BLOCK_ROWS", "96")
        dat.fp8_block_rows.cache_clear()
        with pytest.raises(ValueError):
            dat.block_rows(4096, fp8=True)
    finally:
        dat.fp8_block_rows.cache_clear()


def test_wrapper_refuses_bad_shapes() -> None:
    from services.engine.kernels.attention.decode_attention_triton import decode_attention, supported

    x = inputs(1, (4, 1), 64, 128, torch.float32, torch.device("cpu"), seed=1)
    assert supported(x.k_store) and supported(x.k_store.bfloat16()) and supported(x.k_store.half())
    assert not supported(torch.zeros(8, 1, 68, dtype=torch.uint8))  # a quantised pool layer
    assert not supported(torch.zeros(8, 1, 48)) and not supported(torch.zeros(8, 1, 512))
    with pytest.raises(AssertionError, match="multiple of 64"):
        decode_attention(*x._replace(rows=x.rows[:, :100], key_pos=x.key_pos[:, :100]))
    with pytest.raises(AssertionError):
        decode_attention(*x._replace(k_store=x.k_store[..., :48].contiguous(), v_store=x.v_store[..., :48]))
    with pytest.raises(AssertionError):
        decode_attention(*x._replace(rows=x.rows.int()))


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(where: str, dtype: torch.dtype) -> None:
    from services.engine.kernels.pages.kv_triton import write_kv, write_kv_reference

    device = device_or_skip(where)
    g = torch.Generator().manual_seed(2)
    stores = [torch.randn(40, 2, 64, generator=g).to(device, dtype) for _ in range(2)]
    want = [s.clone() for s in stores]
    rows = torch.tensor([17, 3, 39, 0], device=device)
    kv = torch.randn(4, 6, 64, generator=g).to(device, dtype)  # strided views of a fused projection
    k, v = kv[:, 2:4], kv[:, 4:6]
    write_kv_reference(*want, rows, k, v)
    write_kv(*stores, rows, k, v)
    assert torch.equal(stores[0], want[0]) and torch.equal(stores[1], want[1])
    # a prompt chunk: more tokens than a program takes, not a multiple of it, and Hkv * D not a power of two
    stores = [torch.randn(2000, 3, 64, generator=g).to(device, dtype) for _ in range(2)]
    want = [s.clone() for s in stores]
    rows = torch.randperm(2000, generator=g)[:1037].to(device)
    kv = torch.randn(1037, 11, 64, generator=g).to(device, dtype)
    k, v = kv[:, 5:8], kv[:, 8:11]
    write_kv_reference(*want, rows, k, v)
    write_kv(*stores, rows, k, v)
    assert torch.equal(stores[0], want[0]) and torch.equal(stores[1], want[1])


# -- GPU only: CUDA graphs and compiled variants -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 96])
def test_captured_in_a_cuda_graph(window: int | None) -> None:
    """Capture once on static buffers, change every input in place, replay: the result follows the inputs."""
    from services.engine.kernels.attention.decode_attention_triton import decode_attention, decode_attention_reference

    device = device_or_skip("cuda")
    static = inputs(3, (4, 1), 256, 1024, torch.bfloat16, device, seed=1)
    out = torch.empty_like(static.q)
    decode_attention(*static, window=window, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*static, window=window, out=out)
    for seed in (2, 3):
        fresh = inputs(3, (4, 1), 256, 1024, torch.bfloat16, device, seed=seed)
        for buf, new in zip(static[:6], fresh[:6], strict=True):
            buf.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = decode_attention_reference(*fresh, window=window)
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_new_widths_and_batches_compile_nothing() -> None:
    """W, the split size and the split count are runtime ints: other window buckets reuse the variants
    (one per loop step size, block_rows: windows up to SHORT_WIDTH and longer ones)."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    device = device_or_skip("cuda")
    for width in (512, 2048):
        _check(inputs(1, (4, 1), 256, width, torch.bfloat16, device, seed=1), window=None)
    caches = [
        dat._split_kernel.device_caches[torch.cuda.current_device()][0],
        dat._merge_kernel.device_caches[torch.cuda.current_device()][0],
    ]
    before = [len(c) for c in caches]
    for batch, width in ((1, 1024), (3, 256), (3, 2048), (2, 4096), (5, 1088)):
        _check(inputs(batch, (4, 1), 256, width, torch.bfloat16, device, seed=width), window=None)
    assert [len(c) for c in caches] == before


# -- a local ring's window (rows by arithmetic) ------------------------------------------------------------


def _ring_case(where: str, dtype: torch.dtype, batch: int, width: int, span: int) -> tuple:
    """Rings of `span` rows for 3 sequences in one pool (ring i at row i * span); tokens early in their
    sequence (their window reaches before position 0), in the middle, and far on (the window wraps)."""
    device = device_or_skip(where)
    g = torch.Generator().manual_seed(width + span)
    num_rings = batch + 1
    k_store = torch.randn(num_rings * span, 1, 64, generator=g).to(device, dtype)
    v_store = torch.randn(num_rings * span, 1, 64, generator=g).to(device, dtype)
    q = (2 * torch.randn(batch, 4, 64, generator=g)).to(device, dtype)
    ring_base = (torch.randperm(num_rings, generator=g)[:batch] * span).to(device)
    q_pos = torch.tensor([5, width + 17, 7 * span + 3][:batch], dtype=torch.int64, device=device)
    return q, k_store, v_store, ring_base, q_pos


@pytest.mark.parametrize(
    ("where", "dtype"),
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
     pytest.param("cuda", torch.float32, marks=pytest.mark.gpu)],
)  # fmt: skip
@pytest.mark.parametrize(("width", "span", "window"), [(128, 192, None), (128, 192, 100), (1152, 1216, None)])
def test_ring_window_matches_its_reference(
    where: str, dtype: torch.dtype, width: int, span: int, window: int | None
) -> None:
    """The ring read set by arithmetic equals the reference over the rows it names (ring_read_set), which
    equals plain attention over those rows: before position 0 nothing is read, a wrapped window reads the
    ring's start, a narrower layer window masks the oldest rows; 32- and 64-row loop steps."""
    from services.engine.kernels.attention import decode_attention_triton as dat
    from services.engine.ring.local_ring import ring_read_set

    q, k_store, v_store, ring_base, q_pos = _ring_case(where, dtype, 3, width, span)
    scale = 64**-0.5
    got = dat.decode_attention_ring(q, k_store, v_store, ring_base, span, q_pos, scale, width, window)
    want = dat.decode_attention_ring_reference(q, k_store, v_store, ring_base, span, q_pos, scale, width, window)
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    rows, key_pos = ring_read_set(ring_base, span, q_pos, width)
    assert int((key_pos[0] <= q_pos[0]).sum()) == 6  # positions 0..5 only
    local = (rows[2] - ring_base[2]).tolist()  # a wrapped window: `width` distinct rows of its own ring
    assert len(set(local)) == width and min(local) >= 0 and max(local) < span and local[-1] == (7 * span + 3) % span
    plain = _loop_attention(Inputs(q.cpu(), k_store.cpu(), v_store.cpu(), rows.cpu(), key_pos.cpu(), q_pos.cpu(),
                                   scale), window)  # fmt: skip
    torch.testing.assert_close(want.double().cpu(), plain, rtol=tol, atol=tol)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("heads", "width", "window"), [((4, 1), 256, None), ((8, 2), 512, 96)])
def test_partials_merge_to_the_output(where: str, heads: tuple[int, int], width: int, window: int | None) -> None:
    """`partial=True`: the split kernel's unmerged partials (no merge launch), which `merge_reference` (the
    block kernel's first phase merges them the same way) turns into the output; one split: the output."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    dtype = torch.float32 if where == "cpu" else torch.bfloat16
    x = inputs(1, heads, 64, width, dtype, device_or_skip(where), seed=width)
    got = dat.decode_attention(*x, window=window, partial=True)
    assert isinstance(got, dat.Partials) and got.num_splits == width // dat.split_rows(1, heads[1], width) > 1
    assert got.m.shape == got.l.shape == (1, heads[0], got.num_splits) and got.dtype == dtype
    tol = tolerance(dtype)
    want = dat.decode_attention_reference(*x, window=window)
    torch.testing.assert_close(dat.merge_reference(got).float(), want.float(), rtol=tol, atol=tol)
    assert not isinstance(dat.decode_attention(*x, window=window), dat.Partials)  # merged unless asked
    if heads[1] == 2:  # a batch that fills the grid in one split a row range: the output as always
        one = inputs(128, heads, 64, 64, dtype, x.q.device, seed=1)
        assert dat.split_rows(128, heads[1], 64) == 64
        direct = dat.decode_attention(*one, window=window, partial=True)
        assert isinstance(direct, torch.Tensor)
        want = dat.decode_attention_reference(*one, window=window)
        torch.testing.assert_close(direct.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sorted_keys_skip_the_splits_past_the_query(where: str) -> None:
    """The decode graphs' read sets (rows by position, padding at PAD_POS last, the token's bucket wider than
    its rows): with sorted_keys the splits past the query walk nothing, and the output is the unsorted
    kernel's and the reference's (poisoned output first: every element written)."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    device = device_or_skip(where)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batch, (hq, hkv), d = 3, (4, 2), 32
    width = 256 if device.type == "cpu" else 65_536
    g = torch.Generator().manual_seed(11)
    lengths = [width // 4 + 3, width // 2 - 64, 70]  # real rows of each sequence, the rest padding
    num_rows = batch * width
    k_store = torch.randn(num_rows, hkv, d, generator=g).to(device, dtype)
    v_store = torch.randn(num_rows, hkv, d, generator=g).to(device, dtype)
    q = (2 * torch.randn(batch, hq, d, generator=g)).to(device, dtype)
    rows = torch.zeros(batch, width, dtype=torch.int64)
    key_pos = torch.full((batch, width), PAD_POS, dtype=torch.int64)
    for b, n in enumerate(lengths):
        rows[b, :n] = torch.randperm(num_rows, generator=g)[:n]
        key_pos[b, :n] = torch.arange(n) * 2  # increasing, with gaps
    q_pos = torch.tensor([2 * (n - 1) for n in lengths[:2]] + [2 * 30])  # the last: 39 later keys are future
    x = Inputs(q, k_store, v_store, rows.to(device), key_pos.to(device), q_pos.to(device), d**-0.5)
    want = dat.decode_attention_reference(*x)
    plain = dat.decode_attention(*x)
    out = torch.full_like(q, float("nan"))
    got = dat.decode_attention(*x, out=out, sorted_keys=True)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got.float(), plain.float(), rtol=tol, atol=tol)
    assert dat.split_rows(batch, hkv, width) < width  # several splits, some wholly past the query
