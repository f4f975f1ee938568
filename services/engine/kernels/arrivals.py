"""Arrival counters: the last program of a group to finish does the group's reduction, in the same launch.

A split kernel (a split-K projection: kernels/linear_triton.py) writes per-program partials that would
need a second launch to combine them. Instead each program, after its partial is stored, increments its
group's counter (one int32, acquire-release at device scope); the program that sees `count == n - 1`
is the last, reads every partial (they are all visible to it) and writes the result, then sets the
counter back to 0, so the counters are zero between launches and a CUDA graph can replay the kernel
without a memset.

`counters(device, n)` hands out one zeroed int32 buffer of MAX_COUNTERS per device, made at its first use and
kept for the process (captured graphs hold its address). It returns None when it cannot (n above MAX_COUNTERS,
or a first use while a CUDA graph is being captured, where the allocation would belong to the graph's pool):
the caller then takes its two-launch path. Kernels sharing the buffer must run one after another on a device
(one stream of compute): the engine's forward does; the prefetch stream only copies.
"""

from __future__ import annotations

import threading

import torch

MAX_COUNTERS = 1 << 16  # groups per launch at most (column blocks of a projection): 256 KiB

_lock = threading.Lock()
_buffers: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The zeroed int32 counters of `device` (shared, self-resetting) when n fit, or None."""
    if n > MAX_COUNTERS:
        return None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        buf = _buffers.get(device)
        if buf is not None:
            return buf
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # zeroed before any stream uses it
        _buffers[device] = buf
        return buf


# Tried for decode attention's merge (the last split program of a (sequence, KV head) merging the S
# partials of its G query heads, instead of the merge kernel's launch): 7 us a layer slower on the H200
# at every window (512 rows: 13.4 vs 6.8 us; 4K: 21.2 vs 13.7), the one program's merge loop being serial
# (bench/RESULTS.md); the merge kernel stays.
