"""Routing through the real CacheGuard server against scripted fake engines (in-process gRPC):
least-loaded placement, affinity, moves when a replica is down or unavailable, guards sharing redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import redis

from services.cacheguard.affinity import session_digest
from services.cacheguard.config import CacheGuardConfig
from services.cacheguard.server import GuardServer
from services.common.protos import cacheguard_pb2 as pb
from services.common.protos import cacheguard_pb2_grpc, engine_pb2, engine_pb2_grpc
from services.common.tokenizer import Tokenizer
from tests.cacheguard.test_server import FakeEngine, LoopThread, chunk


class StatsEngine(FakeEngine):
    """A FakeEngine that reports `load` running sequences and can fail its next calls."""

    def __init__(self) -> None:
        super().__init__()
        self.load = 0
        self.unavailable_event = False  # answer with an ERROR_CODE_UNAVAILABLE event first

    def GetStats(self, request: Any, context: grpc.ServicerContext) -> engine_pb2.GetStatsResponse:  # noqa: N802
        return engine_pb2.GetStatsResponse(running_sequences=self.load, waiting_sequences=0)

    def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        if self.unavailable_event:
            self.requests.append(request)
            error = engine_pb2.GenerateError(code=engine_pb2.ERROR_CODE_UNAVAILABLE, message="draining")
            yield engine_pb2.GenerateEvent(error=error)
            return
        yield from super().Generate(request, context)


class Engines:
    """Two fake engine servers; `stop(k)` takes one down (its address refuses connections)."""

    def __init__(self) -> None:
        self.fakes = [StatsEngine(), StatsEngine()]
        self.servers: list[grpc.Server] = []
        self.addrs: list[str] = []
        for fake in self.fakes:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            engine_pb2_grpc.add_EngineServicer_to_server(fake, server)
            self.addrs.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            server.start()
            self.servers.append(server)

    def stop(self, k: int) -> None:
        self.servers[k].stop(0).wait()

    def close(self) -> None:
        for server in self.servers:
            server.stop(0)


@pytest.fixture
def engines() -> Iterator[Engines]:
    e = Engines()
    yield e
    e.close()


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from services.common.model_files import resolve_model_path
    from services.common.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path("embedded:smollm2"))


@pytest.fixture
def start_guard(loop_thread: LoopThread, tokenizer: Tokenizer) -> Iterator[Any]:
    """Factory: a running guard for the given engines (and redis) -> a CacheGuard stub."""
    running: list[tuple[GuardServer, grpc.Channel]] = []

    def start(engine_addrs: list[str], redis_url: str = "", prefix: str = "kvmem:") -> Any:
        config = CacheGuardConfig(
            listen_addr="127.0.0.1:0",
            engine_addrs=tuple(engine_addrs),
            engine_connect_timeout_s=2.0,
            redis_url=redis_url,
            catalog_prefix=prefix,
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


def ask(stub: Any, session_id: str, text: str = "hi") -> pb.GuardDone:
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)])
    events = list(stub.Generate(pb.GuardGenerateRequest(session_id=session_id, chat=chat), timeout=30))
    assert events[-1].WhichOneof("event") == "done", events[-1]
    return events[-1].done


def routed(done: pb.GuardDone) -> tuple[str, str, str]:
    return done.engine_replica, done.routing, done.moved_from


def test_new_sessions_go_to_the_least_loaded_replica_and_stay(engines: Engines, start_guard: Any) -> None:
    a, b = engines.addrs
    stub = start_guard(engines.addrs)
    engines.fakes[0].load = 3
    engines.fakes[1].load = 1
    assert routed(ask(stub, "s1")) == (b, "least_loaded", "")
    engines.fakes[1].load = 5  # now a is less loaded, but s1's prefix is on b
    assert routed(ask(stub, "s1", "more")) == (b, "affinity", "")
    assert routed(ask(stub, "s2")) == (a, "least_loaded", "")


def test_equally_loaded_replicas_take_new_sessions_in_turn(engines: Engines, start_guard: Any) -> None:
    stub = start_guard(engines.addrs)
    replicas = [ask(stub, f"s{k}").engine_replica for k in range(4)]
    assert replicas[0] != replicas[1] and replicas[:2] == replicas[2:]
    assert [len(f.requests) for f in engines.fakes] == [2, 2]


def test_a_session_whose_replica_is_down_moves_and_stays_moved(engines: Engines, start_guard: Any) -> None:
    a, b = engines.addrs
    stub = start_guard(engines.addrs)
    engines.fakes[1].load = 1
    assert routed(ask(stub, "s")) == (a, "least_loaded", "")
    engines.stop(0)
    assert routed(ask(stub, "s", "more")) == (b, "moved", a)
    assert routed(ask(stub, "s", "again")) == (b, "affinity", "")
    assert routed(ask(stub, "new")) == (b, "least_loaded", "")  # a down replica takes no new session


def test_unavailable_before_the_first_event_is_retried_on_another_replica(engines: Engines, start_guard: Any) -> None:
    a, b = engines.addrs
    stub = start_guard(engines.addrs)
    engines.fakes[1].load = 1
    assert routed(ask(stub, "s")) == (a, "least_loaded", "")
    engines.fakes[0].abort_with = (grpc.StatusCode.UNAVAILABLE, "engine not ready")  # channel still READY
    done = ask(stub, "s", "more")
    assert routed(done) == (b, "moved", a)
    assert len(engines.fakes[1].requests) == 1 and engines.fakes[1].requests[0].prompt_token_ids
    engines.fakes[0].abort_with = None
    engines.fakes[1].unavailable_event = True  # now b drains: an UNAVAILABLE error event, before any chunk
    assert routed(ask(stub, "s", "again")) == (a, "moved", b)


def test_unavailable_after_output_started_is_not_retried(engines: Engines, start_guard: Any) -> None:
    stub = start_guard(engines.addrs)
    first = ask(stub, "s").engine_replica
    k = engines.addrs.index(first)
    error = engine_pb2.GenerateError(code=engine_pb2.ERROR_CODE_UNAVAILABLE, message="lost the kvstore")
    engines.fakes[k].script = [chunk([5], "a"), engine_pb2.GenerateEvent(error=error)]
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="more")])
    events = list(stub.Generate(pb.GuardGenerateRequest(session_id="s", chat=chat), timeout=30))
    assert [e.WhichOneof("event") for e in events] == ["chunk", "error"]  # the client saw output: no replay
    assert sum(len(f.requests) for f in engines.fakes) == 2


def test_every_replica_unavailable_passes_the_last_answer_through(engines: Engines, start_guard: Any) -> None:
    stub = start_guard(engines.addrs)
    for fake in engines.fakes:
        fake.unavailable_event = True
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")])
    events = list(stub.Generate(pb.GuardGenerateRequest(session_id="s", chat=chat), timeout=30))
    assert [e.WhichOneof("event") for e in events] == ["error"]
    assert events[0].error.code == engine_pb2.ERROR_CODE_UNAVAILABLE
    assert [len(f.requests) for f in engines.fakes] == [1, 1]


def test_two_guards_share_sessions_through_redis(engines: Engines, start_guard: Any, redis_url: str) -> None:
    a, b = engines.addrs
    prefix = f"kvmem-test-{uuid.uuid4().hex[:8]}:"
    one = start_guard(engines.addrs, redis_url, prefix)
    two = start_guard(engines.addrs, redis_url, prefix)
    engines.fakes[0].load = 2
    assert routed(ask(one, "s")) == (b, "least_loaded", "")
    engines.fakes[0].load = 0
    engines.fakes[1].load = 9
    assert routed(ask(two, "s", "more")) == (b, "affinity", "")  # the other guard placed it: followed
    key = f"{prefix}guard:session:{session_digest('', 's')}"
    assert redis.Redis.from_url(redis_url).get(key) == b.encode()
    engines.stop(1)
    assert routed(ask(two, "s", "again")) == (a, "moved", b)
    assert routed(ask(one, "s", "and again")) == (a, "affinity", "")
    assert redis.Redis.from_url(redis_url).get(key) == a.encode()
