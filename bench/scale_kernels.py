"""Decode kernels at Llama-3.1-8B's shapes (issue 26), CUDA: what a batch-1 or batched decode step spends.

    PYTHONPATH=. python3 bench/scale_kernels.py [--only linear,attention,head,swiglu,fp8,prefill_gemm,residual,pages]
        [--sweep]

- linear: each projection of a decode step (qkv 6144 x 4096, o 4096 x 4096, gate/up 2 x 14336 x 4096 with the
  SiLU product, down 4096 x 14336) at M rows: cuBLAS (F.linear; gate/up then the torch product), the Triton
  kernel's heuristic (kernels/layer/linear_triton.py `config`), and with --sweep every configuration of a small grid
  at M = 1. GB/s counts the weight bytes (each read once). M runs to 64: the kernel takes 32 and 64 rows in wider
  tiles (where cuBLAS splits K into a second launch).
- residual: o and down at 8K and 16K rows followed by the residual sum, as two launches and as addmm_ (the sum in
  cuBLAS's epilogue: models/llama.project_add).
- attention: the flash-decoding kernel (kernels/attention/decode_attention_triton.py) over 32 layers' pools, Hq 32 /
  Hkv 8 of 128, at the decode graphs' padded windows (W a power of two >= the rows, as DecodeGraphs pads them), for
  MAX_SPLIT_ROWS in a few values (rows per split program at most). TB/s counts the real K/V bytes.

- swiglu: the SwiGLU of prefill rows (M x 2 x 14336 -> M x 14336): torch's silu then multiply (two launches) against
  kernels/layer/norm_triton.py `silu_mul` (one), and the largest difference between them. GB/s counts
  3 x M x 14336 x 2 B.
- fp8: both attention kernels over fp8 rows read in place (`fp8=True`, uint8 [R, 8, 16 + 128]) against the same rows
  in bf16: decode at B x rows (the ring's 32 x 4K, one 32K session), its fp8 dots in bf16 (KVMEM_FP8_DOT=bf16, the
  kernel before fp16 operands) and in fp16 (the default) in the same process, with --sweep the fp16 path's warps /
  stages / rows per step (an fp8-tensor-core kernel, wgmma e4m3 with the products transposed, was 196 vs 142 us at
  32 x 4K on an H100 and was removed: bench/RESULTS.md round 18); and the last 8K chunk of a 32K prefill; TB/s
  counts the K/V bytes in each format (an fp8 row is 144 bytes), TFLOP/s the causal attention FLOPs.

- prefill_gemm: cuBLAS TFLOP/s of each projection at prompt-chunk row counts M (8,192 exactly, 8,192 + a few decode
  rows, 16,384 and beyond, a whole 32,640-token prompt), the (M, projection) cells in a shuffled order, five passes,
  the median of each: whether a step should plan its rows to a multiple of something (a first, ordered table
  favoured M = 8,192 by 10-15%, possibly the GPU's clocks settling after the first cells).
- pages: KVPool.write_pages / read_pages of 16, 64 and 256 pages (the ring's restores, the write-through's reads) in
  bf16 and fp8, through the paged layers' one stack against the per-layer copies, eager (ms a call); and a decode
  step's fp8 K/V writes at batch 1 and 32, one launch a layer against two and their contiguous copies.

Times are microseconds per layer, from CUDA-graph replays of 32 calls on 32 distinct weights / pools (one decode
step's layers; nothing stays in L2). bench/kernel_sweep.py is the same method at Gemma 3 270M's shapes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import graph_timing  # noqa: E402
from services.engine.kernels.attention import decode_attention_triton as dat  # noqa: E402
from services.engine.kernels.layer import linear_triton as lt  # noqa: E402

LAYERS = 32
SWEEP_ROWS = tuple(int(m) for m in os.environ.get("KVMEM_SWEEP_ROWS", "1,32").split(","))  # rows the sweep times
# (MAX_SPLIT_ROWS, rows per loop step or 0 for block_rows, num_warps, num_stages, sorted_keys): the engine's
# default before issue 26 first, then with the padding splits skipped (the decode graphs pass sorted_keys now)
VARIANTS = ((512, 0, 4, 2, False), (512, 0, 4, 2, True), (1024, 0, 4, 2, True), (512, 0, 4, 4, True))
# (batch, rows of each sequence, W exact instead of the power-of-two bucket)
CASES = ((1, 32_896, False), (1, 32_896, True), (32, 8_320, False), (64, 2_176, False))
# (BLOCK_V, BLOCK_K, num_warps, LOOP_STAGES) of the head kernel: the short-hidden config (unrolled 64 x 64) first
HEAD_CONFIGS = ((64, 64, 4, 0), (64, 128, 4, 3), (32, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3), (32, 128, 4, 4))
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def per_call_us(fn: Callable[[], object], calls: int = LAYERS, reps: int = 20) -> float:
    """Mean time of one of the `calls` calls `fn` makes, replayed as a CUDA graph (bench/graph_timing.py)."""
    return graph_timing.per_call_us(fn, calls, reps)


def _gated_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_table(dev: torch.device, sweep: bool) -> None:
    # BLOCK_N, BLOCK_K, warps, stages, SPLIT_K (KVMEM_SWEEP_WARPS: "4,8" for the warps too)
    warps = [int(w) for w in os.environ.get("KVMEM_SWEEP_WARPS", "4").split(",")]
    grid = list(itertools.product([16, 32, 64, 128], [128, 256], warps, [4, 6], [1, 2, 4]))
    for name, (n, k) in PROJECTIONS.items():
        gated = name == "gate_up"
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS)]
        gb = n * k * 2 / 1e9
        for m in (1, 16, 32, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            if m > lt.MAX_ROWS:  # the engine's path for a larger batch: cuBLAS
                f = _gated_torch if gated else F.linear
                base = per_call_us(lambda x=x, ws=ws, f=f: [f(x, w) for w in ws])
                print(
                    f"{name:8s} M={m:2d} N={n} K={k}: cublas {base:7.1f} us ({gb / base * 1e6:5.0f} GB/s)", flush=True
                )
                continue
            if gated:
                base = per_call_us(lambda x=x, ws=ws: [_gated_torch(x, w) for w in ws])
                heur = per_call_us(lambda x=x, ws=ws: [lt.linear_gated(x, w, "silu") for w in ws])
                cfg_h = lt.config(n // 2, k)
            else:
                base = per_call_us(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
                heur = per_call_us(lambda x=x, ws=ws: [lt.linear(x, w) for w in ws])
                cfg_h = lt.config(n, k)
            line = (f"{name:8s} M={m:2d} N={n} K={k}: cublas {base:7.1f} us ({gb / base * 1e6:5.0f} GB/s) | "
                    f"triton {cfg_h} {heur:7.1f} us ({gb / heur * 1e6:5.0f} GB/s)")  # fmt: skip
            if sweep and m in SWEEP_ROWS:
                timed = []
                for cfg in grid:
                    if gated and cfg[4] != 1:
                        continue
                    try:
                        if gated:
                            t = per_call_us(
                                lambda x=x, ws=ws, cfg=cfg: [lt.linear_gated(x, w, "silu", cfg=cfg) for w in ws]
                            )
                        else:
                            t = per_call_us(lambda x=x, ws=ws, cfg=cfg: [lt.linear(x, w, cfg=cfg) for w in ws])
                        timed.append((t, cfg))
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                        print(f"  {cfg}: {type(exc).__name__}")
                timed.sort()
                line += " | best " + ", ".join(f"{c} {t:.1f} ({gb / t * 1e6:.0f} GB/s)" for t, c in timed[:3])
            print(line, flush=True)
        del ws


def attention_table(dev: torch.device) -> None:
    heads, kv_heads, d = 32, 8, 128
    real_max = dat.MAX_SPLIT_ROWS
    try:
        for batch, length, exact in CASES:
            width = 256
            while width < length:
                width *= 2
            if exact:  # no bucket: the rows rounded up to whole pages (what the padding costs)
                width = -(-length // 64) * 64
            rows_total = batch * length
            layers = LAYERS if rows_total <= 300_000 else 8  # 32 layers of 32 x 8K would be 34 GB
            ks = [torch.randn(rows_total, kv_heads, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
            vs = [torch.randn(rows_total, kv_heads, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
            q = torch.randn(batch, heads, d, device=dev, dtype=torch.bfloat16)
            pad = torch.zeros(batch, width - length, dtype=torch.long, device=dev)
            rows = torch.cat([torch.arange(b * length, (b + 1) * length, device=dev)[None] for b in range(batch)])
            rows = torch.cat((rows, pad), dim=1).contiguous()
            key_pos = torch.cat(
                (torch.arange(length, device=dev).expand(batch, -1), pad + (1 << 40)), dim=1
            ).contiguous()
            q_pos = torch.full((batch,), length - 1, device=dev)
            gb = 2 * batch * length * kv_heads * d * 2 / 1e9
            cells = []
            real_rows, real_warps, real_stages = dat.block_rows, dat.NUM_WARPS, dat.STAGES_BY_HEAD_DIM
            for max_rows, step, warps, stages, srt in VARIANTS:
                dat.MAX_SPLIT_ROWS, dat.NUM_WARPS, dat.STAGES_BY_HEAD_DIM = max_rows, warps, {d: stages}
                dat.block_rows = (lambda w, step=step: step) if step else real_rows  # type: ignore[assignment]
                try:
                    t = per_call_us(
                        lambda ks=ks, vs=vs, q=q, rows=rows, key_pos=key_pos, q_pos=q_pos, srt=srt: [
                            dat.decode_attention(q, ks[i], vs[i], rows, key_pos, q_pos, d**-0.5, sorted_keys=srt)
                            for i in range(len(ks))
                        ],
                        calls=layers,
                    )
                    splits = -(-width // dat.split_rows(batch, kv_heads, width))
                    name = f"{max_rows}/{step or 0}/{warps}w/{stages}s{'/sorted' if srt else ''}"
                    cells.append(f"{name}: {t:6.1f} us {gb / t * 1e3:4.2f} TB/s ({splits} sp)")
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
                    cells.append(f"{max_rows}/{step}/{warps}w/{stages}s: {type(exc).__name__}")
                finally:
                    dat.block_rows, dat.NUM_WARPS, dat.STAGES_BY_HEAD_DIM = real_rows, real_warps, real_stages
            print(f"attention B={batch} rows {length} W={width}: " + " | ".join(cells), flush=True)
            del ks, vs
            torch.cuda.empty_cache()
    finally:
        dat.MAX_SPLIT_ROWS = real_max


def head_table(dev: torch.device) -> None:
    """The vocabulary head of one row (128256 x 4096): kernels/layer/head_triton.py against cuBLAS + cast + argmax."""
    from services.engine.kernels.layer import head_triton

    ws = [torch.randn(128_256, 4096, device=dev, dtype=torch.bfloat16) / 64 for _ in range(4)]
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    gb = 128_256 * 4096 * 2 / 1e9
    base = per_call_us(lambda: [torch.argmax(F.linear(x, w).float(), dim=-1) for w in ws], calls=4)
    line = f"head 128256 x 4096, 1 row: cublas+argmax {base:6.1f} us ({gb / base * 1e6:5.0f} GB/s)"
    if head_triton.supported(x, ws[0]):
        for cfg in HEAD_CONFIGS:
            try:
                kern = per_call_us(lambda cfg=cfg: [head_triton.head(x, w, True, cfg=cfg) for w in ws], calls=4)
                line += f" | {cfg} {kern:6.1f} us ({gb / kern * 1e6:5.0f} GB/s)"
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is reported
                line += f" | {cfg} {type(exc).__name__}"
    print(line, flush=True)


def swiglu_table(dev: torch.device, ms: tuple[int, ...] = (2048, 8192), inter: int = 14_336) -> None:
    """silu(gate) * up of prefill-sized rows: torch (the engine before norm_triton.silu_mul) and the kernel."""
    from services.engine.kernels.layer import norm_triton

    for m in ms:
        calls = 4
        xs = [torch.randn(m, 2 * inter, device=dev, dtype=torch.bfloat16) * 3 for _ in range(calls)]

        def torch_path(x: torch.Tensor) -> torch.Tensor:
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up

        diff = max((norm_triton.silu_mul(x).float() - torch_path(x).float()).abs().max().item() for x in xs)
        ulps = max((norm_triton.silu_mul(x) != torch_path(x)).float().mean().item() for x in xs)
        base = per_call_us(lambda xs=xs: [torch_path(x) for x in xs], calls=calls)
        kern = per_call_us(lambda xs=xs: [norm_triton.silu_mul(x) for x in xs], calls=calls)
        gb = 3 * m * inter * 2 / 1e9
        print(
            f"swiglu M={m} I={inter}: torch {base:7.1f} us ({gb / base * 1e6:5.0f} GB/s) | silu_mul {kern:7.1f} us "
            f"({gb / kern * 1e6:5.0f} GB/s) | max |diff| {diff:.3g}, elements differing {ulps:.2e}",
            flush=True,
        )
        del xs


def _decode_us(
    q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], reads: tuple[torch.Tensor, ...], fp8: bool
) -> float:
    """Microseconds of one decode attention call over each layer's stores (reads: rows, key_pos, q_pos)."""
    scale = q.shape[-1] ** -0.5
    return per_call_us(
        lambda: [
            dat.decode_attention(q, k, v, *reads, scale, sorted_keys=True, fp8=fp8) for k, v in zip(ks, vs, strict=True)
        ],
        calls=len(ks),
    )


@contextlib.contextmanager
def _fp8_dot(mode: str) -> Iterator[None]:
    """KVMEM_FP8_DOT=mode for the calls inside (dat.fp8_dot is read once: its cache is cleared on the way in and
    out); a CUDA graph captured inside keeps the mode's kernel."""
    before = os.environ.get("KVMEM_FP8_DOT")
    os.environ["KVMEM_FP8_DOT"] = mode
    dat.fp8_dot.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVMEM_FP8_DOT"]
        else:
            os.environ["KVMEM_FP8_DOT"] = before
        dat.fp8_dot.cache_clear()


# (NUM_WARPS, num_stages at D 128, rows per loop step or 0 for block_rows, MAX_SPLIT_ROWS[, MAX_REGISTERS]) of the
# fp16-dot fp8 path, --sweep
FP8_VARIANTS: tuple[tuple[int, ...], ...] = (
    (4, 4, 0, 512), (4, 3, 0, 512), (4, 2, 0, 512), (8, 4, 0, 512), (4, 4, 32, 512), (4, 4, 128, 512),
    (4, 4, 0, 256), (4, 4, 0, 1024), (4, 4, 0, 2048), (8, 4, 0, 1024), (4, 4, 128, 1024),
    (8, 4, 128, 512), (4, 2, 128, 512), (4, 3, 128, 512), (8, 3, 128, 1024), (4, 4, 128, 256),
    (4, 4, 128, 2048), (4, 3, 128, 2048), (4, 2, 256, 1024), (8, 2, 256, 1024), (8, 3, 256, 2048), (4, 3, 128, 1024),
    (4, 2, 128, 1024), (4, 2, 128, 2048), (4, 4, 128, 1024, 128), (4, 3, 128, 1024, 128), (4, 4, 128, 512, 128),
    (4, 2, 128, 1024, 128), (4, 4, 64, 1024, 128), (4, 4, 128, 1024, 168),
)  # fmt: skip


def _fp8_sweep(
    q: torch.Tensor,
    k8s: list[torch.Tensor],
    v8s: list[torch.Tensor],
    reads: tuple[torch.Tensor, ...],
    d: int,
    want: torch.Tensor,
) -> str:
    """The fp16-dot fp8 decode at each FP8_VARIANTS entry (the module's settings patched, then restored): its time
    and its output's relative difference from `want` (the default's output over the first layer: the same rows in
    another order of sums, ~1e-3)."""
    real_rows, real_warps, real_stages = dat.block_rows, dat.NUM_WARPS, dat.STAGES_BY_HEAD_DIM
    real_split, real_fp8_split, real_regs = dat.MAX_SPLIT_ROWS, dat.FP8_MAX_SPLIT_ROWS, dat.MAX_REGISTERS
    cells = []
    for warps, stages, step, split, *regs in FP8_VARIANTS:
        dat.NUM_WARPS, dat.STAGES_BY_HEAD_DIM, dat.MAX_SPLIT_ROWS = warps, {d: stages}, split
        dat.FP8_MAX_SPLIT_ROWS, dat.MAX_REGISTERS = split, (regs[0] if regs else None)
        dat.block_rows = (lambda w, fp8=False, step=step: step) if step else real_rows  # type: ignore[assignment]
        name = f"{warps}w/{stages}s/{step or 'auto'}/{split}" + (f"/r{regs[0]}" if regs else "")
        try:
            with _fp8_dot("fp16"):
                got = dat.decode_attention(q, k8s[0], v8s[0], *reads, d**-0.5, sorted_keys=True, fp8=True).float()
                rel = ((got - want).norm() / want.norm()).item()
                cells.append(f"{name}: {_decode_us(q, k8s, v8s, reads, True):6.1f} us ({rel:.1e})")
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile or fit is reported
            cells.append(f"{name}: {type(exc).__name__}")
        finally:
            dat.block_rows, dat.NUM_WARPS, dat.STAGES_BY_HEAD_DIM = real_rows, real_warps, real_stages
            dat.MAX_SPLIT_ROWS, dat.FP8_MAX_SPLIT_ROWS, dat.MAX_REGISTERS = real_split, real_fp8_split, real_regs
    return " | ".join(cells)


def fp8_table(
    dev: torch.device,
    cases: tuple[tuple[int, int], ...] = ((32, 4096), (1, 32_768)),
    chunk: tuple[int, int] = (8192, 24_576),
    layers: int = 8,
    sweep: bool = False,
) -> None:
    """The attention kernels over fp8 rows in place against the same rows in bf16 (`layers` distinct pools):
    decode of `cases` (batch, rows each) with the fp8 rows' dots in bf16 (KVMEM_FP8_DOT=bf16, before) and in fp16
    (the default), each one's relative difference from bf16 attention and from each other, and with `sweep` the
    fp16 path's FP8_VARIANTS; prefill of a `chunk` (new tokens, past tokens)."""
    from services.engine.kernels.attention import prefill_attention_triton as pat
    from services.engine.kv.kv_formats import parse_format

    fmt = parse_format("fp8")
    heads, kv_heads, d = 32, 8, 128
    for batch, length in cases:
        total = batch * length
        ks = [torch.randn(total, kv_heads, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        vs = [torch.randn(total, kv_heads, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        k8s, v8s = [fmt.quantize(k) for k in ks], [fmt.quantize(v) for v in vs]
        q = torch.randn(batch, heads, d, device=dev, dtype=torch.bfloat16)
        rows = torch.arange(total, device=dev).view(batch, length).contiguous()
        key_pos = torch.arange(length, device=dev).expand(batch, -1).contiguous()
        q_pos = torch.full((batch,), length - 1, device=dev)
        reads = (rows, key_pos, q_pos)
        want = dat.decode_attention(q, ks[0], vs[0], *reads, d**-0.5, sorted_keys=True).float()
        t_bf16 = _decode_us(q, ks, vs, reads, False)
        nbytes = 2 * total * kv_heads * ks[0].shape[-1] * ks[0].element_size()
        cells = [f"bf16 {t_bf16:7.1f} us {nbytes / t_bf16 / 1e6:4.2f} TB/s"]
        nbytes = 2 * total * kv_heads * k8s[0].shape[-1]
        outs, times = {}, {}
        for mode in ("bf16", "fp16"):
            with _fp8_dot(mode):
                outs[mode] = dat.decode_attention(q, k8s[0], v8s[0], *reads, d**-0.5, sorted_keys=True, fp8=True)
                times[mode] = t = _decode_us(q, k8s, v8s, reads, True)
            rel = ((outs[mode].float() - want).norm() / want.norm()).item()
            cells.append(f"fp8 {mode} dots {t:7.1f} us {nbytes / t / 1e6:4.2f} TB/s rel diff {rel:.2e}")
        old, new = outs["bf16"].float(), outs["fp16"].float()
        speedup, between = times["bf16"] / times["fp16"], ((new - old).norm() / old.norm()).item()
        cells.append(f"fp16 dots {speedup:.2f}x the bf16 ones, rel diff between them {between:.2e}")
        print(f"decode attention B={batch} rows {length}: " + " | ".join(cells), flush=True)
        if sweep:
            print(f"  fp8 fp16 dots B={batch} rows {length}: " + _fp8_sweep(q, k8s, v8s, reads, d, new), flush=True)
        del ks, vs, k8s, v8s
        torch.cuda.empty_cache()
    n, past = chunk
    t_all = n + past
    k, v = (torch.randn(t_all, kv_heads, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k8, v8 = fmt.quantize(k), fmt.quantize(v)
    q = torch.randn(n, heads, d, device=dev, dtype=torch.bfloat16)
    rows = torch.arange(t_all, device=dev)
    flops = 2 * heads * d * (t_all**2 - past**2)
    cells = []
    for name, kk, vv, f8 in (("bf16", k, v, False), ("fp8", k8, v8, True)):
        t = per_call_us(lambda kk=kk, vv=vv, f8=f8: [pat.prefill_attention(q, kk, vv, rows, d**-0.5, fp8=f8)], calls=1)
        cells.append(f"{name} {t / 1e3:6.2f} ms {flops / t / 1e6:5.0f} TFLOP/s")
    print(f"prefill attention {n} of {t_all}: " + " | ".join(cells), flush=True)


def prefill_gemm_table(
    dev: torch.device,
    ms: tuple[int, ...] = (8192, 8209, 8320, 16384, 16389, 16512, 32640),
    passes: int = 5,
) -> None:
    import random
    import statistics

    weights = {k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) for k, (n, kk) in PROJECTIONS.items()}
    inputs = {
        (m, k): torch.randn(m, weights[k].shape[1], device=dev, dtype=torch.bfloat16) for m in ms for k in weights
    }
    cells = list(inputs)
    times: dict[tuple[int, str], list[float]] = {c: [] for c in cells}
    rng = random.Random(0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(passes):
        rng.shuffle(cells)
        for m, k in cells:
            x, w = inputs[(m, k)], weights[k]
            F.linear(x, w)
            start.record()
            for _ in range(5):
                F.linear(x, w)
            end.record()
            torch.cuda.synchronize()
            times[(m, k)].append(start.elapsed_time(end) / 5)
    print(f"prefill GEMMs, cuBLAS TFLOP/s (median of {passes} shuffled passes): M, then {' / '.join(weights)}")
    for m in ms:
        row = []
        for k, w in weights.items():
            ms_call = statistics.median(times[(m, k)])
            row.append(f"{k} {2 * m * w.shape[0] * w.shape[1] / ms_call / 1e9:4.0f}")
        print(f"  M {m:6d}: " + ", ".join(row), flush=True)


def residual_table(dev: torch.device, ms: tuple[int, ...] = (8192, 16384), passes: int = 5) -> None:
    """The residual sum after o and down (models/llama.project_add): F.linear then an add launch, against
    residual.addmm_ (the sum as cuBLAS's epilogue, beta 1), us a call, median of shuffled passes."""
    import random
    import statistics

    cells = [(m, k, way) for m in ms for k in ("o", "down") for way in ("add", "addmm_")]
    data = {}
    for m in ms:
        for k in ("o", "down"):
            n, kk = PROJECTIONS[k]
            data[(m, k)] = (
                torch.randn(m, kk, device=dev, dtype=torch.bfloat16),
                torch.randn(n, kk, device=dev, dtype=torch.bfloat16) / kk**0.5,
                torch.randn(m, n, device=dev, dtype=torch.bfloat16),
            )
    times: dict[tuple[int, str, str], list[float]] = {c: [] for c in cells}
    rng = random.Random(0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(passes):
        rng.shuffle(cells)
        for m, k, way in cells:
            x, w, r = data[(m, k)]

            def call(x: torch.Tensor = x, w: torch.Tensor = w, r: torch.Tensor = r, way: str = way) -> None:
                if way == "add":
                    r + F.linear(x, w)
                else:
                    r.addmm_(x, w.t())

            call()
            start.record()
            for _ in range(5):
                call()
            end.record()
            torch.cuda.synchronize()
            times[(m, k, way)].append(start.elapsed_time(end) / 5 * 1e3)
    print(f"residual sum after a projection, us (median of {passes} shuffled passes): linear + add | addmm_ (epilogue)")
    for m in ms:
        for k in ("o", "down"):
            a, b = (statistics.median(times[(m, k, way)]) for way in ("add", "addmm_"))
            print(f"  M {m:6d} {k:5s}: {a:8.1f} | {b:8.1f}  ({a - b:+.1f} us a call)", flush=True)


def pages_table(dev: torch.device) -> None:
    """KVPool.write_pages / read_pages of P pages at the 8B shape (32 layers, 8 KV heads of 128, pages of 64; the
    ring's restores and write-through reads), through the paged layers' one stack against the per-layer copies
    (`stack_copies` off), eager as the engine calls them: ms a call, the median of 5 passes of 10."""
    import statistics

    from services.engine.kv.kv_formats import parse_format
    from services.engine.kv.kv_pool import KVPool

    def timed(fn: Callable[[], object]) -> float:
        fn()
        runs = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / 10)
        return statistics.median(runs)

    for name in ("bf16", "fp8"):
        pool = KVPool(LAYERS, 1024, 64, 8, 128, torch.bfloat16, dev, [parse_format(name)] * LAYERS)
        for count in (16, 64, 256):
            slots = list(range(3, 3 + 3 * count, 3))
            data = torch.randint(0, 255, (count, pool.page_nbytes), dtype=torch.uint8, device=dev)
            cells = []
            for label, on in (("stack", True), ("per layer", False)):
                pool.stack_copies = on
                w = timed(lambda pool=pool, slots=slots, data=data: pool.write_pages(slots, data))
                r = timed(lambda pool=pool, slots=slots: pool.read_pages(slots))
                cells.append(f"{label} write {w:6.3f} read {r:6.3f} ms")
            pool.stack_copies = True
            mb = count * pool.page_nbytes / 2**20
            print(f"pages {name} x {count:3d} ({mb:6.1f} MiB): " + " | ".join(cells), flush=True)
        if name != "fp8":
            continue
        for batch in (1, 32):  # a decode step's K/V writes: k, v views of its qkv rows (32 + 8 + 8 heads)
            qkv = torch.randn(batch, 48, 128, device=dev, dtype=torch.bfloat16)
            k, v = qkv[:, 32:40], qkv[:, 40:]
            rows = torch.arange(batch, device=dev) * 64 + 5
            pool.fp8_kv_one_launch = True
            one = per_call_us(lambda pool=pool, rows=rows, k=k, v=v: [pool.write(i, rows, k, v) for i in range(LAYERS)])
            pool.fp8_kv_one_launch = False
            two = per_call_us(lambda pool=pool, rows=rows, k=k, v=v: [pool.write(i, rows, k, v) for i in range(LAYERS)])
            print(f"fp8 K/V write, batch {batch:2d}: one launch {one:5.2f} us a layer | two (+ copies) {two:5.2f} us")


def main() -> int:
    if not torch.cuda.is_available():
        print("scale_kernels.py needs a CUDA device")
        return 2
    tables = {"attention", "linear", "head", "swiglu", "fp8", "prefill_gemm", "residual", "pages"}
    only = set(sys.argv[sys.argv.index("--only") + 1].split(",")) if "--only" in sys.argv else tables
    dev = torch.device("cuda")
    if "attention" in only:
        attention_table(dev)
    if "linear" in only:
        linear_table(dev, "--sweep" in sys.argv)
    if "head" in only:
        head_table(dev)
    if "swiglu" in only:
        swiglu_table(dev)
    if "fp8" in only:
        fp8_table(dev, sweep="--sweep" in sys.argv)
    if "prefill_gemm" in only:
        prefill_gemm_table(dev)
    if "residual" in only:
        residual_table(dev)
    if "pages" in only:
        pages_table(dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
