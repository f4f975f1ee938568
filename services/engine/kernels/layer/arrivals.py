"""Arrival counters: the last program of a group to finish does the group's reduction, in the same launch.

A split kernel (a split-K projection: kernels/layer/linear_triton.py) writes per-program partials that would
need a second launch to combine them. Instead each program, after its partial is stored, increments its
group's counter (one int32, acquire-release at device scope); the program that sees `count == n - 1`
is the last, reads every partial (they are all visible to it) and writes the result, then sets the
counter back to 0, so the counters are zero between launches and a CUDA graph can replay the kernel
without a memset. A persistent kernel's grid-wide barriers (kernels/layer/block_triton.py) are counters too.

`counters(device, n)` hands out n zeroed int32 counters of the device's buffer (made at its first use that
is not inside a graph capture, kept for the process: captured graphs hold its addresses). Two launches that
may run at once must not share counters (each would count the other's programs: a wrong sum, or a barrier
that waits for ever), so a set belongs to the current stream (its launches run one after another: the set
is reused, grown when a launch needs more) or, while a CUDA graph is being captured, to that one launch
(the graph may replay on any stream, beside other work). It returns None when it cannot (no buffer yet
inside a capture, or the buffer spent): the caller takes its path without counters. `available` says
whether n launches of m counters each would get theirs now.
"""

from __future__ import annotations

import threading

import torch

CAPACITY = 1 << 20  # int32 counters a device has (4 MiB): its streams' sets and every captured launch's
MAX_COUNTERS = 1 << 16  # counters of one launch at most (column blocks of a projection)

_lock = threading.Lock()
_devices: dict[torch.device, _Counters] = {}


class _Counters:
    """One device's buffer: a bump allocator of sets, each stream's set kept for reuse."""

    def __init__(self, device: torch.device) -> None:
        self.buf = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
        self.by_stream: dict[int, tuple[int, int]] = {}  # stream -> (offset, size)
        self.used = 0

    def take(self, stream: int | None, n: int) -> torch.Tensor | None:
        """n counters of `stream`'s set (None: a new set for one captured launch), or None when spent."""
        if stream is not None:
            offset, size = self.by_stream.get(stream, (0, 0))
            if size >= n:
                return self.buf[offset : offset + n]
        if self.used + n > CAPACITY:
            return None
        offset, self.used = self.used, self.used + n
        if stream is not None:
            self.by_stream[stream] = (offset, n)
        return self.buf[offset : offset + n]

    def free(self) -> int:
        return CAPACITY - self.used


def _key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def counters(device: torch.device, n: int) -> torch.Tensor | None:
    """n zeroed, self-resetting int32 counters for a launch on `device` now (the module docstring), or None."""
    if n > MAX_COUNTERS:
        return None
    device = _key(device)
    capturing = _capturing(device)
    with _lock:
        state = _devices.get(device)
        if state is None:
            if capturing:  # the allocation would belong to the graph's memory pool
                return None
            state = _devices[device] = _Counters(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # zeroed before any stream uses it
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        return state.take(None if capturing else stream, n)


def available(device: torch.device, launches: int, n: int) -> bool:
    """Whether `launches` launches of n counters each on `device` now get theirs (`counters`)."""
    device = _key(device)
    capturing = _capturing(device)
    with _lock:
        state = _devices.get(device)
        if state is None:
            return not capturing
        return state.free() >= (launches * n if capturing else n)


# Tried for decode attention's merge (the last split program of a (sequence, KV head) merging the S
# partials of its G query heads, instead of the merge kernel's launch): 7 us a layer slower on the H200
# at every window (512 rows: 13.4 vs 6.8 us; 4K: 21.2 vs 13.7), the one program's merge loop being serial
# (bench/RESULTS.md); the merge kernel stays.
