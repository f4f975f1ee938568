"""OpenAI request -> GuardGenerateRequest, and guard events -> OpenAI response objects."""

from __future__ import annotations

from typing import Any

import pytest

from services.common.protos import cacheguard_pb2, engine_pb2
from services.gateway import builders, convert, responses
from services.gateway.errors import GatewayError
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest


def _chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def _guard_chat(**fields: Any) -> cacheguard_pb2.GuardGenerateRequest:
    return convert.chat_request(_chat(**fields), request_id="r-1", session_id="s-1", tenant="t-1")


def test_unset_sampling_fields_stay_unset() -> None:
    sampling = _guard_chat().sampling
    assert not sampling.HasField("temperature")
    assert not sampling.HasField("top_p")
    assert not sampling.HasField("seed")
    assert (sampling.top_k, sampling.max_tokens, list(sampling.stop), dict(sampling.logit_bias)) == (0, 0, [], {})
    assert not sampling.ignore_eos


def test_sampling_fields() -> None:
    sampling = _guard_chat(
        temperature=0,
        top_p=0.9,
        top_k=40,
        seed=7,
        max_tokens=5,
        stop=["a", "b"],
        stop_token_ids=[2],
        logit_bias={"15": -100, "3": 2.5},
        ignore_eos=True,
    ).sampling
    assert sampling.HasField("temperature") and sampling.temperature == 0.0
    assert sampling.top_p == pytest.approx(0.9)
    assert (sampling.top_k, sampling.seed, sampling.max_tokens) == (40, 7, 5)
    assert list(sampling.stop) == ["a", "b"] and list(sampling.stop_token_ids) == [2]
    assert dict(sampling.logit_bias) == {15: -100.0, 3: 2.5}
    assert sampling.ignore_eos


def test_sampling_edge_values() -> None:
    assert _guard_chat(top_k=-1).sampling.top_k == 0
    assert _guard_chat(seed=-1).sampling.seed == 2**64 - 1
    assert list(_guard_chat(stop="END").sampling.stop) == ["END"]
    assert _guard_chat(max_tokens=9, max_completion_tokens=4).sampling.max_tokens == 4
    assert _guard_chat(max_tokens=9).sampling.max_tokens == 9


@pytest.mark.parametrize("key", ["abc", "-1", "1.5", " 2", "", "99999999999"])
def test_logit_bias_non_token_key_is_400(key: str) -> None:
    with pytest.raises(GatewayError) as err:
        _guard_chat(logit_bias={key: 1})
    assert (err.value.status, err.value.param, err.value.type) == (400, "logit_bias", "invalid_request_error")
    assert repr(key) in err.value.message


def test_chat_messages_and_tools() -> None:
    req = _guard_chat(
        messages=[
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "thinking",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        tools=[
            {"type": "function", "function": {"name": "f", "description": "adds", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "g"}},
        ],
    )
    assert (req.request_id, req.session_id, req.tenant) == ("r-1", "s-1", "t-1")
    assert req.WhichOneof("input") == "chat"
    msgs = req.chat.messages
    assert [(m.role, m.content) for m in msgs] == [
        ("system", "rules"),
        ("user", "ab"),
        ("assistant", ""),
        ("tool", "42"),
    ]
    assert msgs[1].name == "u" and msgs[2].reasoning_content == "thinking" and msgs[3].tool_call_id == "c1"
    assert [(c.id, c.name, c.arguments_json) for c in msgs[2].tool_calls] == [("c1", "f", '{"x":1}')]
    tools = req.chat.tools
    assert [(t.name, t.description, t.parameters_json) for t in tools] == [
        ("f", "adds", '{"type": "object"}'),
        ("g", "", ""),
    ]


def test_tool_call_arguments_object_is_serialized() -> None:
    req = _guard_chat(
        messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"y": 2}}}]}]
    )
    assert req.chat.messages[0].tool_calls[0].arguments_json == '{"y": 2}'


@pytest.mark.parametrize(
    ("prompt", "kind", "value"),
    [
        ("Once upon", "prompt_text", "Once upon"),
        (["Once"], "prompt_text", "Once"),
        ([5, 6, 7], "prompt_tokens", [5, 6, 7]),
        ([[8, 9]], "prompt_tokens", [8, 9]),
    ],
)
def test_completion_prompt_forms(prompt: Any, kind: str, value: Any) -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": prompt, "temperature": 0.5})
    req = convert.completion_request(body, request_id="r", session_id="", tenant="")
    assert req.WhichOneof("input") == kind
    got = req.prompt_text if kind == "prompt_text" else list(req.prompt_tokens.token_ids)
    assert got == value
    assert req.sampling.temperature == 0.5


def _done(reason: int = engine_pb2.FINISH_REASON_STOP) -> cacheguard_pb2.GuardDone:
    return cacheguard_pb2.GuardDone(
        engine_done=engine_pb2.GenerateDone(
            finish_reason=reason,
            usage=engine_pb2.Usage(prompt_tokens=100, completion_tokens=3, cached_tokens=64),
            matched_stop="END",
        ),
        prefix=cacheguard_pb2.PrefixReport(session_id="s", divergence_message_index=-1),
        engine_replica="e1",
    )


@pytest.mark.parametrize(
    ("reason", "name"),
    [
        (engine_pb2.FINISH_REASON_STOP, "stop"),
        (engine_pb2.FINISH_REASON_LENGTH, "length"),
        (engine_pb2.FINISH_REASON_ABORT, "abort"),
        (engine_pb2.FINISH_REASON_UNSPECIFIED, "stop"),
    ],
)
def test_finish_reason(reason: int, name: str) -> None:
    assert responses.finish_reason(reason) == name


def test_chat_builder() -> None:
    b = builders.ChatBuilder("chatcmpl-1", 1700000000, "m")
    whole = b.whole("hey", _done(engine_pb2.FINISH_REASON_LENGTH)).model_dump(mode="json")
    assert whole["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "hey"},
        "finish_reason": "length",
        "logprobs": None,
    }
    assert whole["usage"] == {
        "prompt_tokens": 100,
        "completion_tokens": 3,
        "total_tokens": 103,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    assert whole["kvmem"]["matched_stop"] == "END" and whole["kvmem"]["prefix"]["divergence_message_index"] == -1
    opening = b.opening().model_dump(mode="json")
    assert opening == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        ],
    }
    assert b.delta("x").model_dump(mode="json")["choices"][0]["delta"] == {"content": "x"}
    closing = b.closing(_done()).model_dump(mode="json")
    assert closing["choices"][0]["delta"] == {} and closing["choices"][0]["finish_reason"] == "stop"
    assert closing["kvmem"]["engine_replica"] == "e1" and "usage" not in closing
    usage = b.usage_chunk(_done()).model_dump(mode="json")
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 103 and "kvmem" not in usage


def test_completion_builder() -> None:
    b = builders.CompletionBuilder("cmpl-1", 1, "m")
    assert b.opening() is None
    assert b.delta("ab").model_dump(mode="json") == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "ab", "finish_reason": None, "logprobs": None}],
    }
    whole = b.whole("abc", _done()).model_dump(mode="json")
    assert whole["choices"][0]["text"] == "abc" and whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_model_card() -> None:
    info = engine_pb2.GetModelInfoResponse(
        model_id="smollm2", architecture="llama", max_context=8192, kv_capacity=4096, page_size=64, kv_format="fp8"
    )
    card = responses.model_card(info).model_dump(mode="json")
    assert card["id"] == "smollm2" and card["object"] == "model"
    assert card["kvmem"] == {
        "architecture": "llama",
        "max_context": 8192,
        "kv_capacity": 4096,
        "page_size": 64,
        "kv_format": "fp8",
    }
