"""Prefill attention over paged KV: the Triton kernel against its torch reference, the reference against plain
causal attention over repeated K/V, and causal_sdpa (torch's FlashAttention path) against grouped_sdpa.

On the CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) with small shapes; on CUDA (`-m gpu`)
compiled, at Llama-3.1-8B's head shape.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.engine.kv.attention import causal_sdpa, grouped_sdpa, position_mask
from tests.engine.helpers import device_or_skip


def _pool(n_past: int, n: int, heads: tuple[int, int], d: int, dtype: torch.dtype, device: torch.device, seed: int):  # type: ignore[no-untyped-def]  # noqa: E501
    """A pool of scattered pages (page 8 rows) holding T = n_past + n positions, q for the last n."""
    num_heads, num_kv = heads
    g = torch.Generator().manual_seed(seed)
    t = n_past + n
    pages = -(-t // 8)
    slots = torch.randperm(pages + 5, generator=g)[:pages]  # pages in no particular order, some never used
    rows = (slots[:, None] * 8 + torch.arange(8)[None, :]).reshape(-1)[:t]
    k_store = torch.randn((pages + 5) * 8, num_kv, d, generator=g)
    v_store = torch.randn((pages + 5) * 8, num_kv, d, generator=g)
    q = 2 * torch.randn(n, num_heads, d, generator=g)
    return q.to(device, dtype), k_store.to(device, dtype), v_store.to(device, dtype), rows.to(device)


def _plain(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, rows: torch.Tensor, scale: float
) -> torch.Tensor:  # noqa: E501
    """Causal attention with K/V repeated per query head (float64): the definition."""
    n, num_heads, _ = q.shape
    t = rows.shape[0]
    k = k_store[rows].double().repeat_interleave(num_heads // k_store.shape[1], dim=1).transpose(0, 1)
    v = v_store[rows].double().repeat_interleave(num_heads // k_store.shape[1], dim=1).transpose(0, 1)
    allowed = position_mask(torch.arange(t - n, t, device=q.device), torch.arange(t, device=q.device))
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("n_past,n", [(0, 40), (24, 17), (70, 33), (3, 130)])
def test_reference_and_causal_sdpa_match_plain_attention(n_past: int, n: int) -> None:
    from services.engine.kernels.attention.prefill_attention_triton import prefill_attention_reference

    q, k_store, v_store, rows = _pool(n_past, n, (4, 2), 16, torch.float32, torch.device("cpu"), seed=n)
    want = _plain(q, k_store, v_store, rows, 0.25)
    assert _rel(prefill_attention_reference(q, k_store, v_store, rows, 0.25), want) < 1e-5
    k = k_store[rows].transpose(0, 1)
    v = v_store[rows].transpose(0, 1)
    assert _rel(causal_sdpa(q, k, v, 0.25), want) < 1e-5
    allowed = position_mask(torch.arange(n_past, n_past + n), torch.arange(n_past + n)).repeat(2, 1)
    assert _rel(grouped_sdpa(q, k, v, allowed, 0.25), want) < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("n_past,n,heads", [(0, 20, (4, 2)), (37, 16, (2, 2)), (64, 70, (4, 1))])
def test_kernel_matches_reference_interpreted(n_past: int, n: int, heads: tuple[int, int]) -> None:
    """Interpreted (fp32 dots): rows from scattered pages, chunks that start mid-tile, tiles past the chunk."""
    from services.engine.kernels.attention import prefill_attention_triton as pat

    if not pat.INTERPRETED:
        pytest.skip("compiled Triton: see the gpu test")
    q, k_store, v_store, rows = _pool(n_past, n, heads, 32, torch.float32, torch.device("cpu"), seed=n_past)
    q, k_store, v_store = q.half(), k_store.half(), v_store.half()
    out = pat.prefill_attention(q, k_store, v_store, rows, 32**-0.5, cfg=(16, 16, 4, 1))
    assert not out.isnan().any()
    assert _rel(out, _plain(q, k_store, v_store, rows, 32**-0.5)) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("n_past,n", [(0, 8192), (24_576, 8064), (100, 1000), (4096, 4096)])
def test_kernel_matches_reference_cuda(n_past: int, n: int) -> None:
    from services.engine.kernels.attention import prefill_attention_triton as pat

    dev = device_or_skip("cuda")
    q, k_store, v_store, rows = _pool(n_past, n, (32, 8), 128, torch.bfloat16, dev, seed=n)
    want = pat.prefill_attention_reference(q, k_store, v_store, rows, 128**-0.5)
    got = pat.prefill_attention(q, k_store, v_store, rows, 128**-0.5)
    assert not got.isnan().any()
    assert _rel(got, want) < 1e-2


def test_supported() -> None:
    from services.engine.kernels.attention.prefill_attention_triton import supported

    q = torch.zeros(16, 4, 64, dtype=torch.bfloat16)
    assert supported(q, torch.zeros(8, 2, 64, dtype=torch.bfloat16))
    assert not supported(q[:8], torch.zeros(8, 2, 64, dtype=torch.bfloat16))  # under 16 queries
    assert not supported(q, torch.zeros(8, 2, 64, dtype=torch.uint8))  # a quantised layer
    assert not supported(q.float(), torch.zeros(8, 2, 64))  # fp32
    assert not supported(torch.zeros(16, 4, 48, dtype=torch.bfloat16), torch.zeros(8, 2, 48, dtype=torch.bfloat16))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("mode", ["cudnn", "triton", "flash"])
@pytest.mark.parametrize("kv", ["fp16", "fp8"])
@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_attention_modes_match_masked(
    mode: str, kv: str, where: str, triton_tier: None, fp8_in_place: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step packing three sequences' chunks (one with 21 earlier tokens on scattered pages, one fresh, one a
    ring's over a gapped read set) and two decode tokens (one over a gapped ring read set): each
    prefill attention mode gives the masked path's output, `triton` (and `cudnn`, for chunks under a
    bucket) really runs the kernel (interpreted here) on the three chunks, and every mode but the masked one runs
    both decode tokens through one flash-decoding launch;
    an fp8 pool layer too (read in place by the kernels, with fp8=True, under KVMEM_FP8_ATTENTION=1; gathered
    and dequantised by the masked path). On CUDA the same with the compiled kernels."""
    from services.engine import kernels
    from services.engine.kernels.attention import decode_attention_triton as dat
    from services.engine.kernels.attention import prefill_attention_triton as pat
    from services.engine.kv.kv_formats import parse_format
    from services.engine.kv.kv_pool import KVPool
    from services.engine.kv.paged_attention import SeqSpan, StepAttention

    dev = device_or_skip(where)
    if dev.type == "cuda":
        monkeypatch.setattr(kernels, "_active", kernels.select_tier(dev, "triton"))  # the fixture's tier after
    page, hq, hkv, d = 8, 4, 2, 32
    pool = KVPool(1, 24, page, hkv, d, torch.float16, dev, [parse_format(kv)])
    g = torch.Generator().manual_seed(5)
    slots = [torch.tensor([9, 2, 17, 5, 11]), torch.tensor([0, 3, 20]), torch.tensor([7, 8])]
    past, new = [21, 0, 12], [18, 19, 1]

    def rows(s: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        return (s[pos // page] * page + pos % page).to(dev)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).half().to(dev)

    for s, p in zip(slots, past, strict=True):  # the earlier tokens' K/V are in the pool already
        if p:
            r = rows(s, 0, p)
            pool.write(0, r, randn(p, hkv, d), randn(p, hkv, d))
    spans = [
        SeqSpan(p, n, rows(s, p, p + n), rows(s, 0, p + n), None) for s, p, n in zip(slots, past, new, strict=True)
    ]
    # a ring's decode token: its page 1 not resident (a gapped read set with key positions)
    ring_slots, ring_past = torch.tensor([4, 6, 10, 12]), 29
    r = rows(ring_slots, 0, ring_past)
    pool.write(0, r, randn(ring_past, hkv, d), randn(ring_past, hkv, d))
    kept = torch.cat((torch.arange(0, page), torch.arange(2 * page, ring_past + 1)))
    ring_rows = (ring_slots[kept // page] * page + kept % page).to(dev)
    spans.append(SeqSpan(ring_past, 1, rows(ring_slots, ring_past, ring_past + 1), ring_rows, kept.to(dev)))
    # a ring's prompt chunk over a gapped read set (pages 1 and 2 not resident; the chunk starts inside page 3)
    chunk_slots, chunk_past, chunk_new = torch.tensor([13, 14, 15, 16, 18, 19]), 26, 17
    pool.write(0, rows(chunk_slots, 0, chunk_past), randn(chunk_past, hkv, d), randn(chunk_past, hkv, d))
    seen = torch.cat((torch.arange(0, page), torch.arange(3 * page, chunk_past + chunk_new)))
    chunk_rows = (chunk_slots[seen // page] * page + seen % page).to(dev)
    chunk_write = rows(chunk_slots, chunk_past, chunk_past + chunk_new)
    spans.append(SeqSpan(chunk_past, chunk_new, chunk_write, chunk_rows, seen.to(dev)))
    assert spans[-1].causal_rows
    total = sum(new) + 1 + chunk_new
    q, k, v = randn(total, hq, d), randn(total, hkv, d), randn(total, hkv, d)
    calls, decodes = [], []
    real = pat.prefill_attention
    monkeypatch.setattr(
        pat, "prefill_attention", lambda *a, **kw: calls.append((a[0].shape[0], kw["fp8"])) or real(*a, **kw)
    )
    real_decode = dat.decode_attention
    monkeypatch.setattr(
        dat, "decode_attention", lambda *a, **kw: decodes.append((a[0].shape[0], kw["fp8"])) or real_decode(*a, **kw)
    )
    outs = {}
    for m in ("masked", mode):
        outs[m] = StepAttention(pool, spans, hq // hkv, torch.float16, mode=m).attend(0, q, k, v, d**-0.5)
    paged = mode in ("cudnn", "triton")  # cudnn: short chunks (and every chunk on the CPU) as triton
    assert calls == ([(18, kv == "fp8"), (19, kv == "fp8"), (17, kv == "fp8")] if paged else [])
    assert decodes == [(2, kv == "fp8")]  # both decode tokens in one launch (not in the masked reference)
    assert not outs[mode].isnan().any()
    assert _rel(outs[mode], outs["masked"]) < (2e-3 if kv == "fp16" else 1e-2)  # fp8: q in bf16 in the kernel


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize(
    "where,n_past,n,heads,d",
    [("cpu", 37, 20, (4, 2), 32), pytest.param("cuda", 24_576, 8064, (32, 8), 128, marks=pytest.mark.gpu)],
)
def test_fp8_rows_match_the_reference_over_their_dequantised_rows(
    where: str, n_past: int, n: int, heads: tuple[int, int], d: int
) -> None:
    """An fp8 pool layer read in place (codes in the dots, the row scales on the scores and the probabilities):
    the reference's output over the dequantised rows."""
    from services.engine.kernels.attention import prefill_attention_triton as pat
    from services.engine.kv.kv_formats import parse_format

    dev = device_or_skip(where)
    q, k_store, v_store, rows = _pool(n_past, n, heads, d, torch.bfloat16, dev, seed=n)
    fmt = parse_format("fp8")
    k8, v8 = fmt.quantize(k_store), fmt.quantize(v_store)
    assert pat.supported(q, k8, fp8=True) and not pat.supported(q, k8)
    want = pat.prefill_attention_reference(q, fmt.dequantize(k8, q.dtype), fmt.dequantize(v8, q.dtype), rows, d**-0.5)
    cfg = (16, 16, 4, 1) if pat.INTERPRETED else None
    got = pat.prefill_attention(q, k8, v8, rows, d**-0.5, cfg=cfg, fp8=True)
    assert got.dtype == q.dtype and not got.isnan().any()
    assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("n_past,n", [(0, 40), (0, 48), (0, 7), (32, 40), (16, 5)])
def test_prompt_sdpa_pads_to_its_bucket_and_matches_plain_attention(
    n_past: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk padded at its end to a multiple of PROMPT_BUCKET (16 here): the padded keys are never seen and the
    padded queries' rows dropped; after a past, the past's attention and the chunk's own triangle merged by their
    log-sum-exp (the CPU runs the float32 torch path over the same padding and merge)."""
    from services.engine.kv import attention

    monkeypatch.setattr(attention, "PROMPT_BUCKET", 16)
    q, k_store, v_store, rows = _pool(n_past, n, (4, 2), 16, torch.float32, torch.device("cpu"), seed=n + n_past)
    k_all, v_all = k_store[rows], v_store[rows]
    past = (k_all[:n_past], v_all[:n_past]) if n_past else None
    got = attention.prompt_sdpa(q, k_all[n_past:], v_all[n_past:], 0.25, past)
    assert got.shape == q.shape
    assert _rel(got, _plain(q, k_store, v_store, rows, 0.25)) < 1e-5
    assert not attention.prompt_sdpa_fits(q)  # the CPU never takes it in the engine
    # `fa4` asks for FlashAttention-4, a CUDA kernel: on the CPU the same torch path
    assert torch.equal(attention.prompt_sdpa(q, k_all[n_past:], v_all[n_past:], 0.25, past, "fa4"), got)
    # joined: the past's rows and the chunk's in one tensor, taken apart again where FlashAttention-4 does not run
    for impl in ("cudnn", "fa4"):
        assert torch.equal(attention.prompt_sdpa(q, k_all, v_all, 0.25, None, impl, True), got)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "fa4"])
@pytest.mark.parametrize("n_past,n", [(0, 8192), (0, 8000), (0, 1500), (24_576, 8064), (3072, 1024)])
def test_prompt_sdpa_matches_reference_cuda(n_past: int, n: int, impl: str) -> None:
    """cuDNN's fused attention (and FlashAttention-4's, where installed) over a prompt chunk at the 8B head shape
    (a bucket exactly, padded, after a past)."""
    from services.engine.kernels.attention.prefill_attention_triton import prefill_attention_reference
    from services.engine.kv import attention
    from services.engine.kv.attention import prompt_sdpa, prompt_sdpa_fits

    dev = device_or_skip("cuda")
    if impl == "fa4" and attention.flash_attn4() is None:
        pytest.skip("flash-attn-4 is not installed")
    q, k_store, v_store, rows = _pool(n_past, n, (32, 8), 128, torch.bfloat16, dev, seed=n)
    assert prompt_sdpa_fits(q, n_past) and not prompt_sdpa_fits(q, n_past + 64)
    k_all, v_all = k_store[rows], v_store[rows]
    past = (k_all[:n_past], v_all[:n_past]) if n_past else None
    got = prompt_sdpa(q, k_all[n_past:], v_all[n_past:], 128**-0.5, past, impl)
    joined = prompt_sdpa(q, k_all, v_all, 128**-0.5, None, impl, True)  # the past and the chunk in one tensor
    assert not attention._FA4_REFUSED  # FlashAttention-4 ran (a refusal falls back to cuDNN)
    assert not got.isnan().any()
    want = prefill_attention_reference(q, k_store, v_store, rows, 128**-0.5)
    assert _rel(got, want) < 1e-2
    assert torch.equal(joined, got)  # the same values in the same order: the same kernels


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["cudnn", "fa4"])
def test_step_attention_cudnn_mode_takes_whole_prompts_only(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cudnn` (the CUDA default; `fa4` alike): a fresh prompt of >= one bucket goes through prompt_sdpa, a chunk
    after a past of whole buckets too (1024 here), one after another past (512) through the paged kernel; all
    match the masked path."""
    from services.engine.kv import attention
    from services.engine.kv import paged_attention as pa
    from services.engine.kv.kv_formats import parse_format
    from services.engine.kv.kv_pool import KVPool

    dev = device_or_skip("cuda")
    if mode == "fa4" and attention.flash_attn4() is None:
        pytest.skip("flash-attn-4 is not installed")
    page, hq, hkv, d = 64, 32, 8, 128
    pool = KVPool(1, 80, page, hkv, d, torch.bfloat16, dev, [parse_format("bf16")])
    g = torch.Generator().manual_seed(3)
    past, new = [0, 512, 1024], [1100, 600, 1030]
    slots = [torch.arange(0, 18), torch.arange(20, 38), torch.arange(40, 73)]

    def rows(s: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        return (s[pos // page] * page + pos % page).to(dev)

    for s, p in zip(slots[1:], past[1:], strict=True):
        kv = [torch.randn(p, hkv, d, generator=g).to(dev, torch.bfloat16) for _ in range(2)]
        pool.write(0, rows(s, 0, p), *kv)
    spans = [
        pa.SeqSpan(p, n, rows(s, p, p + n), rows(s, 0, p + n), None) for s, p, n in zip(slots, past, new, strict=True)
    ]
    total = sum(new)
    q, k, v = (torch.randn(total, h, d, generator=g).to(dev, torch.bfloat16) for h in (hq, hkv, hkv))
    calls: list[int] = []
    real = pa.prompt_sdpa
    monkeypatch.setattr(pa, "prompt_sdpa", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    outs = {}
    for m in ("masked", mode):
        outs[m] = pa.StepAttention(pool, spans, hq // hkv, torch.bfloat16, mode=m).attend(0, q, k, v, d**-0.5)
    assert calls == [1100, 1030]
    assert not attention._FA4_REFUSED
    assert _rel(outs[mode], outs["masked"]) < 1e-2


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize(
    "where,t,n,heads,d,dtype",
    [
        ("cpu", 48, 37, 4, 32, torch.float32),
        ("cpu", 16, 16, 2, 16, torch.bfloat16),
        pytest.param("cuda", 8192, 8064, 32, 128, torch.bfloat16, marks=pytest.mark.gpu),
    ],
)
def test_lse_merge_matches_its_reference(where: str, t: int, n: int, heads: int, d: int, dtype: torch.dtype) -> None:
    """The merge of a chunk's two attention parts in one launch: the torch lerp's output, from the [1, H, T, D]
    views of [T, H, D] rows that cuDNN returns, the padded rows past n dropped."""
    from services.engine.kernels.attention import prefill_attention_triton as pat

    dev = device_or_skip(where)
    g = torch.Generator().manual_seed(t + n)
    own, past = (torch.randn(t, heads, d, generator=g).to(dev, dtype).transpose(0, 1)[None] for _ in range(2))
    l_own, l_past = (4 * torch.randn(1, heads, t, 1, generator=g).to(dev) for _ in range(2))
    want = pat.lse_merge_reference(own, l_own, past, l_past, n)
    got = pat.lse_merge(own, l_own, past, l_past, n)
    assert got.shape == (n, heads, d) and got.is_contiguous() and got.dtype == dtype
    assert _rel(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize(
    "where,n_past,n,heads,d,fp8",
    [
        ("cpu", 37, 20, (4, 2), 32, False),
        ("cpu", 21, 33, (2, 1), 32, True),
        pytest.param("cuda", 4096, 8064, (32, 8), 128, False, marks=pytest.mark.gpu),
        pytest.param("cuda", 4096, 8064, (32, 8), 128, True, marks=pytest.mark.gpu),
    ],
)
def test_attention_over_keys_in_parts_merges_as_the_torch_reference(
    where: str, n_past: int, n: int, heads: tuple[int, int], d: int, fp8: bool
) -> None:
    """The exact policy's attention through the kernel: a chunk over its resident rows (causal, `state` written),
    then two batches of earlier keys from other stores (every key seen, `accumulate`), one of them of a length
    that is no multiple of a tile: the output and log-sum-exp of exact_attention's torch grouped_attention_lse
    and merge_partials over the same keys (each part's own stored format, dequantised)."""
    from services.engine.kernels.attention import prefill_attention_triton as pat
    from services.engine.kv.kv_formats import parse_format
    from services.engine.ring.exact_attention import grouped_attention_lse, merge_partials, rows_to_heads

    dev = device_or_skip(where)
    scale = d**-0.5
    q, k_store, v_store, rows = _pool(n_past, n, heads, d, torch.bfloat16, dev, seed=n)
    hosts = [
        _pool(0, length, heads, d, torch.bfloat16, dev, seed=length)[1:] for length in (40, 27 if d == 32 else 2000)
    ]
    fmt = parse_format("fp8")
    stored = (lambda x: fmt.quantize(x)) if fp8 else (lambda x: x)
    plain = (lambda x: fmt.dequantize(x, q.dtype)) if fp8 else (lambda x: x)
    cfg = (16, 16, 4, 1) if pat.INTERPRETED else None
    out = torch.empty(q.shape, dtype=torch.float32, device=dev)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
    pat.prefill_attention(q, stored(k_store), stored(v_store), rows, scale, cfg=cfg, fp8=fp8, state=(out, lse))
    t = rows.shape[0]
    allowed = position_mask(torch.arange(t - n, t, device=dev), torch.arange(t, device=dev))
    mask = torch.zeros(allowed.shape, device=dev).masked_fill_(~allowed, float("-inf")).repeat(heads[0] // heads[1], 1)
    k_res, v_res = (plain(stored(x)).index_select(0, rows).transpose(0, 1) for x in (k_store, v_store))
    want, want_lse = grouped_attention_lse(q.float(), k_res.float(), v_res.float(), mask, scale)
    for k_h, v_h, rows_h in hosts:
        keys = rows_h[: rows_h.shape[0]]
        pat.prefill_attention(q, stored(k_h), stored(v_h), keys, scale, cfg=cfg, fp8=fp8, causal=False,
                              state=(out, lse), accumulate=True)  # fmt: skip
        kh, vh = (plain(stored(x)).index_select(0, keys).transpose(0, 1).float() for x in (k_h, v_h))
        want, want_lse = merge_partials(want, want_lse, *grouped_attention_lse(q.float(), kh, vh, None, scale))
    got_lse = lse.view(n, heads[1], heads[0] // heads[1]).permute(1, 2, 0).reshape(heads[1], -1)  # grouped rows
    assert not out.isnan().any() and not lse.isnan().any()
    assert _rel(out, rows_to_heads(want, n, heads[0])) < 1e-2
    assert (got_lse - want_lse).abs().max().item() < 2e-2


class _Scoring:
    """A stand-in for PageSummaries where the exact path reads it: every layer scores, no summaries to update."""

    def scores_layer(self, layer_idx: int) -> bool:
        return True

    def update_from_pool(self, *args: object) -> None:
        pass


class _Held:
    """HeldPages' read over page bytes already on the device: a layer's bytes of some of them, in order."""

    def __init__(self, pages: list[torch.Tensor]) -> None:
        self.pages = pages

    def read(self, indices: list[int], part: tuple[int, int], device: torch.device) -> torch.Tensor:
        return torch.stack([self.pages[i][part[0] : part[1]] for i in indices]).to(device)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("kv", ["fp16", "fp8"])
@pytest.mark.parametrize("held", [False, True], ids=["on-device", "held"])
@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_exact_chunk_through_the_kernel_matches_the_torch_path(
    kv: str, held: bool, where: str, triton_tier: None, fp8_in_place: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exact chunk (the ring's last prompt chunk) whose context has host pages: through the paged kernel (the
    resident rows in place, then each staging batch of host pages as stored, merged in the kernel) the torch
    path's output (`masked`: gathered rows, grouped_attention_lse, merge_partials) and the same page masses of
    the scoring tokens; the host pages on the device or held (read a layer at a time), fp16 or fp8 pages."""
    from services.engine import kernels
    from services.engine.kernels.attention import prefill_attention_triton as pat
    from services.engine.kv.kv_formats import parse_format
    from services.engine.kv.kv_pool import KVPool
    from services.engine.kv.paged_attention import SeqSpan, StepAttention

    dev = device_or_skip(where)
    if dev.type == "cuda":
        monkeypatch.setattr(kernels, "_active", kernels.select_tier(dev, "triton"))
    page, hq, hkv, d = 8, 4, 2, 32
    pool = KVPool(1, 32, page, hkv, d, torch.float16, dev, [parse_format(kv)])
    g = torch.Generator().manual_seed(7)
    past, new = 45, 20  # pages 0..8; the chunk starts inside page 5
    slot_of = torch.tensor([3, 9, 1, 12, 20, 6, 15, 7, 22])  # logical page -> slot
    pos = torch.arange(past + new)
    all_rows = (slot_of[pos // page] * page + pos % page).to(dev)
    pool.write(0, all_rows, *(torch.randn(past + new, hkv, d, generator=g).half().to(dev) for _ in range(2)))
    host_ids = [1, 2, 4]  # their slots' bytes are the host copies; they are not among the read rows
    host = list(pool.read_pages([int(slot_of[p]) for p in host_ids]))
    seen = torch.tensor([t for t in range(past + new) if t // page not in host_ids])
    q = (2 * torch.randn(new, hq, d, generator=g)).half().to(dev)
    calls = []
    real = pat.prefill_attention
    monkeypatch.setattr(
        pat, "prefill_attention", lambda *a, **kw: calls.append(kw.get("causal", True)) or real(*a, **kw)
    )

    def run(mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        span = SeqSpan(
            past, new, all_rows[past:], all_rows[seen.to(dev)], seen.to(dev), summaries=_Scoring(),  # type: ignore[arg-type]
            touched_pages=torch.zeros(0), touched_rows=torch.zeros(0), touched_valid=torch.zeros(0),
            score_tokens=3, score_pages=6, score_by_attention=True, host_page_ids=host_ids,
            host_pages=[] if held else host, host_held=_Held(host) if held else None,  # type: ignore[arg-type]
        )  # fmt: skip
        out = StepAttention(
            pool, [span], hq // hkv, torch.float16, staging_pages=2, kernel_staging_pages=2, mode=mode
        ).attend(0, q, q[:, :hkv], q[:, :hkv], d**-0.5)
        assert span.scores is not None
        return out, span.scores

    want, want_mass = run("masked")
    assert calls == []
    got, mass = run("triton")
    assert calls == [True, False, False]  # the resident rows, then two staging batches (2 + 1 host pages)
    assert not got.isnan().any()
    assert _rel(got, want) < (2e-3 if kv == "fp16" else 1e-2)
    assert torch.allclose(mass, want_mass, atol=1e-3), (mass - want_mass).abs().max()


@pytest.mark.gpu
def test_fa4_mode_compiles_its_prompt_kernels_at_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fa4`: the engine build runs FlashAttention-4 on a fresh chunk and on one after a past (its CuTe DSL kernels
    compile at first use, seconds each), so no request pays for it; a refusal is remembered (cuDNN from then on)."""
    from services.engine.kv import attention
    from services.engine.kv import paged_attention as pa

    dev = device_or_skip("cuda")
    if attention.flash_attn4() is None:
        pytest.skip("flash-attn-4 is not installed")
    calls: list[int] = []
    real = attention.flash_attn4()
    monkeypatch.setattr(attention, "flash_attn4", lambda: lambda *a, **k: calls.append(a[1].shape[1]) or real(*a, **k))
    pa.warm_prompt_attention("fa4", dev, 32, 8, 128, torch.bfloat16)
    assert calls == [attention.PROMPT_BUCKET, 16 * attention.PROMPT_BUCKET]  # keys: the chunk's, past + chunk's
    assert not attention._FA4_REFUSED
    pa.warm_prompt_attention("cudnn", dev, 32, 8, 128, torch.bfloat16)  # other modes compile nothing here
    assert len(calls) == 2


def test_prefill_attention_config_reaches_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineConfig.prefill_attention is the mode of every step the built engine's runner attends with: an engine
    built with `flash` (torch's causal SDPA over the gathered rows) answers a chunked prompt as the `auto` engine
    (the masked path on the CPU) does, every step through the mode it was built with."""
    from bench.scale_model import write_random_llama
    from services.engine.builder import build_engine
    from services.engine.config import EngineConfig
    from services.engine.kv import paged_attention as pa
    from tests.engine.helpers import greedy, run_until_done

    write_random_llama(tmp_path, "tiny", torch.device("cpu"))
    modes: list[str] = []
    real = pa.StepAttention.__init__

    def spy(self: pa.StepAttention, *a: object, **kw: object) -> None:
        real(self, *a, **kw)  # type: ignore[arg-type]
        modes.append(self.mode)

    monkeypatch.setattr(pa.StepAttention, "__init__", spy)
    prompt = torch.randint(0, 500, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    out = {}
    for m in ("auto", "flash"):
        cfg = EngineConfig(
            model=str(tmp_path), device="cpu", dtype="fp32", max_context=512, kv_capacity=512, prefill_chunk=64,
            prefill_attention=m,
        )  # fmt: skip
        engine, _ = build_engine(cfg, start=False)
        assert engine.runner.prefill_attention == m
        modes.clear()
        seq = engine.submit(f"r-{m}", prompt, greedy(4))
        run_until_done(engine, [seq])
        assert len(modes) >= 3 and set(modes) == {"masked" if m == "auto" else "flash"}  # 3 chunks, the decode
        out[m] = seq.output_ids
        engine.stop()
    assert len(out["flash"]) == 4 and out["flash"] == out["auto"]


def test_auto_is_fa4_where_it_runs_cudnn_on_other_gpus_and_masked_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` resolves by what the device can run: FlashAttention-4 on a Hopper or datacenter Blackwell GPU with the
    wheel importable, cuDNN on any other CUDA device, the masked path off CUDA; named modes are taken as given."""
    from services.engine.kv import paged_attention as pa

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for capability, wheel, want in (((9, 0), True, "fa4"), ((10, 0), True, "fa4"), ((8, 0), True, "cudnn"),
                                    ((12, 0), True, "cudnn"), ((9, 0), False, "cudnn")):  # fmt: skip
        pa.fa4_usable.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        monkeypatch.setattr(pa, "flash_attn4", lambda w=wheel: (lambda *a, **k: None) if w else None)
        assert pa.resolve_prefill_mode("auto", cuda) == want, (capability, wheel)
        assert pa.resolve_prefill_mode("cudnn", cuda) == "cudnn"
    pa.fa4_usable.cache_clear()
    assert pa.resolve_prefill_mode("auto", cpu) == "masked"
    assert pa.resolve_prefill_mode("fa4", cpu) == "fa4"  # taken as given (prompt_sdpa runs cuDNN's torch form there)
    with pytest.raises(ValueError, match="prefill attention"):
        pa.resolve_prefill_mode("fa3", cpu)
