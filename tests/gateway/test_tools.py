"""Tool-call parsing and the malformed tool-call guard, replayed on exact byte strings (Hermes / agent template,
Qwen3-Coder XML bodies, Llama 3 JSON), and the streamed deltas (name first, arguments in pieces)."""

from __future__ import annotations

import json

import pytest

from services.gateway import tools
from services.gateway.tools import MalformedToolCall, StreamParser, Tool, parse

WEATHER = Tool(
    "get_weather",
    {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
)
TIME = Tool("get_time", {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]})
TOOLS = [WEATHER, TIME]
EXAMPLE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "..."}}\n</tool_call>'


def calls(text: str, tool_list: list[Tool] = TOOLS, fmt: str = "hermes") -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parse(text, tool_list, fmt).calls]


def test_example_is_a_correct_call() -> None:
    assert tools.example(WEATHER, "hermes") == EXAMPLE
    assert tools.example(WEATHER, "llama3") == '{"name": "get_weather", "parameters": {"city": "..."}}'
    assert calls(EXAMPLE) == [("get_weather", {"city": "..."})]


def test_hermes_single_parallel_and_text_before() -> None:
    one = b'<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'.decode()
    assert calls(one) == [("get_weather", {"city": "Paris"})]
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    assert calls(two) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    parsed = parse("Let me check.\n" + one, TOOLS, "hermes")
    assert parsed.content == "Let me check." and len(parsed.calls) == 1
    assert parsed.calls[0].id.startswith("call_") and parsed.calls[0].id != parse(one, TOOLS, "hermes").calls[0].id


def test_qwen3_xml_body() -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    assert calls(text) == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize(
    ("text", "truncated", "reason", "function"),
    [
        ("<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>", False, "no <function=NAME> tag", ""),
        (
            "<tool_call>\n<function=get_weather>\n<parameter city>Paris</parameter>\n</function>\n</tool_call>",
            False,
            "<parameter=KEY>...</parameter> tags are invalid",
            "get_weather",
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>Paris\n</function>\n</tool_call>",
            False,
            "<parameter=KEY>...</parameter> tags are invalid",
            "get_weather",
        ),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', True, "cut off by max_tokens", "get_weather"),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}', False, "not closed", "get_weather"),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
            False,
            "not valid JSON",
            "get_weather",
        ),
        ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', False, "not a tool here", "rm_rf"),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>',
            False,
            "'city' is a required property",
            "get_weather",
        ),
        ('<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', False, 'no "name"', ""),
    ],
)
def test_broken_shells_take_the_typed_path(text: str, truncated: bool, reason: str, function: str) -> None:
    with pytest.raises(MalformedToolCall) as exc:
        parse(text, TOOLS, "hermes", truncated=truncated)
    assert reason in exc.value.reason and exc.value.function == function and exc.value.raw == text
    if function == "get_weather":
        assert exc.value.example == EXAMPLE


def test_one_tool_is_the_intended_function_of_a_nameless_shell() -> None:
    with pytest.raises(MalformedToolCall) as exc:
        parse("<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>", [WEATHER], "hermes")
    assert (exc.value.function, exc.value.example) == ("get_weather", EXAMPLE)


@pytest.mark.parametrize(
    "text",
    [
        "Wrap each call in <tool_call></tool_call> tags.",
        "Use the `<tool_call>` tag, then the JSON.",
        'An example:\n```\n<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>\n```\nThat is the format.',
        "```xml\n<tool_call>\n<function=broken\n```",
        "No tools needed: Paris is the capital of France.",
    ],
)
def test_text_that_mentions_the_tags_is_text(text: str) -> None:
    assert parse(text, TOOLS, "hermes") == tools.Parsed(text)


def test_llama3_json() -> None:
    assert calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}', fmt="llama3") == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert calls('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', fmt="llama3") == [
        ("get_time", {"zone": "UTC"})
    ]
    with pytest.raises(MalformedToolCall, match="cut off"):
        parse('{"name": "get_weather", "parameters": {"ci', TOOLS, "llama3", truncated=True)
    assert parse("Oslo is in Norway.", TOOLS, "llama3").calls == []


def _stream(text: str, step: int) -> tuple[list[tools.StreamEvent], tools.Parsed]:
    parser = StreamParser(TOOLS, "hermes")
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    parsed, rest = parser.finish(truncated=False)
    return events + rest, parsed


@pytest.mark.parametrize("step", [1, 3, 200])
def test_stream_sends_text_then_name_then_argument_pieces(step: int) -> None:
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    events, parsed = _stream(text, step)
    content = "".join(e.content for e in events if e.index < 0)
    assert content == "Checking.\n"
    call_events = [e for e in events if e.index == 0]
    assert call_events[0].name == "get_weather" and call_events[0].id == parsed.calls[0].id
    assert all(not e.name for e in call_events[1:])
    args = "".join(e.arguments for e in call_events)
    assert args == '{"city": "Paris", "days": 2}' == parsed.calls[0].arguments
    if step == 1:
        assert len(call_events) > 3  # arguments went out in pieces


def test_stream_holds_back_a_possible_tag_and_never_sends_a_shell_as_text() -> None:
    parser = StreamParser(TOOLS, "hermes")
    assert [e.content for e in parser.feed("Sure <tool")] == ["Sure "]
    parser = StreamParser(TOOLS, "hermes")
    sent = "".join(e.content for e in parser.feed("<tool_call>\n<parameter=city>\nParis\n</parameter>\n"))
    assert sent == ""
    with pytest.raises(MalformedToolCall):
        parser.finish(truncated=True)


def test_forced_grammar_frames_the_call_schema() -> None:
    g = tools.forced_grammar([WEATHER], "hermes", parallel=True)
    assert (g.prefix, g.suffix, g.separator, g.max_calls) == ("<tool_call>\n", "\n</tool_call>", "\n", 8)
    assert g.schema["properties"]["name"] == {"const": "get_weather"}
    assert g.schema["required"] == ["name", "arguments"]
    assert "anyOf" in tools.forced_grammar(TOOLS, "hermes", parallel=False).schema


def test_text_after_the_calls_is_content_beside_them() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = parse(call + "\nI will tell you once I know.", TOOLS, "hermes")
    assert parsed.content == "I will tell you once I know." and parsed.trailing == "I will tell you once I know."
    assert [c.name for c in parsed.calls] == ["get_weather"]
    both = parse("Let me check.\n" + call + "\n\nBack soon.\n", TOOLS, "hermes")
    assert (both.content, both.trailing) == ("Let me check.\nBack soon.", "Back soon.")
    assert parse(call + "\n", TOOLS, "hermes").content is None


@pytest.mark.parametrize("step", [1, 5, 400])
def test_stream_sends_text_after_the_calls_once_they_are_parsed(step: int) -> None:
    text = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\nOne moment.'
    parser = StreamParser(TOOLS, "hermes")
    fed: list[tools.StreamEvent] = []
    for i in range(0, len(text), step):
        fed += parser.feed(text[i : i + step])
    assert "".join(e.content for e in fed if e.index < 0) == "Checking.\n"  # nothing after the calls yet
    parsed, rest = parser.finish(truncated=False)
    assert [e.content for e in rest if e.index < 0 and e.content] == ["One moment."]
    assert parsed.content == "Checking.\nOne moment." and [c.name for c in parsed.calls] == ["get_time"]
