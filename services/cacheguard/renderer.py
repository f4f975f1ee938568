"""ChatRenderer: chat messages -> prompt text with the model's Jinja chat template.

The environment is configured like Hugging Face's `apply_chat_template` (transformers
`chat_template_utils._cached_compile_jinja_template`): an immutable sandbox, `trim_blocks`,
`lstrip_blocks`, loop controls, a `{% generation %}` tag that just renders its body, a `tojson`
filter that keeps key order and does not escape HTML, `raise_exception`, `strftime_now`, `dict`,
and a `namespace` that refuses underscore names. `bos_token` / `eos_token` are template variables.

Models without a chat template use FALLBACK_TEMPLATE, a plain format:

    tools: [<tool definitions as JSON>]            (only when tools are given)

    <role>: <content>                              (one block per message, blank line after;
    tool_calls: [<tool calls as JSON>]              the tool_calls line only when set)

    assistant:                                     (the generation prompt)

Rendering is deterministic: JSON the client sends as text (tool parameter schemas, tool-call
arguments) is parsed and its object keys sorted (recursively; arrays keep their order), so a client
that re-serialises the same schema with another key order renders the same bytes. Key order carries
no meaning in JSON (RFC 8259), so this never changes what a tool or a call says.

A model's template may also be replaced (CacheGuardConfig.chat_template): e.g. a template that
renders tools and reasoning for a model whose own template ignores them. `TemplateSupport` says
what a template renders, probed once at start-up.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.tokenizer import TokenizerInfo

logger = logging.getLogger(__name__)

FALLBACK_TEMPLATE = (
    "{% if tools %}{{ 'tools: ' + (tools | tojson) + '\\n\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] }}"
    "{% if message['tool_calls'] %}{{ '\\ntool_calls: ' + (message['tool_calls'] | tojson) }}{% endif %}"
    "{{ '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

# Names a message's reasoning is passed under, as transformers aliases them (first: the standard one).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def tool_call_format(template: str | None, renders_tools: bool) -> str:
    """The tool-call format a chat template teaches (services/gateway/tools.py reads it): "hermes" for
    `<tool_call>` blocks (Hermes, Qwen, deploy/templates/smollm2-agent.jinja), "llama3" for Llama 3's JSON calls
    (`<|python_tag|>` / "parameters"), "" when the template renders no tools (or has none of these markers)."""
    if not renders_tools or not template:
        return ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return ""


class RenderError(ValueError):
    """The chat template failed on this input (or does not compile); a client error (INVALID_ARGUMENT)."""


class TemplateSupport(NamedTuple):
    """What a chat template renders, found by rendering probe conversations."""

    tools: bool  # tool definitions appear in the text
    reasoning: bool  # an earlier assistant message's reasoning_content appears in the text
    inner_system: bool  # a system message after the first renders (and is not refused)


class RenderedChat(NamedTuple):
    """A rendered prompt and where each message starts in it (character offsets).

    message_starts[k] is where message k's text begins (0 for message 0); messages_end is where the
    generation prompt begins. When the template does not render a conversation's prefixes as
    prefixes of the whole text, a boundary is unknown and message k-1 gets an empty range there.
    """

    text: str
    message_starts: tuple[int, ...]
    messages_end: int


def chat_message(
    role: str,
    content: str,
    *,
    name: str = "",
    tool_call_id: str = "",
    reasoning_content: str = "",
    tool_calls: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """A message as templates expect it: role and content, plus only the optional fields that are set."""
    message: dict[str, Any] = {"role": role, "content": content}
    if name:
        message["name"] = name
    if tool_call_id:
        message["tool_call_id"] = tool_call_id
    if reasoning_content:
        message["reasoning_content"] = reasoning_content
    if tool_calls:
        message["tool_calls"] = [dict(call) for call in tool_calls]
    return message


def tool_call(call_id: str, name: str, arguments_json: str) -> dict[str, Any]:
    """An OpenAI-style tool call; arguments parsed from JSON (kept as the raw string if not JSON)."""
    arguments: Any = arguments_json
    try:
        arguments = canonical_json(json.loads(arguments_json)) if arguments_json else {}
    except json.JSONDecodeError:
        logger.debug("tool call %r: arguments are not JSON, passed to the template as text", name)
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id:
        call = {"id": call_id, **call}
    return call


def tool_definition(name: str, description: str, parameters_json: str) -> dict[str, Any]:
    """An OpenAI-style tool {"type": "function", "function": {name, description, parameters}}.

    parameters_json must be a JSON object (a JSON schema); empty means no parameters
    ({"type": "object", "properties": {}}, OpenAI's meaning of an omitted schema).
    """
    if not name:
        raise RenderError("tool definition has an empty name")
    if parameters_json.strip():
        try:
            parameters = json.loads(parameters_json)
        except json.JSONDecodeError as exc:
            raise RenderError(f"tool {name!r}: parameters are not valid JSON: {exc}") from None
        if not isinstance(parameters, dict):
            raise RenderError(f"tool {name!r}: parameters must be a JSON object, got {type(parameters).__name__}")
        parameters = canonical_json(parameters)
    else:
        parameters = {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def canonical_json(value: Any) -> Any:
    """`value` with every object's keys sorted, recursively (arrays keep their order)."""
    if isinstance(value, dict):
        return {k: canonical_json(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [canonical_json(v) for v in value]
    return value


class ChatRenderer:
    """Renders chat messages (+ tools) with a model's chat template, deterministically."""

    def __init__(self, tokenizer_info: TokenizerInfo) -> None:
        self.has_template = bool(tokenizer_info.chat_template)
        source = tokenizer_info.chat_template if self.has_template else FALLBACK_TEMPLATE
        assert source is not None
        self._variables = {"bos_token": tokenizer_info.bos_token, "eos_token": tokenizer_info.eos_token}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise RenderError(f"chat template does not compile: {exc}") from None
        if not self.has_template:
            logger.warning("model has no chat template: using the plain fallback format")
        self.support = self._probe()
        self.tool_call_format = tool_call_format(tokenizer_info.chat_template, self.support.tools)
        if not self.support.tools:
            logger.warning("the chat template does not render tools: tool definitions will not reach the model")

    def _probe(self) -> TemplateSupport:
        def renders(marker: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> bool:
            try:
                return marker in self.render(messages, tools)
            except RenderError:
                return False

        user = chat_message("user", "a")
        tool = tool_definition("kvmem_probe_tool", "", "")
        reasoning = chat_message("assistant", "b", reasoning_content="kvmem_probe_reasoning")
        inner = chat_message("system", "kvmem_probe_system")
        return TemplateSupport(
            tools=renders("kvmem_probe_tool", [user], [tool]),
            reasoning=renders("kvmem_probe_reasoning", [user, reasoning, chat_message("user", "c")]),
            inner_system=renders("kvmem_probe_system", [user, chat_message("assistant", "b"), inner, user]),
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of `messages` (plain dicts); raises RenderError when the template fails."""
        chat = [_alias_reasoning(m) for m in messages]
        try:
            return self._template.render(
                messages=chat,
                tools=[dict(t) for t in tools] if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
        except jinja2.TemplateError as exc:
            raise RenderError(f"chat template error: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise RenderError(f"chat template error: {type(exc).__name__}: {exc}") from None

    def render_with_boundaries(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> RenderedChat:
        """Render with the generation prompt and find where each message starts.

        Message k starts where the render of messages[:k] (no generation prompt) ends, when that
        render is a prefix of the whole text; otherwise the boundary is taken as unknown. Rendering
        every prefix costs O(n^2) messages (1.6 s for 1,000 messages, minutes for 10,000): the
        boundaries come from renders of two messages each when those tile the whole render
        (`_paired_starts`), from every prefix only for templates where they do not.
        """
        text = self.render(messages, tools, add_generation_prompt=True)
        starts = self._paired_starts(messages, tools, text)
        if starts is None:
            starts = self._prefix_starts(messages, tools, text)
        return RenderedChat(text=text, message_starts=tuple(starts[:-1]), messages_end=starts[-1])

    def _prefix_starts(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, text: str
    ) -> list[int]:
        """Each message's start (and the messages' end) from the render of every prefix: O(n^2)."""
        starts = [0]
        for k in range(1, len(messages) + 1):
            starts.append(self._prefix_end(messages[:k], tools, text, floor=starts[-1]))
        return starts

    def _paired_starts(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, text: str
    ) -> list[int] | None:
        """The starts `_prefix_starts` finds, from O(n) renders of at most two messages: message k >= 1
        renders as what render([m0, mk]) adds to render([m0]). Kept only when those pieces, in order, are
        exactly the whole render without the generation prompt, `text` starts with it, and the prefix
        renders before the last and the middle message end where the pieces say (a template that renders
        a message by its neighbours or place fails one of these); None otherwise."""
        try:
            head = self.render(messages[:1], tools, add_generation_prompt=False)
            whole = self.render(messages, tools, add_generation_prompt=False)
        except RenderError:
            return None
        if not text.startswith(whole) or not whole.startswith(head):
            return None
        starts = [0, len(head)]
        for message in messages[1:]:
            try:
                pair = self.render([messages[0], message], tools, add_generation_prompt=False)
            except RenderError:
                return None
            piece = pair[len(head) :]
            if not pair.startswith(head) or not whole.startswith(piece, starts[-1]):
                return None
            starts.append(starts[-1] + len(piece))
        if starts[-1] != len(whole):
            return None
        for k in {len(messages) - 1, len(messages) // 2} - {0}:
            if self._prefix_end(messages[:k], tools, text, floor=-1) != starts[k]:
                return None
        return starts

    def _prefix_end(
        self,
        head: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        text: str,
        floor: int,
    ) -> int:
        try:
            prefix = self.render(head, tools, add_generation_prompt=False)
        except RenderError:
            return floor
        if len(prefix) < floor or not text.startswith(prefix):
            return floor
        return len(prefix)


def _alias_reasoning(message: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of a message with its reasoning also under `thinking`, as transformers passes it."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return dict(message)
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers in HF templates): renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` inside templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed attribute names (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON in insertion key order (stable: our dicts are built in a fixed order), HTML left alone."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
