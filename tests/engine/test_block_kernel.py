"""The persistent layer-half kernel (kernels/layer/block_triton.py) against its torch reference, the six launches'
torch code composed. On the CPU it runs interpreted as one program (tests/conftest.py); on CUDA (`-m gpu`)
compiled, one program per SM, its grid-wide barriers crossed three times a launch."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.engine.helpers import device_or_skip

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _weights(  # noqa: ANN202
    hidden: int, q_dim: int, inter: int, n_qkv: int | None, device: torch.device, seed: int,
    dtype: torch.dtype = torch.bfloat16, family: str = "gemma",
):  # fmt: skip
    """Gemma 3's layer (post-norms, GELU, norm weights around 0) or the Llama family's (no post-norms, SiLU,
    norm weights around 1, a qkv bias as Qwen2 has)."""
    from services.engine.kernels.layer.block_triton import BlockWeights

    g = torch.Generator().manual_seed(seed)

    def mat(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=dtype)

    gemma = family == "gemma"

    def norm() -> torch.Tensor:
        return (0.1 * torch.randn(hidden, generator=g) + (0.0 if gemma else 1.0)).to(device=device, dtype=dtype)

    bias = None if gemma or not n_qkv else torch.randn(n_qkv, generator=g).to(device=device, dtype=dtype)
    return BlockWeights(
        o=mat(hidden, q_dim), post_attn=norm() if gemma else None, pre_ffn=norm(), gate_up=mat(2 * inter, hidden),
        down=mat(hidden, inter), post_ffn=norm() if gemma else None, next_norm=norm(),
        qkv=mat(n_qkv, hidden) if n_qkv else None, qkv_bias=bias, eps=1e-6, gemma=gemma,
        act="gelu_tanh" if gemma else "silu",
    )  # fmt: skip


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["gemma", "llama"])
@pytest.mark.parametrize(("hidden", "q_dim", "inter", "n_qkv"), [(96, 128, 200, 160), (80, 64, 128, None)])
def test_matches_the_launches_torch_code(
    where: str, dtype: torch.dtype, family: str, hidden: int, q_dim: int, inter: int, n_qkv: int | None
) -> None:
    """Odd sizes (masked tails, several tiles a phase), with and without the next layer's qkv, both families;
    fp32 to the summation order, bf16 to its rounding."""
    from services.engine.kernels.layer.block_triton import block, block_reference

    device = device_or_skip(where)
    w = _weights(hidden, q_dim, inter, n_qkv, device, seed=hidden + inter, dtype=dtype, family=family)
    g = torch.Generator().manual_seed(7)
    attn = torch.randn(1, q_dim, generator=g).to(device=device, dtype=dtype)
    x = (4 * torch.randn(1, hidden, generator=g)).to(device=device, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    _assert_outputs_close(block(attn, x, w), block_reference(attn, x, w), tol)


def _assert_outputs_close(
    got: tuple[torch.Tensor | None, ...], want: tuple[torch.Tensor | None, ...], tol: float
) -> None:
    """(x', h', qkv' or None) pairs: the same shapes and dtypes, close to `tol`."""
    for name, a, b in zip(("x'", "h'", "qkv'"), got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert a is not None and a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=name)


def _partials(heads: int, head_dim: int, splits: int, device: torch.device, dtype: torch.dtype, seed: int):  # noqa: ANN202
    """Split-kernel partials as the kernel leaves them: per split a running max m (base 2), l >= 1 (the max's
    own term) and acc of l's scale; split 1 of head 0 saw no key (m = -inf, l = acc = 0)."""
    from services.engine.kernels.attention.decode_attention_triton import Partials

    g = torch.Generator().manual_seed(seed)
    m = 4 * torch.randn(1, heads, splits, generator=g)
    lsum = 1 + 5 * torch.rand(1, heads, splits, generator=g)
    acc = torch.randn(1, heads, splits, head_dim, generator=g) * lsum[..., None]
    m[0, 0, 1], lsum[0, 0, 1], acc[0, 0, 1] = float("-inf"), 0.0, 0.0
    return Partials(m.to(device), lsum.to(device), acc.to(device), dtype)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["gemma", "llama"])
@pytest.mark.parametrize(
    ("hidden", "heads", "head_dim", "inter", "n_qkv", "splits"), [(96, 2, 64, 200, 160, 5), (80, 4, 16, 128, None, 16)]
)
def test_merges_the_attention_partials_in_its_first_phase(
    where: str, dtype: torch.dtype, family: str, hidden: int, heads: int, head_dim: int, inter: int,
    n_qkv: int | None, splits: int,
) -> None:  # fmt: skip
    """The attention's unmerged partials (decode_attention's `partial=True`) instead of its output: the block
    merges each head itself (one launch fewer a layer), as the merge kernel and then the o projection would."""
    from services.engine.kernels.attention.decode_attention_triton import merge_reference
    from services.engine.kernels.layer.block_triton import block, block_reference, takes

    device = device_or_skip(where)
    w = _weights(hidden, heads * head_dim, inter, n_qkv, device, seed=hidden + splits, dtype=dtype, family=family)
    p = _partials(heads, head_dim, splits, device, dtype, seed=splits)
    x = (4 * torch.randn(1, hidden, generator=torch.Generator().manual_seed(3))).to(device=device, dtype=dtype)
    assert takes(p, x, w)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    got = block(p, x, w)
    _assert_outputs_close(got, block_reference(p, x, w), tol)
    _assert_outputs_close(got, block(merge_reference(p).reshape(1, -1), x, w), tol)  # merged first: the same


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [16, 64])
def test_merges_gemma_sized_partials_compiled(splits: int) -> None:
    """Gemma 3 270M's sizes (4 heads of 256 into 640; the splits of a sliding and of a global layer), one
    program per SM, the weight tiles loaded while waiting at the barriers; a CUDA graph replays it."""
    from services.engine.kernels.layer.block_triton import block, block_reference

    device = device_or_skip("cuda")
    w = _weights(640, 1024, 2048, 1536, device, seed=splits)
    p = _partials(4, 256, splits, device, torch.bfloat16, seed=splits)
    x = (4 * torch.randn(1, 640, generator=torch.Generator().manual_seed(5))).to(device=device, dtype=torch.bfloat16)
    want = block_reference(p, x, w)
    got = block(p, x, w)
    # fewer programs than tiles (a smaller GPU) and no preloads: each program loops over its share of tiles
    for out in (got, block(p, x, w, programs=16), block(p, x, w, preload=False)):
        _assert_outputs_close(out, want, 3e-2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # compiled above, off the capture
        out = block(p, x, w)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, got, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_replays_in_a_cuda_graph_and_its_counters_return_to_zero(family: str) -> None:
    """Gemma 3 270M's sizes, every program of the device: replayed many times in a graph (the barrier
    counters must be zero again after each launch, or the next replay's barriers pass early), the same
    result each replay; each captured launch has counters of its own."""
    from services.engine.kernels.layer import arrivals
    from services.engine.kernels.layer.block_triton import COUNTERS, block, block_reference

    device = device_or_skip("cuda")
    w = _weights(640, 1024, 2048, 1536, device, seed=3, family=family)
    attn = torch.randn(1, 1024, device=device, dtype=torch.bfloat16)
    x = torch.randn(1, 640, device=device, dtype=torch.bfloat16)
    block(attn, x, w)  # compile (and make the counters) off the capture
    torch.cuda.synchronize()
    state = arrivals._devices[torch.device("cuda", torch.cuda.current_device())]
    used = state.used
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(attn, x, w)
        block(attn, x, w)
    assert state.used == used + 2 * COUNTERS
    for _ in range(3):
        attn.copy_(torch.randn_like(attn))
        graph.replay()
        want = block_reference(attn, x, w)
        for a, b in zip(out, want, strict=True):
            assert a is not None and b is not None
            torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    assert not state.buf.any()


@pytest.mark.gpu
def test_launches_on_two_streams_at_once_do_not_share_barriers() -> None:
    """Two streams each launching the kernel many times, at once (two engines in one process): each stream
    has its own counters, so neither waits for the other's programs; every result is the reference's."""
    from services.engine.kernels.layer.block_triton import block, block_reference

    device = device_or_skip("cuda")
    w = _weights(640, 1024, 2048, 1536, device, seed=4)
    inputs = [(torch.randn(1, 1024, device=device, dtype=torch.bfloat16),
               torch.randn(1, 640, device=device, dtype=torch.bfloat16)) for _ in range(2)]  # fmt: skip
    block(*inputs[0], w)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    outs: list[list[torch.Tensor]] = [[], []]
    for _ in range(50):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[i].append(block(*inputs[i], w)[0])
    torch.cuda.synchronize()
    for i in range(2):
        want = block_reference(*inputs[i], w)[0].float()
        for got in outs[i]:
            torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_counter_sets_belong_to_a_stream_or_to_one_captured_launch() -> None:
    """kernels/layer/arrivals.py's sets: a stream's is reused (grown when a launch needs more), a captured launch
    gets one of its own, and a spent buffer gives none (the caller keeps its path without counters)."""
    from services.engine.kernels.layer.arrivals import CAPACITY, _Counters

    state = _Counters(torch.device("cpu"))
    a, b = state.take(1, 4), state.take(2, 4)
    assert a is not None and b is not None and a.shape == (4,)
    again = state.take(1, 3)
    assert again is not None and again.data_ptr() == a.data_ptr() and b.data_ptr() != a.data_ptr()
    grown = state.take(1, 8)
    assert grown is not None and grown.shape == (8,) and grown.data_ptr() != a.data_ptr()
    captured = [state.take(None, 4) for _ in range(3)]  # a new set for each captured launch
    ptrs = {t.data_ptr() for t in captured if t is not None}
    assert len(ptrs) == 3 and not ptrs & {grown.data_ptr(), b.data_ptr()}
    state.used = CAPACITY
    assert state.take(None, 4) is None and state.take(3, 4) is None  # spent
    assert state.take(1, 8) is not None  # a stream's own set stays


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_a_one_row_forward_takes_the_block_kernel_and_matches_torch(
    triton_tier: None, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """A decode row through tiny Gemma 3 (six layers) or tiny Llama (two: no post-norms, SiLU, plain residual
    adds) on the (interpreted) Triton tier: every layer's second half is one block launch, the last without a
    qkv, and the logits are the torch tier's; a prompt of several rows keeps the launches."""
    from services.engine import kernels
    from services.engine.kernels.layer import block_triton
    from services.engine.kv.attention import ContiguousKV
    from tests.engine.helpers import tiny_gemma, tiny_model

    calls: list[bool] = []
    real = block_triton.block

    def counted(attn, x, w, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(w.qkv is not None)
        return real(attn, x, w, *args, **kwargs)

    monkeypatch.setattr(block_triton, "block", counted)
    model = tiny_gemma(64) if family == "gemma" else tiny_model(64, seed=5)
    layers = len(model.layers)
    ids = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(10)
    with torch.no_grad():
        kv = ContiguousKV(layers)
        model(ids[:9], pos[:9], kv)  # the prompt: launches
        assert calls == []
        fused = model.logits(model(ids[9:], pos[9:], kv))  # one decode row: a block a layer
        assert calls == [True] * (layers - 1) + [False]
        kernels.use_tier(kernels.select_tier(torch.device("cpu"), "torch"))
        kv = ContiguousKV(layers)
        model(ids[:9], pos[:9], kv)
        plain = model.logits(model(ids[9:], pos[9:], kv))
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert not torch.equal(fused, torch.zeros_like(fused))


@pytest.mark.parametrize(
    ("env", "on"),
    [({}, True), ({"KVMEM_BLOCK_KERNEL": "0"}, False), ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}, False),
     ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}, True)],
)  # fmt: skip
def test_off_by_switch_and_under_a_share_of_the_sms(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], on: bool
) -> None:
    """Its barriers need every program resident at once: an MPS share of the SMs turns it off, as the switch does."""
    from services.engine.kernels.layer import block_triton

    for name in ("KVMEM_BLOCK_KERNEL", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    block_triton.enabled.cache_clear()
    try:
        assert block_triton.enabled() is on
    finally:
        block_triton.enabled.cache_clear()


def test_supported_takes_one_row_and_whole_layers_only() -> None:
    """What the kernel cannot read keeps the launches: two rows, a norm of another length, one post-norm
    without the other, an unknown activation, a hidden size past 1,024; `block` refuses what it does not take."""
    import dataclasses

    from services.engine.kernels.layer.block_triton import block, supported

    w = _weights(96, 128, 200, 160, torch.device("cpu"), seed=1, dtype=torch.float32)
    x = torch.zeros(1, 96)
    assert supported(x, w)
    assert not supported(torch.zeros(2, 96), w)
    assert not supported(x.to(torch.bfloat16), w)  # x's dtype is the weights'
    assert not supported(x, dataclasses.replace(w, next_norm=torch.zeros(95)))
    assert not supported(x, dataclasses.replace(w, post_ffn=None))
    assert not supported(x, dataclasses.replace(w, act="relu"))
    big = _weights(1040, 64, 64, None, torch.device("cpu"), seed=1, dtype=torch.float32)
    assert not supported(torch.zeros(1, 1040), big)
    with pytest.raises(ValueError, match="block kernel"):
        block(torch.zeros(1, 127), x, w)  # attn of the wrong width
