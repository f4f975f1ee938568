"""Cost of finding where each message starts in a rendered conversation (the cache guard's renderer).

    .venv/bin/python bench/guard_render.py [--sizes 100,300,1000,3000] [--template smollm2|agent]

The guard renders every chat request twice (count and prepare), each time with the start of every
message. Baseline: rendering every prefix of the conversation (`ChatRenderer._prefix_starts`, what the
renderer did before 2026-11-30: O(n^2) messages rendered). Now: renders of two messages each, checked
against the whole render (`render_with_boundaries`). Both give the same boundaries (checked here); the
table prints milliseconds and the ratio from the same run. CPU only; no model weights (the embedded
SmolLM2's template, or deploy/templates/smollm2-agent.jinja with tools and reasoning).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.cacheguard.renderer import ChatRenderer, chat_message, tool_definition  # noqa: E402
from services.common.model_files import resolve_model_path  # noqa: E402
from services.common.tokenizer import load_tokenizer  # noqa: E402

AGENT_TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "templates" / "smollm2-agent.jinja"


def conversation(n: int) -> list[dict[str, Any]]:
    """An agent-like chat of n messages: a system prompt, then user / assistant (with reasoning) / tool turns."""
    messages = [chat_message("system", "You are a coding agent.")]
    roles = ["user", "assistant", "tool", "assistant"]
    for i in range(n - 1):
        role = roles[i % len(roles)]
        extra: dict[str, Any] = {"reasoning_content": f"think {i}"} if role == "assistant" else {}
        if role == "tool":
            extra = {"tool_call_id": f"call_{i}"}
        messages.append(chat_message(role, f"turn {i}: " + "some words " * (1 + i % 9), **extra))
    return messages


def timed(repeats: int, fn: Any, *args: Any) -> tuple[float, Any]:
    """The best of `repeats` wall times of fn(*args), seconds, and its result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,300,1000,3000", help="conversation lengths in messages")
    p.add_argument("--template", choices=("smollm2", "agent"), default="smollm2")
    a = p.parse_args()
    info = load_tokenizer(resolve_model_path("embedded:smollm2")).info
    if a.template == "agent":
        info = dataclasses.replace(info, chat_template=AGENT_TEMPLATE.read_text())
    renderer = ChatRenderer(info)
    tools = [tool_definition("read_file", "Read a file", '{"type":"object","properties":{"path":{"type":"string"}}}')]
    print(f"template {a.template}; best of 3 (1 for the baseline past 1,000 messages)")
    print("messages | one render ms | every prefix ms (baseline) | paired ms | speed-up | same boundaries")
    for n in (int(x) for x in a.sizes.split(",")):
        messages = conversation(n)
        one, _ = timed(3, renderer.render, messages, tools)
        paired, rendered = timed(3, renderer.render_with_boundaries, messages, tools)
        base, starts = timed(3 if n <= 1000 else 1, renderer._prefix_starts, messages, tools, rendered.text)
        same = starts == [*rendered.message_starts, rendered.messages_end]
        print(f"{n:8d} | {1e3 * one:13.1f} | {1e3 * base:26.0f} | {1e3 * paired:9.1f} | {base / paired:7.1f}x | {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
