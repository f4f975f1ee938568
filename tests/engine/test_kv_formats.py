"""KV formats (services/engine/kv/kv_formats.py) in the pool: round-trip error bounds, Triton kernels equal
to the torch reference (interpreter on the CPU), page bytes, per-layer specs, and engines on tiny models
with quantised pools (teacher-forced logits near the fp32 pool, a ring whose restored pages are exact)."""

from __future__ import annotations

import importlib.util  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from services.common.pagehash import chain_hashes  # noqa: E402
from services.common.tokenizer import Tokenizer  # noqa: E402
from services.engine.config import ConfigError, EngineConfig  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.engine.kernels import KernelTier, active_tier, use_tier  # noqa: E402
from services.engine.kv.kv_formats import (  # noqa: E402
    KVFormat,
    KVFormatError,
    e4m3_encode,
    hadamard,
    parse_format,
    parse_spec,
    resolve_formats,
)
from services.engine.kv.kv_pool import KVPool  # noqa: E402
from services.engine.kv.paged_attention import SeqSpan, StepAttention  # noqa: E402
from services.engine.ring.state import RingLimits  # noqa: E402
from services.kvstore.client import KVStoreClient  # noqa: E402
from tests.conftest import StartStore  # noqa: E402
from tests.engine.helpers import (  # noqa: E402
    device_or_skip,
    drain,
    events_of,
    greedy,
    make_engine,
    ring_limits,
    run_until_done,
    tiny_gemma,
    tiny_model,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
QUANTISED = ["fp8", "int8", "nvfp4"]
ALL = ["fp32", "bf16", "fp16", "fp8", "fp8+h", "int8", "int8+h", "nvfp4", "nvfp4+h"]
VOCAB = 49152
CPU = torch.device("cpu")


def _rows(n: int, h: int, d: int, seed: int = 0) -> torch.Tensor:
    """[n, h, d] values with per-row magnitudes over four decades and a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g) * torch.logspace(-2, 2, n)[:, None, None]
    x[:, :, 3] *= 8.0
    x[0, 0] = 0.0  # an all-zero row
    return x


# -- round trips ----------------------------------------------------------------------------------------


def test_fp8_round_trip_within_half_a_step_of_the_row_max() -> None:
    x = _rows(32, 2, 64)
    fmt = parse_format("fp8")
    y = fmt.dequantize(fmt.quantize(x), torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # e4m3: 3 mantissa bits -> relative half step 2^-4; below 2^-6 * scale steps are 2^-9 * scale
    bound = x.abs() * 2.0**-4 + amax / 448 * 2.0**-10 + 1e-30
    assert ((y - x).abs() <= bound).all()
    assert torch.equal(y[0, 0], torch.zeros(64))
    assert (y - x).abs().max() > 0  # it does quantise


def test_int8_round_trip_within_half_a_step_of_the_group_max() -> None:
    x = _rows(32, 2, 64)
    fmt = parse_format("int8")
    y = fmt.dequantize(fmt.quantize(x), torch.float32)
    gmax = x.view(32, 2, 2, 32).abs().amax(-1, keepdim=True)
    err = (y - x).view(32, 2, 2, 32).abs()
    assert (err <= gmax / 254 * 1.002 + 1e-7).all()  # half a step, the step's fp16 rounding
    assert (err.amax(-1, keepdim=True) > gmax / 2000).any()


def test_nvfp4_round_trip_within_the_e2m1_step_of_the_block_max() -> None:
    x = _rows(32, 2, 64)
    fmt = parse_format("nvfp4")
    y = fmt.dequantize(fmt.quantize(x), torch.float32)
    bmax = x.view(32, 2, 4, 16).abs().amax(-1, keepdim=True)
    err = (y - x).view(32, 2, 4, 16).abs()
    # E2M1 steps are at most 2 (4 -> 6) in units of the block scale ~ bmax / 6 (e4m3-rounded: +/- 2^-4)
    assert (err <= bmax / 6 * 1.0625 + 1e-7).all()
    levels = (y.view(32, 2, 4, 16).abs() / (bmax / 6)).flatten()
    assert levels.unique().numel() > 8  # many blocks, each on its own scale


def test_e4m3_encoding_equals_the_torch_cast_on_normal_values() -> None:
    y = torch.cat([torch.rand(50_000) * 448, torch.tensor([0.0, 2.0**-6, 448.0, 447.0, 1.0625, 1.1875])])
    assert torch.equal(e4m3_encode(y), y.to(torch.float8_e4m3fn).view(torch.uint8).int())


@pytest.mark.parametrize("base", QUANTISED)
def test_hadamard_keys_are_rotated_back(base: str) -> None:
    """+h keys come back as ordinary keys (a missing inverse rotation would give an error near 1.4).
    On keys whose channels differ in scale (log-normal, as after RoPE) the rotation helps the int8 grid
    (2x less error measured); fp8 (a float grid) and nvfp4 (16-value blocks) do not gain on this data."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 2, 64, generator=g) * torch.exp(torch.randn(64, generator=g))
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-4)
    errs = {}
    for name in (base, base + "+h"):
        pool = KVPool(1, 4, 64, 2, 64, torch.float32, CPU, [parse_format(name)])
        pool.write(0, torch.arange(256), x, x)
        k, v = pool.gather(0, torch.arange(256), torch.float32)
        assert torch.equal(pool.gather_keys(0, torch.arange(256)), k)
        errs[name] = ((k - x).norm() / x.norm()).item()
        assert torch.equal(v, parse_format(base).dequantize(parse_format(base).quantize(x), torch.float32))
    assert errs[base + "+h"] < {"fp8": 0.04, "int8": 0.008, "nvfp4": 0.15}[base]
    if base == "int8":
        assert errs["int8+h"] < errs["int8"] / 1.5


# -- Triton kernels against the torch reference -----------------------------------------------------


@pytest.mark.parametrize("name", ["fp8", "int8", "nvfp4", "nvfp4+h"])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_triton_kernels_write_the_reference_bytes(triton_tier: None, name: str, head_dim: int) -> None:
    from services.engine.kernels.pages import kv_triton

    fmt = parse_format(name)
    assert kv_triton.supported(fmt, head_dim)
    x = _rows(9, 2, head_dim, seed=head_dim)
    rows = torch.tensor([7, 0, 12, 3, 4, 15, 1, 9, 2])
    store = torch.zeros(16, 2, fmt.row_bytes(head_dim), dtype=torch.uint8)
    kv_triton.quantize_scatter(fmt, x, rows, store)
    assert torch.equal(store[rows], fmt.quantize(x))
    out = kv_triton.gather_dequantize(fmt, store, rows.flip(0), head_dim, torch.float32)
    assert torch.equal(out, fmt.dequantize(store[rows.flip(0)], torch.float32))


def test_fp8_k_and_v_written_in_one_launch_equal_the_reference(triton_tier: None) -> None:
    """quantize_scatter_kv: K and V of a step read through their strides (views of one qkv row block, as a decode
    step has them) into the two stores of one pool stack, byte for byte the reference quantisation; refused (nothing
    written) for stores that are not one stack's K then V, and for formats other than fp8."""
    from services.engine.kernels.pages import kv_triton

    fmt = parse_format("fp8")
    hq, h, d = 4, 2, 32
    qkv = _rows(9, hq + 2 * h, d, seed=5)
    k, v = qkv[:, hq : hq + h], qkv[:, hq + h :]
    assert not k.is_contiguous() and not v.is_contiguous()
    rows = torch.tensor([7, 0, 12, 3, 4, 15, 1, 9, 2])
    stack = torch.zeros(3, 2, 16, h, fmt.row_bytes(d), dtype=torch.uint8)
    assert kv_triton.quantize_scatter_kv(fmt, k, v, rows, stack[1, 0], stack[1, 1])
    assert torch.equal(stack[1, 0][rows], fmt.quantize(k)) and torch.equal(stack[1, 1][rows], fmt.quantize(v))
    assert not stack[0].any() and not stack[2].any()  # only that layer's stores
    other = torch.zeros(16, h, fmt.row_bytes(d), dtype=torch.uint8)
    assert not kv_triton.quantize_scatter_kv(fmt, k, v, rows, stack[1, 1], stack[1, 0])  # V before K
    assert not kv_triton.quantize_scatter_kv(fmt, k, v, rows, stack[1, 0], other) and not other.any()
    int8 = parse_format("int8")
    assert not kv_triton.quantize_scatter_kv(int8, k, v, rows, stack[1, 0], stack[1, 1])
    pools = [KVPool(2, 4, 4, h, d, torch.float32, CPU, [fmt, parse_format("fp8+h")]) for _ in range(2)]
    pools[0].fp8_kv_one_launch = True  # KVMEM_FP8_KV_ONE_LAUNCH=1: the pool's writes through the one launch
    for pool in pools:
        for layer in (0, 1):
            pool.write(layer, rows, k, v)
    for layer in (0, 1):
        assert torch.equal(pools[0].k[layer], pools[1].k[layer]) and torch.equal(pools[0].v[layer], pools[1].v[layer])


@pytest.mark.parametrize("name", ["fp8+h", "int8", "nvfp4"])
def test_pool_on_the_triton_tier_equals_the_torch_pool(triton_tier: None, name: str) -> None:
    x, v = _rows(12, 2, 32, seed=1), _rows(12, 2, 32, seed=2)
    rows = torch.randperm(16)[:12]
    pools = []
    for tier in ("triton", "torch"):
        use_tier(KernelTier(tier, "cpu", None, False))
        pool = KVPool(1, 4, 4, 2, 32, torch.float32, CPU, [parse_format(name)])
        pool.write(0, rows, x, v)
        pools.append((pool, pool.gather(0, rows, torch.float32), pool.gather(0, rows, torch.bfloat16)))
    (a, ga, ha), (b, gb, hb) = pools
    assert torch.equal(a.k[0], b.k[0]) and torch.equal(a.v[0], b.v[0])
    assert torch.equal(ga[0], gb[0]) and torch.equal(ga[1], gb[1])
    # bf16 out: the interpreter's fp32 -> bf16 cast may round differently (one bf16 step at most)
    for x16, y16 in zip(ha, hb, strict=True):
        assert x16.dtype == torch.bfloat16
        torch.testing.assert_close(x16.float(), y16.float(), rtol=2**-7, atol=1e-30)


# -- pages as bytes -------------------------------------------------------------------------------------


def _mixed_pool(formats: Sequence[str], num_slots: int = 4) -> KVPool:
    return KVPool(len(formats), num_slots, 8, 2, 32, torch.float32, CPU, [parse_format(f) for f in formats])


def test_page_bytes_round_trip_exactly_through_a_mixed_pool() -> None:
    names = ["fp8", "bf16", "nvfp4+h", "int8", "fp32"]
    src = _mixed_pool(names)
    for layer in range(len(names)):
        src.write(layer, torch.arange(32), _rows(32, 2, 32, seed=layer), _rows(32, 2, 32, seed=10 + layer))
    expected = sum(2 * 8 * 2 * parse_format(f).row_bytes(32) for f in names)
    assert src.page_nbytes == expected == 2 * 8 * 2 * (48 + 64 + 24 + 36 + 128)  # fp8: 16-byte head + 32 codes
    pages = torch.stack([src.read_page(s) for s in (1, 3)])
    assert pages.dtype == torch.uint8 and pages.shape == (2, src.page_nbytes)
    dst = _mixed_pool(names)
    dst.write_pages([2, 0], pages)
    assert torch.equal(dst.read_page(2), pages[0]) and torch.equal(dst.read_page(0), pages[1])
    rows_src, rows_dst = src.rows(torch.tensor([1])), dst.rows(torch.tensor([2]))
    for layer in range(len(names)):
        k_ref, v_ref = src.gather(layer, rows_src, torch.float32)
        assert torch.equal(dst.gather(layer, rows_dst, torch.float32)[0], k_ref)
        k_page, v_page = src.page_kv(pages[0], layer, torch.float32)  # a host page, dequantised
        assert torch.equal(k_page, k_ref) and torch.equal(v_page, v_ref)


def test_pages_kv_decodes_one_layer_of_many_pages_as_page_kv_does_each() -> None:
    """pages_kv (the exact chunk's staging batch: only one layer's bytes of each host page travel) equals
    page_kv page by page, concatenated, in every format; a uniform plain pool takes its own fast path."""
    for names in (["fp8", "bf16", "nvfp4+h", "int8", "fp32"], ["bf16"] * 3):
        pool = _mixed_pool(names)
        for layer in range(len(names)):
            pool.write(layer, torch.arange(32), _rows(32, 2, 32, seed=layer), _rows(32, 2, 32, seed=10 + layer))
        pages = [pool.read_page(s) for s in (3, 0, 2)]
        for layer in range(len(names)):
            k, v = pool.pages_kv(pages, layer, torch.float32, CPU)
            assert k.shape == v.shape == (3 * 8, 2, 32)
            k_ref = torch.cat([pool.page_kv(p, layer, torch.float32)[0] for p in pages])
            v_ref = torch.cat([pool.page_kv(p, layer, torch.float32)[1] for p in pages])
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
            rows = pool.rows(torch.tensor([3, 0, 2]))
            k_pool, v_pool = pool.gather(layer, rows, torch.float32)  # what the slots themselves hold
            assert torch.equal(k, k_pool.reshape(k.shape)) and torch.equal(v, v_pool.reshape(v.shape))


def test_many_host_pages_are_held_in_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """host_pages_fit: fetched to the device while the pages fit in HOST_PAGES_ON_DEVICE bytes, else held."""
    from services.engine.kv import kv_pool

    pool = _mixed_pool(["bf16", "fp8"])
    monkeypatch.setattr(kv_pool, "HOST_PAGES_ON_DEVICE", 3 * pool.page_nbytes)
    assert pool.host_pages_fit(3) and not pool.host_pages_fit(4)


def test_a_restore_of_some_layers_writes_them_from_their_packed_bytes() -> None:
    """write_pages of a page's parts (KVPool.layer_parts: the bytes of some layers, packed) writes what
    the whole page writes into those layers; in a mixed pool the parts have different sizes."""
    for names in (["bf16"] * 4, ["fp8", "bf16", "nvfp4+h", "int8"]):
        src = _mixed_pool(names)
        for layer in range(len(names)):
            src.write(layer, torch.arange(32), _rows(32, 2, 32, seed=layer), _rows(32, 2, 32, seed=10 + layer))
        pages = torch.stack([src.read_page(s) for s in (1, 3)])
        layers = (1, 2)
        parts = src.layer_parts(layers)
        assert parts == ((src._layer_offsets[1], src._layer_offsets[3]),)  # adjacent layers: one range
        assert src.layer_parts((0, 3)) == ((0, src._layer_offsets[1]), (src._layer_offsets[3], src.page_nbytes))
        packed = torch.stack([torch.cat([page[lo:hi] for lo, hi in parts]) for page in pages])
        whole, part = _mixed_pool(names), _mixed_pool(names)
        whole._write_rows([2, 0], None, pages, layers)
        part._write_rows([2, 0], None, packed, layers)
        for layer in range(len(names)):
            assert torch.equal(part.k[layer], whole.k[layer]) and torch.equal(part.v[layer], whole.v[layer])
        assert whole.k[1].any() and not whole.k[0].any()
        with pytest.raises(ValueError, match="neither a whole page"):
            part._write_rows([2], None, packed[:1, :-2], layers)


def test_copy_rows_moves_quantised_rows() -> None:
    pool = _mixed_pool(["nvfp4", "fp8"])
    for layer in range(2):
        pool.write(layer, torch.arange(8), _rows(8, 2, 32), _rows(8, 2, 32, seed=3))
    pool.copy_rows(0, 2, 5)
    for layer in range(2):
        a = pool.gather(layer, torch.arange(5), torch.float32)
        b = pool.gather(layer, torch.arange(16, 21), torch.float32)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_plain_pool_layout_is_unchanged() -> None:
    pool = KVPool(2, 2, 4, 2, 8, torch.bfloat16, CPU)
    pool.write(1, torch.tensor([5]), torch.ones(1, 2, 8), torch.full((1, 2, 8), 2.0))
    assert pool.k[1].dtype == torch.bfloat16 and pool.k[1].shape == (8, 2, 8)
    assert pool.page_nbytes == 2 * 2 * 4 * 2 * 8 * 2
    page = pool.read_page(1).view(torch.bfloat16).view(2, 2, 4, 2, 8)  # layer, K/V, token, head, dim
    assert page[1, 0, 1].eq(1).all() and page[1, 1, 1].eq(2).all() and page[0].eq(0).all()


# -- specs ------------------------------------------------------------------------------------------------


GEMMA_WINDOWS = (8, None, 8, 8, None, 8)


def test_spec_parsing_resolution_and_canonical_names() -> None:
    spec = parse_spec(" FP8 , global=bf16 ", auto="fp32")
    assert spec.name == "fp8,global=bf16"
    assert [f.name for f in spec.resolve(GEMMA_WINDOWS)] == ["fp8", "bf16", "fp8", "fp8", "bf16", "fp8"]
    spec = parse_spec("int8+h,0-1=auto,5=nvfp4,local=fp16,0=fp8", auto="bf16")
    assert spec.name == "int8+h,0-1=bf16,5=nvfp4,local=fp16,0=fp8"  # later parts override earlier ones
    assert [f.name for f in spec.resolve(GEMMA_WINDOWS)] == ["fp8", "bf16", "fp16", "fp16", "int8+h", "fp16"]
    assert parse_spec("auto", auto="bf16").name == "bf16" and parse_spec("global=fp8", auto="fp32").name == (
        "fp32,global=fp8"
    )
    assert parse_spec("nvfp4+h", "bf16").uniform == KVFormat("nvfp4", True)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fp9", "kv format 'fp9' unknown"),
        ("bf16+h", "+h (Hadamard keys) only applies"),
        ("fp8+x", "kv format 'fp8+x' unknown"),
        ("fp8,,bf16", "has an empty part"),
        ("fp8,bf16", "two default formats ('fp8' and 'bf16')"),
        ("fp8,globals=bf16", "selector 'globals' is not global, local, N or N-M"),
        ("fp8,3-1=bf16", "empty layer range 3-1"),
        ("fp8,1-2=int4", "kv format 'int4' unknown"),
        ("fp8," + ",".join(f"{i}=bf16" for i in range(20)), "the page label allows 64"),
    ],
)
def test_bad_specs_are_refused_naming_the_part(text: str, message: str) -> None:
    with pytest.raises(KVFormatError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        parse_spec(text, auto="bf16")
    with pytest.raises(ConfigError, match="kv format"):
        EngineConfig(kv_format=text, device="cpu")


def test_resolution_refusals_name_the_layer_and_head_dim() -> None:
    with pytest.raises(KVFormatError, match="layer 6 out of range, the model has 6 layers"):
        resolve_formats("fp8,6=bf16", "bf16", GEMMA_WINDOWS, 64)
    with pytest.raises(KVFormatError, match="int8 needs head_dim divisible by 32, got 48"):
        resolve_formats("int8", "bf16", GEMMA_WINDOWS, 48)
    with pytest.raises(KVFormatError, match="fp8\\+h needs a power-of-two head_dim, got 48"):
        resolve_formats("fp8+h", "bf16", GEMMA_WINDOWS, 48)


def test_engine_config_names_and_page_hashes_separate_formats() -> None:
    cfg = EngineConfig(kv_format="nvfp4+h,global=bf16", device="cpu")
    assert cfg.kv_format_name == "nvfp4+h,global=bf16" and cfg.kv_dtype == torch.float32
    assert EngineConfig(device="cpu").kv_format_name == "fp32"
    assert EngineConfig(kv_format="bf16", device="cpu").kv_dtype == torch.bfloat16
    tokens = list(range(128))
    by_format = {f: chain_hashes(tokens, 64, "m", f) for f in ("bf16", "fp8", "fp8+h", "fp8,global=bf16")}
    assert len({h for hashes in by_format.values() for h in hashes}) == 8  # no page shared across formats


# -- engines on tiny models -----------------------------------------------------------------------------


@torch.inference_mode()
def _teacher_forced_logits(model: torch.nn.Module, pool: KVPool, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits [T, V] of every position, prefilled in chunks through StepAttention over `pool`."""
    cfg = model.config
    out = []
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        span = SeqSpan(start, n, torch.arange(start, start + n), torch.arange(start + n), None)
        attn = StepAttention(pool, [span], cfg.num_heads // cfg.num_kv_heads, torch.float32)
        hidden = model(torch.tensor(ids[start : start + n]), torch.arange(start, start + n), attn)
        out.append(model.logits(hidden).float())
    return torch.cat(out)


# Mean |logit - fp32-pool logit| over 48 teacher-forced positions, measured on these tiny random models
# (logit std ~2; the std-0.5 random llama amplifies KV error far more than a trained model):
#   llama: bf16 0.011, int8 0.034 (+h 0.031), fp8 0.162 (+h 0.160), nvfp4 0.589 (+h 0.563)
#   gemma: bf16 0.005, int8 0.014 (+h 0.012), fp8 0.062 (+h 0.059), nvfp4 0.272 (+h 0.258)
# The bounds leave 1.5x room; max errors are 6-15x the means (llama nvfp4: 8.9).
MEAN_LOGIT_ERROR = {
    "llama": {"bf16": 0.017, "int8": 0.05, "fp8": 0.25, "nvfp4": 0.9},
    "gemma": {"bf16": 0.008, "int8": 0.021, "fp8": 0.095, "nvfp4": 0.41},
}


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_quantised_pools_keep_logits_near_the_fp32_pool(arch: str) -> None:
    model = tiny_model(VOCAB, seed=3) if arch == "llama" else tiny_gemma(VOCAB, seed=3)
    cfg = model.config
    ids = [int(i) for i in torch.randint(100, VOCAB, (48,), generator=torch.Generator().manual_seed(0))]

    def logits(name: str) -> torch.Tensor:
        pool = KVPool(cfg.num_layers, 12, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU,
                      [parse_format(name)] * cfg.num_layers)  # fmt: skip
        return _teacher_forced_logits(model, pool, ids, chunk=16)

    ref = logits("fp32")
    means = {}
    for name in ("bf16", "int8", "int8+h", "fp8", "fp8+h", "nvfp4", "nvfp4+h"):
        means[name] = (logits(name) - ref).abs().mean().item()
        bound = MEAN_LOGIT_ERROR[arch][name.removesuffix("+h")]
        assert 0 < means[name] <= bound, f"{arch} {name}: mean logit error {means[name]:.4f} > {bound}"
    assert means["bf16"] < means["int8"] < means["fp8"] < means["nvfp4"]


def _engine(
    model: torch.nn.Module, tokenizer: Tokenizer, kv_format: str, num_slots: int, page_size: int = 4,
    ring: RingLimits | None = None, store_address: str = "", policy: str = "exact",
) -> Engine:  # fmt: skip
    """helpers.make_engine with a pool in `kv_format` (one format for every layer), exact prefill by default
    and ring chunks of 8 tokens with a ring (stopped after the test, as make_engine's engines are)."""
    return make_engine(
        model, tokenizer, num_slots, page_size=page_size, ring=ring, ring_chunk=8 if ring else 0,
        store_address=store_address, default_policy=policy, kv_format=parse_format(kv_format).name,
    )  # fmt: skip


@pytest.mark.parametrize("kv_format", ["fp8", "int8", "nvfp4+h"])
def test_engine_generates_with_a_quantised_pool(smol_tokenizer: Tokenizer, kv_format: str) -> None:
    """Greedy tokens from the engine equal a one-sequence teacher-forced pass over the same format."""
    model = tiny_model(VOCAB, seed=4)
    engine = _engine(model, smol_tokenizer, kv_format, num_slots=32)
    prompt = [int(i) for i in torch.randint(100, VOCAB, (21,), generator=torch.Generator().manual_seed(1))]
    seq = engine.submit("q", prompt, greedy(8))
    run_until_done(engine, [seq])
    tokens, _ = drain(events_of(seq))
    assert len(tokens) == 8
    cfg = model.config
    pool = KVPool(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU,
                  [parse_format(kv_format)] * cfg.num_layers)  # fmt: skip
    forced = _teacher_forced_logits(model, pool, prompt + tokens, chunk=16)
    assert forced[len(prompt) - 1 :].argmax(-1).tolist()[:8] == tokens


def test_ring_restores_quantised_pages_byte_for_byte(smol_tokenizer: Tokenizer, start_store: StartStore) -> None:
    """A second fp8+h ring engine adopts the first one's pages from the kvstore and restores them: every
    resident page equals its host copy byte for byte, and its tokens equal an unlimited fp8+h pool's."""
    address = start_store(host_kv_mib=32).address
    model = tiny_model(VOCAB, seed=11)
    prompt = [int(i) for i in torch.randint(100, VOCAB, (70,), generator=torch.Generator().manual_seed(2))]
    engines = []
    for name in ("first", "second"):
        engine = _engine(model, smol_tokenizer, "fp8+h", num_slots=8, ring=ring_limits(budget_pages=8),
                         store_address=address)  # fmt: skip
        seq = engine.submit(name, prompt if name == "first" else prompt + [901, 902, 903], greedy(6))
        run_until_done(engine, [seq])
        engine.write_through.flush()
        engines.append((engine, seq))
    second, seq = engines[1]
    tokens, done = drain(events_of(seq))
    assert done.cached_tokens == 68 and second.ring.num_restores > 0  # 17 pages from the host store
    checked = 0
    with KVStoreClient(address) as reader:
        for h in chain_hashes(seq.token_ids, 4, "tiny", "fp8+h"):
            slot = second.slots.lookup(h)
            if slot is not None:
                assert reader.get_page(h) == second.pool.read_page(slot).numpy().tobytes()
                checked += 1
    assert checked >= 3
    dense = _engine(model, smol_tokenizer, "fp8+h", num_slots=32)
    seq2 = dense.submit("dense", prompt + [901, 902, 903], greedy(6))
    run_until_done(dense, [seq2])
    assert drain(events_of(seq2))[0] == tokens
    for engine, _ in engines:
        engine.write_through.close()


# -- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8", "int8", "nvfp4", "fp8+h", "nvfp4+h"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_cuda_triton_kernels_match_the_reference(name: str, head_dim: int) -> None:
    """On the GPU: the kernels write the reference's bytes (fp32 division may move a rare value by one
    code) and dequantise exactly what the reference dequantises from the same bytes."""
    if not torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("needs CUDA and triton")
    from services.engine.kernels.pages import kv_triton

    dev = torch.device("cuda")
    fmt = parse_format(name)
    x = _rows(3000, 3, head_dim, seed=7).to(dev, torch.bfloat16)
    rows = torch.randperm(4096, device=dev)[:3000]
    store = torch.zeros(4096, 3, fmt.row_bytes(head_dim), dtype=torch.uint8, device=dev)
    kv_triton.quantize_scatter(fmt, x, rows, store)
    ref = fmt.quantize(x)
    differ = (store[rows] != ref).float().mean().item()
    assert differ < 1e-3, f"{differ:.2e} of the bytes differ"
    for dtype in (torch.float32, torch.bfloat16):
        out = kv_triton.gather_dequantize(fmt, store, rows, head_dim, dtype)
        assert torch.equal(out, fmt.dequantize(store[rows], dtype))
    before = active_tier()
    try:
        use_tier(KernelTier("triton", "cuda", (9, 0), True))
        pool = KVPool(2, 64, 64, 3, head_dim, torch.bfloat16, dev, [fmt, parse_format("bf16")])
        pool.write(0, rows[:500], x[:500], x[:500])
        k, v = pool.gather(0, rows[:500], torch.float32)
        slot = int(rows[0]) // 64
        page = pool.read_page(slot)
        assert page.numel() == pool.page_nbytes
        k_page, _ = pool.page_kv(page, 0, torch.float32)  # the torch reference over the page's bytes
        k_rows = pool.gather_keys(0, pool.rows(torch.tensor([slot], device=dev)))
        torch.testing.assert_close(k_page, k_rows, rtol=1e-5, atol=1e-6)  # +h: two fp32 matmuls
        err = (v - x[:500].float()).abs().max() / x[:500].float().abs().max()
        assert err < {"fp8": 0.07, "int8": 0.01, "nvfp4": 0.2}[fmt.base]
    finally:
        use_tier(before)


@pytest.mark.gpu
def test_cuda_fp8_k_and_v_in_one_launch_write_the_two_launches_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU (KVMEM_FP8_KV_ONE_LAUNCH=1's path): a decode step's K and V, strided views of its qkv rows, written
    by quantize_scatter_kv into a pool's fp8 layers land as the two quantising launches write them; the one launch
    took both layers' writes (a refusal would fall back to two launches and compare them with themselves)."""
    if not torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("needs CUDA and triton")
    from services.engine.kernels.pages import kv_triton

    taken: list[bool] = []
    real = kv_triton.quantize_scatter_kv
    monkeypatch.setattr(kv_triton, "quantize_scatter_kv", lambda *a: taken.append(real(*a)) or taken[-1])
    dev = torch.device("cuda")
    hq, h, d = 32, 8, 128
    qkv = _rows(96, hq + 2 * h, d, seed=3).to(dev, torch.bfloat16)
    k, v = qkv[:, hq : hq + h], qkv[:, hq + h :]
    rows = torch.randperm(4096, device=dev)[:96]
    before = active_tier()
    try:
        use_tier(KernelTier("triton", "cuda", (9, 0), True))
        pools = [KVPool(2, 64, 64, h, d, torch.bfloat16, dev, [parse_format("fp8")] * 2) for _ in range(2)]
        pools[0].fp8_kv_one_launch, pools[1].fp8_kv_one_launch = True, False
        for pool in pools:
            for layer in (0, 1):
                pool.write(layer, rows, k, v)
        assert taken == [True, True]  # the one-launch pool's two layers; the other pool never asks
        for layer in (0, 1):
            assert torch.equal(pools[0].k[layer], pools[1].k[layer]) and torch.equal(
                pools[0].v[layer], pools[1].v[layer]
            )
        assert pools[0].k[0][rows].any()
    finally:
        use_tier(before)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", ["bf16", "fp8", "mixed", "local"])
def test_pages_move_through_the_layer_stack_as_through_each_layer(
    case: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_pages / read_pages over the paged layers' one stack (one reorder and one indexed copy for every layer,
    the CUDA path) leave and return the same bytes as the per-layer copies: plain and fp8 pools, a pool of mixed
    formats (no stack: the per-layer path), and one with local rings (whole pages and the slots' parts)."""
    from services.engine.ring.local_ring import LocalRings

    device = device_or_skip(where)
    formats = {"bf16": ["bf16"] * 3, "fp8": ["fp8"] * 3, "mixed": ["fp8", "bf16", "fp8"], "local": ["bf16"] * 3}[case]
    local = LocalRings({1: 8}, span=16, num_rings=2, page_size=8) if case == "local" else None

    def pool() -> KVPool:
        built = KVPool(3, 6, 8, 2, 32, torch.float32, device, [parse_format(f) for f in formats], local)
        built.stack_copies = True  # the CUDA path, here on the CPU
        return built

    src = pool()
    for layer in src.paged_layers:
        rows = torch.arange(48, device=device)
        src.write(layer, rows, _rows(48, 2, 32, seed=layer).to(device), _rows(48, 2, 32, seed=10 + layer).to(device))
    assert (src._slot_stack is None) == (case == "mixed")
    ring = (0, [0, 1]) if local is not None else None
    pages = src.read_pages([4, 1], ring)
    monkeypatch.setattr(src, "stack_copies", False)  # the per-layer path, on the same stores
    assert torch.equal(src.read_pages([4, 1], ring), pages)
    monkeypatch.undo()
    parts = [pages] if local is None else [pages, torch.cat([pages[:, lo:hi] for lo, hi in src.slot_parts], dim=1)]
    for data in parts:
        fast, slow = pool(), pool()
        monkeypatch.setattr(slow, "stack_copies", False)
        fast.write_pages([0, 5], data)
        slow.write_pages([0, 5], data)
        monkeypatch.undo()
        for layer in src.paged_layers:
            assert torch.equal(fast.k[layer], slow.k[layer]) and torch.equal(fast.v[layer], slow.v[layer])
            assert torch.equal(fast.k[layer][:8], src.k[layer][32:40])  # slot 4's rows now in slot 0
            assert torch.equal(fast.v[layer][40:48], src.v[layer][8:16])  # slot 1's in slot 5


@pytest.mark.parametrize(("env", "on"), [(None, True), ("1", True), ("0", False)])
def test_fp8_layers_are_read_in_place_unless_switched_off(
    env: str | None, on: bool, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """An fp8 layer's rows go to the attention kernels as stored (KVPool.fp8_kv) by default; KVMEM_FP8_ATTENTION=0
    sends it through the gather + dequantise path (fp8_kv None); a bf16 layer is never an fp8 store."""
    from services.engine.kv import kv_pool

    if env is None:
        monkeypatch.delenv("KVMEM_FP8_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("KVMEM_FP8_ATTENTION", env)
    kv_pool.fp8_in_place.cache_clear()
    request.addfinalizer(kv_pool.fp8_in_place.cache_clear)
    pool = KVPool(2, 4, 4, 2, 16, torch.bfloat16, torch.device("cpu"),
                  formats=[parse_format("fp8"), parse_format("bf16")])  # fmt: skip
    assert kv_pool.fp8_in_place() is on
    assert (pool.fp8_kv(0) is not None) is on
    assert pool.fp8_kv(1) is None
