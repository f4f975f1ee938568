"""ChatRenderer equals transformers' apply_chat_template; tojson key order; typed errors; fallback."""

from __future__ import annotations

from typing import Any

import pytest

from services.cacheguard.renderer import (
    ChatRenderer,
    RenderError,
    chat_message,
    tool_call,
    tool_definition,
)
from services.common.model_files import resolve_model_path
from services.common.tokenizer import TokenizerInfo

SMOL_DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    """The reference: transformers' tokenizer of the embedded SmolLM2 GGUF (loaded once, ~7 s)."""
    from transformers import AutoTokenizer

    path = resolve_model_path("embedded:smollm2")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smol_info(hf_tokenizer: Any) -> TokenizerInfo:
    assert "<|im_start|>" in hf_tokenizer.chat_template
    return TokenizerInfo(
        chat_template=hf_tokenizer.chat_template,
        bos_token=hf_tokenizer.bos_token,
        eos_token=hf_tokenizer.eos_token,
        bos_token_id=hf_tokenizer.bos_token_id,
        eos_token_ids=(hf_tokenizer.eos_token_id,),
        add_bos=False,
    )


def info_with(template: str | None) -> TokenizerInfo:
    return TokenizerInfo(
        chat_template=template, bos_token="<s>", eos_token="</s>", bos_token_id=1, eos_token_ids=(2,), add_bos=True
    )


CONVERSATIONS = {
    "user only": [chat_message("user", "What is 2+2?")],
    "system and user": [chat_message("system", "You are terse."), chat_message("user", "What is 2+2?")],
    "multi-turn": [
        chat_message("system", "You are terse."),
        chat_message("user", "What is 2+2?"),
        chat_message("assistant", "4"),
        chat_message("user", "And 3+3?"),
    ],
    "multi-turn without system": [
        chat_message("user", "Hi"),
        chat_message("assistant", "Hello! How can I help?"),
        chat_message("user", "Tell me a joke."),
    ],
    "unicode, braces, newlines, empty": [
        chat_message("system", ""),
        chat_message("user", "café → 東京 {{ not_a_variable }} {% raw %}\n\n  indented\n"),
    ],
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_render_equals_transformers(
    hf_tokenizer: Any, smol_info: TokenizerInfo, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ours = ChatRenderer(smol_info).render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == expected


def test_smollm2_literal_text(smol_info: TokenizerInfo) -> None:
    text = ChatRenderer(smol_info).render([chat_message("user", "Hi")])
    assert text == SMOL_DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_message_boundaries_smollm2(smol_info: TokenizerInfo) -> None:
    messages = CONVERSATIONS["multi-turn without system"]
    rendered = ChatRenderer(smol_info).render_with_boundaries(messages)
    assert rendered.text == ChatRenderer(smol_info).render(messages)
    a = len(SMOL_DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n")
    b = a + len("<|im_start|>assistant\nHello! How can I help?<|im_end|>\n")
    c = b + len("<|im_start|>user\nTell me a joke.<|im_end|>\n")
    assert rendered.message_starts == (0, a, b)
    assert rendered.messages_end == c
    assert rendered.text[c:] == "<|im_start|>assistant\n"


def test_message_boundaries_unknown_when_prefixes_render_differently() -> None:
    # The message count at the top changes every prefix: no message boundary can be found.
    template = "{{ messages | length }}\n{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    messages = [chat_message("user", "a"), chat_message("assistant", "b")]
    rendered = ChatRenderer(info_with(template)).render_with_boundaries(messages)
    assert rendered.text == "2\nuser: a\nassistant: b\n"
    assert rendered.message_starts == (0, 0)
    assert rendered.messages_end == len(rendered.text)


# Templates whose rendering of a message depends on its place or neighbours: the paired renders must not be
# trusted there, and the boundaries must equal those of every prefix.
PLACED_TEMPLATES = {
    "last message marked": "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last %} (last){% endif %}\n"
    "{% endfor %}",
    "turn numbers": "{% for m in messages %}{{ loop.index }}. {{ m.role }}: {{ m.content }}\n{% endfor %}",
    "alternation enforced": "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}[{{ m.role }}] {{ m.content }}\n{% endfor %}",
    "previous role": "{% set ns = namespace(prev='') %}{% for m in messages %}{% if m.role == ns.prev %}+{% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% set ns.prev = m.role %}{% endfor %}",
    "message count": "{{ messages | length }}\n{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
}


def _long_chat(n: int) -> list[dict[str, Any]]:
    roles = ["user", "assistant", "user", "user", "assistant", "tool"]
    return [chat_message(roles[i % len(roles)], f"message {i}\n" + "x" * (i % 7)) for i in range(n)]


@pytest.mark.parametrize("name", list(PLACED_TEMPLATES))
def test_boundaries_equal_every_prefix_render_whatever_the_template(name: str) -> None:
    renderer = ChatRenderer(info_with(PLACED_TEMPLATES[name]))
    pair = [chat_message("user", "a"), chat_message("assistant", "b")]
    for messages in [*CONVERSATIONS.values(), _long_chat(40), pair]:
        try:
            rendered = renderer.render_with_boundaries(messages)
        except RenderError:
            continue  # the alternation template refuses some conversations outright
        exact = renderer._prefix_starts(messages, None, rendered.text)
        assert [*rendered.message_starts, rendered.messages_end] == exact, name


def test_boundaries_of_a_long_chat_take_linear_rendering(smol_info: TokenizerInfo) -> None:
    """SmolLM2's template renders each message by itself: 600 messages' boundaries (the same as from every
    prefix) render O(n) messages in all, not the O(n^2) of every prefix (180,000 here)."""
    renderer = ChatRenderer(smol_info)
    messages = _long_chat(600)
    rendered_messages = 0
    real = renderer.render

    def counted(msgs, tools=None, add_generation_prompt=True):  # type: ignore[no-untyped-def]
        nonlocal rendered_messages
        rendered_messages += len(msgs)
        return real(msgs, tools, add_generation_prompt)

    renderer.render = counted  # type: ignore[method-assign]
    rendered = renderer.render_with_boundaries(messages)
    assert rendered_messages <= 6 * len(messages), rendered_messages
    renderer.render = real  # type: ignore[method-assign]
    assert [*rendered.message_starts, rendered.messages_end] == renderer._prefix_starts(messages, None, rendered.text)
    assert rendered.message_starts[-1] > rendered.message_starts[-2] > 0


TOOLS_TEMPLATE = (
    "{% if tools %}{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% if m.tool_calls %} calls={{ m.tool_calls | tojson }}{% endif %}"
    "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"
)
WEATHER_PARAMS = (
    '{"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"type":"integer"}},"required":["zeta"]}'
)


def tool_conversation() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    tools = [tool_definition("get_weather", "Weather <now> & café", WEATHER_PARAMS)]
    messages = [
        chat_message("user", "Weather in Paris?"),
        chat_message("assistant", "", tool_calls=[tool_call("call_1", "get_weather", '{"zeta": "Paris", "alpha": 3}')]),
        chat_message("tool", '{"temp": 21}', tool_call_id="call_1"),
    ]
    return messages, tools


def test_tools_render_with_stable_key_order(hf_tokenizer: Any) -> None:
    messages, tools = tool_conversation()
    renderer = ChatRenderer(info_with(TOOLS_TEMPLATE))
    text = renderer.render(messages, tools)
    # JSON the client sent as text is rendered with sorted object keys (arrays keep their order).
    expected_tool = (
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & café", '
        '"parameters": {"properties": {"alpha": {"type": "integer"}, "zeta": {"type": "string"}}, '
        '"required": ["zeta"], "type": "object"}}}'
    )
    expected_call = (
        '[{"id": "call_1", "type": "function", "function": {"name": "get_weather", '
        '"arguments": {"alpha": 3, "zeta": "Paris"}}}]'
    )
    assert text == (
        f"{expected_tool}\n"
        "user: Weather in Paris?\n"
        f"assistant:  calls={expected_call}\n"
        'tool: {"temp": 21} id=call_1\n'
        "<s>assistant:"
    )
    # Built again from the same JSON text: byte-identical.
    again_messages, again_tools = tool_conversation()
    assert renderer.render(again_messages, again_tools) == text
    # The same schema and arguments re-serialised with other key orders and spacing: byte-identical.
    reordered_params = (
        '{"required": ["zeta"], "properties": {"alpha": {"type": "integer"}, '
        '"zeta": {"type": "string"}},"type":"object"}'
    )
    reserialised_tools = [tool_definition("get_weather", "Weather <now> & café", reordered_params)]
    reserialised = [
        again_messages[0],
        chat_message("assistant", "", tool_calls=[tool_call("call_1", "get_weather", '{ "alpha":3, "zeta":"Paris" }')]),
        again_messages[2],
    ]
    assert renderer.render(reserialised, reserialised_tools) == text
    reference = hf_tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=TOOLS_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        bos_token="<s>",
    )
    assert text == reference


def test_reasoning_alias_and_generation_tag_match_transformers(hf_tokenizer: Any) -> None:
    template = (
        "{% for m in messages %}{{ m.role }}|{{ m.thinking }}|{{ m.reasoning_content }}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{{ '\\n' }}{% endfor %}"
    )
    messages = [chat_message("user", "q"), chat_message("assistant", "a", reasoning_content="think")]
    ours = ChatRenderer(info_with(template)).render(messages, add_generation_prompt=False)
    assert ours == "user||[q]\nassistant|think|think[a]\n"
    assert ours == hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)


def test_tool_call_arguments() -> None:
    assert tool_call("", "f", "") == {"type": "function", "function": {"name": "f", "arguments": {}}}
    # Arguments that are not JSON reach the template as the raw text.
    assert tool_call("c", "f", "{oops") == {
        "id": "c",
        "type": "function",
        "function": {"name": "f", "arguments": "{oops"},
    }


def test_tool_definition_defaults_and_errors() -> None:
    assert tool_definition("f", "", "") == {
        "type": "function",
        "function": {"name": "f", "description": "", "parameters": {"type": "object", "properties": {}}},
    }
    with pytest.raises(RenderError, match="'f': parameters are not valid JSON"):
        tool_definition("f", "", '{"type": "object",')
    with pytest.raises(RenderError, match="must be a JSON object, got list"):
        tool_definition("f", "", "[1, 2]")
    with pytest.raises(RenderError, match="empty name"):
        tool_definition("", "", "{}")


def test_bad_template_does_not_compile() -> None:
    with pytest.raises(RenderError, match="does not compile"):
        ChatRenderer(info_with("{% for m in %}{{ m }}"))


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{% set ns = namespace(_secret=1) %}", "underscore"),
        ("{{ messages.clear() }}", "chat template error"),  # the sandbox refuses mutation
    ],
)
def test_template_errors_are_render_errors(template: str, message: str) -> None:
    renderer = ChatRenderer(info_with(template))
    with pytest.raises(RenderError, match=message):
        renderer.render([chat_message("user", "x")])


def test_fallback_format_without_template() -> None:
    renderer = ChatRenderer(info_with(None))
    assert not renderer.has_template
    messages = [
        chat_message("system", "Be brief."),
        chat_message("user", "Hi"),
        chat_message("assistant", "", tool_calls=[tool_call("c1", "f", '{"x": 1}')]),
    ]
    tools = [tool_definition("f", "does f", '{"type": "object"}')]
    assert renderer.render(messages) == (
        "system: Be brief.\n\nuser: Hi\n\n"
        'assistant: \ntool_calls: [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]'
        "\n\nassistant:"
    )
    assert renderer.render(messages[:2], tools, add_generation_prompt=False) == (
        'tools: [{"type": "function", "function": {"name": "f", "description": "does f", '
        '"parameters": {"type": "object"}}}]\n\nsystem: Be brief.\n\nuser: Hi\n\n'
    )
    rendered = renderer.render_with_boundaries(messages[:2])
    assert rendered.message_starts == (0, len("system: Be brief.\n\n"))
    assert rendered.text[rendered.messages_end :] == "assistant:"
