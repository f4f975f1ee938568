"""The segment planner through the gateway's HTTP API, against an in-process fake cache guard with a
small pool (200 "tokens", a token being a word) and a toy model that reads the TEXT of map prompts.

Covers the request extension `kvmem`, the server default, `kvmem.plan` on every level, streaming
with progress chunks, and errors during a plan; the real model runs in tests/e2e/test_planner_e2e.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import httpx
import pytest

from services.common.protos import cacheguard_pb2, cacheguard_pb2_grpc, engine_pb2
from services.gateway.app import create_app
from services.gateway.config import ConfigError, GatewayConfig
from services.gateway.guard_client import GuardClient
from tests.gateway.fake_guard import FakeGuardServer

pytestmark = pytest.mark.anyio

POOL = 200
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. "


def _words(text: str) -> int:
    return len(text.split())


def _done(prompt_tokens: int, text: str, policy: str = "resident", unverified: bool = False) -> Any:
    engine_done = engine_pb2.GenerateDone(
        finish_reason=engine_pb2.FINISH_REASON_STOP,
        usage=engine_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=_words(text), cached_tokens=0),
        prefill_policy=policy,
        unverified=unverified,
    )
    done = cacheguard_pb2.GuardDone(engine_done=engine_done, engine_replica="toy-engine")
    return cacheguard_pb2.GuardGenerateEvent(done=done)


class ToyGuard(cacheguard_pb2_grpc.CacheGuardServicer):
    """Counts words; answers map prompts from their TEXT; `explode` in a TEXT fails that call."""

    def __init__(self) -> None:
        self.requests: list[cacheguard_pb2.GuardGenerateRequest] = []

    @staticmethod
    def count(req: Any) -> int:
        kind = req.WhichOneof("input")
        if kind == "chat":
            return sum(_words(m.content) + 4 for m in req.chat.messages)
        if kind == "prompt_text":
            return _words(req.prompt_text)
        return len(req.prompt_tokens.token_ids)

    async def Generate(  # noqa: N802
        self, request: cacheguard_pb2.GuardGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cacheguard_pb2.GuardGenerateEvent]:
        self.requests.append(request)
        prompt_tokens = self.count(request)
        if prompt_tokens + request.sampling.max_tokens > POOL and request.prefill_policy == 0:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"the prompt has {prompt_tokens} tokens")
        content = request.chat.messages[-1].content if request.WhichOneof("input") == "chat" else ""
        text = re.search(r"TEXT:\n(.*)\n\nQUESTION:", content, re.S)
        if text and "explode" in text.group(1):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine lost")
        if text:
            key = re.search(r"pass key is (\d+)", text.group(1))
            answer = f"ANSWER: {key.group(1)} | EVIDENCE: the pass key is {key.group(1)}" if key else "NOT FOUND"
        else:
            answer = "Hello there."
        yield cacheguard_pb2.GuardGenerateEvent(chunk=engine_pb2.TokenChunk(token_ids=[1], text=answer))
        policy = {1: "exact", 2: "sparse"}.get(request.prefill_policy, "resident")
        yield _done(prompt_tokens, answer, policy, unverified=policy == "sparse")

    async def CountTokens(  # noqa: N802
        self, request: cacheguard_pb2.CountTokensRequest, context: grpc.aio.ServicerContext
    ) -> cacheguard_pb2.CountTokensResponse:
        return cacheguard_pb2.CountTokensResponse(num_tokens=self.count(request))

    async def GetModelInfo(  # noqa: N802
        self, request: engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetModelInfoResponse:
        return engine_pb2.GetModelInfoResponse(
            model_id="toy", max_context=4 * POOL, kv_capacity=POOL, page_size=64, tool_call_format="hermes"
        )


@pytest.fixture(scope="module")
def toy_server() -> Iterator[FakeGuardServer]:
    server = FakeGuardServer(ToyGuard())
    yield server
    server.stop()


@pytest.fixture
def toy(toy_server: FakeGuardServer) -> ToyGuard:
    toy_server.servicer.requests.clear()
    return toy_server.servicer  # type: ignore[return-value]


async def _client(config: GatewayConfig) -> AsyncIterator[httpx.AsyncClient]:
    guard = GuardClient(config.cacheguard_addr)
    try:
        transport = httpx.ASGITransport(app=create_app(config, guard))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client
    finally:
        await guard.close()


@pytest.fixture
async def client(toy_server: FakeGuardServer, toy: ToyGuard, one_event_loop: None) -> AsyncIterator[httpx.AsyncClient]:
    async for c in _client(GatewayConfig(cacheguard_addr=toy_server.addr, planner_answer_reserve=32)):
        yield c


def document(key: str | None = None, repeats: int = 40, explode: bool = False) -> str:
    sentences = [FILLER] * repeats
    if key:
        sentences.insert(repeats * 2 // 3, f"The pass key is {key}. ")
    if explode:
        sentences.insert(1, "explode ")
    return "".join(sentences)


def passkey_chat(key: str | None = "4242", **fields: Any) -> dict[str, Any]:
    content = f"{document(key, explode=fields.pop('explode', False))}\n\nWhat is the pass key?"
    return {"model": "toy", "messages": [{"role": "user", "content": content}], **fields}


def sse(text: str) -> list[Any]:
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


# ---------------------------------------------------------------- levels over HTTP


async def test_small_chat_is_L1_with_its_plan(client: httpx.AsyncClient, toy: ToyGuard) -> None:
    r = await client.post(
        "/v1/chat/completions", json={"model": "toy", "messages": [{"role": "user", "content": "hi"}]}
    )
    plan = r.json()["kvmem"]["plan"]
    assert (plan["level"], plan["num_calls"], plan["prefill_policy"], plan["over_pool"]) == ("L1", 1, "resident", False)
    assert toy.requests[0].prefill_policy == engine_pb2.PREFILL_POLICY_UNSPECIFIED


async def test_over_pool_chat_is_answered_in_shards(client: httpx.AsyncClient, toy: ToyGuard) -> None:
    r = await client.post("/v1/chat/completions", json=passkey_chat(max_tokens=16), headers={"X-Session-Id": "s9"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "4242"
    assert body["choices"][0]["finish_reason"] == "stop" and r.headers["x-session-id"] == "s9"
    plan = body["kvmem"]["plan"]
    assert (plan["level"], plan["map"], plan["reduce"], plan["over_pool"]) == ("L2", "model", "single", True)
    assert plan["num_shards"] > 2 and plan["num_calls"] == plan["num_shards"] == len(toy.requests)
    assert plan["evidence"] == [{"shard": plan["evidence"][0]["shard"], "quote": "The pass key is 4242."}]
    assert plan["unverified"] == [] and plan["prompt_tokens"] > POOL and plan["pool_tokens"] == POOL
    assert body["usage"]["prompt_tokens"] == sum(ToyGuard.count(q) for q in toy.requests)
    assert all(q.sampling.max_tokens == 48 and q.sampling.temperature == 0 for q in toy.requests)


async def test_stream_sends_progress_then_the_answer(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions", json=passkey_chat(stream=True, stream_options={"include_usage": True})
    )
    chunks = sse(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    progress = [c["kvmem"]["progress"] for c in chunks if c["choices"] == [] and "kvmem" in c]
    num_shards = chunks[-2]["kvmem"]["plan"]["num_shards"]
    assert [p["done"] for p in progress] == list(range(num_shards + 1))
    assert {p["phase"] for p in progress} == {"map"} and {p["total"] for p in progress} == {num_shards}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "4242"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["kvmem"]["plan"]["level"] == "L2"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > POOL


async def test_unanswerable_is_a_visible_refusal(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=passkey_chat(key=None))
    body = r.json()
    assert r.status_code == 200
    assert body["choices"][0]["message"]["content"].startswith("I could not answer this faithfully: none of the")
    plan = body["kvmem"]["plan"]
    assert plan["level"] == "L3" and plan["refusal"]["reason"] == "no_evidence"


async def test_refuse_policy_makes_no_call(client: httpx.AsyncClient, toy: ToyGuard) -> None:
    r = await client.post("/v1/chat/completions", json=passkey_chat(kvmem={"over_pool_policy": "refuse"}, stream=True))
    chunks = sse(r.text)
    assert "over-pool policy is 'refuse'" in chunks[1]["choices"][0]["delta"]["content"]
    assert chunks[-1]["kvmem"]["plan"]["refusal"]["reason"] == "over_pool" and toy.requests == []


async def test_sparse_is_forwarded_and_flagged(client: httpx.AsyncClient, toy: ToyGuard) -> None:
    r = await client.post("/v1/chat/completions", json=passkey_chat(kvmem={"over_pool_policy": "sparse"}))
    plan = r.json()["kvmem"]["plan"]
    (sent,) = toy.requests
    assert sent.prefill_policy == engine_pb2.PREFILL_POLICY_SPARSE
    assert (plan["level"], plan["prefill_policy"], plan["unverified"]) == ("L1", "sparse", ["sparse_prefill"])
    r = await client.post("/v1/chat/completions", json=passkey_chat(kvmem={"over_pool_policy": "exact"}))
    plan = r.json()["kvmem"]["plan"]
    assert (plan["prefill_policy"], plan["unverified"], plan["over_pool"]) == ("exact", [], True)


async def test_the_call_budget_comes_from_the_request(client: httpx.AsyncClient, toy: ToyGuard) -> None:
    r = await client.post("/v1/chat/completions", json=passkey_chat(kvmem={"max_calls": 1}))
    plan = r.json()["kvmem"]["plan"]
    assert (plan["level"], plan["refusal"]["reason"], plan["max_calls"], toy.requests) == (
        "L3", "budget_exhausted", 1, []
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kvmem", "param"),
    [
        ({"over_pool_policy": "fast"}, "kvmem.over_pool_policy"),
        ({"max_calls": 0}, "kvmem.max_calls"),
        ({"x": 1}, "kvmem.x"),
    ],
)
async def test_bad_options_are_400(client: httpx.AsyncClient, kvmem: dict[str, Any], param: str) -> None:
    r = await client.post("/v1/chat/completions", json=passkey_chat(kvmem=kvmem))
    assert r.status_code == 400 and r.json()["error"]["param"] == param


async def test_completions_prompt_text_and_token_ids(client: httpx.AsyncClient) -> None:
    prompt = f"{document('777')}\n\nWhat is the pass key?"
    r = await client.post("/v1/completions", json={"model": "toy", "prompt": prompt})
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "777"
    assert body["kvmem"]["plan"]["level"] == "L2"
    r = await client.post("/v1/completions", json={"model": "toy", "prompt": list(range(1, 400))})
    plan = r.json()["kvmem"]["plan"]
    assert (plan["level"], plan["refusal"]["reason"]) == ("L3", "not_splittable")


async def test_tools_over_the_pool_are_not_split(client: httpx.AsyncClient, toy: ToyGuard) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    r = await client.post("/v1/chat/completions", json=passkey_chat(tools=[tool]))
    plan = r.json()["kvmem"]["plan"]
    assert (plan["level"], plan["refusal"]["reason"], toy.requests) == ("L3", "not_splittable", [])
    assert "tools" in plan["refusal"]["message"]


async def test_a_failed_call_is_an_http_error_or_an_sse_error(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=passkey_chat(explode=True))
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
    r = await client.post("/v1/chat/completions", json=passkey_chat(explode=True, stream=True))
    chunks = sse(r.text)
    assert chunks[-1]["error"]["code"] == "unavailable"
    metrics = (await client.get("/metrics")).text
    assert 'kvmem_gateway_stream_errors_total{route="/v1/chat/completions",type="service_unavailable"} 1.0' in metrics


async def test_server_default_policy(toy_server: FakeGuardServer, toy: ToyGuard) -> None:
    async for c in _client(GatewayConfig(cacheguard_addr=toy_server.addr, over_pool_policy="refuse")):
        r = await c.post("/v1/chat/completions", json=passkey_chat())
        assert r.json()["kvmem"]["plan"]["refusal"]["reason"] == "over_pool"
        r = await c.post("/v1/chat/completions", json=passkey_chat(kvmem={"over_pool_policy": "shard"}))
        assert r.json()["kvmem"]["plan"]["level"] == "L2"


def test_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_OVER_POOL_POLICY", "exact")
    monkeypatch.setenv("KVMEM_PLANNER_MAX_CALLS", "7")
    config = GatewayConfig.from_args(["--planner-map-concurrency", "2"])
    assert (config.over_pool_policy, config.planner.max_calls, config.planner.map_concurrency) == ("exact", 7, 2)
    with pytest.raises(ConfigError, match="over_pool_policy must be one of shard, sparse, exact, refuse, got 'x'"):
        GatewayConfig(over_pool_policy="x")
    with pytest.raises(ConfigError, match="planner_max_calls must be >= 1, got 0"):
        GatewayConfig(planner_max_calls=0)
