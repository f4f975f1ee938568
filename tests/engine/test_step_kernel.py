"""The end of a decode step in one launch (kernels/step_triton.py) against decode_graph.advance_inputs.

On the CPU it runs under TRITON_INTERPRET=1 (tests/conftest.py); on CUDA (`-m gpu`) compiled.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.engine.step.decode_graph import advance_inputs
from tests.engine.helpers import device_or_skip

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("batch", "step"), [(1, 0), (3, 5), (5, 7)])
def test_advance_matches_the_torch_steps(where: str, batch: int, step: int) -> None:
    """Token into its burst row and the ids, positions and write rows one on, ring bases untouched, the
    step index on (wrapping at the page size, 8 here), three steps in a row."""
    from services.engine.kernels.step_triton import advance

    device = device_or_skip(where)
    g = torch.Generator().manual_seed(batch * 10 + step)
    inputs = torch.randint(0, 1000, (5, batch), generator=g).to(device)
    inputs[4] = 0
    inputs[4, 0] = step
    burst = torch.randint(0, 1000, (8, batch), generator=g).to(device)
    want_inputs, want_burst = inputs.clone(), burst.clone()
    for _ in range(3):
        token = torch.randint(0, 50_000, (batch,), generator=g).to(device)
        advance(token, burst, inputs)
        advance_inputs(token, want_burst, want_inputs)
        assert torch.equal(inputs, want_inputs) and torch.equal(burst, want_burst)
    assert int(inputs[4, 0]) == (step + 3) % 8
