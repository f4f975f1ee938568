"""Programmatic dependent launch (Hopper and newer) for the Triton kernels of a forward pass.

A batch-1 decode step is a chain of ~200 small kernels, each waiting for the one before: every launch
pays the grid's start-up and the first loads' latency after its predecessor has fully drained. With
programmatic dependent launch (PDL; `launch_pdl=True`, griddepcontrol in PTX) a kernel's programs are
started while its predecessor still runs, and wait (`wait`: the predecessor has completed and its writes
are visible) before they read or write anything; after the wait each lets its own successor start
(`launch_dependents`): one kernel is launched ahead at a time, its start-up hidden behind the running one.
Every kernel of the chain waits before its first access, so waiting on the predecessor transitively waits
on all earlier kernels; a kernel launched without PDL (cuBLAS, torch) starts after its predecessor as
usual. Measured on the H200 (bench/RESULTS.md): a 2K decode step's graph replay 0.712 -> 0.605 ms.

Tried and dropped: letting the successor start before the wait (a chain of launched-ahead kernels; with
the weight prefetch that follows, 18 gate/up projections in a row took 105 us instead of 77), and a projection
prefetching its weight slice into L2 before its wait (`prefetch.global.L2`; weights are never written by
the step): the step took 0.637 ms with it, 0.605 without.

`enabled(device)` says whether the kernels launch so: compiled on a CUDA device of capability 9.0 or
newer, and not switched off with KVMEM_PDL=0. Interpreted (CPU tests) the PDL constexpr is False and
none of this is emitted.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

logger = logging.getLogger(__name__)


@functools.cache
def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (CUDA capability >= 9.0, KVMEM_PDL not 0); decided once
    per device."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    on = torch.cuda.get_device_capability(index) >= (9, 0) and os.environ.get("KVMEM_PDL", "1") != "0"
    logger.info("programmatic dependent launch on cuda:%d: %s", index, "on" if on else "off")
    return on


@triton.jit
def start(PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next kernel's programs start (PDL only)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def launch_args(device: torch.device) -> dict[str, bool]:
    """The keywords of a PDL kernel's launch: its PDL constexpr and Triton's launch_pdl, both `enabled`."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}
