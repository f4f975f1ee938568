"""The Engine gRPC API in-process on a tiny model: event stream shape, typed status codes, stats."""

from __future__ import annotations

import time

import grpc
import pytest

from services.common.protos import engine_pb2 as pb
from services.common.protos import engine_pb2_grpc as pb_grpc
from services.engine.builder import ModelInfo
from services.engine.server import serve
from tests.conftest import free_port
from tests.engine.helpers import make_engine, reference_greedy, tiny_model

VOCAB = 49152


@pytest.fixture(scope="module")
def stub(smol_tokenizer):
    model = tiny_model(VOCAB, seed=3)
    engine = make_engine(model, smol_tokenizer, num_slots=64, page_size=8, max_context=128)
    engine.start()
    info = ModelInfo("tiny", "llama", 128, 512, 8, "fp32", VOCAB, (2,), "cpu", "float32", "engine-test")
    addr = f"127.0.0.1:{free_port()}"
    server = serve(engine, info, addr, max_workers=8)
    channel = grpc.insecure_channel(addr)
    yield pb_grpc.EngineStub(channel), model
    channel.close()
    server.stop(0)
    engine.stop()


def _greedy(n: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_generate_streams_chunks_then_done(stub) -> None:
    client, model = stub
    prompt = [11, 500, 9000, 42, 7]
    events = list(client.Generate(pb.GenerateRequest(request_id="x", prompt_token_ids=prompt, sampling=_greedy(9))))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["chunk"] * 9 + ["done"]
    tokens = [t for e in events[:-1] for t in e.chunk.token_ids]
    assert tokens == reference_greedy(model, prompt, 9)
    done = events[-1].done
    assert done.finish_reason == pb.FINISH_REASON_LENGTH
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 9)


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (pb.GenerateRequest(prompt_token_ids=[], sampling=_greedy(1)), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt_token_ids=[VOCAB], sampling=_greedy(1)), grpc.StatusCode.INVALID_ARGUMENT),
        (
            pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(temperature=3.0)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (pb.GenerateRequest(prompt_token_ids=[1] * 100, sampling=_greedy(100)), grpc.StatusCode.OUT_OF_RANGE),
    ],
)
def test_bad_requests_get_typed_status_and_service_keeps_serving(stub, request_, code) -> None:
    client, _ = stub
    with pytest.raises(grpc.RpcError) as err:
        list(client.Generate(request_))
    assert err.value.code() == code
    assert "Traceback" not in (err.value.details() or "")
    ok = list(client.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6], sampling=_greedy(2))))
    assert ok[-1].WhichOneof("event") == "done"


def test_cancelled_stream_frees_its_slots(stub) -> None:
    client, _ = stub
    call = client.Generate(pb.GenerateRequest(prompt_token_ids=[3] * 20, sampling=_greedy(100)))
    next(call)
    call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = client.GetStats(pb.GetStatsRequest())
        if stats.running_sequences == 0:
            break
        time.sleep(0.05)
    assert stats.running_sequences == 0
    assert stats.free_slots + stats.cached_slots == stats.num_slots
    assert stats.local_rings == 0 and stats.device_kv_bytes > 0  # a Llama: every layer in the slots


def test_model_info(stub) -> None:
    client, _ = stub
    info = client.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model_id, info.page_size, info.max_context) == ("tiny", 8, 128)
