"""Page-summary, page-scoring and decode-attention kernels: each available backend against the torch path.

    python bench/kernel_table.py --device cuda            # GPU: triton, cupy and torch
    .venv/bin/python bench/kernel_table.py --device cpu --contexts 2048 --reps 3 \
        --decode-widths 256 --decode-batches 1,2      # smoke test (torch only)

Shapes: Gemma 3 270M (18 layers, 1 KV head, 4 query heads, head_dim 256) and SmolLM2 (30 layers,
3 KV heads, 9 query heads, head_dim 64) at 2K/8K/32K tokens of context (32/128/512 pages of 64).
Every timing covers all layers of the model, as the engine runs it:

    update keys   summaries of every page of the context from the gathered keys (kv_pool.gather_keys:
                  index_select of the bf16 pool rows and a widening copy to fp32, then the update):
                  what a prefix reuse / restore summarises; the torch column is the reference path
    update rows   the same straight from the bf16 pool rows (PageSummaries.update_rows: no copy)
    chunk keys    a 512-token prefill chunk's 8 pages from the gathered keys (every prefill chunk)
    score 1       one decode query token against every page (every decode step of a ring sequence)
    score 64      a 64-token query (the prompt's last turn, at re-selection)

Times are CUDA-event medians in microseconds per model (all layers); `x` is torch time / backend
time (above 1: faster than the reference). `err` is the largest relative difference from the torch
reference over the outputs (scores: pages holding at least 1e-3 of the mass).

The second table is one decode step's attention (one new token per sequence) at Gemma 3 270M's
shapes, B sequences each reading a window of W pool rows (scattered pages, the last one half full and
padded as decode_graph pads it), all 18 layers, bf16:

    torch     the path decode_graph runs today: per step an additive mask from the key positions, per
              layer index_select of the K and V rows, SDPA of [B, Hkv, G, D] queries over [B, Hkv, W, D]
    triton    kernels/attention/decode_attention_triton.decode_attention per layer (rows read in place, one
              split kernel + one merge kernel)

Both run as CUDA-graph replays on CUDA (as decode steps do), so launch overhead is not counted;
`err` is the largest difference from the torch path relative to the largest output value.

The third table (CUDA only) is Gemma 3 270M's four projections of a decode step over all 18 layers:
cuBLAS (F.linear) vs kernels/layer/linear_triton.py, with the weight bandwidth the kernel reaches; its gated row
is the gate/up projection with GELU(gate) * up as its epilogue against the two launches it replaces.

The fourth (`--tables block`) is Gemma 3 270M's 18 layers from the attention output to the next layer's
qkv: the six launches a decode step ran (o, post-norm + add + next norm, gated gate/up, down, post-norm +
add + next norm, qkv) against kernels/layer/block_triton.py's one persistent launch per layer, over grid sizes,
warps, and with the weights loaded before each barrier or after it; both replayed from a CUDA graph.

The fifth (`--tables head`) is Gemma 3 270M's vocabulary head at the end of a decode step (262,144 x 640
bf16): cuBLAS, the cast to fp32 and torch.argmax (the baseline) against kernels/layer/head_triton.py's one launch,
ten heads a replay, with the weight bandwidth each reaches and whether the tokens agree.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine.kv.attention import PAD_POS  # noqa: E402
from services.engine.ring.summaries import page_scores_reference, summary_update_reference  # noqa: E402

logger = logging.getLogger("bench.kernel_table")
PAGE = 64


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_dim: int


SHAPES = [Shape("gemma3-270m", 18, 1, 4, 256), Shape("smollm2", 30, 3, 9, 64)]


def _timer(device: torch.device, fn: Callable[[], object], reps: int) -> float:
    """Median microseconds of `fn` (after two warm-up calls)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


class Case:
    """One model shape at one context length: a bf16 pool per layer, summary tables, queries."""

    def __init__(self, shape: Shape, num_pages: int, device: torch.device) -> None:
        g = torch.Generator(device="cpu").manual_seed(num_pages)
        self.shape, self.num_pages, self.device = shape, num_pages, device
        rows = num_pages * PAGE
        self.pool = [
            torch.randn(rows, shape.num_kv_heads, shape.head_dim, generator=g).to(device, torch.bfloat16)
            for _ in range(shape.num_layers)
        ]
        slots = torch.randperm(num_pages, generator=g).to(device)  # pages live in scattered slots
        self.rows = (slots[:, None] * PAGE + torch.arange(PAGE, device=device)).reshape(-1)
        self.page_ids = torch.arange(num_pages, device=device)
        self.valid = torch.ones(num_pages, PAGE, dtype=torch.bool, device=device)
        self.valid[-1, PAGE // 2 :] = False  # the last page is partial
        table = (shape.num_layers, num_pages, shape.num_kv_heads, shape.head_dim)
        self.tables = [torch.zeros(table, device=device) for _ in range(3)]
        self.q = {n: torch.randn(n, shape.num_heads, shape.head_dim, generator=g).to(device, torch.bfloat16)
                  for n in (1, 64)}  # fmt: skip
        self.scale = shape.head_dim**-0.5
        self.run_update(None, num_pages, False)

    def gather(self, layer: int, pages: int) -> torch.Tensor:
        """kv_pool.gather_keys: [pages, 64, Hkv, D] fp32 copies of the pool rows."""
        rows = self.rows[: pages * PAGE]
        keys = self.pool[layer].index_select(0, rows).float()
        return keys.view(pages, PAGE, *keys.shape[1:])

    def layer_tables(self, layer: int) -> list[torch.Tensor]:
        return [t[layer] for t in self.tables]

    def run_update(self, kernels: object | None, pages: int, from_rows: bool) -> None:
        ids, valid = self.page_ids[:pages], self.valid[:pages]
        for layer in range(self.shape.num_layers):
            if kernels is None:
                kmin, kmax, kmean = self.layer_tables(layer)
                summary_update_reference(kmin, kmax, kmean, ids, self.gather(layer, pages), valid)
            elif from_rows:
                kernels.summary_update(  # type: ignore[attr-defined]
                    *self.layer_tables(layer), ids, self.pool[layer], valid, rows=self.rows[: pages * PAGE]
                )
            else:
                keys = self.gather(layer, pages)
                kernels.summary_update(*self.layer_tables(layer), ids, keys.view(-1, *keys.shape[2:]), valid)  # type: ignore[attr-defined]

    def run_scores(self, kernels: object | None, num_tokens: int) -> torch.Tensor:
        score = page_scores_reference if kernels is None else kernels.page_scores  # type: ignore[attr-defined]
        total = torch.zeros(self.num_pages, device=self.device)
        kmin, kmax = self.tables[0], self.tables[1]
        for layer in range(self.shape.num_layers):
            total += score(self.q[num_tokens], kmin[layer], kmax[layer], self.scale)
        return total


def _rel_err(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    """Largest |got - want| / |want| where |want| >= floor (infinities must match exactly); nan if any got is."""
    if torch.isnan(got).any():
        return float("nan")
    inf = torch.isinf(want)
    if not torch.equal(got[inf], want[inf]):
        return float("inf")
    keep = (want.abs() >= floor) & ~inf
    return float(((got - want).abs()[keep] / want.abs()[keep]).max()) if keep.any() else 0.0


def _ops(case: Case) -> dict[str, tuple[Callable[[object | None], object], Callable[[object | None], float]]]:
    """op name -> (timed call for a kernel module or None = reference, its error against the reference)."""

    def update_err(kernels: object | None, from_rows: bool, pages: int) -> float:
        case.run_update(None, pages, False)
        want = [t[:, :pages].clone() for t in case.tables]
        for t in case.tables:
            t[:, :pages] = float("nan")  # a kernel that writes nothing shows as nan
        case.run_update(kernels, pages, from_rows)
        got = [t[:, :pages] for t in case.tables]
        return max(_rel_err(g, w, 1e-6) for g, w in zip(got, want, strict=True))

    def score_err(kernels: object | None, n: int) -> float:
        want = case.run_scores(None, n)
        return _rel_err(case.run_scores(kernels, n), want, 1e-3 * float(want.sum()) / case.num_pages)

    chunk, every = min(8, case.num_pages), case.num_pages
    return {
        "update keys": (lambda k: case.run_update(k, every, False), lambda k: update_err(k, False, every)),
        "update rows": (lambda k: case.run_update(k, every, True), lambda k: update_err(k, True, every)),
        "chunk keys": (lambda k: case.run_update(k, chunk, False), lambda k: update_err(k, False, chunk)),
        "score 1": (lambda k: case.run_scores(k, 1), lambda k: score_err(k, 1)),
        "score 64": (lambda k: case.run_scores(k, 64), lambda k: score_err(k, 64)),
    }  # fmt: skip


class DecodeCase:
    """One decode step's attention: B sequences of W pool rows each, a bf16 pool per layer."""

    def __init__(self, shape: Shape, batch: int, width: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(batch * width)
        self.shape, self.device = shape, device
        num_pages = batch * width // PAGE
        pool = (num_pages * PAGE, shape.num_kv_heads, shape.head_dim)
        self.k = [torch.randn(pool, generator=g, device=device, dtype=torch.bfloat16) for _ in range(shape.num_layers)]
        self.v = [torch.randn(pool, generator=g, device=device, dtype=torch.bfloat16) for _ in range(shape.num_layers)]
        slots = torch.randperm(num_pages, generator=g, device=device).view(batch, width // PAGE)
        self.rows = (slots[:, :, None] * PAGE + torch.arange(PAGE, device=device)).reshape(batch, width)
        self.key_pos = torch.arange(width, device=device).repeat(batch, 1)
        self.rows[:, width - PAGE // 2 :] = 0  # the last page is half full: padding rows
        self.key_pos[:, width - PAGE // 2 :] = PAD_POS
        self.q_pos = torch.full((batch,), width - PAGE // 2 - 1, device=device)
        self.q = torch.randn(batch, shape.num_heads, shape.head_dim, generator=g, device=device, dtype=torch.bfloat16)
        self.scale = shape.head_dim**-0.5
        self.out = torch.empty_like(self.q)

    def torch_layer(self, layer: int, mask: torch.Tensor) -> torch.Tensor:
        """decode_graph's gather + SDPA for one layer -> [B, Hq, D]."""
        batch, width = self.rows.shape
        hkv, d = self.shape.num_kv_heads, self.shape.head_dim
        k = self.k[layer].index_select(0, self.rows.reshape(-1)).view(batch, width, hkv, d).transpose(1, 2)
        v = self.v[layer].index_select(0, self.rows.reshape(-1)).view(batch, width, hkv, d).transpose(1, 2)
        q = self.q.view(batch, hkv, self.shape.num_heads // hkv, d)  # [B, Hkv, G, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(batch, self.shape.num_heads, d)

    def mask(self) -> torch.Tensor:
        """The additive mask [B, 1, 1, W] decode_graph builds once per step."""
        allowed = self.key_pos <= self.q_pos[:, None]
        zero = torch.zeros((), dtype=self.q.dtype, device=self.device)
        return torch.where(allowed, zero, float("-inf")).to(self.q.dtype)[:, None, None, :]

    def run(self, kernels: object | None) -> None:
        """One step's attention over every layer (the torch path when kernels is None)."""
        if kernels is None:
            mask = self.mask()
            for layer in range(self.shape.num_layers):
                self.torch_layer(layer, mask)
            return
        for layer in range(self.shape.num_layers):
            kernels.decode_attention(  # type: ignore[attr-defined]
                self.q, self.k[layer], self.v[layer], self.rows, self.key_pos, self.q_pos, self.scale, out=self.out
            )

    def err(self, kernels: object) -> float:
        """Largest |kernel - torch path| over every layer, relative to the largest torch output."""
        mask, worst = self.mask(), 0.0
        for layer in range(self.shape.num_layers):
            want = self.torch_layer(layer, mask).float()
            got = kernels.decode_attention(  # type: ignore[attr-defined]
                self.q, self.k[layer], self.v[layer], self.rows, self.key_pos, self.q_pos, self.scale
            ).float()
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        return worst


def _graphed(device: torch.device, fn: Callable[[], object]) -> Callable[[], object]:
    """On CUDA, `fn` captured in a CUDA graph (replayed as a decode step is); elsewhere `fn` itself."""
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles Triton kernels) off the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _decode_table(
    device: torch.device, backends: dict[str, object], widths: list[int], batches: list[int], reps: int
) -> None:
    """The decode-attention rows: the torch path vs the Triton kernel, at Gemma 3 270M shapes."""
    kernels = None
    if "triton" in backends:
        kernels = importlib.import_module("services.engine.kernels.attention.decode_attention_triton")
    header = "| model | window | batch | torch us |" + (" triton us | triton x | triton err |" if kernels else "")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    shape = SHAPES[0]
    for width in widths:
        for batch in batches:
            case = DecodeCase(shape, batch, width, device)
            ref = _timer(device, _graphed(device, functools.partial(case.run, None)), reps)
            cells = [f"{ref:.0f}"]
            if kernels is not None:
                t = _timer(device, _graphed(device, functools.partial(case.run, kernels)), reps)
                cells += [f"{t:.0f}", f"{ref / t:.1f}", f"{case.err(kernels):.1e}"]
            label = f"{width // 1024}K" if width % 1024 == 0 else str(width)
            print(f"| {shape.name} | {label} | {batch} | " + " | ".join(cells) + " |", flush=True)
            del case


LINEAR_SHAPES = (("qkv", 1536, 640), ("o", 640, 1024), ("gate_up", 4096, 640), ("down", 640, 2048))  # Gemma 3 270M


def _linear_table(device: torch.device, batches: list[int], reps: int) -> None:
    """The projection rows: cuBLAS (F.linear) vs kernels/layer/linear_triton.py, 18 layers' distinct weights
    (537 MB with the head: nothing stays in L2)."""
    from services.engine.kernels.layer import linear_triton

    print("| projection | N x K | batch | torch us | triton us | triton x | triton err | triton GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    layers = SHAPES[0].num_layers
    for name, n, k in LINEAR_SHAPES:
        g = torch.Generator(device=device).manual_seed(n + k)
        weights = [torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(layers)]
        for batch in batches:
            x = torch.randn(batch, k, generator=g, device=device, dtype=torch.bfloat16)

            def torch_path(x: torch.Tensor = x, weights: list[torch.Tensor] = weights) -> None:
                for w in weights:
                    F.linear(x, w)

            def triton_path(x: torch.Tensor = x, weights: list[torch.Tensor] = weights) -> None:
                for w in weights:
                    linear_triton.linear(x, w)

            ref = _timer(device, _graphed(device, torch_path), reps)
            t = _timer(device, _graphed(device, triton_path), reps)
            want = linear_triton.linear_reference(x, weights[0]).float()
            err = float((linear_triton.linear(x, weights[0]).float() - want).abs().max() / want.abs().max())
            gbs = layers * n * k * 2 / (t * 1e-6) / 1e9
            print(f"| {name} | {n} x {k} | {batch} | {ref:.0f} | {t:.0f} | {ref / t:.2f} | {err:.1e} | {gbs:.0f} |",
                  flush=True)  # fmt: skip
            if name == "gate_up":  # the gated epilogue vs the two launches it replaces (Triton linear + GELU kernel)
                _gated_row(device, x, weights, n, k, batch, reps)


def _gated_row(
    device: torch.device, x: torch.Tensor, weights: list[torch.Tensor], n: int, k: int, batch: int, reps: int
) -> None:
    from services.engine.kernels.layer import linear_triton, norm_triton

    def two_launches() -> None:
        for w in weights:
            norm_triton.gelu_tanh_mul(linear_triton.linear(x, w))

    def gated() -> None:
        for w in weights:
            linear_triton.linear_gated(x, w, "gelu_tanh")

    ref = _timer(device, _graphed(device, two_launches), reps)
    t = _timer(device, _graphed(device, gated), reps)
    want = linear_triton.linear_gated_reference(x, weights[0], "gelu_tanh").float()
    err = float((linear_triton.linear_gated(x, weights[0], "gelu_tanh").float() - want).abs().max() / want.abs().max())
    gbs = len(weights) * n * k * 2 / (t * 1e-6) / 1e9
    print(f"| gate_up + GELU * up (vs Triton linear + GELU kernel) | {n} x {k} | {batch} | {ref:.0f} | {t:.0f} | "
          f"{ref / t:.2f} | {err:.1e} | {gbs:.0f} |", flush=True)  # fmt: skip


def _block_table(device: torch.device, reps: int) -> None:
    """The persistent layer-half kernel (kernels/layer/block_triton.py) against the six launches it replaces (o,
    post-norm + add + pre-norm, gated gate/up, down, post-norm + add + next norm, next qkv), Gemma 3 270M's
    18 layers chained through the residual stream, both replayed from a CUDA graph."""
    from services.engine.kernels.layer import block_triton, linear_triton, norm_triton

    layers, hidden, q_dim, inter, n_qkv = SHAPES[0].num_layers, 640, 1024, 2048, 1536
    g = torch.Generator(device=device).manual_seed(5)

    def mat(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16) / k**0.5

    def norm() -> torch.Tensor:
        return 0.1 * torch.randn(hidden, generator=g, device=device, dtype=torch.bfloat16)

    weights = [
        block_triton.BlockWeights(mat(hidden, q_dim), norm(), norm(), mat(2 * inter, hidden), mat(hidden, inter),
                                  norm(), norm(), mat(n_qkv, hidden) if i < layers - 1 else None, None, 1e-6, True,
                                  "gelu_tanh")
        for i in range(layers)
    ]  # fmt: skip
    attn = torch.randn(1, q_dim, generator=g, device=device, dtype=torch.bfloat16)
    x0 = torch.randn(1, hidden, generator=g, device=device, dtype=torch.bfloat16)

    def launches() -> torch.Tensor:
        x = x0
        for w in weights:
            assert w.post_attn is not None and w.post_ffn is not None  # Gemma 3's sandwich norms
            o = linear_triton.linear(attn, w.o)
            s, h = norm_triton.add_rms_norm(o, w.post_attn, x, w.pre_ffn, w.eps, gemma=True)
            d = linear_triton.linear(linear_triton.linear_gated(h, w.gate_up, "gelu_tanh"), w.down)
            x, h = norm_triton.add_rms_norm(d, w.post_ffn, s, w.next_norm, w.eps, gemma=True)
            if w.qkv is not None:
                linear_triton.linear(h, w.qkv)
        return x

    def persistent(programs: int | None = None, warps: int = 8, preload: bool = True) -> torch.Tensor:
        x = x0
        for w in weights:
            x, _, _ = block_triton.block(attn, x, w, programs, warps, preload)
        return x

    def want() -> torch.Tensor:
        x = x0
        for w in weights:
            x, _, _ = block_triton.block_reference(attn, x, w)
        return x

    ref_x = want().float()
    print("| path | programs | us (18 layers) | x vs launches | err vs torch |")
    print("|---|---|---|---|---|")
    base = _timer(device, _graphed(device, launches), reps)
    err = float((launches().float() - ref_x).abs().max() / ref_x.abs().max())
    print(f"| six launches (linear, add_rms_norm, gated, linear, add_rms_norm, linear) | - | {base:.1f} | 1.00 | "
          f"{err:.1e} |")  # fmt: skip
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    variants = [(p, 8, True) for p in sorted({sms, 128, 96})] + [(sms, 4, True), (sms, 8, False)]
    for programs, warps, preload in variants:
        if programs > sms:
            continue
        run = functools.partial(persistent, programs, warps, preload)
        t = _timer(device, _graphed(device, run), reps)
        err = float((run().float() - ref_x).abs().max() / ref_x.abs().max())
        label = f"persistent block ({warps} warps{', weights loaded while waiting at the barriers' if preload else ''})"
        print(f"| {label} | {programs} | {t:.1f} | {base / t:.2f} | {err:.1e} |", flush=True)


def _head_table(device: torch.device, reps: int) -> None:
    """The vocabulary head of a one-row step: cuBLAS + cast + torch.argmax against kernels/layer/head_triton.py."""
    from services.engine.kernels.layer import head_triton

    vocab, hidden, heads = 262_144, 640, 10
    g = torch.Generator(device=device).manual_seed(11)
    weight = (torch.randn(vocab, hidden, generator=g, device=device) / hidden**0.5).to(torch.bfloat16)
    rows = [torch.randn(1, hidden, generator=g, device=device).to(torch.bfloat16) for _ in range(heads)]
    tokens: dict[str, list[torch.Tensor]] = {"torch": [], "kernel": []}

    def baseline() -> None:
        tokens["torch"] = [torch.argmax(head_triton.head_reference(h, weight), dim=-1) for h in rows]

    def fused() -> None:
        tokens["kernel"] = [t for h in rows if (t := head_triton.head(h, weight, argmax=True)[1]) is not None]

    nbytes = weight.numel() * weight.element_size()
    print("| path | us a head | weight TB/s | x vs baseline | tokens agree |")
    print("|---|---|---|---|---|")
    base = _timer(device, _graphed(device, baseline), reps) / heads
    print(f"| cuBLAS + fp32 cast + torch.argmax | {base:.1f} | {nbytes / base / 1e6:.2f} | 1.00 | - |")
    t = _timer(device, _graphed(device, fused), reps) / heads
    baseline()
    fused()
    agree = all(bool(torch.equal(a, b)) for a, b in zip(tokens["torch"], tokens["kernel"], strict=True))
    print(f"| kernels/layer/head_triton.py (one launch) | {t:.1f} | {nbytes / t / 1e6:.2f} | {base / t:.2f} "
          f"| {agree} |", flush=True)  # fmt: skip


def _backends(device: torch.device, wanted: list[str]) -> dict[str, object]:
    """Kernel modules that can run here (triton, cupy), by name."""
    found: dict[str, object] = {}
    for name in wanted:
        if name == "torch":
            continue
        if device.type != "cuda":
            logger.warning("%s skipped: kernels are timed on CUDA only (the interpreter is for tests)", name)
            continue
        try:
            found[name] = importlib.import_module(f"services.engine.kernels.pages.summaries_{name}")
        except ImportError as e:
            logger.warning("%s skipped: %s", name, e)
    return found


def _summary_table(device: torch.device, backends: dict[str, object], contexts: list[int], reps: int) -> None:
    """The page-summary and scoring rows: every model shape and context, each backend vs the torch reference."""
    names = list(backends)
    header = "| model | context | op | torch us | " + " | ".join(f"{n} us | {n} x | {n} err" for n in names) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for shape in SHAPES:
        for ctx in contexts:
            case = Case(shape, ctx // PAGE, device)
            for op, (run, err) in _ops(case).items():
                ref = _timer(device, functools.partial(run, None), reps)
                cells = [f"{ref:.0f}"]
                for name in names:
                    t = _timer(device, functools.partial(run, backends[name]), reps)
                    cells += [f"{t:.0f}", f"{ref / t:.1f}", f"{err(backends[name]):.1e}"]
                print(f"| {shape.name} | {ctx // 1024}K | {op} | " + " | ".join(cells) + " |", flush=True)
            del case


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--contexts", default="2048,8192,32768", help="context lengths in tokens")
    p.add_argument("--backends", default="triton,cupy")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tables", default="summary,decode,linear", help="summary, decode, linear, block, head")
    p.add_argument("--decode-widths", default="2048,4096,8192", help="decode attention: rows read per sequence")
    p.add_argument("--decode-batches", default="1,8", help="decode attention: sequences per step")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(a.device)
    backends = _backends(device, a.backends.split(","))
    tables = a.tables.split(",")
    if "summary" in tables:
        _summary_table(device, backends, _ints(a.contexts), a.reps)
    if "decode" in tables:
        print()
        _decode_table(device, backends, _ints(a.decode_widths), _ints(a.decode_batches), a.reps)
    if "block" in tables and device.type == "cuda":  # CUDA only: interpreted, 18 layers take minutes
        print()
        _block_table(device, a.reps)
    if "linear" in tables and device.type == "cuda":  # CUDA only: the interpreter is for tests
        print()
        _linear_table(device, _ints(a.decode_batches), a.reps)
    if "head" in tables and device.type == "cuda":
        print()
        _head_table(device, a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
