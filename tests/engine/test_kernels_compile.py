"""The Triton kernels compile for the H200 (sm_90) on a machine without a GPU: Triton's frontend and backend run
ahead of time (ASTSource -> cubin), so an error the CPU interpreter cannot see (a jit function reading a plain
module global, an unsupported cast) fails here instead of on the device. Compiled with the constexprs the engine
launches at Llama-3.1-8B's shape (32 / 8 heads of 128): the fp8 variants of both attention kernels and the
SwiGLU kernel of prefill rows (none of them has run on a GPU yet). The tests'
CPU runs interpret every kernel (tests/conftest.py sets TRITON_INTERPRET=1 before any kernel module is
imported), so the compile runs in a child process with the interpreter off."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _compile(fn, types: dict[str, str], constexprs: dict[str, object], div16: tuple[str, ...] = (), **options):  # type: ignore[no-untyped-def]  # noqa: E501
    """`div16`: the arguments the launch specialises as multiples of 16 (Triton does so for every pointer torch
    allocates and every integer divisible by 16): what the compiler knows of alignment at run time. `options`:
    the launch's compile options (num_warps, num_stages), Triton's defaults when absent."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(types, **{name: "constexpr" for name in constexprs})
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in div16}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options or None)


def _pipelined_word_loads(ptx: str) -> None:
    """The fp8 codes load 16 bytes at a time through cp.async (pipelined), not byte by byte nor in 4-byte words:
    the byte loads of f3cc28f ran the decode kernel at a quarter of its bf16 speed on the H200, the 4-byte words
    of 54586d4 (rows of 4 + D bytes) at a third (bench/results/scale_kernels_h200_{f3cc28f,fp8_b54f95b}.txt). The
    device's Triton 3.6 placed the row scales, loaded alone, in the score tile's layout: 128 4-byte copies a thread in
    the prefill kernel (16 in the decode kernel) until attention_tiles._row_scales read each row's 16-byte head."""
    assert "ld.global.b8" not in ptx and "ld.global.u8" not in ptx, "fp8 codes loaded byte by byte"
    sizes = re.findall(r"cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*, (0x[0-9a-f]+)", ptx)
    assert "0x10" in sizes, f"no 16-byte cp.async: {sorted(set(sizes))}"
    assert sizes.count("0x4") <= 8, f"{sizes.count('0x4')} 4-byte copies (the scales take a few)"


def prefill_ptx(fp8: bool = True, causal: bool = True, state: int = 0) -> str:
    """The prefill kernel over fp8 rows (else bf16 rows), compiled for sm_90 as the engine launches it at the 8B
    shape -> PTX; `causal` False and `state` 1 or 2: the exact policy's parts (a float32 output and its
    log-sum-exp written, or read and merged into)."""
    from services.engine.kernels.attention import prefill_attention_triton as pat

    ints = ["n_q", "past"] + [f"stride_{s}" for s in ("qn", "qh", "kr", "kh", "vr", "vh", "on", "oh")]
    store = "*u8" if fp8 else "*bf16"
    out = "*fp32" if state else "*bf16"
    types = dict(q_ptr="*bf16", k_ptr=store, v_ptr=store, rows_ptr="*i64", out_ptr=out, lse_ptr=out,
                 scale_log2="fp32")  # fmt: skip
    types.update({name: "i32" for name in ints})
    block_m, block_n, warps, stages = pat.config(128)
    constexprs: dict[str, object] = dict(
        G=4, D=128, BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP32=False, FP8=fp8, CAUSAL=causal, STATE=state
    )
    # at the 8B shape: q/out strides 4096 / 128, pool rows 8 x 144 = 1152 bytes apart, heads 144
    div16 = ("q_ptr", "k_ptr", "v_ptr", "rows_ptr", "out_ptr", "stride_qn", "stride_qh", "stride_kr", "stride_vr",
             "stride_kh", "stride_vh",
             "stride_on", "stride_oh")  # fmt: skip
    return str(_compile(pat._prefill_kernel, types, constexprs, div16, num_warps=warps, num_stages=stages).asm["ptx"])


def split_ptx(f16: bool, fp8: bool = True, block_n: int = 64) -> str:
    """The decode split kernel over fp8 rows (`f16`: the fp16 dots, the default; else KVMEM_FP8_DOT=bf16's), or
    with fp8 False over bf16 rows, compiled for sm_90 as the engine launches it at the 8B shape -> PTX."""
    from services.engine.kernels.attention import decode_attention_triton as dat

    store = "*u8" if fp8 else "*bf16"
    ptrs = dict(q_ptr="*bf16", k_ptr=store, v_ptr=store, rows_ptr="*i64", key_pos_ptr="*i64", q_pos_ptr="*i64",
                m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr="*bf16", keep_ptr="*bf16",
                keep_pos_ptr="*i64")  # fmt: skip
    ints = ["width", "rows_per_split", "num_splits", "window", "span"]
    ints += [f"stride_{s}" for s in ("qb", "qh", "kr", "kh", "vr", "vh", "ob", "oh")]
    types = dict(ptrs, scale_log2="fp32", **{name: "i32" for name in ints})
    div16 = (*ptrs, "width", "rows_per_split", "stride_qb", "stride_qh", "stride_kr", "stride_vr", "stride_kh",
             "stride_vh", "stride_ob",
             "stride_oh")  # fmt: skip
    constexprs = dict(G=4, BLOCK_G=16, D=128, BLOCK_N=block_n, HAS_WINDOW=False, RING=False, DIRECT=False,
                      DOT_FP32=False, INTERPRETED=False, SPLIT_BLOCKS=0, KEEP_Q=True, KEEP_AT=True, PDL=True,
                      SORTED=True, FP8=fp8, FP8_F16=f16 and fp8)  # fmt: skip
    options = dict(num_warps=dat.NUM_WARPS, num_stages=dat.STAGES_BY_HEAD_DIM[128])  # the launch's at D 128
    return str(_compile(dat._split_kernel, types, constexprs, div16, **options).asm["ptx"])


def compile_fp8_attention() -> None:
    """Both fp8 attention kernels to cubin; each PTX converts the codes with the hardware's e4m3 conversion."""
    ptx = prefill_ptx()
    assert "e4m3" in ptx
    _pipelined_word_loads(ptx)
    for causal, state in ((True, 1), (False, 2)):  # an exact chunk's resident rows, then its host pages as stored
        ptx = prefill_ptx(causal=causal, state=state)
        assert "e4m3" in ptx
        _pipelined_word_loads(ptx)
    # KVMEM_FP8_DOT=bf16, the default fp16 operands, and those in the 128-row steps of windows past SHORT_WIDTH
    for f16, block_n in ((False, 64), (True, 64), (True, 128)):
        ptx = split_ptx(f16, block_n=block_n)
        assert "e4m3" in ptx
        _pipelined_word_loads(ptx)
        if f16:
            _fp16_codes(ptx)


def _fp16_codes(ptx: str) -> None:
    """The fp16 decode path (attention_tiles.softmax_step_f16) converts each pair of codes with one cvt (the bf16
    path adds a cvt.bf16.f16 a code: 128 a thread a tile at the 8B shape) and reads the value codes 16 bytes at a time
    from shared memory, transposed as fp16 by ldmatrix.trans (the bf16 path: 64 ld.shared.b8 a thread a tile)."""
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "bf16.f16" not in ptx, "codes converted through bf16"
    assert not re.search(r"ld\.shared\.[bu]8", ptx), "codes read from shared memory byte by byte"
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx, "no fp16 value tile transposed by ldmatrix"


def compile_silu_mul() -> None:
    """The SwiGLU kernel of prefill-sized rows (norm_triton.silu_mul), as the engine launches it."""
    from services.engine.kernels.layer import norm_triton

    types = dict(gate_up_ptr="*bf16", out_ptr="*bf16", inter="i32")
    _compile(norm_triton._act_mul_kernel, types, dict(BLOCK=1024, ACT=norm_triton.GATED_ACTS["silu"], PDL=True))


def compile_advance() -> None:
    """The end of a captured decode step (step_triton.advance: inputs advanced, a read-set switch copied), compiled
    as the engine launches it on the GPU (the loop's bound the switch's width, not the interpreter's constexpr);
    its PTX copies a switching row's read sets in a loop."""
    from services.engine.kernels.layer import step_triton

    ptrs = ("token_ptr", "burst_ptr", "inputs_ptr", "rows_ptr", "key_pos_ptr", "rows_next_ptr", "key_pos_next_ptr")
    types = dict({name: "*i64" for name in ptrs}, batch="i32", pages="i32", width="i32")
    constexprs = dict(BLOCK=step_triton.BLOCK_W, INTERPRETED=False, WIDTH=0, PDL=True)
    ptx = str(_compile(step_triton._advance_kernel, types, constexprs, ptrs).asm["ptx"])
    assert "st.global" in ptx and "ld.global" in ptx


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="triton with its CUDA backend is not installed",
)
def test_fp8_attention_silu_and_advance_kernels_compile_for_sm90() -> None:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("compiled"), proc.stdout


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    compile_fp8_attention()
    compile_silu_mul()
    compile_advance()
    print("compiled")
