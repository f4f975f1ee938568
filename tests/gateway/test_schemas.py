"""Request validation: what is accepted, what is refused with a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from services.gateway.errors import GatewayError, map_validation_errors
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "hi"}]


def _error(model: type[ChatCompletionRequest] | type[CompletionRequest], body: dict[str, Any]) -> GatewayError:
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body)
    return map_validation_errors(exc.value.errors())


def test_minimal_chat_and_defaults() -> None:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": USER})
    assert req.stream is False and req.include_usage is False
    assert (req.temperature, req.top_p, req.top_k, req.seed, req.max_new_tokens) == (None, None, None, None, None)
    assert req.stop_list == []


def test_unknown_fields_are_ignored() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi", "audio": None}], "store": True, "foo": 1}
    )
    assert req.messages[0].content == "hi"
    assert not hasattr(req, "foo")


def test_accepted_values() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": USER,
            "temperature": 1,  # an int is a number
            "n": 1,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "response_format": {"type": "text"},
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": False,
            "user": "u-1",
            "tool_choice": "auto",
        }
    )
    assert req.temperature == 1.0 and req.include_usage
    assert not ChatCompletionRequest.model_validate(
        {"model": "m", "messages": USER, "stream_options": {"include_usage": True}}
    ).include_usage  # usage chunks only exist in streams


def test_text_parts_are_joined() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]}
    )
    assert req.messages[0].content == "ab"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": USER}, "model", "Missing required parameter: 'model'."),
        ({"model": "m"}, "messages", "Missing required parameter: 'messages'."),
        (
            {"model": "m", "messages": USER, "n": 17},
            "n",
            "Invalid value for 'n': Input should be less than or equal to 16",
        ),
        (
            {"model": "m", "messages": USER, "n": 0},
            "n",
            "Invalid value for 'n': Input should be greater than or equal to 1",
        ),
        ({"model": 3, "messages": USER}, "model", "Invalid value for 'model': Input should be a valid string"),
        (
            {"model": "m", "messages": USER, "max_tokens": "10"},
            "max_tokens",
            "Invalid value for 'max_tokens': Input should be a valid integer",
        ),
        (
            {"model": "m", "messages": USER, "max_tokens": 0},
            "max_tokens",
            "Invalid value for 'max_tokens': Input should be greater than or equal to 1",
        ),
        (
            {"model": "m", "messages": USER, "temperature": 3},
            "temperature",
            "Invalid value for 'temperature': Input should be less than or equal to 2",
        ),
        (
            {"model": "m", "messages": USER, "stop": ["a", 1]},
            "stop[1]",
            "Invalid value for 'stop[1]': Input should be a valid string",
        ),
        (
            {"model": "m", "messages": USER, "stop": ""},
            "stop",
            "Invalid value for 'stop': stop strings must be non-empty",
        ),
        (
            {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "Invalid value for 'messages[0].role': "
            "Input should be 'system', 'developer', 'user', 'assistant' or 'tool'",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "Invalid value for 'messages[0].content': content parts of type 'image_url' are not supported; only 'text'",
        ),
        (
            {"model": "m", "messages": USER, "logit_bias": {"5": -101}},
            "logit_bias",
            "Invalid value for 'logit_bias': logit_bias['5'] = -101.0 is outside [-100, 100]",
        ),
        (
            {"model": "m", "messages": USER, "logit_bias": {"5": "big"}},
            "logit_bias.5",
            "Invalid value for 'logit_bias.5': Input should be a valid number",
        ),
        (
            {"model": "m", "messages": USER, "frequency_penalty": -2.5},
            "frequency_penalty",
            "Invalid value for 'frequency_penalty': Input should be greater than or equal to -2",
        ),
        (
            {"model": "m", "messages": USER, "top_logprobs": 3},
            "top_logprobs",
            "Invalid value for 'top_logprobs': top_logprobs needs logprobs: true",
        ),
        (
            {"model": "m", "messages": USER, "response_format": {"type": "json_schema"}},
            "response_format",
            "Invalid value for 'response_format': type 'json_schema' needs json_schema.schema",
        ),
        (
            {"model": "m", "messages": USER, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "Invalid value for 'stream_options.include_usage': Input should be a valid boolean",
        ),
    ],
)
def test_chat_400s_name_the_field(body: dict[str, Any], param: str, message: str) -> None:
    err = _error(ChatCompletionRequest, body)
    assert (err.status, err.type, err.param, err.message) == (400, "invalid_request_error", param, message)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (["a"] * 33, "a batch of 33 prompts; at most 32"),
        (["a", ""], "prompt must not hold an empty prompt"),
        ([], "prompt must not be empty"),
        ([[]], "prompt must not hold an empty prompt"),
        ([3, -4], "prompt token ids must be >= 0"),
        ([2**31], "prompt token ids must be >= 0"),
        (None, "Input should be a valid string"),
    ],
)
def test_bad_prompts(prompt: Any, message: str) -> None:
    err = _error(CompletionRequest, {"model": "m", "prompt": prompt})
    assert err.param == "prompt"
    assert err.message.endswith(message)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("echo", True, "echo=true is not supported"),
        ("suffix", "x", "suffix is not supported"),
        ("best_of", 2, "best_of=2 is not supported; only 1"),
        ("n", 17, "Input should be less than or equal to 16"),
    ],
)
def test_completion_refused_fields(field: str, value: Any, message: str) -> None:
    err = _error(CompletionRequest, {"model": "m", "prompt": "p", field: value})
    assert (err.param, err.message) == (field, f"Invalid value for '{field}': {message}")


def test_completion_accepts_false_and_one() -> None:
    req = CompletionRequest.model_validate(
        {"model": "m", "prompt": "p", "echo": False, "best_of": 1, "max_tokens": 3, "logprobs": None}
    )
    assert req.max_new_tokens == 3


def test_fastapi_style_locations() -> None:
    """FastAPI prefixes 'body'; union member tags are dropped from the param."""
    err = map_validation_errors([{"loc": ("body", "messages", 0, "content", "str"), "msg": "bad", "type": "x"}])
    assert err.param == "messages[0].content"
    err = map_validation_errors([{"loc": ("body", 7), "msg": "Expecting value", "type": "json_invalid"}])
    assert err.message.startswith("We could not parse the JSON body")
    assert map_validation_errors([]).status == 400
