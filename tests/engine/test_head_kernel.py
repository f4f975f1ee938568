"""The vocabulary head kernel (kernels/layer/head_triton.py) against its torch reference (F.linear, the fp32 cast,
torch.argmax). On the CPU it runs interpreted (tests/conftest.py); on CUDA (`-m gpu`) compiled, at Gemma 3
270M's vocabulary, and replayed from a CUDA graph."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.engine.helpers import device_or_skip

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _head_inputs(vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, seed: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device=device, dtype=dtype)
    h = torch.randn(1, hidden, generator=g).to(device=device, dtype=dtype)
    return h, weight


def _counters_zero(device: torch.device) -> bool:
    from services.engine.kernels.layer import arrivals

    state = arrivals._devices.get(arrivals._key(device))
    return state is None or not bool(state.buf.any())


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "hidden"), [(1000, 96), (64, 64), (130, 200)])
def test_logits_and_argmax_match_torch(where: str, dtype: torch.dtype, vocab: int, hidden: int) -> None:
    """Odd sizes (a part-filled last tile, a hidden size that is not a multiple of the loads): the logits are
    the reference's to the dtype's rounding, the token is torch.argmax of the kernel's own logits and of the
    reference's, and the arrival counter is back at zero."""
    from services.engine.kernels.layer.head_triton import head, head_reference

    device = device_or_skip(where)
    h, weight = _head_inputs(vocab, hidden, dtype, device, seed=vocab + hidden)
    logits, token = head(h, weight, argmax=True)
    want = head_reference(h, weight)
    assert logits.shape == (1, vocab) and logits.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(logits, want, rtol=tol, atol=tol)
    assert torch.equal(logits.to(dtype).float(), logits)  # rounded to the weight dtype, as cuBLAS's output
    assert token is not None and token.shape == (1,) and token.dtype == torch.int64
    assert int(token) == int(torch.argmax(logits, dim=-1))
    assert int(token) == int(torch.argmax(want, dim=-1))
    assert _counters_zero(device)
    plain, none = head(h, weight)  # no argmax: no counter, no token
    assert none is None
    torch.testing.assert_close(plain, logits, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cfg", [(32, 64, 4, 3), (128, 32, 8, 2)])
def test_the_pipelined_loop_and_other_tiles_match_torch(where: str, cfg: tuple[int, int, int, int]) -> None:
    """The configurations bench/scale_kernels.py tries at a long hidden (a loop pipelined LOOP_STAGES deep,
    other tiles): the reference's logits to bf16 rounding and torch.argmax's token."""
    from services.engine.kernels.layer.head_triton import head, head_reference

    device = device_or_skip(where)
    h, weight = _head_inputs(300, 200, torch.bfloat16, device, seed=7)
    logits, token = head(h, weight, argmax=True, cfg=cfg)
    want = head_reference(h, weight)
    torch.testing.assert_close(logits, want, rtol=8e-3, atol=8e-3)
    assert token is not None and int(token) == int(torch.argmax(logits, dim=-1)) == int(torch.argmax(want, dim=-1))
    assert _counters_zero(device)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ties_go_to_the_first_row_and_nan_beats_every_number(where: str) -> None:
    """torch.argmax's rules: of equal maxima the first row, inside a tile and across tiles (64 rows a tile);
    a NaN logit is larger than every number, the first NaN row wins."""
    from services.engine.kernels.layer.head_triton import head

    device = device_or_skip(where)
    h, weight = _head_inputs(400, 64, torch.float32, device, seed=1)
    top = 10 * h[0] / h[0].norm()
    for row in (250, 131, 130, 70):  # tiles 3, 2, 2, 1: the first maximal row is 70
        weight[row] = top
    _, token = head(h, weight, argmax=True)
    assert token is not None and int(token) == 70
    weight[70] = 0.0  # then 130 (before 131 in its tile)
    _, token = head(h, weight, argmax=True)
    assert token is not None and int(token) == 130
    weight[310, 5] = float("nan")
    weight[390, 0] = float("nan")
    logits, token = head(h, weight, argmax=True)
    assert token is not None and int(token) == 310 == int(torch.argmax(logits, dim=-1))
    assert _counters_zero(device)


def test_refuses_what_it_does_not_take() -> None:
    from services.engine.kernels.layer.head_triton import head, supported

    h, weight = _head_inputs(100, 32, torch.float32, torch.device("cpu"), seed=2)
    assert supported(h, weight)
    assert not supported(torch.cat([h, h]), weight)  # two rows: cuBLAS
    assert not supported(h.to(torch.bfloat16), weight)  # mixed dtypes
    assert not supported(h, weight.t())  # not contiguous
    with pytest.raises(ValueError, match="head kernel"):
        head(torch.cat([h, h]), weight)


def test_the_models_take_it_for_one_row_and_agree_with_cublas_path(
    monkeypatch: pytest.MonkeyPatch, triton_tier: None
) -> None:
    """llama.vocab_head on the interpreted Triton tier: one row through the kernel (logits and argmax), two rows through
    F.linear; the same logits either way to the rounding; a tiny Gemma's `head` (what a decode step calls) takes
    it too; KVMEM_HEAD_KERNEL=0 keeps one row on F.linear."""
    from services.engine.kernels.layer import head_triton
    from services.engine.models.llama import vocab_head
    from tests.engine.helpers import tiny_gemma

    calls: list[int] = []
    real = head_triton.head

    def counted(h: torch.Tensor, weight: torch.Tensor, argmax: bool = False):  # noqa: ANN202
        calls.append(h.shape[0])
        return real(h, weight, argmax)

    monkeypatch.setattr(head_triton, "head", counted)
    h, weight = _head_inputs(300, 48, torch.bfloat16, torch.device("cpu"), seed=3)
    one, token = vocab_head(h, weight, argmax=True)
    two, tokens = vocab_head(torch.cat([h, h]), weight, argmax=True)
    assert calls == [1]  # the one row only
    assert token is not None and tokens is not None
    torch.testing.assert_close(one[0], two[0], rtol=8e-3, atol=8e-3)
    assert int(token) == int(torch.argmax(one, dim=-1)) and tokens.tolist() == torch.argmax(two, dim=-1).tolist()
    model = tiny_gemma(64)  # the decode graph's call: the model's head (tied embedding, no softcap)
    hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    logits, model_token = model.head(hidden, argmax=True)
    assert calls == [1, 1] and model_token is not None
    torch.testing.assert_close(logits, head_triton.head_reference(hidden, model.embed_tokens.weight))
    assert int(model_token) == int(torch.argmax(logits, dim=-1))
    calls.clear()
    monkeypatch.setenv("KVMEM_HEAD_KERNEL", "0")
    head_triton.enabled.cache_clear()
    try:
        off, off_token = vocab_head(h, weight, argmax=True)
    finally:
        head_triton.enabled.cache_clear()  # the next test reads the switch again (set back by monkeypatch)
    assert calls == []
    torch.testing.assert_close(off, two[:1], rtol=0, atol=0)
    assert off_token is not None and int(off_token) == int(tokens[0])


@pytest.mark.gpu
def test_gemma_vocabulary_replayed_from_a_graph() -> None:
    """Gemma 3 270M's head (262,144 x 640 bf16): captured twice in one graph and replayed with new rows, the
    token each time torch.argmax of the logits and the counters back at zero."""
    from services.engine.kernels.layer.head_triton import head, head_reference

    device = device_or_skip("cuda")
    h, weight = _head_inputs(262_144, 640, torch.bfloat16, device, seed=4)
    head(h, weight, argmax=True)  # compile and make the counters off the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, token = head(h, weight, argmax=True)
        logits2, token2 = head(h, weight, argmax=True)
    assert token is not None and token2 is not None
    for seed in range(5):
        h.copy_(torch.randn(1, 640, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        want = head_reference(h, weight)
        torch.testing.assert_close(logits, want, rtol=8e-3, atol=8e-3)
        assert int(token) == int(torch.argmax(logits, dim=-1)) == int(token2)
        assert torch.equal(logits, logits2)
    assert _counters_zero(device)
