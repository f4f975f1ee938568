"""The timing loop of the kernel sweeps (bench/kernel_sweep.py, bench/scale_kernels.py): one decode step's worth
of calls on distinct weights / pools, captured once in a CUDA graph and replayed (nothing stays in L2, no launch
overhead from the host), timed with CUDA events."""

from __future__ import annotations

from collections.abc import Callable

import torch


def per_call_us(fn: Callable[[], object], calls: int, reps: int = 20) -> float:
    """Mean time in microseconds of one of the `calls` calls `fn` makes, replayed as a CUDA graph `reps` times
    (after one eager warm-up on a side stream, for compiling and allocator pools, and three replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps / calls
