"""build_engine: model, tokenizer, pool, write-through and engine from an EngineConfig."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from services.common.logs import redact_url
from services.common.model_files import default_model_id, resolve_model_path
from services.common.tokenizer import load_tokenizer
from services.engine.config import ConfigError, EngineConfig
from services.engine.engine import Engine
from services.engine.kernels import select_tier, use_tier
from services.engine.kv.kv_formats import KVFormatError
from services.engine.kv.kv_pool import KVPool
from services.engine.kv.paged_attention import warm_prompt_attention
from services.engine.kv.recurrent_state import RecurrentStates
from services.engine.kv.write_through import WriteThrough
from services.engine.models.config import ModelConfig
from services.engine.models.loader import load_model
from services.engine.records import EngineLimits
from services.engine.ring.local_ring import LocalRings, ring_span
from services.engine.ring.state import RingLimits
from services.engine.ring.summaries import warm_page_scores
from services.engine.step.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    architecture: str
    max_context: int
    kv_capacity: int
    page_size: int
    kv_format: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    replica_id: str


def build_engine(config: EngineConfig, start: bool = True) -> tuple[Engine, ModelInfo]:
    """Load everything and start the loop thread (`start`; without it the caller drives Engine.step, as
    bench/profile_decode.py does); raises ConfigError on impossible combinations."""
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    device = config.torch_device
    path = resolve_model_path(config.model)
    t0 = time.monotonic()
    logger.info("loading tokenizer from %s", path)
    tokenizer = load_tokenizer(path)
    logger.info("loading model weights (%s, %s on %s)", path.name, config.torch_dtype, device)
    model_config, model = load_model(path, device, config.torch_dtype)
    logger.info("model loaded in %.1f s", time.monotonic() - t0)
    max_context = _check_context(config, model_config)
    use_tier(select_tier(device, config.kernels))
    model_id = config.model_id or default_model_id(path)
    try:
        formats = config.kv_spec.resolve(model_config.kv_layer_windows)
        pool = KVPool(
            len(model_config.kv_layers),  # qwen3_5: the full-attention layers only (the linear ones keep a state)
            config.num_slots,
            config.page_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            config.kv_dtype,
            device,
            formats,
            local_rings(model_config, config) if config.local_ring else None,
        )
    except KVFormatError as exc:
        raise ConfigError(f"kv_format {config.kv_format!r} for {model_config.architecture}: {exc}") from None
    logger.info(
        "device KV per token: %d bytes (%d of %d layers carry K/V)",
        pool.page_nbytes // config.page_size, len(model_config.kv_layers), model_config.num_layers,
    )  # fmt: skip
    config.check_host_capacity(pool.page_nbytes)
    if config.restore_method == "triton" and device.type != "cuda":
        raise ConfigError(f"restore_method 'triton' reads host pages in a CUDA kernel; this engine is on {device}")
    write_through = _write_through(config)
    host = None
    if write_through is not None:  # the ring's host pages; without a ring, prefixes evicted from the device
        from services.engine.ring.host_pages import KVStoreHostPages

        host = KVStoreHostPages(
            _store_client(config), write_through, pool.page_nbytes, config.replica_name, config.restore_method,
            config.held_restore_method,
        )  # fmt: skip
        host.prepare(device)  # same-host arenas registered as pinned memory now, not inside a first restore
    heads = (model_config.num_heads, model_config.num_kv_heads, model_config.head_dim)
    if config.ring_enabled:
        assert host is not None  # check_host_capacity refuses a ring without a kvstore
        logger.info(
            "ring on: budget %d pages per sequence (protect %d, recent %d, skeleton <= %d, evidence <= %d), "
            "chunk %d tokens, default policy %s, retrieval %s",
            config.ring_budget_pages, config.protect_pages, config.recent_pages, config.skeleton_pages,
            config.evidence_pages, config.ring_chunk, config.prefill_policy, "on" if config.retrieval else "OFF",
        )  # fmt: skip
        max_pages = -(-max_context // config.page_size)
        warm_page_scores(device, *heads, max_pages, (torch.float32, config.torch_dtype))
    warm_prompt_attention(config.prefill_attention, device, *heads, config.torch_dtype)
    limits = EngineLimits(
        max_context=max_context,
        page_size=config.page_size,
        prefill_chunk=config.prefill_chunk,
        max_running=config.max_running,
        max_waiting=config.max_waiting,
        vocab_size=model_config.vocab_size,
        model_id=model_id,
        kv_format=config.kv_page_label,
        default_policy=config.prefill_policy,
        ring=ring_limits(config) if config.ring_enabled else None,
        ring_chunk=config.ring_chunk if config.ring_enabled else 0,
        decode_burst=config.burst_for(device),
        decode_overlap=config.decode_overlap,
        split_bursts=config.split_bursts,
    )
    states = recurrent_states(model_config, config, device)
    runner = ModelRunner(
        model, pool, device, host, cuda_graphs=config.cuda_graphs,
        max_batch=config.max_running, states=states, prefill_attention=config.prefill_attention,
    )  # fmt: skip
    engine = Engine(limits, runner, tokenizer, write_through)
    if start:
        engine.start()
    info = ModelInfo(
        model_id=model_id,
        architecture=model_config.architecture,
        max_context=max_context,
        kv_capacity=config.pool_tokens,
        page_size=config.page_size,
        kv_format=config.kv_format_name,
        vocab_size=model_config.vocab_size,
        eos_token_ids=tuple(tokenizer.info.eos_token_ids),
        device=str(device),
        dtype=str(config.torch_dtype).removeprefix("torch."),
        replica_id=config.replica_name,
    )
    return engine, info


def recurrent_states(model_config: ModelConfig, config: EngineConfig, device: torch.device) -> RecurrentStates | None:
    """The linear-attention layers' per-sequence states (one slot per running sequence), or None (no such layers).
    Their decode steps run eagerly: the decode runner (CUDA graphs) does not take the state buffers yet."""
    if model_config.linear is None:
        return None
    return RecurrentStates(
        model_config.linear, config.max_running, device, config.torch_dtype,
        config.state_interval_pages * config.page_size, config.state_snapshots,
    )  # fmt: skip


def local_rings(model_config: ModelConfig, config: EngineConfig) -> LocalRings | None:
    """The sliding-window layers' rings (one per running sequence), or None when the model has none."""
    windows = {i: w for i, w in enumerate(model_config.kv_layer_windows) if w is not None}
    if not windows:
        return None
    span = ring_span(max(windows.values()), config.page_size)
    return LocalRings(windows, span, config.max_running, config.page_size)


def ring_limits(config: EngineConfig) -> RingLimits:
    return RingLimits(
        page_size=config.page_size, budget_pages=config.ring_budget_pages, protect_pages=config.protect_pages,
        recent_pages=config.recent_pages, skeleton_pages=config.skeleton_pages,
        evidence_pages=config.evidence_pages, neighbor_pages=config.neighbor_pages, query_tail=config.query_tail,
        max_query=256, rescore_interval=config.rescore_interval, retrieval=config.retrieval,
        audit_dir=config.audit_dir, prefetch_steps=config.ring_prefetch_steps,
        switch_in_burst=config.ring_switch_in_burst, vote_top=config.ring_vote_top,
        anchor_pages=config.ring_anchor_pages, read_ahead=config.ring_read_ahead, follow_copy=config.ring_follow_copy,
        question_replay=config.ring_question_replay,
        exclude_recent=config.ring_exclude_recent, query_pass=config.ring_query_pass,
        head_fusion=config.ring_head_fusion, score_from=config.ring_score_from,
    )  # fmt: skip


def _check_context(config: EngineConfig, model_config: ModelConfig) -> int:
    """The served context: the configured one, refused when over the model's positions."""
    if config.max_context > model_config.max_position_embeddings:
        raise ConfigError(
            f"max_context {config.max_context} > the model's {model_config.max_position_embeddings} positions"
        )
    return config.max_context


def _store_client(config: EngineConfig):  # type: ignore[no-untyped-def]
    """All replicas registered in redis (consistent hashing) when a redis URL is set, else one kvstore."""
    if config.redis_url:
        from services.kvstore.cluster import KVStoreCluster

        return KVStoreCluster(config.redis_url, config.catalog_prefix)
    from services.kvstore.client import KVStoreClient

    return KVStoreClient(config.kvstore_addrs[0])


def _write_through(config: EngineConfig) -> WriteThrough | None:
    if not config.has_host_store:
        logger.warning("no kvstore configured: finished pages have no host copy")
        return None
    where = f"the kvstore replicas in {redact_url(config.redis_url)}" if config.redis_url else config.kvstore_addrs[0]
    logger.info("writing finished pages through to %s", where)
    return WriteThrough(_store_client(config), config.kv_page_label, config.write_through_queue)
