"""The fp8 attention kernels' global-to-shared copies at sm_90, without a GPU: per thread, how many `cp.async` copies
of each width the decode split kernel (bf16 and fp16 dots) and the prefill kernel compile to over fp8 rows, at
Llama-3.1-8B's shape (32 / 8 heads of 128), and the bytes they move; the same kernels over bf16 rows beside
them. The codes should go 16 bytes a copy; a row's
scale is 4 bytes, and how the compiler places it decides how often each thread copies it.

    TRITON_INTERPRET=0 PYTHONPATH=. python3 bench/fp8_copies.py
    TRITON_INTERPRET=0 PYTHONPATH=/path/to/triton-3.6:. python3 bench/fp8_copies.py   # the device's compiler

(`pip install --no-deps --target /path/to/triton-3.6 triton==3.6.0` gives torch 2.11's Triton beside a newer
one.) Compiled by tests/engine/test_kernels_compile.py's split_ptx / prefill_ptx (ASTSource -> PTX)."""

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


def main() -> int:
    import test_kernels_compile as tkc
    import triton

    print(f"Triton {triton.__version__}, sm_90: cp.async copies a thread by width (bytes), and bytes in all")
    kernels = (
        ("decode, bf16 dots", lambda: tkc.split_ptx(False)),
        ("decode, fp16 dots", lambda: tkc.split_ptx(True)),
        ("prefill", tkc.prefill_ptx),
        ("decode, bf16 rows", lambda: tkc.split_ptx(False, fp8=False)),
        ("prefill, bf16 rows", lambda: tkc.prefill_ptx(fp8=False)),
    )
    for name, compiled in kernels:
        ptx = compiled()
        count = copies(ptx)
        cells = ", ".join(f"{width} B x {count[width]}" for width in sorted(count, reverse=True))
        print(f"  {name:18s} {cells}; {sum(w * n for w, n in count.items())} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
