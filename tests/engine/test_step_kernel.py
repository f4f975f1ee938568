"""The end of a decode step in one launch (kernels/layer/step_triton.py) against decode_graph.advance_inputs.

On the CPU it runs under TRITON_INTERPRET=1 (tests/conftest.py); on CUDA (`-m gpu`) compiled.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.engine.kv.attention import PAD_POS
from services.engine.step.decode_graph import advance_inputs
from tests.engine.helpers import device_or_skip

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


Reads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # rows, key_pos, rows_next, key_pos_next


def _reads(batch: int, width: int, g: torch.Generator, device: torch.device) -> Reads:
    """rows, key_pos, rows_next, key_pos_next [B, W]: random, the two sets told apart by their values."""
    rows = torch.randint(0, 1000, (batch, width), generator=g).to(device)
    key_pos = torch.randint(0, 1000, (batch, width), generator=g).to(device)
    return rows, key_pos, rows + 5000, key_pos + 5000


def _cloned(reads: Reads) -> Reads:
    return reads[0].clone(), reads[1].clone(), reads[2].clone(), reads[3].clone()


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("batch", "step", "width"), [(1, 0, 256), (3, 5, 1024), (5, 7, 512)])
def test_advance_matches_the_torch_steps(where: str, batch: int, step: int, width: int) -> None:
    """Token into its burst row and the ids, positions and write rows one on, ring bases, keep_pos and
    switch_pos untouched, the step index on (wrapping at the page size, 8 here), three steps in a row; a row
    whose new position reaches its switch_pos takes rows_next / key_pos_next (whole rows of W, several copy
    blocks at W 1024) at that step and not before, the others keep theirs."""
    from services.engine.kernels.layer.step_triton import advance

    device = device_or_skip(where)
    g = torch.Generator().manual_seed(batch * 10 + step)
    inputs = torch.randint(0, 1000, (7, batch), generator=g)
    inputs[4] = step  # every column holds the step index
    inputs[5] = torch.randint(-1, 1000, (batch,), generator=g)
    after = torch.arange(batch) % 4  # the step after which row b switches: 1, 2, 3 or (0) never
    inputs[6] = torch.where(after > 0, inputs[1] + after, PAD_POS)
    inputs = inputs.to(device)
    burst = torch.randint(0, 1000, (8, batch), generator=g).to(device)
    reads = _reads(batch, width, g, device)
    first = _cloned(reads)
    want_inputs, want_burst = inputs.clone(), burst.clone()
    want_reads = _cloned(reads)
    for k in range(1, 4):
        token = torch.randint(0, 50_000, (batch,), generator=g).to(device)
        advance(token, burst, inputs, reads)
        advance_inputs(token, want_burst, want_inputs, want_reads)
        assert torch.equal(inputs, want_inputs) and torch.equal(burst, want_burst)
        for got, want in zip(reads, want_reads, strict=True):
            assert torch.equal(got, want)
        switched = ((after > 0) & (after <= k)).to(device)[:, None]
        assert torch.equal(reads[0], torch.where(switched, first[2], first[0]))
        assert torch.equal(reads[1], torch.where(switched, first[3], first[1]))
    assert (inputs[4] == (step + 3) % 8).all()
    assert torch.equal(reads[2], first[2]) and torch.equal(reads[3], first[3])  # the next sets stay
