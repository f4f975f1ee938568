"""The gateway's side of the API surface against the fake guard: n choices (seeds seed + j, later choices start
after the first one's first event), batched prompts, 404 model_not_found and aliases, tools on a template that
renders none (a typed 400), the sampling fields reaching the guard, and the OpenAPI document."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from services.gateway.config import GatewayConfig
from tests.gateway.fake_guard import ANSWER, FakeGuard, FakeGuardServer, chat_body, client_for, sse_payloads

pytestmark = pytest.mark.anyio

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


async def test_n_choices_get_their_own_seeds(client: httpx.AsyncClient, fake: FakeGuard) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body("hi", n=3, seed=7, temperature=0.5))
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == ANSWER for c in body["choices"])
    # the first choice goes first; the later ones start together after its first event, in either order
    seeds = [q.sampling.seed for q in fake.requests]
    assert seeds[0] == 7 and sorted(seeds) == [7, 8, 9]
    assert len({q.request_id for q in fake.requests}) == 3
    assert body["usage"]["prompt_tokens"] == 12 and body["usage"]["completion_tokens"] == 12  # prompt counted once


async def test_n_choices_stream_by_index(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body("hi", n=2, stream=True))
    chunks = [p for p in sse_payloads(r.text) if isinstance(p, dict) and p.get("choices")]
    texts: dict[int, str] = {0: "", 1: ""}
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content") or ""
    assert texts == {0: ANSWER, 1: ANSWER}
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]


async def test_batched_prompts_are_one_request_each(client: httpx.AsyncClient, fake: FakeGuard) -> None:
    r = await client.post("/v1/completions", json={"model": "m", "prompt": ["a b", "c d e"], "n": 2})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    assert [q.prompt_text for q in fake.requests] == ["a b", "a b", "c d e", "c d e"]
    assert r.json()["usage"]["prompt_tokens"] == 24


async def test_unknown_model_is_404_unless_an_alias(
    client: httpx.AsyncClient, fake_guard_server: FakeGuardServer
) -> None:
    r = await client.post("/v1/chat/completions", json={**chat_body("hi"), "model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"
    assert (await client.get("/v1/models/gpt-4o")).status_code == 404
    config = GatewayConfig(cacheguard_addr=fake_guard_server.addr, model_aliases=("gpt-4o",))
    async for aliased in client_for(config):
        r = await aliased.post("/v1/chat/completions", json={**chat_body("hi"), "model": "gpt-4o"})
        assert r.status_code == 200 and r.json()["model"] == "m"


async def test_tools_on_a_template_without_them_are_a_typed_400(client: httpx.AsyncClient, fake: FakeGuard) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body("hi", tools=[TOOL], tool_choice="required"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "tools_not_supported"
    assert fake.requests == []
    ok = await client.post("/v1/chat/completions", json=chat_body("hi", tools=[TOOL], tool_choice="none"))
    assert ok.status_code == 200  # tool_choice none: the tools are context only


async def test_sampling_fields_reach_the_guard(client: httpx.AsyncClient, fake: FakeGuard) -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = chat_body(
        "hi", presence_penalty=0.5, frequency_penalty=-0.25, logprobs=True, top_logprobs=4, repetition_penalty=1.1,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    s = fake.requests[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs, s.top_logprobs) == (0.5, -0.25, True, 4)
    assert abs(s.repetition_penalty - 1.1) < 1e-6
    assert (s.grammar.kind, s.grammar.text) == (
        "json_schema",
        '{"type": "object", "properties": {"a": {"type": "integer"}}}',
    )
    await client.post("/v1/completions", json={"model": "m", "prompt": "x", "logprobs": 2})
    assert (fake.requests[-1].sampling.logprobs, fake.requests[-1].sampling.top_logprobs) == (True, 2)


async def test_openapi_document_has_the_real_statuses(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat) == {"200", "400", "401", "404", "413", "422", "429", "499", "500", "503"}
    assert chat["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert "text/event-stream" in chat["200"]["content"]
    assert set(doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]) == {"200", "401", "404", "503"}
    assert (await client.get("/docs")).status_code == 200
