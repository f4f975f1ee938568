"""Qwen3.5 hybrids in the engine (CPU): the full-attention layers in the paged pool, the linear layers' states in
RecurrentStates. Answers equal a one-sequence reference; turn 2 of a conversation and a second engine on the
same kvstore reuse the prefix up to the last state snapshot (cached_tokens) and still answer as a cold prefill;
the ring over the full-attention layers (exact policy) answers as the reference with a pool smaller than the
context."""

from __future__ import annotations

import random

import pytest
import torch

from bench.tiny_qwen3_5 import random_model, tiny_text_config
from services.common.tokenizer import Tokenizer
from services.engine.engine import Engine
from services.engine.kv.attention import ContiguousKV
from services.engine.kv.kv_pool import KVPool
from services.engine.kv.recurrent_state import RecurrentStates, state_key
from services.engine.kv.write_through import WriteThrough
from services.engine.models.loader import load_model
from services.engine.models.qwen3_5 import Qwen3_5ForCausalLM
from services.engine.records import EngineLimits
from services.engine.ring.host_pages import KVStoreHostPages
from services.engine.ring.state import RingLimits
from services.engine.step.model_runner import ModelRunner
from services.kvstore.client import KVStoreClient
from tests.conftest import StartStore, before_stores_stop
from tests.engine.helpers import drain, events_of, greedy, made_engines, ring_limits, run_until_done

VOCAB = 1024  # ids SmolLM2's tokenizer detokenizes (the engine does)
PAGE = 4
INTERVAL_PAGES = 2  # a snapshot every 8 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Qwen3_5ForCausalLM:
    directory = tmp_path_factory.mktemp("q35")
    random_model(tiny_text_config(VOCAB, layers=4, hidden=32), seed=7).save_pretrained(str(directory))
    _, m = load_model(directory, torch.device("cpu"), torch.float32)
    assert isinstance(m, Qwen3_5ForCausalLM)
    return m


def reference(model: Qwen3_5ForCausalLM, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of one sequence: the contiguous cache and a one-slot state, no pages, no scheduler."""
    cfg = model.config
    assert cfg.linear is not None
    states = RecurrentStates(cfg.linear, 1, torch.device("cpu"), torch.float32, 16)
    kv = ContiguousKV(len(cfg.kv_layers))
    with torch.inference_mode():
        hidden = model(
            torch.tensor(prompt), torch.arange(len(prompt)), kv, states.batch([0], [len(prompt)], [True], [True])
        )
        out: list[int] = []
        for _ in range(n):
            out.append(int(model.logits(hidden[-1:]).argmax()))
            pos = len(prompt) + len(out) - 1
            hidden = model(torch.tensor([out[-1]]), torch.tensor([pos]), kv, states.batch([0], [1], [False], [True]))
    return out


def make_engine(
    model: Qwen3_5ForCausalLM, tokenizer: Tokenizer, num_slots: int, store_address: str = "",
    ring: RingLimits | None = None, max_running: int = 4, default_policy: str = "sparse",
    decode_runner: bool = False, decode_burst: int = 1,
) -> Engine:  # fmt: skip
    cfg = model.config
    assert cfg.linear is not None
    pool = KVPool(
        len(cfg.kv_layers), num_slots, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu")
    )
    states = RecurrentStates(cfg.linear, max_running, torch.device("cpu"), torch.float32, INTERVAL_PAGES * PAGE, 8)
    write_through = host = None
    if store_address:
        write_through = WriteThrough(KVStoreClient(store_address), "fp32", 256)
        host = KVStoreHostPages(KVStoreClient(store_address), write_through, pool.page_nbytes, "q35-test")
    limits = EngineLimits(
        max_context=512, page_size=PAGE, prefill_chunk=16, max_running=max_running, max_waiting=64,
        vocab_size=cfg.vocab_size, model_id="tiny-q35", kv_format="fp32", default_policy=default_policy, ring=ring,
        ring_chunk=8 if ring is not None else 0,  # within the ring's recent pages
        decode_burst=decode_burst,
    )  # fmt: skip
    runner = ModelRunner(model, pool, torch.device("cpu"), host, decode_runner=decode_runner, states=states)
    engine = Engine(limits, runner, tokenizer, write_through)
    made_engines.append(engine)
    if host is not None:
        before_stores_stop(engine.stop)
    return engine


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def _ask(engine: Engine, name: str, prompt: list[int], n: int) -> tuple[list[int], int]:
    seq = engine.submit(name, prompt, greedy(n))
    run_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    return tokens, done.cached_tokens  # type: ignore[union-attr]


def test_batched_answers_equal_the_reference(model: Qwen3_5ForCausalLM, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=64)
    prompts = [_prompt(n, i) for i, n in enumerate((37, 5, 20))]
    seqs = [engine.submit(f"r{i}", p, greedy(9)) for i, p in enumerate(prompts)]
    run_until_done(engine, seqs)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert drain(events_of(seq))[0] == reference(model, prompt, 9)
    assert engine.runner.states is not None and engine.runner.states.num_free() == 4  # every slot given back


def test_turn_two_reuses_the_prefix_up_to_a_snapshot(model: Qwen3_5ForCausalLM, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=64)
    prompt = _prompt(29, 3)
    answer, cached = _ask(engine, "t1", prompt, 6)
    assert answer == reference(model, prompt, 6) and cached == 0
    turn2 = prompt + answer + _prompt(7, 4)  # turn 1 computed 34 tokens: snapshots at 8, 16, 24, 32
    got, cached = _ask(engine, "t2", turn2, 6)
    assert cached == 32
    assert engine.scheduler.prefixes.num_state_restores == 1
    assert got == reference(model, turn2, 6)  # the answer of a cold prefill


def test_the_decode_runner_carries_the_states_through_bursts(
    model: Qwen3_5ForCausalLM, smol_tokenizer: Tokenizer
) -> None:
    """The decode runner (static buffers; captured on CUDA with KVMEM_RECURRENT_GRAPHS=1, eager here) with bursts
    of up to 3 steps and overlapped (continued) steps: batched answers equal the reference (a batch of 3 padded
    to 4 rows repeats sequence 0's slot), and the snapshots taken at boundaries crossed while decoding are the
    states there: turn 2 restores one and answers as a cold prefill."""
    engine = make_engine(model, smol_tokenizer, num_slots=64, decode_runner=True, decode_burst=3)
    prompts = [_prompt(n, 10 + i) for i, n in enumerate((13, 1, 22))]  # a one-token prompt: fresh in the runner
    seqs = [engine.submit(f"r{i}", p, greedy(14)) for i, p in enumerate(prompts)]
    run_until_done(engine, seqs)
    answers = [drain(events_of(seq))[0] for seq in seqs]
    assert answers == [reference(model, p, 14) for p in prompts]
    decode = engine.runner.decode
    assert decode is not None and decode.num_eager > 0
    assert engine.stats.overlapped_steps_total > 0
    states, cfg = engine.runner.states, model.config
    assert states is not None and cfg.linear is not None
    want = {}  # the state after each boundary of each sequence, from a one-sequence prefill of its tokens
    for prompt, answer in zip(prompts, answers, strict=True):
        tokens = prompt + answer[:-1]  # the last token is never fed
        for end in range(8, len(tokens) + 1, 8):
            ref = RecurrentStates(cfg.linear, 1, torch.device("cpu"), torch.float32, 8)
            with torch.inference_mode():
                model(torch.tensor(tokens[:end]), torch.arange(end), ContiguousKV(len(cfg.kv_layers)),
                      ref.batch([0], [end], [True], [True]))  # fmt: skip
            want[(len(prompt), end)] = ref.ssm[:, 0].clone()
    snapshots = [states._snapshots[h][1] for h in states.snapshot_keys()]
    assert len(snapshots) >= 6  # five of them at boundaries crossed while decoding
    for snap in snapshots:  # each is the state at its boundary (not one a continued step moved on)
        assert min(float((snap - ref).abs().max()) for ref in want.values()) < 1e-4
    turn2 = prompts[0] + answers[0] + _prompt(5, 20)  # turn 1 computed 26 tokens: its last snapshot at 24 (decode)
    got, cached = _ask(engine, "t2", turn2, 6)
    assert cached == 24 and engine.scheduler.prefixes.num_state_restores == 1
    assert got == reference(model, turn2, 6)


def test_second_engine_restores_state_from_the_store(
    model: Qwen3_5ForCausalLM, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    address = start_store(host_kv_mib=32).address
    first = make_engine(model, smol_tokenizer, num_slots=64, store_address=address)
    prompt = _prompt(45, 5)
    _ask(first, "a", prompt, 3)
    assert first.write_through is not None
    first.write_through.flush()
    second = make_engine(model, smol_tokenizer, num_slots=64, store_address=address)
    turn2 = prompt + _prompt(5, 6)
    got, cached = _ask(second, "b", turn2, 5)
    assert cached == 40  # pages and the state at 40 from the store (the first engine's snapshot)
    assert second.scheduler.prefixes.num_host_restored == 10 and second.scheduler.prefixes.num_state_restores == 1
    assert got == reference(model, turn2, 5)
    states = first.runner.states
    assert states is not None and states.num_snapshots_taken == 3  # chunk ends on boundaries: 16, 32, 40
    with KVStoreClient(address) as client:  # each snapshot is in the store beside the pages
        assert all(loc.found for loc in client.lookup([state_key(h) for h in states.snapshot_keys()]))


@pytest.mark.slow
def test_ring_exact_over_a_small_pool(
    model: Qwen3_5ForCausalLM, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    """The ring pages the full-attention layers only; with `exact`, pages outside the budget stream from the
    host and the answer is the reference's."""
    address = start_store(host_kv_mib=32).address
    engine = make_engine(
        model, smol_tokenizer, num_slots=16, store_address=address, ring=ring_limits(12), default_policy="exact"
    )
    prompt = _prompt(120, 8)  # 30 pages through a pool of 16 slots, 12 resident per sequence
    got, _ = _ask(engine, "long", prompt, 6)
    assert got == reference(model, prompt, 6)
    assert engine.pool.num_layers == 1  # one of the four layers carries K/V
