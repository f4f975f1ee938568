"""The end of a captured decode step (Triton): its tokens recorded and its inputs advanced, one launch.

A decode burst replays the same CUDA graph step after step (decode_graph.py), so each step ends by
turning its argmax into the next step's inputs on the device: the token goes into the burst's row of
`burst_tokens` and becomes the next input id, positions and write rows move one on, and the step
index wraps at the page size. In torch that is five small launches (decode_graph.advance_inputs, the
reference); here it is one program for the whole batch.

Shapes: token [B] int64 (the argmax); burst_tokens [P, B] int64 contiguous; inputs [5, B] int64
contiguous, rows ids, positions, write_rows, ring_base and step (column 0 holds the step index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels import pdl


@triton.jit
def _advance_kernel(token_ptr, burst_ptr, inputs_ptr, batch, pages, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    b = tl.arange(0, BLOCK_B)
    ok = b < batch
    step = tl.load(inputs_ptr + 4 * batch)
    token = tl.load(token_ptr + b, mask=ok)
    tl.store(burst_ptr + step * batch + b, token, mask=ok)
    tl.store(inputs_ptr + b, token, mask=ok)
    for row in tl.static_range(1, 3):  # positions, write_rows
        at = inputs_ptr + row * batch + b
        tl.store(at, tl.load(at, mask=ok) + 1, mask=ok)
    tl.debug_barrier()  # every thread has read the step before it changes
    tl.store(inputs_ptr + 4 * batch, (step + 1) % pages)


def advance(token: torch.Tensor, burst_tokens: torch.Tensor, inputs: torch.Tensor) -> None:
    """decode_graph.advance_inputs in one launch (capturable: no host sync)."""
    batch = token.shape[0]
    assert token.shape == (batch,) and token.dtype == torch.int64, (token.shape, token.dtype)
    assert burst_tokens.shape[1] == batch and burst_tokens.is_contiguous() and burst_tokens.dtype == torch.int64
    assert inputs.shape == (5, batch) and inputs.is_contiguous() and inputs.dtype == torch.int64, inputs.shape
    _advance_kernel[(1,)](
        token.contiguous(), burst_tokens, inputs, batch, burst_tokens.shape[0],
        BLOCK_B=max(16, triton.next_power_of_2(batch)), **pdl.launch_args(token.device),
    )  # fmt: skip
