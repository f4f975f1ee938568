"""Tool calls in model output: the formats the chat templates we load teach, parsing (whole and streamed), the
malformed tool-call guard, and the grammar that enforces tool_choice "required" / named.

Formats (GetModelInfoResponse.tool_call_format, set by the cache guard from the chat template):
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call (Hermes, Qwen2.5,
  deploy/templates/smollm2-agent.jinja). Inside the block the Qwen3-Coder XML body is also read:
  `<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>`.
- "llama3": the whole answer is one JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1+ JSON tool calling),
  optionally after `<|python_tag|>`.

The guard (seed 001's failure): an answer whose tool-call part is a broken shell (no function name, parameter tags
that do not pair, a block cut off by max_tokens, JSON that does not parse, an unknown function, arguments that do
not match the function's schema) is never returned as text nor as a call: `MalformedToolCall` names the function
it meant and shows a correct call of it. Text that merely mentions the tags (in prose after other text, in a code
fence or in inline code) is text.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema

logger = logging.getLogger(__name__)

HERMES, LLAMA3 = "hermes", "llama3"
FORMATS = (HERMES, LLAMA3)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MAX_PARALLEL = 8  # calls one constrained answer may hold (tool_choice required/named with parallel_tool_calls)

_FENCE = re.compile(r"```.*?(```|\Z)", re.S)
_INLINE = re.compile(r"`[^`\n]*`")
_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # JSON schema ({"type": "object", "properties": {}} when none)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text outside the calls, before and after them (None when there is none)
    calls: list[ParsedCall] = field(default_factory=list)
    trailing: str = ""  # the text after the calls (part of content; streamed once the answer is parsed)


class MalformedToolCall(Exception):
    """The answer is a broken tool-call shell; `function` is the call it meant ("" when unknown)."""

    def __init__(self, reason: str, function: str, example: str, raw: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.function = function
        self.example = example
        self.raw = raw


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------- examples and grammars


def _placeholder(schema: dict[str, Any]) -> Any:
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[0] if kind else "string"
    if kind == "object":
        props = schema.get("properties", {})
        required = schema.get("required", list(props))
        return {k: _placeholder(v) for k, v in props.items() if k in required}
    if kind == "array":
        return [_placeholder(schema.get("items", {}))]
    return {"integer": 0, "number": 0.0, "boolean": True, "null": None}.get(str(kind), "...")


def example(tool: Tool, fmt: str) -> str:
    """A correct call of `tool` in `fmt` (placeholder values of the right types)."""
    args = _placeholder(tool.parameters) if tool.parameters else {}
    if fmt == LLAMA3:
        return json.dumps({"name": tool.name, "parameters": args})
    return f"{OPEN}\n{json.dumps({'name': tool.name, 'arguments': args})}\n{CLOSE}"


def call_schema(tools: list[Tool], fmt: str) -> dict[str, Any]:
    """The JSON schema of one call object of any of `tools` (name first, then the arguments)."""
    key = "parameters" if fmt == LLAMA3 else "arguments"
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, key: t.parameters or {"type": "object"}},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


@dataclass(frozen=True)
class ToolGrammar:
    """What the engine's Grammar message carries for a forced call: one call object's schema between a prefix and
    a suffix, repeated up to `max_calls` times (joined by `separator`)."""

    schema: dict[str, Any]
    prefix: str
    suffix: str
    separator: str
    max_calls: int


def forced_grammar(tools: list[Tool], fmt: str, parallel: bool) -> ToolGrammar:
    if fmt == LLAMA3:
        return ToolGrammar(call_schema(tools, fmt), "", "", "", 1)
    return ToolGrammar(call_schema(tools, fmt), OPEN + "\n", "\n" + CLOSE, "\n", MAX_PARALLEL if parallel else 1)


# ---------------------------------------------------------------- parsing


def _masked(text: str) -> str:
    """`text` with code fences and inline code blanked (same length): tags inside them are not calls."""
    out = _FENCE.sub(lambda m: " " * len(m.group(0)), text)
    return _INLINE.sub(lambda m: " " * len(m.group(0)), out)


def _intended(body: str, tools: list[Tool]) -> str:
    m = re.search(r'"name"\s*:\s*"([^"]*)"', body) or _FUNCTION.search(body)
    if m and m.group(1).strip():
        return m.group(1).strip()
    return tools[0].name if len(tools) == 1 else ""


def _check(name: str, args: Any, tools: list[Tool], fmt: str, raw: str, body: str) -> ParsedCall:
    by_name = {t.name: t for t in tools}
    tool = by_name.get(name)
    if tool is None:
        known = ", ".join(sorted(by_name)) or "none"
        fallback = tools[0] if len(tools) == 1 else None
        ex = example(fallback, fmt) if fallback else ""
        raise MalformedToolCall(f"the call names function {name!r}, which is not a tool here (tools: {known})",
                                name, ex, raw)  # fmt: skip
    if not isinstance(args, dict):
        raise MalformedToolCall("the call's arguments are not a JSON object", name, example(tool, fmt), raw)
    if tool.parameters:
        try:
            jsonschema.validate(args, tool.parameters)
        except jsonschema.ValidationError as exc:
            raise MalformedToolCall(f"the arguments do not match {name}'s schema: {exc.message}", name,
                                    example(tool, fmt), raw) from None  # fmt: skip
        except jsonschema.SchemaError:
            logger.warning("tool %r has an invalid parameter schema; arguments not checked", name)
    return ParsedCall(call_id(), name, json.dumps(args, ensure_ascii=False))


def _parse_block(body: str, tools: list[Tool], raw: str) -> ParsedCall:
    """One `<tool_call>` block's body: JSON {"name", "arguments"} or the XML function body."""
    stripped = body.strip()
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError as exc:
            name = _intended(body, tools)
            tool = next((t for t in tools if t.name == name), None)
            raise MalformedToolCall(f"the call is not valid JSON ({exc.msg} at character {exc.pos})", name,
                                    example(tool, HERMES) if tool else "", raw) from None  # fmt: skip
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise MalformedToolCall('the call has no "name"', _intended(body, tools), _ex(tools, body), raw)
        call_args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(call_args, str):
            try:
                call_args = json.loads(call_args)
            except json.JSONDecodeError:
                pass
        return _check(obj["name"], call_args, tools, HERMES, raw, body)
    fn = _FUNCTION.search(stripped)
    if fn is None or not fn.group(1).strip():
        raise MalformedToolCall("the call has no <function=NAME> tag", _intended(body, tools), _ex(tools, body), raw)
    name = fn.group(1).strip()
    inner = stripped[fn.end() :]
    if "</function>" not in inner:
        raise MalformedToolCall("the <function> tag is not closed", name, _ex(tools, body), raw)
    inner = inner[: inner.index("</function>")]
    params = _PARAMETER.findall(inner)
    leftover = _PARAMETER.sub("", inner).strip()
    if leftover or inner.count("<parameter") != len(params):
        raise MalformedToolCall("the call's <parameter=KEY>...</parameter> tags are invalid", name, _ex(tools, body),
                                raw)  # fmt: skip
    args: dict[str, Any] = {}
    for key, value in params:
        try:
            args[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            args[key.strip()] = value
    return _check(name, args, tools, HERMES, raw, body)


def _ex(tools: list[Tool], body: str) -> str:
    name = _intended(body, tools)
    tool = next((t for t in tools if t.name == name), None)
    return example(tool, HERMES) if tool else (example(tools[0], HERMES) if tools else "")


def _hermes(text: str, tools: list[Tool], truncated: bool) -> Parsed:
    masked = _masked(text)
    start = masked.find(OPEN)
    if start < 0:
        stray = masked.find(CLOSE)
        if stray >= 0 and not masked[:stray].strip():
            raise MalformedToolCall(f"the answer has {CLOSE} without {OPEN}", _intended(text, tools),
                                    _ex(tools, text), text)  # fmt: skip
        return Parsed(text)
    before = text[:start]
    if before.strip() and not before.rstrip().endswith((".", ":", "\n")) and "\n" not in before:
        return Parsed(text)  # a tag mentioned in a sentence: text
    calls: list[ParsedCall] = []
    pos, after = start, ""
    while pos < len(text):
        rest = masked[pos:]
        if not rest.strip():
            break
        if not rest.lstrip().startswith(OPEN):
            if re.search(r"</?(tool_call|function|parameter)\b", rest):
                raise MalformedToolCall("a broken tool-call tag after the calls", _intended(text[pos:], tools),
                                        _ex(tools, text[pos:]), text)  # fmt: skip
            after = text[pos:].strip()  # plain text after the calls: content beside them (as OpenAI's)
            break
        open_at = pos + (len(rest) - len(rest.lstrip())) + len(OPEN)
        end = masked.find(CLOSE, open_at)
        if end < 0:
            reason = "the call was cut off by max_tokens" if truncated else f"the call is not closed with {CLOSE}"
            body = text[open_at:]
            raise MalformedToolCall(reason, _intended(body, tools), _ex(tools, body), text)
        calls.append(_parse_block(text[open_at:end], tools, text))
        pos = end + len(CLOSE)
    content = "\n".join(part for part in (before.strip(), after) if part)
    return Parsed(content or None, calls, after)


def _llama3(text: str, tools: list[Tool], truncated: bool) -> Parsed:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{") or '"name"' not in body[:200]:
        return Parsed(text)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        name = _intended(body, tools)
        tool = next((t for t in tools if t.name == name), None)
        reason = "the call was cut off by max_tokens" if truncated else f"the call is not valid JSON ({exc.msg})"
        raise MalformedToolCall(reason, name, example(tool, LLAMA3) if tool else "", text) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Parsed(text)
    return Parsed(None, [_check(obj["name"], obj.get("parameters", obj.get("arguments", {})), tools, LLAMA3, text,
                                body)])  # fmt: skip


def parse(text: str, tools: list[Tool], fmt: str, truncated: bool = False) -> Parsed:
    """The answer's text and tool calls; raises MalformedToolCall for a broken shell (module docstring)."""
    if fmt == LLAMA3:
        return _llama3(text, tools, truncated)
    return _hermes(text, tools, truncated)


# ---------------------------------------------------------------- streaming


@dataclass
class StreamEvent:
    """What one piece of output adds: text, a new call (index, id, name), or a piece of a call's arguments."""

    content: str = ""
    index: int = -1
    id: str = ""
    name: str = ""
    arguments: str = ""


class StreamParser:
    """Hermes output as it streams: text goes out at once except what may be the start of a `<tool_call>` tag;
    inside a block, the call's name goes out as soon as it is known, then the arguments in pieces as they arrive.
    `finish` parses the whole answer (the guard): a malformed shell raises there, before any of it went out as
    text (a block's text is never sent as content). Llama 3 JSON calls are held back whole and sent at finish."""

    def __init__(self, tools: list[Tool], fmt: str) -> None:
        self.tools = tools
        self.fmt = fmt
        self.text = ""
        self._sent = 0  # characters of `text` settled (sent as content, or part of a call)
        self._in_calls = False  # a call block started: nothing more goes out as content
        self._calls: list[dict[str, Any]] = []  # per streamed call: id, name, arguments sent so far
        self._held = fmt == LLAMA3

    def feed(self, piece: str) -> list[StreamEvent]:
        self.text += piece
        if self._held:
            return self._llama3_feed()
        out: list[StreamEvent] = []
        if not self._in_calls:
            masked = _masked(self.text)
            at = masked.find(OPEN, self._sent)
            if at >= 0 and self._starts_calls(at):
                if at > self._sent:
                    out.append(StreamEvent(content=self.text[self._sent : at]))
                self._sent = at
                self._in_calls = True
            else:
                safe = len(self.text) - _partial_tag(self.text)
                if "```" in masked[self._sent :] and masked.count("```") % 2:
                    safe = len(self.text)  # inside an open fence: tags there are text
                if safe > self._sent:
                    out.append(StreamEvent(content=self.text[self._sent : safe]))
                    self._sent = safe
        if self._in_calls:
            out.extend(self._call_events())
        return out

    def _starts_calls(self, at: int) -> bool:
        before = self.text[:at]
        return not before.strip() or before.rstrip().endswith((".", ":", "\n")) or "\n" in before

    def _llama3_feed(self) -> list[StreamEvent]:
        body = self.text.lstrip().removeprefix(PYTHON_TAG).lstrip()
        if body and not body.startswith("{") and not PYTHON_TAG.startswith(self.text.lstrip()):
            self._held = False
            self.fmt = "text"
            self._sent = len(self.text)
            return [StreamEvent(content=self.text)]
        return []

    def _call_events(self) -> list[StreamEvent]:
        """Name and argument pieces of the blocks in the text so far (JSON bodies; XML bodies go out at finish)."""
        out: list[StreamEvent] = []
        blocks = self.text[self._sent :].split(OPEN)[1:]
        for k, block in enumerate(blocks):
            body = block.split(CLOSE)[0]
            m = re.match(r'\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*', body)
            if m is None:
                continue
            if k >= len(self._calls):
                self._calls.append({"id": call_id(), "name": m.group(1), "sent": 0})
                out.append(StreamEvent(index=k, id=self._calls[k]["id"], name=m.group(1)))
            args = _json_value_prefix(body[m.end() :])
            call = self._calls[k]
            if len(args) > call["sent"]:
                out.append(StreamEvent(index=k, arguments=args[call["sent"] :]))
                call["sent"] = len(args)
        return out

    def finish(self, truncated: bool) -> tuple[Parsed, list[StreamEvent]]:
        """The whole answer parsed (raises MalformedToolCall) and the events still to send."""
        if self.fmt == "text":
            return Parsed(self.text), []
        parsed = parse(self.text, self.tools, self.fmt, truncated)
        out: list[StreamEvent] = []
        if not parsed.calls:
            if len(self.text) > self._sent:
                out.append(StreamEvent(content=self.text[self._sent :]))
            return parsed, out
        calls = []
        for k, call in enumerate(parsed.calls):
            streamed = self._calls[k] if k < len(self._calls) else None
            if streamed is None:
                out.append(StreamEvent(index=k, id=call.id, name=call.name))
                out.append(StreamEvent(index=k, arguments=call.arguments))
                calls.append(call)
                continue
            raw_args = _raw_arguments(self.text, k)
            if raw_args is not None and len(raw_args) > streamed["sent"]:
                out.append(StreamEvent(index=k, arguments=raw_args[streamed["sent"] :]))
            calls.append(ParsedCall(streamed["id"], call.name, raw_args if raw_args is not None else call.arguments))
        if parsed.trailing:  # text after the calls goes out once the calls are known to be well-formed
            before = self.text[: self.text.find(OPEN)]
            sep = "\n" if before.strip() and not before.endswith("\n") else ""
            out.append(StreamEvent(content=sep + parsed.trailing))
        return Parsed(parsed.content, calls, parsed.trailing), out


def _raw_arguments(text: str, k: int) -> str | None:
    blocks = text.split(OPEN)[1:]
    if k >= len(blocks):
        return None
    body = blocks[k].split(CLOSE)[0]
    m = re.match(r'\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*', body)
    if m is None:
        return None
    value = _json_value_prefix(body[m.end() :])
    try:
        json.loads(value)
    except json.JSONDecodeError:
        return None
    return value


def _json_value_prefix(text: str) -> str:
    """The longest start of `text` that lies inside its first JSON value (ends where that value closes)."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return text[: i + 1]
            if depth < 0:
                return text[:i]
    return text


def _partial_tag(text: str) -> int:
    """How many trailing characters of `text` could be the start of `<tool_call>` (held back)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
