"""The fp8 decode kernel's inner loop in sm_90 SASS, without a GPU: instruction counts of the split kernel's main
loop for the bf16 pool (the bandwidth to match), the fp8 rows with bf16 dots (KVMEM_FP8_DOT=bf16) and with fp16
dots (the default), at Llama-3.1-8B's shape (32 / 8 heads of 128, 64 rows a step, 4 warps, 4 stages).

    TRITON_INTERPRET=0 PYTHONPATH=. python3 bench/fp8_sass.py

Compiled ahead of time as tests/engine/test_kernels_compile.py does (ASTSource -> cubin), disassembled with the
nvdisasm Triton ships; the loop is the span of the longest backward branch. Counts are per thread and loop step
(64 rows: 16 KB of codes for K and V at D 128)."""

from __future__ import annotations

import collections
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

logger = logging.getLogger(__name__)
WATCH = ("F2F.BF16.F16", "F2FP.F16.E4M3.UNPACK_B", "LDS.U8", "PRMT", "HMMA", "LDSM", "BAR.SYNC")


def split_kernel_cubin(fp8: bool, f16: bool) -> bytes:
    import test_kernels_compile as tkc

    from services.engine.kernels.attention import decode_attention_triton as dat

    code = "*u8" if fp8 else "*bf16"
    ptrs = dict(q_ptr="*bf16", k_ptr=code, v_ptr=code, rows_ptr="*i64", key_pos_ptr="*i64", q_pos_ptr="*i64",
                m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr="*bf16", keep_ptr="*bf16",
                keep_pos_ptr="*i64")  # fmt: skip
    ints = ["width", "rows_per_split", "num_splits", "window", "span"]
    ints += [f"stride_{s}" for s in ("qb", "qh", "kr", "kh", "vr", "vh", "ob", "oh")]
    types = dict(ptrs, scale_log2="fp32", **{name: "i32" for name in ints})
    constexprs = dict(G=4, BLOCK_G=16, D=128, BLOCK_N=64, HAS_WINDOW=False, RING=False, DIRECT=False, DOT_FP32=False,
                      INTERPRETED=False, SPLIT_BLOCKS=0, KEEP_Q=False, KEEP_AT=False, PDL=True, SORTED=True,
                      FP8=fp8,
                      FP8_F16=f16)  # fmt: skip
    div16 = (*ptrs, "width", "rows_per_split", "stride_qb", "stride_qh", "stride_kr", "stride_vr", "stride_kh",
             "stride_vh", "stride_ob", "stride_oh")  # fmt: skip
    return tkc._compile(dat._split_kernel, types, constexprs, div16, num_stages=4).asm["cubin"]  # type: ignore[no-any-return]


def loop_counts(cubin: bytes) -> tuple[int, collections.Counter[str]]:
    """(instructions, opcode counts) of the longest loop of the cubin's SASS."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    labels: dict[str, int] = {}
    insts: list[str] = []
    for line in sass.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(insts)
        elif m := re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            insts.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip()))
    loops = [(labels[m.group(1)], i) for i, t in enumerate(insts)
             if (m := re.search(r"BRA\s+`?\(?(\.L_x_\d+)", t)) and labels.get(m.group(1), i + 1) <= i]  # fmt: skip
    start, end = max(loops, key=lambda span: span[1] - span[0])
    body = insts[start : end + 1]
    return len(body), collections.Counter(t.split()[0] for t in body)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if os.environ.get("TRITON_INTERPRET") == "1":
        logger.error("run with TRITON_INTERPRET=0: the kernels must compile")
        return 2
    import triton

    logger.info("triton %s, sm_90, split kernel loop (per thread, per 64-row step)", triton.__version__)
    for name, fp8, f16 in (
        ("bf16 pool", False, False),
        ("fp8, bf16 dots", True, False),
        ("fp8, fp16 dots", True, True),
    ):
        total, ops = loop_counts(split_kernel_cubin(fp8, f16))
        watched = ", ".join(f"{op} {sum(n for o, n in ops.items() if o.startswith(op))}" for op in WATCH)
        logger.info("%-15s %4d instructions: %s", name, total, watched)
    return 0


if __name__ == "__main__":
    sys.exit(main())
