"""Factories for engine tests: a tiny random Llama, an Engine on a tiny pool, a dense reference."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from services.common.tokenizer import Tokenizer, TokenizerInfo
from services.engine.engine import Engine
from services.engine.kv.attention import ContiguousKV
from services.engine.kv.kv_formats import parse_format
from services.engine.kv.kv_pool import KVPool
from services.engine.kv.write_through import WriteThrough
from services.engine.models.config import ModelConfig
from services.engine.models.llama import LlamaForCausalLM
from services.engine.records import EngineLimits
from services.engine.ring.host_pages import KVStoreHostPages
from services.engine.ring.local_ring import LocalRings, ring_span
from services.engine.ring.state import RingLimits
from services.engine.step.model_runner import ModelRunner
from services.engine.step.sampling import SamplingParams
from services.engine.step.sequence import Chunk, Done, Event, Failed
from services.kvstore.client import KVStoreClient
from tests.conftest import before_stores_stop


def device_or_skip(where: str) -> torch.device:
    """torch.device(where); skips the test when `where` is "cuda" and this machine has no CUDA device."""
    if where == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(where)


def tiny_model(vocab_size: int, seed: int = 0, architecture: str = "llama") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=False,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # large weights: logits far apart, greedy is stable across kernels
    return model.eval()


def make_engine(
    model: LlamaForCausalLM,
    tokenizer: Tokenizer,
    num_slots: int,
    page_size: int = 4,
    prefill_chunk: int = 16,
    max_running: int = 8,
    max_context: int = 256,
    ring: RingLimits | None = None,
    ring_chunk: int = 0,
    store_address: str = "",
    default_policy: str = "sparse",
    store_factory: Callable[[], Any] | None = None,
    local_ring: bool = True,
    kv_format: str = "fp32",
    decode_burst: int = 1,
    local_span: int = 0,
    decode_overlap: bool = True,
    device: str = "cpu",
    cuda_graphs: bool = True,
    split_bursts: bool = False,
) -> Engine:
    """An engine on `device` (the model already there; on CUDA the decode runner captures its steps unless
    `cuda_graphs` is False); with `ring`, pages go through a real kvstore process at `store_address`.
    Sliding-window layers get local rings (one per running sequence, `local_span` rows each, default
    ring_span's) unless `local_ring` is False; `kv_format` (one format for every layer, kv_formats.py) is
    the pool's and the page hashes'."""
    cfg = model.config
    windows = {i: w for i, w in enumerate(cfg.layer_windows) if w is not None}
    local = None
    if windows and local_ring:
        span = local_span or ring_span(max(windows.values()), page_size)
        local = LocalRings(windows, span, max_running, page_size)
    pool = KVPool(
        cfg.num_layers, num_slots, page_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device(device),
        [parse_format(kv_format)] * cfg.num_layers, local=local,
    )  # fmt: skip
    write_through = host = None
    if store_address or store_factory:
        new_client = store_factory or (lambda: KVStoreClient(store_address))
        write_through = WriteThrough(new_client(), kv_format, 256)
        host = KVStoreHostPages(new_client(), write_through, pool.page_nbytes, "engine-test")
    limits = EngineLimits(
        max_context=max_context,
        page_size=page_size,
        prefill_chunk=prefill_chunk,
        max_running=max_running,
        max_waiting=64,
        vocab_size=cfg.vocab_size,
        model_id="tiny",
        kv_format=kv_format,
        default_policy=default_policy,
        ring=ring,
        ring_chunk=ring_chunk,
        decode_burst=decode_burst,
        decode_overlap=decode_overlap,
        split_bursts=split_bursts,
    )
    runner = ModelRunner(model, pool, torch.device(device), host, cuda_graphs=cuda_graphs)
    engine = Engine(limits, runner, tokenizer, write_through)
    made_engines.append(engine)
    if host is not None:  # stopped before the test's kvstore, whose pins it renews
        before_stores_stop(engine.stop)
    return engine


made_engines: list[Engine] = []  # every make_engine engine, stopped after its test (conftest.py)


def ring_limits(budget_pages: int, page_size: int = 4, retrieval: bool = True, **kw: object) -> RingLimits:
    """Small ring limits for tests: protect 1 page, recent 3 pages, skeleton 2, evidence as given."""
    values: dict[str, object] = dict(
        page_size=page_size, budget_pages=budget_pages, protect_pages=1, recent_pages=3, skeleton_pages=2,
        evidence_pages=max(0, (budget_pages - 4) // 2), neighbor_pages=1, query_tail=8, max_query=64,
        rescore_interval=4, retrieval=retrieval,
    )  # fmt: skip
    values.update(kw)
    return RingLimits(**values)  # type: ignore[arg-type]


@torch.inference_mode()
def reference_greedy(model: LlamaForCausalLM, prompt: list[int], num_new: int) -> list[int]:
    """Greedy decoding with the one-sequence contiguous cache (no pages, no scheduler)."""
    kv = ContiguousKV(model.config.num_layers)
    ids = list(prompt)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv)
    out: list[int] = []
    for _ in range(num_new):
        token = int(model.logits(hidden[-1:]).argmax())
        out.append(token)
        pos = len(ids) + len(out) - 1
        hidden = model(torch.tensor([token]), torch.tensor([pos]), kv)
    return out


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer of tokens t0 .. t{vocab_size - 1}, no special tokens: for tests that only
    detokenize ids, on machines without the embedded model (the GPU host)."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    fast = FastTokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    fast.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(fast, TokenizerInfo(None, None, None, None, (), False))


def random_prompt(n: int, seed: int, vocab_size: int = 49152) -> list[int]:
    """n token ids drawn from [100, vocab_size) by a seeded generator (the same ids for the same seed)."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab_size) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def drain(events: list[Event]) -> tuple[list[int], Done | Failed]:
    tokens: list[int] = []
    for ev in events[:-1]:
        assert isinstance(ev, Chunk)
        tokens.extend(ev.token_ids)
    last = events[-1]
    assert isinstance(last, Done | Failed)
    return tokens, last


def run_until_done(engine: Engine, seqs: list, max_steps: int = 10_000) -> None:
    """Drive the engine loop by hand (no thread) until every sequence has finished."""
    engine.poll()
    for _ in range(max_steps):
        if all(s.is_finished for s in seqs):
            return
        engine.step()
        engine.slots.check_integrity()
    raise AssertionError("sequences did not finish")


def events_of(seq) -> list[Event]:
    out = []
    while not seq.events.empty():
        out.append(seq.events.get_nowait())
    return out


def tiny_gemma(vocab_size: int, seed: int = 0, window: int = 8) -> torch.nn.Module:
    """A tiny random Gemma 3 (our forward) with sliding layers of `window` tokens: S, F, S, S, F, S."""
    from transformers import Gemma3TextConfig

    from services.engine.models.config import ModelConfig
    from services.engine.models.gemma3 import Gemma3ForCausalLM

    s, f = "sliding_attention", "full_attention"
    hf = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=window,
        layer_types=[s, f, s, s, f, s], max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(ModelConfig.from_hf_config(hf.to_dict()))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


DECODE_MODELS = ("llama", "gemma", "gemma-local")  # the decode tests' model kinds


def decode_model(kind: str, vocab_size: int) -> torch.nn.Module:
    """A decode test's model (DECODE_MODELS): tiny Llama, tiny Gemma 3 (window 8), or tiny Gemma 3 whose
    sliding layers a test pool puts in local rings (`test_local_rings`)."""
    if kind == "llama":
        return tiny_model(vocab_size, seed=3)
    m = tiny_gemma(vocab_size, seed=3, window=8)
    m.test_local_rings = kind == "gemma-local"
    return m
