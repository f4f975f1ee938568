"""GuardCore with the real SmolLM2 tokenizer: the replayed transcripts of bench/guard_replay.py at the
token level (no engine), session ids that ignore the clock, read-only counting, and what the model's
own template does not render."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.guard_replay import AGENT_TEMPLATE, PERTURBATIONS, build_transcript, client_request
from services.cacheguard.core import GuardCore, PromptRequest
from services.cacheguard.renderer import TemplateSupport, chat_message
from services.cacheguard.server import decode_request
from services.cacheguard.sessions import common_prefix_len
from services.common.model_files import resolve_model_path
from services.common.protos import cacheguard_pb2 as pb
from services.common.tokenizer import Tokenizer, load_tokenizer

TRANSCRIPT = build_transcript(num_user_turns=3, steps_per_turn=2, file_lines=8, num_tools=5)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model_path("embedded:smollm2"))


@pytest.fixture
def core(tokenizer: Tokenizer) -> GuardCore:
    return GuardCore(tokenizer, max_sessions=64, chat_template=AGENT_TEMPLATE.read_text())


def as_request(body: dict[str, Any], session_id: str = "", off: bool = False) -> PromptRequest:
    """An OpenAI-shaped chat body through the guard's own proto decoding."""
    messages = [
        pb.ChatMessage(
            role=m["role"],
            content=m.get("content") or "",
            tool_call_id=m.get("tool_call_id", ""),
            reasoning_content=m.get("reasoning_content", ""),
            tool_calls=[
                pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments_json=c["function"]["arguments"])
                for c in m.get("tool_calls", [])
            ],
        )
        for m in body["messages"]
    ]
    tools = [
        pb.ToolDefinition(
            name=t["function"]["name"],
            description=t["function"]["description"],
            parameters_json=json.dumps(t["function"]["parameters"]),
        )
        for t in body["tools"]
    ]
    chat = pb.ChatInput(messages=messages, tools=tools)
    return decode_request(pb.GuardGenerateRequest(session_id=session_id, chat=chat, normalizations_off=off))


def test_agent_template_renders_tools_and_reasoning(core: GuardCore, tokenizer: Tokenizer) -> None:
    assert core.renderer.support == TemplateSupport(tools=True, reasoning=True, inner_system=True)
    assert GuardCore(tokenizer, 4).renderer.support == TemplateSupport(tools=False, reasoning=False, inner_system=True)


@pytest.mark.parametrize("perturbation", PERTURBATIONS)
def test_guard_on_every_request_extends_the_previous_one(core: GuardCore, perturbation: str) -> None:
    previous: list[int] = []
    for k in range(len(TRANSCRIPT.request_ends)):
        prepared = core.prepare(as_request(client_request(TRANSCRIPT, k, perturbation, "t"), f"on-{perturbation}"))
        assert not prepared.report.diverged, (k, prepared.report)
        assert prepared.token_ids[: len(previous)] == previous
        previous = prepared.token_ids


# The first request at which the client's perturbation breaks the prefix without the guard, and how.
EXPECTED_OFF = {
    "timestamp": (1, 0, "content", "message 0 (system) content changed at char 40 (a date/time line)"),
    "tool_order": (1, 0, "tools", "tool definitions reordered ("),
    "reasoning": (3, 2, "reasoning_content", "message 2 (assistant) reasoning_content removed"),
}


@pytest.mark.parametrize("perturbation", sorted(EXPECTED_OFF))
def test_guard_off_reports_where_and_why_the_prefix_broke(core: GuardCore, perturbation: str) -> None:
    reports = [
        core.prepare(as_request(client_request(TRANSCRIPT, k, perturbation, "t"), f"off-{perturbation}", off=True))
        for k in range(len(TRANSCRIPT.request_ends))
    ]
    first, index, field, reason = EXPECTED_OFF[perturbation]
    assert [r.report.diverged for r in reports[:first]] == [False] * first
    report = reports[first].report
    assert (report.divergence_message_index, report.divergence_field) == (index, field)
    assert report.divergence_reason.startswith(reason)
    assert report.normalizations == ()
    assert report.common_prefix_tokens == common_prefix_len(reports[first - 1].token_ids, reports[first].token_ids)


def test_sent_tokens_are_the_tokenization_of_the_normalised_text(core: GuardCore, tokenizer: Tokenizer) -> None:
    """The guard never reuses earlier token ids for new text: what it sends is what the text tokenizes to."""
    for k in range(3):
        request = as_request(client_request(TRANSCRIPT, k, "all", "t"), "tokens")
        memory = core.sessions.memory("tokens")
        chat = core.normalizer.apply(request.messages or [], request.tools, memory)
        text = core.renderer.render(chat.messages, chat.tools)
        assert core.prepare(request).token_ids == tokenizer.encode(text)


def test_derived_session_ids_ignore_the_clock_line(core: GuardCore) -> None:
    def derived(system: str, user: str = "hi") -> str:
        messages = [chat_message("system", system), chat_message("user", user)]
        return core.prepare(PromptRequest(messages=messages, tenant="t")).session_id

    first = derived("Current date: 2026-11-29\n\nYou are terse.")
    assert derived("Current date: 2026-11-30\n\nYou are terse.") == first
    assert derived("You are terse.") == first
    assert derived("Current date: 2026-11-29\n\nYou are verbose.") != first
    assert derived("Current date: 2026-11-29\n\nYou are terse.", "hello") != first


def test_count_tokens_reads_the_session_without_changing_it(core: GuardCore) -> None:
    body = client_request(TRANSCRIPT, 5, "reasoning", "t")  # reasoning of the first user turn dropped
    full = client_request(TRANSCRIPT, 4, "none", "t")  # the client sent it one request earlier
    core.prepare(as_request(full, "count"))
    memory = core.sessions.memory("count")
    counted = core.count_tokens(as_request(body, "count"))
    assert core.sessions.memory("count") == memory
    without_session = core.count_tokens(as_request(body))
    sent = core.prepare(as_request(body, "count"))
    assert counted == len(sent.token_ids) > without_session  # the restored reasoning is counted
    assert "reasoning" in sent.report.normalizations


def test_with_the_models_own_template_tools_do_not_render_and_are_never_blamed(tokenizer: Tokenizer) -> None:
    core = GuardCore(tokenizer, max_sessions=4)
    ids = [core.prepare(as_request(client_request(TRANSCRIPT, k, "tool_order", "t"), "own", off=True)) for k in (0, 1)]
    assert not ids[1].report.diverged
    assert "read_file" not in tokenizer.decode(ids[1].token_ids)
