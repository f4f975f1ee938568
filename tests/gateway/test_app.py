"""The gateway app against the fake CacheGuard (fake_guard.py): chat, completions and bad input."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest

from services.common.protos import cacheguard_pb2, engine_pb2
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.errors import GENERIC_500, map_grpc_error
from services.gateway.guard_client import GuardClient
from tests.gateway.fake_guard import ANSWER, MODEL_ID, FakeGuard, FakeGuardServer, chat_body, sse_payloads

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------- chat


async def test_chat_non_stream(client: httpx.AsyncClient, fake: FakeGuard) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json=chat_body("hi", temperature=0, max_tokens=7, stop="END", seed=3, unknown_field={"x": 1}),
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
    r = await client.post("/v1/chat/completions", json=chat_body("length"))
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_reassembles(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body("hi", stream=True))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(r.text)
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
    r = await client.post(
        "/v1/chat/completions", json=chat_body("hi", stream=True, stream_options={"include_usage": True})
    )
    payloads = sse_payloads(r.text)
    usage_chunk = payloads[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    assert usage_chunk["usage"]["total_tokens"] == 16
    assert payloads[-3]["choices"][0]["finish_reason"] == "stop"


async def test_chat_stream_midstream_error(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body("midstream-error", stream=True))
    assert r.status_code == 200
    payloads = sse_payloads(r.text)
    assert payloads[-1] == "[DONE]"
    request_id = r.headers["x-request-id"]
    assert request_id == payloads[0]["id"]  # the response id names the request in header, body and logs
    assert payloads[-2] == {
        "error": {"message": GENERIC_500, "type": "server_error", "param": None, "code": None, "request_id": request_id}
    }
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in payloads[:-2])
    assert text == "Hello"
    assert "secret engine detail" not in r.text


async def test_chat_stream_ended_without_done(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body("no-done", stream=True))
    payloads = sse_payloads(r.text)
    assert payloads[-2]["error"]["type"] == "server_error"


async def test_chat_non_stream_ended_without_done(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body("no-done"))
    assert r.status_code == 500 and r.json()["error"]["message"] == GENERIC_500


async def test_stream_error_before_first_token_keeps_http_status(client: httpx.AsyncClient) -> None:
    code = engine_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED
    r = await client.post("/v1/chat/completions", json=chat_body(f"error-first:{code}", stream=True))
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
    r = await client.post("/v1/chat/completions", json=chat_body(f"error-first:{engine_code}"))
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
    r = await client.post("/v1/chat/completions", json=chat_body(f"status:{grpc_code}", stream=stream))
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
    payloads = sse_payloads(r.text)
    chunks = payloads[:-1]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ANSWER
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


# ---------------------------------------------------------------- bad input

JSON = {"Content-Type": "application/json"}  # bodies sent as json.dumps writes them: lone surrogates as escapes


@pytest.mark.parametrize(
    ("body", "param", "message_part"),
    [
        ({"model": "m"}, "messages", "Missing required parameter: 'messages'"),
        (chat_body("hi", n=17), "n", "less than or equal to 16"),
        (chat_body("hi", temperature="0.5"), "temperature", "valid number"),
        (chat_body("hi", stream="yes"), "stream", "valid boolean"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid string"),
        (chat_body("hi", logit_bias={"1": 101}), "logit_bias", "outside [-100, 100]"),
        (chat_body("hi", logit_bias={"abc": 1}), "logit_bias", "not a token id"),
        (chat_body("hi", presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
        (chat_body("hi", response_format={"type": "json_schema"}), "response_format", "needs json_schema.schema"),
        (chat_body("hi", tool_choice="required"), "tool_choice", "needs tools"),
        (chat_body("hi", logprobs=False, top_logprobs=2), "top_logprobs", "needs logprobs"),
        ({"model": "m", "messages": []}, "messages", "at least 1 item"),
        # a lone surrogate escape is valid JSON but not Unicode text (it was a 500 building the guard call)
        ({"model": "m", "messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content", "surrogate"),
        (chat_body("hi", stop=["\udc00"]), "stop", "surrogate"),
        ({"model": "m", "messages": [{"role": "user", "content": None}]}, "messages[0]", "needs 'content'"),
        ({"model": "m", "messages": [{"role": "assistant"}]}, "messages[0]", "needs 'content'"),
    ],
)
async def test_bad_chat_input_is_400(
    client: httpx.AsyncClient, fake: FakeGuard, body: dict[str, Any], param: str, message_part: str
) -> None:
    r = await client.post("/v1/chat/completions", content=json.dumps(body), headers=JSON)  # surrogates escaped
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert message_part in err["message"]
    assert fake.requests == []


async def test_bad_completions_input_is_400(client: httpx.AsyncClient) -> None:
    for body, param in [
        ({"model": "m", "prompt": ["a", ""]}, "prompt"),
        ({"model": "m", "prompt": "a", "echo": True}, "echo"),
        ({"model": "m", "prompt": [-1]}, "prompt"),
        ({"model": "m", "prompt": "\ud800"}, "prompt"),
    ]:
        r = await client.post("/v1/completions", content=json.dumps(body), headers=JSON)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), body


async def test_unparseable_json_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]
    r = await client.post("/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400 and r.json()["error"]["message"] == "The request body must be a JSON object."
    r = await client.post(
        "/v1/chat/completions", content=json.dumps(chat_body("hi")), headers={"Content-Type": "text/x"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "The request body must be a JSON object. Send it with 'Content-Type: application/json' (got 'text/x')."
    )


async def test_unknown_url_and_long_session_id(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = await client.post("/v1/chat/completions", json=chat_body("hi"), headers={"X-Session-Id": "s" * 300})
    assert r.status_code == 400 and "X-Session-Id" in r.json()["error"]["message"]


async def test_unexpected_exception_is_generic_500(fake_guard_server: FakeGuardServer) -> None:
    class BrokenGuard(GuardClient):
        def generate(self, req: cacheguard_pb2.GuardGenerateRequest) -> Any:
            raise RuntimeError("secret internal state")

    guard = BrokenGuard(fake_guard_server.addr)
    app = create_app(GatewayConfig(cacheguard_addr=fake_guard_server.addr), guard)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        r = await client.post("/v1/chat/completions", json=chat_body("hi"))
    await guard.close()
    assert r.status_code == 500
    request_id = r.headers["x-request-id"]
    assert request_id.startswith("chatcmpl-")
    assert r.json() == {
        "error": {"message": GENERIC_500, "type": "server_error", "param": None, "code": None, "request_id": request_id}
    }
