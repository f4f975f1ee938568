"""The real CacheGuard gRPC server in-process against a scripted fake Engine gRPC servicer.

The fake engine records the requests it gets and answers with scripted events (or a gRPC status),
so these tests check the guard alone: what the engine receives, how events and errors come back,
and the prefix report. End-to-end tests through the real engine live elsewhere.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc
import pytest

from services.cacheguard.config import CacheGuardConfig
from services.cacheguard.core import GuardCore, PromptRequest
from services.cacheguard.renderer import chat_message
from services.cacheguard.server import GuardServer
from services.cacheguard.sessions import common_prefix_len
from services.common.model_files import resolve_model_path
from services.common.protos import cacheguard_pb2 as pb
from services.common.protos import cacheguard_pb2_grpc, engine_pb2, engine_pb2_grpc
from services.common.tokenizer import Tokenizer, load_tokenizer
from tests.conftest import free_port

T = TypeVar("T")
SMOL_DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)
MODEL_INFO = engine_pb2.GetModelInfoResponse(
    model_id="fake-model", architecture="llama", max_context=2048, page_size=64, replica_id="fake-0"
)


def chunk(token_ids: list[int], text: str) -> engine_pb2.GenerateEvent:
    return engine_pb2.GenerateEvent(chunk=engine_pb2.TokenChunk(token_ids=token_ids, text=text))


def done(prompt_tokens: int = 0) -> engine_pb2.GenerateEvent:
    usage = engine_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=3, cached_tokens=64)
    return engine_pb2.GenerateEvent(
        done=engine_pb2.GenerateDone(finish_reason=engine_pb2.FINISH_REASON_STOP, usage=usage)
    )


DEFAULT_SCRIPT = [chunk([10, 11], "Hel"), chunk([12], "lo"), done()]


class FakeEngine(engine_pb2_grpc.EngineServicer):
    """Answers Generate with `script` (or aborts with `abort_with`), recording every request."""

    def __init__(self) -> None:
        self.requests: list[engine_pb2.GenerateRequest] = []
        self.script: list[engine_pb2.GenerateEvent] = list(DEFAULT_SCRIPT)
        self.abort_with: tuple[grpc.StatusCode, str] | None = None
        self.slow = False  # stream chunks every 50 ms until the caller goes away
        self.cancelled = threading.Event()

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        self.requests.append(request)
        if self.abort_with is not None:
            context.abort(*self.abort_with)
        if self.slow:
            # The server stops pulling from a cancelled stream, so cancellation shows in the callback.
            finished = threading.Event()
            context.add_callback(lambda: None if finished.is_set() else self.cancelled.set())
            for i in range(200):
                yield chunk([i], "x")
                time.sleep(0.05)
            finished.set()
            return
        yield from self.script

    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> engine_pb2.GetModelInfoResponse:  # noqa: N802
        return MODEL_INFO


class LoopThread:
    """An asyncio loop in a background thread: the guard's grpc.aio server lives there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model_path("embedded:smollm2"))  # ~7 s, once for the module


@pytest.fixture(scope="module")
def engine_addr() -> Iterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    engine_pb2_grpc.add_EngineServicer_to_server(fake, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield fake, addr
    server.stop(0)


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def start_guard(loop_thread: LoopThread, tokenizer: Tokenizer) -> Iterator[Any]:
    """Factory: a running guard for the given engine addresses -> a CacheGuard stub."""
    running: list[tuple[GuardServer, grpc.Channel]] = []

    def start(engine_addrs: list[str], connect_timeout_s: float = 5.0) -> cacheguard_pb2_grpc.CacheGuardStub:
        config = CacheGuardConfig(
            listen_addr="127.0.0.1:0", engine_addrs=tuple(engine_addrs), engine_connect_timeout_s=connect_timeout_s
        )
        guard = GuardServer(config, tokenizer)
        loop_thread.run(guard.start())
        channel = grpc.insecure_channel(guard.addr)
        running.append((guard, channel))
        return cacheguard_pb2_grpc.CacheGuardStub(channel)

    yield start
    for guard, channel in running:
        channel.close()
        loop_thread.run(guard.stop(0))


@pytest.fixture
def fake(engine_addr: tuple[FakeEngine, str]) -> FakeEngine:
    engine_addr[0].reset()
    return engine_addr[0]


@pytest.fixture(scope="module")
def guard(start_guard: Any, engine_addr: tuple[FakeEngine, str]) -> cacheguard_pb2_grpc.CacheGuardStub:
    return start_guard([engine_addr[1]])


def chat(*messages: tuple[str, str], tools: list[pb.ToolDefinition] | None = None) -> pb.ChatInput:
    return pb.ChatInput(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages], tools=tools or [])


def generate(
    stub: cacheguard_pb2_grpc.CacheGuardStub, chat_input: pb.ChatInput, session_id: str = "", **kw: Any
) -> list[pb.GuardGenerateEvent]:
    request = pb.GuardGenerateRequest(session_id=session_id, chat=chat_input, **kw)
    return list(stub.Generate(request, timeout=30))


TURN1 = [("system", "You are terse."), ("user", "What is 2+2?")]
TURN1_TEXT = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
GEN_PROMPT = "<|im_start|>assistant\n"


def test_engine_receives_the_rendered_prompt_ids(
    guard: Any, fake: FakeEngine, tokenizer: Tokenizer, engine_addr: tuple[FakeEngine, str]
) -> None:
    sampling = engine_pb2.SamplingParams(temperature=0.0, max_tokens=5, stop=["\n\n"], seed=7)
    events = generate(guard, chat(*TURN1), "s-ids", request_id="req-1", tenant="acme", sampling=sampling)
    [received] = fake.requests
    assert list(received.prompt_token_ids) == tokenizer.encode(TURN1_TEXT + GEN_PROMPT)
    assert received.request_id == "req-1"
    assert received.namespace == "acme"
    assert received.sampling == sampling
    # Chunks in order, then one done carrying the engine's done, the replica and the prefix report.
    assert [e.WhichOneof("event") for e in events] == ["chunk", "chunk", "done"]
    assert [list(e.chunk.token_ids) for e in events[:2]] == [[10, 11], [12]]
    assert "".join(e.chunk.text for e in events[:2]) == "Hello"
    final = events[-1].done
    assert final.engine_done == DEFAULT_SCRIPT[-1].done
    assert final.engine_replica == engine_addr[1]
    assert final.prefix == pb.PrefixReport(session_id="s-ids", divergence_message_index=-1)


def test_second_turn_reports_the_previous_prompt_as_common_prefix(
    guard: Any, fake: FakeEngine, tokenizer: Tokenizer
) -> None:
    generate(guard, chat(*TURN1), "s-turns")
    first_ids = list(fake.requests[0].prompt_token_ids)
    turn2 = [*TURN1, ("assistant", "4"), ("user", "And 3+3?")]
    events = generate(guard, chat(*turn2), "s-turns")
    second_ids = list(fake.requests[1].prompt_token_ids)
    assert second_ids[: len(first_ids)] == first_ids
    assert events[-1].done.prefix == pb.PrefixReport(
        session_id="s-turns",
        previous_tokens=len(first_ids),
        common_prefix_tokens=len(first_ids),
        diverged=False,
        divergence_message_index=-1,
    )
    # An edited system prompt: diverged in message 0, at the first differing token.
    turn3 = [("system", "You are terse!"), *turn2[1:]]
    events = generate(guard, chat(*turn3), "s-turns")
    third_ids = list(fake.requests[2].prompt_token_ids)
    assert events[-1].done.prefix == pb.PrefixReport(
        session_id="s-turns",
        previous_tokens=len(second_ids),
        common_prefix_tokens=common_prefix_len(second_ids, third_ids),
        diverged=True,
        divergence_message_index=0,
        divergence_reason="message 0 (system) content changed at char 13",
        divergence_field="content",
    )
    # "terse." -> "terse!": every token up to and including "terse" is shared.
    assert common_prefix_len(second_ids, third_ids) == len(tokenizer.encode("<|im_start|>system\nYou are terse"))


def test_derived_session_ids_follow_the_opening_messages(guard: Any, fake: FakeEngine) -> None:
    first = generate(guard, chat(("user", "derive me")), tenant="t-derive")[-1].done.prefix
    second = generate(guard, chat(("user", "derive me"), ("assistant", "ok"), ("user", "more")), tenant="t-derive")
    prefix = second[-1].done.prefix
    assert first.session_id.startswith("auto-") and first.previous_tokens == 0
    assert prefix.session_id == first.session_id
    assert prefix.previous_tokens == prefix.common_prefix_tokens == len(fake.requests[0].prompt_token_ids)
    other_tenant = generate(guard, chat(("user", "derive me")), tenant="t-other")[-1].done.prefix
    assert other_tenant.session_id != first.session_id and other_tenant.previous_tokens == 0


def test_count_tokens_agrees_with_the_forwarded_prompt(guard: Any, fake: FakeEngine, tokenizer: Tokenizer) -> None:
    turn = chat(*TURN1, ("assistant", "4"), ("user", "Now in words?"))
    counted = guard.CountTokens(pb.CountTokensRequest(chat=turn), timeout=30).num_tokens
    generate(guard, turn, "s-count")
    assert counted == len(fake.requests[0].prompt_token_ids) > 0
    text = "Once upon a time"
    counted = guard.CountTokens(pb.CountTokensRequest(prompt_text=text), timeout=30).num_tokens
    list(guard.Generate(pb.GuardGenerateRequest(prompt_text=text), timeout=30))
    assert list(fake.requests[1].prompt_token_ids) == tokenizer.encode(text, add_special_tokens=True)
    assert counted == len(fake.requests[1].prompt_token_ids)


def test_prompt_tokens_pass_through(guard: Any, fake: FakeEngine) -> None:
    request = pb.GuardGenerateRequest(session_id="s-tok", prompt_tokens=pb.PromptTokens(token_ids=[1, 2, 3]))
    list(guard.Generate(request, timeout=30))
    request = pb.GuardGenerateRequest(session_id="s-tok", prompt_tokens=pb.PromptTokens(token_ids=[1, 2, 4]))
    events = list(guard.Generate(request, timeout=30))
    assert [list(r.prompt_token_ids) for r in fake.requests] == [[1, 2, 3], [1, 2, 4]]
    assert events[-1].done.prefix == pb.PrefixReport(
        session_id="s-tok",
        previous_tokens=3,
        common_prefix_tokens=2,
        diverged=True,
        divergence_message_index=-1,
        divergence_reason="prompt changed at token 2",
        divergence_field="tokens",
    )


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room: 40 of 32 slots"),
        (grpc.StatusCode.OUT_OF_RANGE, "prompt 900 + max_tokens 200 > max_context 1024"),
        (grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1], got 2"),
        (grpc.StatusCode.UNAVAILABLE, "engine not ready"),
    ],
)
def test_engine_status_errors_pass_through(guard: Any, fake: FakeEngine, code: grpc.StatusCode, details: str) -> None:
    fake.abort_with = (code, details)
    with pytest.raises(grpc.RpcError) as err:
        generate(guard, chat(("user", "hi")), "s-err")
    assert err.value.code() == code
    assert err.value.details() == details


def test_engine_error_event_is_relayed(guard: Any, fake: FakeEngine) -> None:
    error = engine_pb2.GenerateError(code=engine_pb2.ERROR_CODE_OVERLOADED, message="queue full")
    fake.script = [chunk([5], "a"), engine_pb2.GenerateEvent(error=error)]
    events = generate(guard, chat(("user", "hi")), "s-err-event")
    assert [e.WhichOneof("event") for e in events] == ["chunk", "error"]
    assert events[1].error == error


def test_stream_without_done_is_internal(guard: Any, fake: FakeEngine) -> None:
    fake.script = [chunk([5], "a")]
    with pytest.raises(grpc.RpcError) as err:
        generate(guard, chat(("user", "hi")), "s-nodone")
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "without done or error" in err.value.details()


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            pb.GuardGenerateRequest(
                chat=chat(("user", "hi"), tools=[pb.ToolDefinition(name="f", parameters_json="{bad")])
            ),
            "'f': parameters are not valid JSON",
        ),
        (pb.GuardGenerateRequest(), "request has no input"),
        (pb.GuardGenerateRequest(chat=pb.ChatInput()), "chat has no messages"),
        (pb.GuardGenerateRequest(prompt_text=""), "prompt_text is empty"),
        (
            pb.GuardGenerateRequest(prompt_tokens=pb.PromptTokens(token_ids=[1, 10**7])),
            "prompt token 1 is 10000000, outside the vocabulary [0, 49152)",
        ),
    ],
)
def test_bad_input_is_invalid_argument(
    guard: Any, fake: FakeEngine, request_: pb.GuardGenerateRequest, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(guard.Generate(request_, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert fake.requests == []


def test_client_cancel_cancels_the_engine_call(guard: Any, fake: FakeEngine) -> None:
    fake.slow = True
    call = guard.Generate(pb.GuardGenerateRequest(session_id="s-cancel", chat=chat(("user", "hi"))), timeout=30)
    assert next(call).WhichOneof("event") == "chunk"
    assert next(call).WhichOneof("event") == "chunk"
    call.cancel()
    assert fake.cancelled.wait(timeout=5), "the engine call was not cancelled"


def test_model_info_comes_from_the_engine(guard: Any, fake: FakeEngine) -> None:
    assert guard.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30) == MODEL_INFO


def test_no_engine_reachable_is_unavailable(start_guard: Any, fake: FakeEngine) -> None:
    dead = f"127.0.0.1:{free_port()}"
    stub = start_guard([dead], connect_timeout_s=0.5)
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, chat(("user", "hi")), "s-dead")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dead in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_first_healthy_replica_is_chosen(start_guard: Any, fake: FakeEngine, engine_addr: Any) -> None:
    stub = start_guard([f"127.0.0.1:{free_port()}", engine_addr[1]], connect_timeout_s=5.0)
    events = generate(stub, chat(("user", "hi")), "s-failover")
    assert events[-1].done.engine_replica == engine_addr[1]
    assert len(fake.requests) == 1


def test_core_message_spans_cover_each_message(tokenizer: Tokenizer) -> None:
    core = GuardCore(tokenizer, max_sessions=4)
    messages = [chat_message(r, c) for r, c in [*TURN1, ("assistant", "4"), ("user", "And 3+3?")]]
    prompt = core.tokenize(PromptRequest(messages=messages))
    texts = [tokenizer.decode(prompt.token_ids[s.token_start : s.token_end]) for s in prompt.message_spans]
    assert texts == [
        "<|im_start|>system\nYou are terse.<|im_end|>\n",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
        "<|im_start|>assistant\n4<|im_end|>\n",
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n",
    ]
    assert tokenizer.decode(prompt.token_ids[prompt.message_spans[-1].token_end :]) == GEN_PROMPT
    # Without a system message the template's default one belongs to message 0.
    prompt = core.tokenize(PromptRequest(messages=[chat_message("user", "Hi")]))
    [span] = prompt.message_spans
    assert tokenizer.decode(prompt.token_ids[: span.token_end]) == SMOL_DEFAULT_SYSTEM + (
        "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_query_start_is_the_last_user_message(tokenizer: Tokenizer) -> None:
    """The engine's ring scores pages against the last user turn: the guard says where it starts."""
    from services.cacheguard.core import GuardCore, PromptRequest
    from services.cacheguard.renderer import chat_message

    core = GuardCore(tokenizer, max_sessions=8)
    msgs = [chat_message("user", "Remember 4417."), chat_message("assistant", "OK."),
            chat_message("user", "What number?")]  # fmt: skip
    prepared = core.prepare(PromptRequest(messages=msgs, session_id="q"))
    assert prepared.query_start is not None
    tail = core.tokenizer.decode(prepared.token_ids[prepared.query_start :])
    assert "What number?" in tail and "4417" not in tail
