"""The step loop on CUDA queues its launches without host synchronisations (bench/sync_sites.py counts them):
a prompt chunk that samples nothing, and a batch of prompts at once, synchronise only where a token is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.mark.gpu
def test_prompt_chunks_and_batches_synchronise_only_to_read_tokens(tmp_path: Path) -> None:
    from bench.scale_engine import prompts_of
    from bench.scale_model import write_random_llama
    from bench.sync_sites import count_sites
    from services.engine.builder import build_engine
    from services.engine.config import EngineConfig
    from tests.engine.helpers import device_or_skip

    write_random_llama(tmp_path, "tiny", device_or_skip("cuda"))
    cfg = EngineConfig(
        model=str(tmp_path), device="cuda", max_context=4096, kv_capacity=16384, prefill_chunk=1024, max_running=16
    )
    engine, info = build_engine(cfg)
    try:
        gen = torch.Generator().manual_seed(0)
        count_sites(engine, prompts_of(gen, info.vocab_size, 2, 3000), 4, "warm", 3)  # one-time costs first
        for count, length in ((1, 4000), (8, 1024)):
            sites = count_sites(engine, prompts_of(gen, info.vocab_size, count, length), 8, f"r{count}", 3)
            step_sites = [key for key in sites.counts if not any("sampling.py" in frame for frame in key)]
            # the engine's own frames (the step, the runner, attention, the ring) never synchronise; a site with
            # no engine frame is torch's or the test thread's
            assert all(key == ("(outside services/)",) for key in step_sites), sites.table(f"{count} x {length}")
            assert sum(sites.counts.values()) <= 2 * count + 2, sites.table(f"{count} x {length}")
    finally:
        engine.stop()
