"""The end of a captured decode step (Triton): its tokens recorded and its inputs advanced, one launch.

A decode burst replays the same CUDA graph step after step (decode_graph.py), so each step ends by
turning its argmax into the next step's inputs on the device: the token goes into the burst's row of
`burst_tokens` and becomes the next input id, positions and write rows move one on, and the step
index wraps at the page size. A batch row whose new position is its `switch_pos` (a re-selection taking
effect inside the burst, work.Switch) then reads its next read set: rows and key_pos take rows_next
and key_pos_next. In torch that is a handful of small launches (decode_graph.advance_inputs, the
reference); here it is one launch of one program per batch row: each program touches its own column of
the inputs and its own row of the read sets only, so no program waits for another, and the rare switch
copies its W rows in the program of its batch row (a row that does not switch loops zero times).

Shapes: token [B] int64 (the argmax); burst_tokens [P, B] int64 contiguous; inputs [7, B] int64
contiguous, rows ids, positions, write_rows, ring_base, step (every column holds the step index),
keep_pos and switch_pos; rows, key_pos, rows_next, key_pos_next [B, W] int64 contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from services.engine.kernels import pdl

BLOCK_W = 512  # read-set entries a switching program copies per loop step (of each of the two tensors)
NUM_INPUTS = 7  # rows of `inputs`


@triton.jit(do_not_specialize=["width"])  # one compiled variant whatever the window bucket
def _advance_kernel(
    token_ptr,  # [B]
    burst_ptr,  # [P, B]
    inputs_ptr,  # [7, B]
    rows_ptr,  # [B, W]
    key_pos_ptr,  # [B, W]
    rows_next_ptr,  # [B, W]
    key_pos_next_ptr,  # [B, W]
    batch,
    pages,
    width,
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    WIDTH: tl.constexpr,  # width, interpreted only (0 when compiled): the loop's bound
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    b = tl.program_id(0).to(tl.int64)
    step_at = inputs_ptr + 4 * batch + b
    step = tl.load(step_at)
    token = tl.load(token_ptr + b)
    tl.store(burst_ptr + step * batch + b, token)
    tl.store(inputs_ptr + b, token)
    pos = tl.load(inputs_ptr + batch + b) + 1
    tl.store(inputs_ptr + batch + b, pos)
    write_at = inputs_ptr + 2 * batch + b
    tl.store(write_at, tl.load(write_at) + 1)
    tl.store(step_at, (step + 1) % pages)
    # the read set switches before the step at switch_pos: copy the W entries of this row, else nothing
    n_stop = tl.where(pos == tl.load(inputs_ptr + 6 * batch + b), width, 0)
    base = b * width
    for w0 in range(0, WIDTH if INTERPRETED else n_stop, BLOCK):
        w = w0 + tl.arange(0, BLOCK)
        ok = w < n_stop  # interpreted, the loop runs to the constexpr bound: masked when not switching
        tl.store(rows_ptr + base + w, tl.load(rows_next_ptr + base + w, mask=ok), mask=ok)
        tl.store(key_pos_ptr + base + w, tl.load(key_pos_next_ptr + base + w, mask=ok), mask=ok)


# Triton's interpreter fails on a loop whose bound is a runtime int under numpy >= 2.4 (triton-lang/triton#9171;
# kernels/attention/decode_attention_triton.py): interpreted, the bound is a constexpr instead
INTERPRETED = isinstance(_advance_kernel, InterpretedFunction)


def advance(
    token: torch.Tensor,
    burst_tokens: torch.Tensor,
    inputs: torch.Tensor,
    reads: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """decode_graph.advance_inputs in one launch (capturable: no host sync). reads: rows, key_pos, rows_next,
    key_pos_next [B, W]."""
    batch = token.shape[0]
    assert token.shape == (batch,) and token.dtype == torch.int64, (token.shape, token.dtype)
    assert burst_tokens.shape[1] == batch and burst_tokens.is_contiguous() and burst_tokens.dtype == torch.int64
    assert inputs.shape == (NUM_INPUTS, batch) and inputs.is_contiguous() and inputs.dtype == torch.int64, inputs.shape
    width = reads[0].shape[1]
    for t in reads:
        assert t.shape == (batch, width) and t.is_contiguous() and t.dtype == torch.int64, (t.shape, t.dtype)
    _advance_kernel[(batch,)](
        token.contiguous(), burst_tokens, inputs, *reads, batch, burst_tokens.shape[0], width,
        BLOCK=BLOCK_W, INTERPRETED=INTERPRETED, WIDTH=width if INTERPRETED else 0, **pdl.launch_args(token.device),
    )  # fmt: skip
