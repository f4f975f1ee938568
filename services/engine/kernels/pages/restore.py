"""Restore many pages from host memory into a device tensor in one go.

A source is a flat uint8 host tensor (a kvstore arena mapped in this process, or a pinned staging
buffer); page i of a restore starts at byte `offsets[i]` of the source and lands in row `rows[i]` of
`out` (uint8 [R, page_nbytes]). With the source registered as pinned memory (`register_host`, i.e.
cudaHostRegister) the bytes move by DMA; unregistered (pageable) sources are staged by the driver.

Methods (`restore_pages(method=...)`):
- `copies`: the pages grouped into runs that are consecutive in both source and `out` (a kvstore
  allocates the pages of one model back to back), one cudaMemcpyAsync per run, all on the current
  stream: the copy engines at PCIe speed, a handful of calls for a batch. The default; on the CPU
  it is a memcpy per run.
- `triton`: one gather launch for the whole batch; the GPU reads the registered source directly
  (UVA: the host address is the device address), 16-byte words.
- `reference`: the torch reference: index every page through the CPU tensor, stack, one copy.
All three are asynchronous on CUDA: the caller synchronizes before the source may change.

`parts` restores only some byte ranges of every page, packed side by side in `out`'s rows (a page's
paged layers: with local rings a slot holds 3 of Gemma 3 270M's 18 layers, and a restore into slots
moves a sixth of the page): each (page, part) is then a unit of its own, by the same methods.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from services.engine.kv.transfers import device_index

logger = logging.getLogger(__name__)

METHODS = ("copies", "triton", "reference")
WORD_BYTES = 16  # the gather kernel moves int32 x 4 per thread: offsets and page sizes must be multiples
BLOCK_WORDS = 4096  # int32 words per gather program (16 KiB)
# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every context, readable by kernels
HOST_REGISTER_FLAGS = 0x1 | 0x2
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712

try:
    import triton
    import triton.language as tl
except ImportError:  # the copies and the reference still work
    triton = None
    tl = None


class RestoreError(RuntimeError):
    """A restore cannot run as asked (shapes, dtypes, devices, alignment, registration); the message has the numbers."""


class Run(NamedTuple):
    """Pages that are consecutive in the source and in `out`: one copy."""

    row: int  # first row of `out`
    offset: int  # byte offset of the first page in the source
    num_pages: int


def copy_runs(offsets: Sequence[int], rows: Sequence[int], page_nbytes: int) -> list[Run]:
    """Coalesce pages (in order) into runs where page i+1 follows page i in both the source and `out`."""
    runs: list[Run] = []
    for offset, row in zip(offsets, rows, strict=True):
        if runs:
            last = runs[-1]
            if offset == last.offset + last.num_pages * page_nbytes and row == last.row + last.num_pages:
                runs[-1] = last._replace(num_pages=last.num_pages + 1)
                continue
        runs.append(Run(row, offset, 1))
    return runs


def restore_reference(
    src: torch.Tensor, offsets: Sequence[int], page_nbytes: int, device: torch.device
) -> torch.Tensor:
    """Torch reference: uint8 [P, page_nbytes] on `device`, page i = src[offsets[i] : offsets[i] + page_nbytes]."""
    if not offsets:
        return torch.empty(0, page_nbytes, dtype=torch.uint8, device=device)
    pages = torch.stack([src[o : o + page_nbytes] for o in offsets])  # one CPU copy per page
    return pages.to(device)


Part = tuple[int, int]  # bytes [lo, hi) of a page


def parts_nbytes(parts: Sequence[Part]) -> int:
    return sum(hi - lo for lo, hi in parts)


def restore_pages(
    src: torch.Tensor,
    offsets: Sequence[int],
    out: torch.Tensor,
    rows: Sequence[int] | None = None,
    method: str = "copies",
    parts: Sequence[Part] | None = None,
) -> None:
    """Copy page i of `src` (uint8 [S], host; bytes offsets[i] .. + page_nbytes) into out[rows[i]]
    (out: uint8 [R, page_nbytes], host or device; rows default to 0..P-1). Asynchronous on CUDA.
    With `parts` (byte ranges of the source page, in order), only those bytes, packed: out is
    [R, sum of the parts' sizes]."""
    rows = list(range(len(offsets))) if rows is None else list(rows)
    # one part from byte 0 is the pages' first out.shape[1] bytes: the plain restore already copies those
    if parts is not None and not (len(parts) == 1 and parts[0][0] == 0):
        _restore_parts(src, offsets, out, rows, method, list(parts))
        return
    _check(src, offsets, out, rows, method)
    if not offsets:
        return
    page_nbytes = out.shape[1]
    if method == "copies":
        flat_out = out.view(-1)
        for run in copy_runs(offsets, rows, page_nbytes):
            n = run.num_pages * page_nbytes
            dst = flat_out[run.row * page_nbytes : run.row * page_nbytes + n]
            dst.copy_(src[run.offset : run.offset + n], non_blocking=True)
    elif method == "triton":
        _restore_triton(src, offsets, out, rows)
    else:
        out[torch.tensor(rows, dtype=torch.long, device=out.device)] = restore_reference(
            src, offsets, page_nbytes, out.device
        )


def _restore_parts(
    src: torch.Tensor, offsets: Sequence[int], out: torch.Tensor, rows: list[int], method: str, parts: list[Part]
) -> None:
    """Each (page, part) as a page of its own: parts of one size in one restore into out viewed as
    [R * parts, size]; parts of different sizes (layers of different KV formats) one restore each into a
    buffer, then into their columns of out."""
    if not parts or any(not 0 <= lo < hi for lo, hi in parts):
        raise RestoreError(f"parts must be non-empty byte ranges, got {parts}")
    if out.dim() != 2 or out.shape[1] != parts_nbytes(parts):
        raise RestoreError(f"out rows of {tuple(out.shape[1:])} bytes for parts of {parts_nbytes(parts)} bytes")
    widths = {hi - lo for lo, hi in parts}
    if len(widths) == 1:
        n, width = len(parts), widths.pop()
        unit_offsets = [o + lo for o in offsets for lo, _ in parts]
        unit_rows = [r * n + j for r in rows for j in range(n)]
        restore_pages(src, unit_offsets, out.view(-1, width), unit_rows, method)
        return
    index = device_index(rows, out.device)
    col = 0
    for lo, hi in parts:
        buffer = torch.empty(len(rows), hi - lo, dtype=torch.uint8, device=out.device)
        restore_pages(src, [o + lo for o in offsets], buffer, None, method)
        out[:, col : col + hi - lo].index_copy_(0, index, buffer)
        col += hi - lo


def _check(src: torch.Tensor, offsets: Sequence[int], out: torch.Tensor, rows: list[int], method: str) -> None:
    if method not in METHODS:
        raise RestoreError(f"restore method {method!r} not in {', '.join(METHODS)}")
    if src.dtype != torch.uint8 or src.dim() != 1 or src.device.type != "cpu" or not src.is_contiguous():
        raise RestoreError(
            f"source must be a flat contiguous uint8 host tensor, got {src.dtype} {tuple(src.shape)} on {src.device}"
        )
    if out.dtype != torch.uint8 or out.dim() != 2 or not out.is_contiguous():
        raise RestoreError(
            f"out must be a contiguous uint8 [R, page_nbytes] tensor, got {out.dtype} {tuple(out.shape)}"
        )
    if len(rows) != len(offsets):
        raise RestoreError(f"{len(offsets)} offsets but {len(rows)} rows")
    page_nbytes = out.shape[1]
    bad = [o for o in offsets if o < 0 or o + page_nbytes > src.numel()]
    if bad:
        raise RestoreError(f"page at offset {bad[0]} (+{page_nbytes}) is outside the source of {src.numel()} bytes")
    bad_rows = [r for r in rows if not 0 <= r < out.shape[0]]
    if bad_rows:
        raise RestoreError(f"row {bad_rows[0]} is outside out's {out.shape[0]} rows")
    if method == "triton":
        if triton is None:
            raise RestoreError("the triton restore needs triton installed")
        if out.device.type == "cpu" and not _interpreted():
            raise RestoreError("the triton restore on the CPU needs TRITON_INTERPRET=1 (tests only)")
        misaligned = [o for o in offsets if o % WORD_BYTES] + ([page_nbytes] if page_nbytes % WORD_BYTES else [])
        if misaligned or src.data_ptr() % WORD_BYTES or src.numel() % 4:
            raise RestoreError(
                f"the triton restore needs {WORD_BYTES}-byte aligned pages and source: offsets/size "
                f"{misaligned[:1]}, source at {src.data_ptr():#x} of {src.numel()} bytes"
            )


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _restore_triton(src: torch.Tensor, offsets: Sequence[int], out: torch.Tensor, rows: list[int]) -> None:
    page_words = out.shape[1] // 4
    # page starts and destination rows, in 16-byte units / rows; int64 [P] each, on out's device
    table = torch.tensor([[o // WORD_BYTES for o in offsets], rows], dtype=torch.int64)
    if out.device.type == "cuda":
        table = table.pin_memory().to(out.device, non_blocking=True)
    grid = (len(offsets), triton.cdiv(page_words, BLOCK_WORDS))
    _gather_kernel()[grid](
        src.view(torch.int32), table[0], table[1], out.view(torch.int32), page_words,
        BLOCK=BLOCK_WORDS, num_warps=8,
    )  # fmt: skip


def _gather_pages(src_ptr, start_ptr, row_ptr, out_ptr, page_words, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """out[row[p], w] = src[start[p] * 4 + w] over int32 words; program (p, block of BLOCK words)."""
    page = tl.program_id(0)
    words = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = words < page_words
    start = tl.load(start_ptr + page) * 4  # 16-byte units -> int32 words: 16-byte aligned
    row = tl.load(row_ptr + page)
    data = tl.load(src_ptr + start + words, mask=mask)
    tl.store(out_ptr + row * page_words + words, data, mask=mask)


_kernels: dict[bool, object] = {}


def _gather_kernel():  # type: ignore[no-untyped-def]
    """The jitted gather, made on first use: whether Triton interprets is read then, not at import."""
    interpreted = _interpreted()
    if interpreted not in _kernels:
        _kernels[interpreted] = triton.jit(_gather_pages)
    return _kernels[interpreted]


# ---- pinned host memory ----------------------------------------------------------------------------


def register_host(address: int, nbytes: int) -> None:
    """cudaHostRegister [address, address + nbytes) as pinned, mapped memory (RestoreError on failure);
    it pins every page of the range: seconds for a range of several GB."""
    start = time.monotonic()
    rc = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, HOST_REGISTER_FLAGS))
    if rc != 0:
        _clear_cuda_error()
        raise RestoreError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed: CUDA error {rc}")
    elapsed_s = time.monotonic() - start
    logger.info("registered %d MiB of host memory at %#x as pinned in %.2f s", nbytes >> 20, address, elapsed_s)


def _clear_cuda_error() -> None:
    """Consume the error a failed runtime call left for this thread. torch reads that error at its next
    kernel-launch check and raises it as the launching op's own; torch.cuda.cudart() does not bind
    cudaGetLastError, so a one-element fill is that check here."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:  # torch.AcceleratorError: the error being cleared
        pass


def unregister_host(address: int) -> None:
    """cudaHostUnregister (logged, never raised: the caller is tearing down)."""
    rc = int(torch.cuda.cudart().cudaHostUnregister(address))
    if rc != 0:
        _clear_cuda_error()
        logger.warning("cudaHostUnregister at %#x failed: CUDA error %d", address, rc)


def host_tensor(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 [nbytes] CPU tensor over raw host memory (no reference to its owner: keep that alive)."""
    import ctypes

    import numpy as np

    raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
    return torch.from_numpy(raw)
