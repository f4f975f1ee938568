"""The gateway app against an in-process FAKE CacheGuard (grpc.aio server with scripted streams).

The fake is the gateway's unit-test double; the real stack is tested end to end elsewhere.
What the fake does is chosen by the request text (last chat message or prompt):
  "status:<CODE>"    abort the RPC with that gRPC status before any event
  "error-first:<n>"  send a stream error event with engine ErrorCode n before any token
  "midstream-error"  two chunks, then an INTERNAL error event
  "no-done"          one chunk, then end the stream without done
  "hang"             one chunk, then wait (records whether the call was cancelled)
  "length"           the default answer with finish_reason length
  anything else      chunks "Hello", ", ", "world", "!" and done (usage 12/4/8 cached)
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from services.common.protos import cacheguard_pb2, cacheguard_pb2_grpc, engine_pb2
from services.gateway.app import create_app
from services.gateway.config import ApiKey, ConfigError, GatewayConfig, key_tenant, parse_api_keys
from services.gateway.errors import GENERIC_500, map_grpc_error
from services.gateway.guard_client import GuardClient

pytestmark = pytest.mark.anyio

PIECES = ["Hello", ", ", "world", "!"]
ANSWER = "".join(PIECES)
MODEL_ID = "fake-smollm2"


def _chunk(text: str, token_id: int) -> cacheguard_pb2.GuardGenerateEvent:
    return cacheguard_pb2.GuardGenerateEvent(chunk=engine_pb2.TokenChunk(token_ids=[token_id], text=text))


def _done(req: cacheguard_pb2.GuardGenerateRequest, reason: int) -> cacheguard_pb2.GuardGenerateEvent:
    engine_done = engine_pb2.GenerateDone(
        finish_reason=reason,
        usage=engine_pb2.Usage(prompt_tokens=12, completion_tokens=4, cached_tokens=8),
        matched_stop="",
    )
    prefix = cacheguard_pb2.PrefixReport(
        session_id=req.session_id or "derived-session",
        previous_tokens=64,
        common_prefix_tokens=60,
        diverged=True,
        divergence_message_index=2,
        divergence_reason="message 2 changed",
        divergence_field="content",
        normalizations=["tool_order"],
    )
    done = cacheguard_pb2.GuardDone(
        engine_done=engine_done, prefix=prefix, engine_replica="engine-0", routing="affinity"
    )
    return cacheguard_pb2.GuardGenerateEvent(done=done)


def _error(code: int, message: str) -> cacheguard_pb2.GuardGenerateEvent:
    return cacheguard_pb2.GuardGenerateEvent(error=engine_pb2.GenerateError(code=code, message=message))


def _script(req: cacheguard_pb2.GuardGenerateRequest) -> str:
    if req.WhichOneof("input") == "chat":
        return req.chat.messages[-1].content
    return req.prompt_text


class FakeGuard(cacheguard_pb2_grpc.CacheGuardServicer):
    """Scripted CacheGuard; records the requests it got and whether a call was cancelled."""

    def __init__(self) -> None:
        self.requests: list[cacheguard_pb2.GuardGenerateRequest] = []
        self.cancelled = threading.Event()

    async def Generate(
        self, request: cacheguard_pb2.GuardGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cacheguard_pb2.GuardGenerateEvent]:
        self.requests.append(request)
        script = _script(request)
        if script.startswith("status:"):
            code = getattr(grpc.StatusCode, script.removeprefix("status:"))
            await context.abort(code, f"scripted {code.name} detail")
        if script.startswith("error-first:"):
            yield _error(int(script.removeprefix("error-first:")), "scripted stream error")
            return
        if script == "midstream-error":
            yield _chunk("Hel", 1)
            yield _chunk("lo", 2)
            yield _error(engine_pb2.ERROR_CODE_INTERNAL, "secret engine detail")
            return
        if script == "no-done":
            yield _chunk("x", 1)
            return
        if script == "hang":
            yield _chunk("a", 1)
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        for i, piece in enumerate(PIECES):
            yield _chunk(piece, 100 + i)
        reason = engine_pb2.FINISH_REASON_LENGTH if script == "length" else engine_pb2.FINISH_REASON_STOP
        yield _done(request, reason)

    async def CountTokens(
        self, request: cacheguard_pb2.CountTokensRequest, context: grpc.aio.ServicerContext
    ) -> cacheguard_pb2.CountTokensResponse:
        return cacheguard_pb2.CountTokensResponse(num_tokens=len(request.prompt_text.split()))

    async def GetModelInfo(
        self, request: engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetModelInfoResponse:
        return engine_pb2.GetModelInfoResponse(
            model_id=MODEL_ID,
            architecture="llama",
            max_context=32768,
            kv_capacity=4096,
            page_size=64,
            kv_format="bf16",
        )


class FakeGuardServer:
    """The fake on a free loopback port, served by its own event loop in a daemon thread."""

    def __init__(self) -> None:
        self.servicer = FakeGuard()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.addr = f"127.0.0.1:{port}"

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        cacheguard_pb2_grpc.add_CacheGuardServicer_to_server(self.servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # grpc.aio needs asyncio


@pytest.fixture(scope="module")
def fake_guard_server() -> Iterator[FakeGuardServer]:
    server = FakeGuardServer()
    yield server
    server.stop()


@pytest.fixture
def fake(fake_guard_server: FakeGuardServer) -> FakeGuard:
    fake_guard_server.servicer.requests.clear()
    fake_guard_server.servicer.cancelled.clear()
    return fake_guard_server.servicer


async def _client_for(config: GatewayConfig, **transport: Any) -> AsyncIterator[httpx.AsyncClient]:
    guard = GuardClient(config.cacheguard_addr, model_info_ttl_s=config.model_info_ttl_s)
    app = create_app(config, guard)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, **transport), base_url="http://gateway"
        ) as client:
            yield client
    finally:
        await guard.close()


@pytest.fixture
async def client(fake: FakeGuard, fake_guard_server: FakeGuardServer) -> AsyncIterator[httpx.AsyncClient]:
    async for c in _client_for(GatewayConfig(cacheguard_addr=fake_guard_server.addr)):
        yield c


KEYS = "alice:sk-alice,sk-anon"


@pytest.fixture
async def auth_client(fake: FakeGuard, fake_guard_server: FakeGuardServer) -> AsyncIterator[httpx.AsyncClient]:
    config = GatewayConfig(cacheguard_addr=fake_guard_server.addr, api_keys=parse_api_keys(KEYS))
    async for c in _client_for(config):
        yield c


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "any-name", "messages": [{"role": "user", "content": content}], **fields}


def _sse_payloads(text: str) -> list[Any]:
    """The data of each SSE event; the final [DONE] as the string itself."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


# ---------------------------------------------------------------- chat


async def test_chat_non_stream(client: httpx.AsyncClient, fake: FakeGuard) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json=_chat("hi", temperature=0, max_tokens=7, stop="END", seed=3, unknown_field={"x": 1}),
        headers={"X-Session-Id": "s-1"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and r.headers["x-request-id"] == body["id"]
    assert body["model"] == MODEL_ID
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": ANSWER},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 4,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    plan = body["kvmem"].pop("plan")  # the segment planner's report (more in test_planning.py)
    assert (plan["level"], plan["over_pool"], plan["num_calls"], plan["prompt_tokens"]) == ("L1", False, 1, 12)
    assert body["kvmem"] == {
        "engine_replica": "engine-0",
        "matched_stop": "",
        "prefix": {
            "session_id": "s-1",
            "previous_tokens": 64,
            "common_prefix_tokens": 60,
            "diverged": True,
            "divergence_message_index": 2,
            "divergence_reason": "message 2 changed",
            "divergence_field": "content",
            "normalizations": ["tool_order"],
        },
        "routing": "affinity",
        "moved_from": "",
    }
    assert r.headers["x-session-id"] == "s-1"
    (sent,) = fake.requests
    assert sent.session_id == "s-1" and sent.tenant == "" and sent.request_id == body["id"]
    assert [(m.role, m.content) for m in sent.chat.messages] == [("user", "hi")]
    assert sent.sampling.HasField("temperature") and sent.sampling.temperature == 0
    assert (sent.sampling.max_tokens, list(sent.sampling.stop), sent.sampling.seed) == (7, ["END"], 3)


async def test_chat_finish_reason_length(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=_chat("length"))
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_reassembles(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=_chat("hi", stream=True))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = _sse_payloads(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == ANSWER
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert chunks[-1]["kvmem"]["engine_replica"] == "engine-0"
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage chunk


async def test_chat_stream_usage_chunk(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=_chat("hi", stream=True, stream_options={"include_usage": True}))
    payloads = _sse_payloads(r.text)
    usage_chunk = payloads[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    assert usage_chunk["usage"]["total_tokens"] == 16
    assert payloads[-3]["choices"][0]["finish_reason"] == "stop"


async def test_chat_stream_midstream_error(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=_chat("midstream-error", stream=True))
    assert r.status_code == 200
    payloads = _sse_payloads(r.text)
    assert payloads[-1] == "[DONE]"
    assert payloads[-2] == {"error": {"message": GENERIC_500, "type": "server_error", "param": None, "code": None}}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in payloads[:-2])
    assert text == "Hello"
    assert "secret engine detail" not in r.text


async def test_chat_stream_ended_without_done(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=_chat("no-done", stream=True))
    payloads = _sse_payloads(r.text)
    assert payloads[-2]["error"]["type"] == "server_error"


async def test_chat_non_stream_ended_without_done(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=_chat("no-done"))
    assert r.status_code == 500 and r.json()["error"]["message"] == GENERIC_500


async def test_stream_error_before_first_token_keeps_http_status(client: httpx.AsyncClient) -> None:
    code = engine_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED
    r = await client.post("/v1/chat/completions", json=_chat(f"error-first:{code}", stream=True))
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["message"] == "scripted stream error"


@pytest.mark.parametrize(
    ("engine_code", "status", "error_type", "code"),
    [
        (engine_pb2.ERROR_CODE_INVALID_ARGUMENT, 400, "invalid_request_error", None),
        (
            engine_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED,
            400,
            "invalid_request_error",
            "context_length_exceeded",
        ),
        (engine_pb2.ERROR_CODE_OVERLOADED, 429, "rate_limit_error", "overloaded"),
        (engine_pb2.ERROR_CODE_INTERNAL, 500, "server_error", None),
        (engine_pb2.ERROR_CODE_UNSPECIFIED, 500, "server_error", None),
    ],
)
async def test_stream_error_codes_non_stream(
    client: httpx.AsyncClient, engine_code: int, status: int, error_type: str, code: str | None
) -> None:
    r = await client.post("/v1/chat/completions", json=_chat(f"error-first:{engine_code}"))
    assert r.status_code == status
    assert (r.json()["error"]["type"], r.json()["error"]["code"]) == (error_type, code)


@pytest.mark.parametrize(
    ("grpc_code", "status", "error_type", "code"),
    [
        ("INVALID_ARGUMENT", 400, "invalid_request_error", None),
        ("OUT_OF_RANGE", 400, "invalid_request_error", "context_length_exceeded"),
        ("RESOURCE_EXHAUSTED", 429, "rate_limit_error", "overloaded"),
        ("UNAVAILABLE", 503, "service_unavailable", "unavailable"),
        ("DEADLINE_EXCEEDED", 503, "service_unavailable", "timeout"),
        ("UNAUTHENTICATED", 401, "authentication_error", "invalid_api_key"),
        ("NOT_FOUND", 404, "invalid_request_error", "not_found"),
        ("INTERNAL", 500, "server_error", None),
        ("FAILED_PRECONDITION", 500, "server_error", None),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_grpc_status_mapping(
    client: httpx.AsyncClient, grpc_code: str, status: int, error_type: str, code: str | None, stream: bool
) -> None:
    r = await client.post("/v1/chat/completions", json=_chat(f"status:{grpc_code}", stream=stream))
    assert r.status_code == status
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == (error_type, code, None)
    if status < 500:
        assert err["message"] == f"scripted {grpc_code} detail"
    else:
        assert "scripted" not in err["message"]  # 5xx details stay in the log
    assert ("retry-after" in r.headers) == (status in (429, 503))


def test_map_grpc_error_without_details() -> None:
    err = map_grpc_error(grpc.StatusCode.OUT_OF_RANGE, "")
    assert (err.status, err.code) == (400, "context_length_exceeded")
    assert err.message == "The prompt plus max_tokens exceeds the model's context length."
    assert map_grpc_error(None, "x").status == 500


# ---------------------------------------------------------------- completions


async def test_completions_text_and_tokens(client: httpx.AsyncClient, fake: FakeGuard) -> None:
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "Once upon", "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": ANSWER, "finish_reason": "stop", "logprobs": None}]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    assert body["kvmem"]["prefix"]["common_prefix_tokens"] == 60
    r = await client.post("/v1/completions", json={"model": "m", "prompt": [[1, 2, 3]]})
    assert r.status_code == 200
    text_req, token_req = fake.requests
    assert text_req.prompt_text == "Once upon" and text_req.sampling.max_tokens == 4
    assert list(token_req.prompt_tokens.token_ids) == [1, 2, 3]


async def test_completions_stream(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        json={"model": "m", "prompt": ["hi"], "stream": True, "stream_options": {"include_usage": True}},
    )
    payloads = _sse_payloads(r.text)
    chunks = payloads[:-1]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ANSWER
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("body", "param", "message_part"),
    [
        ({"model": "m"}, "messages", "Missing required parameter: 'messages'"),
        (_chat("hi", n=2), "n", "n=2 is not supported"),
        (_chat("hi", temperature="0.5"), "temperature", "valid number"),
        (_chat("hi", stream="yes"), "stream", "valid boolean"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid string"),
        (_chat("hi", logit_bias={"1": 101}), "logit_bias", "outside [-100, 100]"),
        (_chat("hi", logit_bias={"abc": 1}), "logit_bias", "not a token id"),
        (_chat("hi", presence_penalty=0.5), "presence_penalty", "not supported"),
        (_chat("hi", response_format={"type": "json_object"}), "response_format", "not supported"),
        ({"model": "m", "messages": []}, "messages", "at least 1 item"),
    ],
)
async def test_bad_chat_input_is_400(
    client: httpx.AsyncClient, fake: FakeGuard, body: dict[str, Any], param: str, message_part: str
) -> None:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert message_part in err["message"]
    assert fake.requests == []


async def test_bad_completions_input_is_400(client: httpx.AsyncClient) -> None:
    for body, param in [
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": "a", "echo": True}, "echo"),
        ({"model": "m", "prompt": [-1]}, "prompt"),
    ]:
        r = await client.post("/v1/completions", json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), body


async def test_unparseable_json_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]
    r = await client.post("/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400 and r.json()["error"]["message"] == "The request body must be a JSON object."
    r = await client.post("/v1/chat/completions", content=json.dumps(_chat("hi")), headers={"Content-Type": "text/x"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "The request body must be a JSON object. Send it with 'Content-Type: application/json' (got 'text/x')."
    )


async def test_unknown_url_and_long_session_id(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = await client.post("/v1/chat/completions", json=_chat("hi"), headers={"X-Session-Id": "s" * 300})
    assert r.status_code == 400 and "X-Session-Id" in r.json()["error"]["message"]


async def test_unexpected_exception_is_generic_500(fake_guard_server: FakeGuardServer) -> None:
    class BrokenGuard(GuardClient):
        def generate(self, req: cacheguard_pb2.GuardGenerateRequest) -> Any:
            raise RuntimeError("secret internal state")

    guard = BrokenGuard(fake_guard_server.addr)
    app = create_app(GatewayConfig(cacheguard_addr=fake_guard_server.addr), guard)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        r = await client.post("/v1/chat/completions", json=_chat("hi"))
    await guard.close()
    assert r.status_code == 500
    assert r.json() == {"error": {"message": GENERIC_500, "type": "server_error", "param": None, "code": None}}


# ---------------------------------------------------------------- models, health, metrics


async def test_models(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert r.json() == {
        "object": "list",
        "data": [
            {
                "id": MODEL_ID,
                "object": "model",
                "created": 0,
                "owned_by": "kvmem",
                "kvmem": {
                    "architecture": "llama",
                    "max_context": 32768,
                    "kv_capacity": 4096,
                    "page_size": 64,
                    "kv_format": "bf16",
                },
            }
        ],
    }
    assert (await client.get(f"/v1/models/{MODEL_ID}")).json()["id"] == MODEL_ID
    r = await client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_health_up(client: httpx.AsyncClient) -> None:
    r = await client.get("/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


async def test_health_down_and_requests_503(free_tcp_port: int) -> None:
    config = GatewayConfig(cacheguard_addr=f"127.0.0.1:{free_tcp_port}", health_timeout_s=1)
    async for client in _client_for(config):
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = await client.post("/v1/chat/completions", json=_chat("hi"))
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert r.headers["retry-after"] == "1"
        assert (await client.get("/v1/models")).status_code == 503


async def test_metrics_text(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json=_chat("hi"))
    await client.post("/v1/chat/completions", json=_chat("hi", stream=True))
    await client.post("/v1/chat/completions", json=_chat("hi", n=3))
    await client.post("/v1/chat/completions", json=_chat("midstream-error", stream=True))
    text = (await client.get("/metrics")).text
    lines = set(text.splitlines())
    assert 'kvmem_gateway_requests_total{route="/v1/chat/completions",status="200"} 3.0' in lines
    assert 'kvmem_gateway_requests_total{route="/v1/chat/completions",status="400"} 1.0' in lines
    assert "kvmem_gateway_prompt_tokens_total 24.0" in lines
    assert "kvmem_gateway_completion_tokens_total 8.0" in lines
    assert "kvmem_gateway_cached_tokens_total 16.0" in lines
    assert 'kvmem_gateway_time_to_first_token_seconds_count{route="/v1/chat/completions"} 3.0' in lines
    assert 'kvmem_gateway_request_latency_seconds_count{route="/v1/chat/completions"} 4.0' in lines
    assert 'kvmem_gateway_stream_errors_total{route="/v1/chat/completions",type="server_error"} 1.0' in lines
    assert 'kvmem_gateway_requests_in_flight{route="/metrics"} 1.0' in lines
    assert 'kvmem_gateway_requests_in_flight{route="/v1/chat/completions"} 0.0' in lines


# ---------------------------------------------------------------- API keys


async def test_auth_required_on_v1(auth_client: httpx.AsyncClient, fake: FakeGuard) -> None:
    r = await auth_client.post("/v1/chat/completions", json=_chat("hi"))
    assert r.status_code == 401
    assert r.json()["error"] == {
        "message": "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    r = await auth_client.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "Incorrect API key provided."
    assert fake.requests == []
    assert (await auth_client.get("/health")).status_code == 200
    assert (await auth_client.get("/metrics")).status_code == 200


async def test_auth_key_names_tenant(auth_client: httpx.AsyncClient, fake: FakeGuard) -> None:
    r = await auth_client.post("/v1/chat/completions", json=_chat("hi"), headers={"Authorization": "Bearer sk-alice"})
    assert r.status_code == 200
    r = await auth_client.post(
        "/v1/completions", json={"model": "m", "prompt": "x"}, headers={"Authorization": "bearer sk-anon"}
    )
    assert r.status_code == 200
    assert [req.tenant for req in fake.requests] == ["alice", key_tenant("sk-anon")]


def test_parse_api_keys() -> None:
    keys = parse_api_keys(" alice:sk-1 , sk-2,, bob:sk:3 ")
    assert keys == (
        ApiKey("alice", "sk-1"),
        ApiKey(key_tenant("sk-2"), "sk-2"),
        ApiKey("bob", "sk:3"),
    )
    assert key_tenant("sk-2").startswith("key-") and len(key_tenant("sk-2")) == 16
    assert "sk-1" not in repr(keys)
    with pytest.raises(ConfigError, match="listed twice"):
        parse_api_keys("a:k,b:k")
    with pytest.raises(ConfigError, match="non-empty"):
        parse_api_keys("a:")
    assert parse_api_keys("") == ()


def test_config_from_args_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_GATEWAY_PORT", "8123")
    monkeypatch.setenv("KVMEM_API_KEYS", "team:sk-t")
    monkeypatch.setenv("KVMEM_CACHEGUARD_ADDR", "10.0.0.2:6000")
    config = GatewayConfig.from_args(["--host", "0.0.0.0"])
    assert (config.host, config.port, config.cacheguard_addr) == ("0.0.0.0", 8123, "10.0.0.2:6000")
    assert config.api_keys == (ApiKey("team", "sk-t"),) and config.auth_enabled
    assert GatewayConfig.from_args(["--port", "9000"]).port == 9000
    monkeypatch.setenv("KVMEM_GATEWAY_PORT", "eighty")
    with pytest.raises(ConfigError, match="eighty"):
        GatewayConfig.from_args([])
    with pytest.raises(ConfigError, match="'nohost'"):
        GatewayConfig(cacheguard_addr="nohost")
    with pytest.raises(ConfigError, match="request_timeout_s must be > 0, got 0"):
        GatewayConfig(request_timeout_s=0)


# ---------------------------------------------------------------- real server: SDK, disconnects


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """Run `app` under uvicorn (with lifespan) on a free port in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def server_url(fake: FakeGuard, fake_guard_server: FakeGuardServer) -> Iterator[str]:
    config = GatewayConfig(cacheguard_addr=fake_guard_server.addr, api_keys=parse_api_keys(KEYS))
    with serve_in_thread(create_app(config)) as url:  # the guard client is made by the lifespan
        yield url


def test_openai_sdk(server_url: str, fake: FakeGuard) -> None:
    sdk = openai.OpenAI(base_url=f"{server_url}/v1", api_key="sk-alice", max_retries=0)
    assert [m.id for m in sdk.models.list()] == [MODEL_ID]

    chat = sdk.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        temperature=0.2,
        max_completion_tokens=16,
        extra_headers={"X-Session-Id": "sdk-session"},
    )
    assert chat.choices[0].message.content == ANSWER
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 8
    assert chat.model_extra is not None and chat.model_extra["kvmem"]["prefix"]["session_id"] == "sdk-session"

    stream = sdk.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 16

    completion = sdk.completions.create(model=MODEL_ID, prompt="Once", max_tokens=4)
    assert completion.choices[0].text == ANSWER

    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], n=2)
    assert bad.value.code is None and bad.value.param == "n"
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "status:OUT_OF_RANGE"}])
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.APIError, match="server had an error"):
        list(
            sdk.chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": "midstream-error"}], stream=True
            )
        )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server_url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert [r.tenant for r in fake.requests] == ["alice"] * 5
    assert [m.role for m in fake.requests[0].chat.messages] == ["system", "user"]
    assert fake.requests[0].sampling.max_tokens == 16


def test_curl_style_request(server_url: str) -> None:
    """A plain HTTP client, as curl would send it (raw JSON bytes, bearer header)."""
    body = b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
    headers = {"Authorization": "Bearer sk-alice", "Content-Type": "application/json"}
    with httpx.Client(base_url=server_url) as http:
        r = http.post("/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 200
    assert r.text.endswith("data: [DONE]\n\n")


def test_stream_disconnect_cancels_guard_call(server_url: str, fake: FakeGuard) -> None:
    headers = {"Authorization": "Bearer sk-alice"}
    with httpx.Client(base_url=server_url, headers=headers) as http:
        with http.stream("POST", "/v1/chat/completions", json=_chat("hang", stream=True)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk: generation has started
    assert fake.cancelled.wait(5), "the gateway did not cancel the guard call"


def test_non_stream_disconnect_cancels_guard_call(server_url: str, fake: FakeGuard) -> None:
    headers = {"Authorization": "Bearer sk-alice"}
    with httpx.Client(base_url=server_url, headers=headers, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=_chat("hang"))
    assert fake.cancelled.wait(5), "the gateway did not cancel the guard call"


def test_main_serves_until_sigterm(fake_guard_server: FakeGuardServer) -> None:
    """`python -m services.gateway` logs ready with its URL, answers, and exits 0 on SIGTERM."""
    repo_root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "services.gateway", "--port", "0", "--cacheguard-addr", fake_guard_server.addr]
    proc = subprocess.Popen(cmd, cwd=repo_root, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = None
        deadline = time.monotonic() + 30
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "the gateway exited before it was ready"
            if "ready on " in line:
                url = line.split("ready on ")[1].split()[0]
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_main_refuses_bad_config() -> None:
    repo_root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "services.gateway", "--cacheguard-addr", "no-port"]
    result = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "cacheguard_addr must be host:port" in result.stderr


# ---------------------------------------------------------------- cache guard reports


async def test_metrics_count_prefix_reports_normalisations_and_routing(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json=_chat("hi"))
    await client.post("/v1/chat/completions", json=_chat("hi", stream=True))
    await client.post("/v1/chat/completions", json=_chat("midstream-error", stream=True))  # no done: not counted
    lines = set((await client.get("/metrics")).text.splitlines())
    assert 'kvmem_guard_prefix_requests_total{outcome="diverged"} 2.0' in lines
    assert 'kvmem_guard_prefix_divergences_total{field="content"} 2.0' in lines
    assert "kvmem_guard_prefix_lost_tokens_total 8.0" in lines  # (64 previous - 60 common) x 2
    assert 'kvmem_guard_normalizations_total{name="tool_order"} 2.0' in lines
    assert 'kvmem_guard_routing_total{decision="affinity"} 2.0' in lines


async def test_normalize_header_turns_the_guard_normalisations_off(client: httpx.AsyncClient, fake: FakeGuard) -> None:
    await client.post("/v1/chat/completions", json=_chat("hi"))
    await client.post("/v1/chat/completions", json=_chat("hi"), headers={"X-KVMem-Normalize": "off"})
    await client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"X-KVMem-Normalize": "OFF"})
    await client.post("/v1/chat/completions", json=_chat("hi"), headers={"X-KVMem-Normalize": "on"})
    assert [r.normalizations_off for r in fake.requests] == [False, True, True, False]
