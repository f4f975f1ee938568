"""The fp8 attention kernels' global-to-shared copies at sm_90, without a GPU: per thread, how many `cp.async` copies
of each width the decode split kernel (bf16 and fp16 dots) and the prefill kernel compile to over fp8 rows, at
Llama-3.1-8B's shape (32 / 8 heads of 128), and the bytes they move. The codes should go 16 bytes a copy; a row's
scale is 4 bytes, and how the compiler places it decides how often each thread copies it.

    TRITON_INTERPRET=0 PYTHONPATH=. python3 bench/fp8_copies.py
    TRITON_INTERPRET=0 PYTHONPATH=/path/to/triton-3.6:. python3 bench/fp8_copies.py   # the device's compiler

(`pip install --no-deps --target /path/to/triton-3.6 triton==3.6.0` gives torch 2.11's Triton beside a newer
one.) Compiled ahead of time as tests/engine/test_kernels_compile.py does (ASTSource -> PTX)."""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))


def copies(ptx: str) -> collections.Counter[int]:
    """cp.async copies in the PTX by width in bytes."""
    return collections.Counter(
        int(w, 16) for w in re.findall(r"cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*, (0x[0-9a-f]+)", ptx)
    )


def decode_ptx(f16: bool) -> str:
    import test_kernels_compile as tkc

    from services.engine.kernels import decode_attention_triton as dat

    ptrs = dict(q_ptr="*bf16", k_ptr="*u8", v_ptr="*u8", rows_ptr="*i64", key_pos_ptr="*i64", q_pos_ptr="*i64",
                m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr="*bf16", keep_ptr="*bf16")  # fmt: skip
    ints = ["width", "rows_per_split", "num_splits", "window", "span"]
    ints += [f"stride_{s}" for s in ("qb", "qh", "kr", "kh", "vr", "vh", "ob", "oh")]
    types = dict(ptrs, scale_log2="fp32", **{name: "i32" for name in ints})
    div16 = (*ptrs, "width", "rows_per_split", "stride_qb", "stride_qh", "stride_kr", "stride_vr", "stride_kh",
             "stride_vh", "stride_ob", "stride_oh")  # fmt: skip
    constexprs = dict(G=4, BLOCK_G=16, D=128, BLOCK_N=64, HAS_WINDOW=False, RING=False, DIRECT=False,
                      DOT_FP32=False, INTERPRETED=False, SPLIT_BLOCKS=0, KEEP_Q=True, PDL=True, SORTED=True, FP8=True,
                      FP8_F16=f16)  # fmt: skip
    return str(tkc._compile(dat._split_kernel, types, constexprs, div16).asm["ptx"])


def prefill_ptx() -> str:
    import test_kernels_compile as tkc

    from services.engine.kernels import prefill_attention_triton as pat

    ints = ["n_q", "past"] + [f"stride_{s}" for s in ("qn", "qh", "kr", "kh", "vr", "vh", "on", "oh")]
    types = dict(q_ptr="*bf16", k_ptr="*u8", v_ptr="*u8", rows_ptr="*i64", out_ptr="*bf16", scale_log2="fp32")
    types.update({name: "i32" for name in ints})
    block_m, block_n, _, _ = pat.config(128)
    constexprs: dict[str, object] = dict(G=4, D=128, BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP32=False, FP8=True)
    div16 = ("q_ptr", "k_ptr", "v_ptr", "rows_ptr", "out_ptr", "stride_qn", "stride_qh", "stride_kr", "stride_vr",
             "stride_kh", "stride_vh", "stride_on", "stride_oh")  # fmt: skip
    return str(tkc._compile(pat._prefill_kernel, types, constexprs, div16).asm["ptx"])


def main() -> int:
    import triton

    print(f"Triton {triton.__version__}, sm_90: cp.async copies a thread by width (bytes), and bytes in all")
    for name, ptx in (("decode, bf16 dots", decode_ptx(False)), ("decode, fp16 dots", decode_ptx(True)),
                      ("prefill", prefill_ptx())):  # fmt: skip
        count = copies(ptx)
        cells = ", ".join(f"{width} B x {count[width]}" for width in sorted(count, reverse=True))
        print(f"  {name:18s} {cells}; {sum(w * n for w, n in count.items())} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
