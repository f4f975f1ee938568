"""The grammar tables are built once, off the request path: at engine start-up on a background thread that a first
constrained request waits for (never a second build); a failed build is a typed error on every call; and the
tables give each token's own bytes (logprobs' `bytes`)."""

from __future__ import annotations

import threading
import time

import pytest

from services.common.tokenizer import Tokenizer
from services.engine.step.grammar import GrammarError, GrammarSpec, GrammarTables
from services.engine.step.sampling import SamplingParams
from tests.engine.helpers import make_engine, tiny_model


class _Build:
    """A build that blocks until released and counts its calls (the threads that ran it)."""

    def __init__(self, result: object = "compiler", error: Exception | None = None) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []
        self.result, self.error = result, error

    def __call__(self):  # noqa: ANN204
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(10)
        if self.error is not None:
            raise self.error
        return self.result


def test_start_builds_on_a_background_thread_and_a_request_waits_for_it() -> None:
    build = _Build()
    tables = GrammarTables(build)  # type: ignore[arg-type]
    thread = tables.start()
    assert thread is not None and tables.start() is None  # one build
    assert build.entered.wait(5) and not tables.ready
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(tables.compiler()))
    waiter.start()
    time.sleep(0.1)
    assert got == [] and waiter.is_alive()  # the request waits for the build in flight
    build.release.set()
    waiter.join(5)
    thread.join(5)
    assert got == ["compiler"] and tables.ready and tables.compiler() == "compiler"
    assert build.threads == ["grammar-tables"]  # built once, on its own thread, not on the request's


def test_without_start_the_first_call_builds_inline() -> None:
    build = _Build()
    build.release.set()
    tables = GrammarTables(build)  # type: ignore[arg-type]
    assert tables.compiler() == "compiler" and tables.compiler() == "compiler"
    assert build.threads == [threading.current_thread().name]
    assert tables.start() is None


def test_a_failed_build_is_a_grammar_error_on_every_call() -> None:
    build = _Build(error=ImportError("No module named 'xgrammar'"))
    build.release.set()
    tables = GrammarTables(build)  # type: ignore[arg-type]
    tables.start().join(5)  # type: ignore[union-attr]
    for _ in range(2):
        with pytest.raises(GrammarError, match="not installed on this engine .No module named 'xgrammar'"):
            tables.compiler()
    assert len(build.threads) == 1


def test_engine_start_builds_the_tables_before_any_request(smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(tiny_model(49152, seed=3), smol_tokenizer, num_slots=64, max_context=256)
    assert not engine.grammar_tables.ready
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while not engine.grammar_tables.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.grammar_tables.ready  # nobody asked for a grammar: start-up built them
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=4, grammar=GrammarSpec("json_object"))
        engine.submit("g", smol_tokenizer.encode("JSON:"), params)
        assert time.perf_counter() - t0 < 1.0  # a first constrained request compiles its grammar only
    finally:
        engine.stop()


def test_token_bytes_are_the_vocabularys_not_the_decoded_text(smol_tokenizer: Tokenizer) -> None:
    tables = GrammarTables.of(smol_tokenizer, 49152)
    ids = smol_tokenizer.encode("🙂")  # one character, two byte-level pieces: F0 9F | 99 82
    assert ids == [10813, 38887] and [smol_tokenizer.decode([t]) for t in ids] == ["\ufffd", "\ufffd\ufffd"]
    assert [tables.token_bytes(t) for t in ids] == [b"\xf0\x9f", b"\x99\x82"]
    assert tables.token_bytes(smol_tokenizer.encode(" hello")[0]) == b" hello"
    assert tables.token_bytes(2) == b"<|im_end|>" and tables.token_bytes(10**6) == b""


def test_logprob_protos_carry_each_tokens_own_bytes(smol_tokenizer: Tokenizer) -> None:
    from services.engine.server import logprob_to_proto
    from services.engine.step.sampling import Sampled

    tables = GrammarTables.of(smol_tokenizer, 49152)
    lp = logprob_to_proto(Sampled(10813, -0.5, [(10813, -0.5), (38887, -1.0)]), smol_tokenizer, tables.token_bytes)
    assert (lp.token, lp.token_bytes, lp.logprob) == ("\ufffd", b"\xf0\x9f", -0.5)
    assert [(t.token_id, t.token_bytes) for t in lp.top] == [(10813, b"\xf0\x9f"), (38887, b"\x99\x82")]
