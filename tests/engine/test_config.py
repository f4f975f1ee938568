"""EngineConfig's start-up guards: impossible configurations are refused with the numbers in the message."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import ConfigError, EngineConfig

BF16_SMOLLM2_PAGE = 64 * 30 * 2 * 3 * 64 * 2  # bytes of one page: 1.47 MB


def test_defaults_are_a_plain_engine() -> None:
    cfg = EngineConfig()
    assert cfg.num_slots == 128 and not cfg.ring_enabled  # 8,192-token pool = 8,192-token context
    cfg.check_host_capacity(BF16_SMOLLM2_PAGE)  # no ring: nothing to check


def test_ring_window_sizes_follow_the_pool() -> None:
    cfg = EngineConfig(max_context=32768, kv_capacity=4096, redis_url="redis://x")
    assert cfg.ring_enabled and cfg.ring_budget_pages == 64
    assert cfg.ring_chunk == 512 and cfg.recent_pages == 9 and cfg.protect_pages == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(page_size=48), "page_size must be a power of two, got 48"),
        (dict(kv_capacity=32), "kv_capacity 32 is smaller than one page"),
        (dict(kv_capacity=1024, ring_budget=2048), "ring_budget 2048 tokens > kv_capacity 1024"),
        (
            dict(max_context=8192, kv_capacity=256, protect_tokens=192),
            r"protect 3 \+ recent 2 \+ 1 working page = 6 pages > ring budget 4 pages: short by 2",
        ),  # noqa: E501
        (
            dict(max_context=8192, kv_capacity=2048, recent_tokens=256),
            r"recent_tokens 256 = 4 pages cannot hold a prefill chunk of 512 tokens \(9 pages",
        ),  # noqa: E501
        (dict(prefill_policy="fast"), "prefill_policy 'fast' not in sparse, exact"),
        (dict(retrieval_share=1.5), r"retrieval_share must be in \[0, 1\], got 1.5"),
        (dict(kernels="cuda"), "kernels 'cuda' not in auto, triton, cupy, torch"),
        (dict(ring_prefetch_steps=-1), "ring_prefetch_steps must be >= 0, got -1"),
        (dict(restore_method="dma"), r"restore_method must be one of \('copies', 'triton', 'reference'\), got 'dma'"),
        (dict(held_restore_method="x"), r"held_restore_method must be one of \('copies', 'triton', 'reference'\)"),
        (dict(prefill_attention="fa3"), r"prefill_attention must be one of \('auto', 'cudnn', 'fa4', .*got 'fa3'"),
        (dict(decode_burst=-1), r"decode_burst must be in \[0, page_size 64\], got -1"),
        (dict(decode_burst=65), r"decode_burst must be in \[0, page_size 64\], got 65"),
        (dict(dtype="int4"), "dtype 'int4' not in auto"),
    ],
)
def test_impossible_configurations_are_refused_with_numbers(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


def test_the_host_store_must_hold_what_the_pool_cannot() -> None:
    """host_pages + pool_pages >= ceil(max_context / page_size), checked once the page size is known."""
    ring = EngineConfig(max_context=32768, kv_capacity=4096, redis_url="redis://x", host_kv_mib=512)
    with pytest.raises(ConfigError, match=r"page_size\): 364 \+ 64 < 512 \(max_context 32768, host_kv_mib 512"):
        ring.check_host_capacity(BF16_SMOLLM2_PAGE)
    EngineConfig(max_context=32768, kv_capacity=4096, redis_url="redis://x", host_kv_mib=1024).check_host_capacity(
        BF16_SMOLLM2_PAGE
    )  # 728 + 64 >= 512
    no_store = EngineConfig(max_context=32768, kv_capacity=4096)
    with pytest.raises(ConfigError, match=r"0 \+ 64 < 512 .*no kvstore configured"):
        no_store.check_host_capacity(BF16_SMOLLM2_PAGE)


def test_settings_come_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_KV_CAPACITY", "2048")
    monkeypatch.setenv("KVMEM_CUDA_GRAPHS", "0")
    monkeypatch.setenv("KVMEM_DECODE_BURST", "4")
    monkeypatch.setenv("KVMEM_RESTORE_METHOD", "triton")
    monkeypatch.setenv("KVMEM_PREFILL_ATTENTION", "fa4")
    monkeypatch.setenv("KVMEM_CATALOG_PREFIX", "kvmem:deploy1:")
    cfg = EngineConfig.from_args(["--max-context", "16384", "--kernels", "torch", "--kv-format", "fp8,global=bf16"])
    assert (cfg.kv_capacity, cfg.max_context, cfg.cuda_graphs, cfg.kernels) == (2048, 16384, False, "torch")
    assert cfg.decode_burst == 4 and EngineConfig.from_args(["--decode-burst", "1"]).decode_burst == 1
    auto = EngineConfig()  # bursts where they pay: on CUDA
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (auto.burst_for(cuda), auto.burst_for(cpu), cfg.burst_for(cpu)) == (8, 1, 4)
    assert cfg.kv_format == "fp8,global=bf16" and cfg.restore_method == "triton"
    assert cfg.prefill_attention == "fa4" and EngineConfig().prefill_attention == "auto"
    assert EngineConfig.from_args(["--prefill-attention", "triton"]).prefill_attention == "triton"
    assert cfg.catalog_prefix == "kvmem:deploy1:" and EngineConfig().catalog_prefix == "kvmem:"
    with pytest.raises(ConfigError, match="catalog_prefix"):
        EngineConfig(catalog_prefix="")
