"""Host <-> device copies that do not wait for the stream.

An index tensor built with `torch.tensor(values, device=cuda)` copies from pageable memory, and that copy
synchronises the host with everything queued on the stream before it: a decode burst still running
(engine.py: overlapped bursts) would be waited for by every restore, page read or summary that builds an
index. Through pinned memory the copy is queued like a kernel (the caching host allocator keeps the pinned
block until the copy is done). The same holds the other way: a device tensor copied into pinned memory
with `to_host` arrives behind what is queued before it, and the caller waits for the event `copied`
records after it (not for the whole stream).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] on `device`, queued on its current stream without a host synchronisation."""
    index = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory: pinned and queued on the current stream for a CUDA tensor (valid once an event
    recorded after this call has completed), the tensor itself on the CPU (already the host's)."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def copied(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on `device`'s current stream after the copies queued so far (CUDA; None on the
    CPU, where `to_host` copies nothing): whoever reads those host copies waits for it."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
