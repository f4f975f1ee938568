"""Engines without a ring take prefixes from the host store too: pages that left the device (evicted, or
written by another engine) come back in one batched restore instead of being prefilled again."""

from __future__ import annotations

import random

import pytest

from services.common.tokenizer import Tokenizer
from tests.conftest import StartStore
from tests.engine.helpers import drain, events_of, greedy, make_engine, reference_greedy, run_until_done, tiny_model

VOCAB = 49152
PAGE = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, seed=5)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def test_second_engine_restores_the_first_engines_prefix(
    model, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    address = start_store(host_kv_mib=32).address
    first = make_engine(model, smol_tokenizer, num_slots=32, store_address=address)
    prompt = _prompt(41, 1)
    run_until_done(first, [first.submit("turn1", prompt, greedy(3))])
    first.write_through.flush()
    second = make_engine(model, smol_tokenizer, num_slots=32, store_address=address)
    turn2 = prompt + [901, 902, 903]
    seq = second.submit("turn2", turn2, greedy(6))
    run_until_done(second, [seq])
    tokens, done = drain(events_of(seq))
    assert done.cached_tokens == 40  # the 10 whole prompt pages, from the host store
    assert second.scheduler.prefixes.num_host_restored == 10
    assert tokens == reference_greedy(model, turn2, 6)  # restored K/V is the K/V the model computes
    second.slots.check_integrity()
    for engine in (first, second):
        engine.stop()


def test_restore_is_capped_by_the_free_slots(model, smol_tokenizer: Tokenizer, start_store: StartStore) -> None:
    """With slots held elsewhere, only as many pages come back as leave room for the rest of the prompt
    and a page to decode into; the answer is still the reference."""
    address = start_store(host_kv_mib=32).address
    first = make_engine(model, smol_tokenizer, num_slots=40, store_address=address)
    prompt = _prompt(60, 2)  # 15 whole pages
    run_until_done(first, [first.submit("long", prompt, greedy(2))])
    first.write_through.flush()
    small = make_engine(model, smol_tokenizer, num_slots=24, store_address=address)
    held = [small.slots.allocate() for _ in range(12)]  # other sequences' pages: 12 slots left
    seq = small.submit("again", prompt + [7, 8], greedy(2))
    small.poll()
    small.step()  # admission: the restore happens here, while the 8 slots are held
    # 7 restored + the next chunk's 4 pages + 1 = 12 (restoring more would leave no room to prefill)
    assert small.scheduler.prefixes.num_host_restored == 7
    for slot in held:
        small.slots.release(slot)
    run_until_done(small, [seq])
    tokens, done = drain(events_of(seq))
    assert done.cached_tokens == 7 * PAGE
    assert tokens == reference_greedy(model, prompt + [7, 8], 2)
    small.slots.check_integrity()
    for engine in (first, small):
        engine.stop()


def test_without_a_store_nothing_is_restored(model, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    prompt = _prompt(30, 3)
    seq = engine.submit("plain", prompt, greedy(3))
    run_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert done.cached_tokens == 0 and engine.scheduler.prefixes.num_host_restored == 0
    assert tokens == reference_greedy(model, prompt, 3)
    engine.stop()
