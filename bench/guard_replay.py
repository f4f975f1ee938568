"""Prefix stability of replayed agent transcripts through the real stack: cache guard on vs off.

    .venv/bin/python bench/guard_replay.py                 # starts its own stack (embedded SmolLM2, CPU)
    .venv/bin/python bench/guard_replay.py --url http://127.0.0.1:8000   # an already running stack

An agent transcript (system prompt with a clock line, tool definitions, user tasks, assistant turns
with reasoning and tool calls, tool results) is replayed request by request, as a client would send
it: request k is the conversation up to its k-th client input (a user message or a tool result),
answered with max_tokens=1. The client perturbs what it sends, as real clients do:

  timestamp   the system prompt's first line is the current time, different in every request
  tool_order  the tool definitions come in another order in every request (rotated by one place)
  reasoning   reasoning_content of assistant messages before the last user message is dropped
              (kept only inside the current tool loop, as interleaved-thinking clients do)
  all         the three at once;  none: no perturbation (the baseline)

Each perturbation runs twice on the same stack: guard on (normalisations) and off (the request
header `X-KVMem-Normalize: off`: messages rendered exactly as sent). Each run has its own session
id and a run tag in its system prompt, so no run reuses another run's pages. The measure of request
k is cached_tokens(k) / prompt_tokens(k-1): the share of the previous request's prompt whose KV was
reused. An engine that reuses whole 64-token pages only can reach at most
floor(prompt_tokens(k-1) / 64) * 64 / prompt_tokens(k-1) (column `ceiling min`); one that also keeps
partial pages can reach 100%.

The stack renders with deploy/templates/smollm2-agent.jinja (`--chat-template`): SmolLM2's ChatML
plus the tools and reasoning sections of agent templates. SmolLM2's own template renders role and
content only, so with it a reordered tool list or a dropped reasoning block would not change a
single token, and there would be nothing to measure for those two perturbations.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

AGENT_TEMPLATE = REPO_ROOT / "deploy" / "templates" / "smollm2-agent.jinja"
PERTURBATIONS = ("none", "timestamp", "tool_order", "reasoning", "all")
PAGE_SIZE = 64

logger = logging.getLogger("bench.guard_replay")

# ---------------------------------------------------------------- transcripts


@dataclass
class Transcript:
    """A recorded agent conversation: instructions, tools and messages (assistant messages with reasoning)."""

    instructions: str
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # user / assistant / tool, in order; no system message
    request_ends: list[int] = field(default_factory=list)  # request k sends messages[: request_ends[k]]

    def __post_init__(self) -> None:
        self.request_ends = [k + 1 for k, m in enumerate(self.messages) if m["role"] in ("user", "tool")]


_WORDS = (
    "cache page token prefix session replica engine store batch queue slot bucket shard chunk window "
    "budget score summary header record buffer arena offset length format layer head query key value"
).split()
_TOOL_SPECS = [
    ("read_file", "Read a text file of the repository and return its lines with line numbers.",
     {"path": ("string", "Path relative to the repository root."),
      "start_line": ("integer", "First line to return (1-based)."),
      "num_lines": ("integer", "How many lines to return; at most 400.")}, ["path"]),
    ("search_code", "Search the repository for a regular expression and return matching lines.",
     {"pattern": ("string", "A Python regular expression."),
      "path_glob": ("string", "Only search files matching this glob, e.g. 'services/**/*.py'."),
      "max_results": ("integer", "Stop after this many matches.")}, ["pattern"]),
    ("run_tests", "Run pytest on a selection of tests and return the summary and the failures.",
     {"selector": ("string", "A pytest node id, file or directory."),
      "timeout_s": ("integer", "Give up after this many seconds.")}, ["selector"]),
    ("apply_patch", "Apply a unified diff to one file of the repository; fails if a hunk does not match.",
     {"path": ("string", "The file to patch."), "diff": ("string", "The unified diff, with context lines.")},
     ["path", "diff"]),
    ("list_directory", "List the entries of a directory of the repository, with file sizes.",
     {"path": ("string", "Directory relative to the repository root."),
      "recursive": ("boolean", "Also list subdirectories.")}, ["path"]),
]  # fmt: skip
_INSTRUCTIONS = (
    "You are a careful coding agent working in a Python repository. Use the tools to read code, search "
    "for definitions and run tests before you change anything. Explain briefly what you found, then act. "
    "Keep answers short and precise. Never invent file contents: read them. When a test fails, read the "
    "failure, find the cause in the code, patch it, and run the test again. Do not change tests unless "
    "they are wrong. Report what you changed and why."
)


def _tools(num_tools: int) -> list[dict[str, Any]]:
    tools = []
    for name, description, props, required in _TOOL_SPECS[:num_tools]:
        properties = {p: {"type": t, "description": d} for p, (t, d) in props.items()}
        parameters = {"type": "object", "properties": properties, "required": required}
        tools.append(
            {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
        )
    return tools


def _code_lines(rng: random.Random, num_lines: int, start: int) -> str:
    out = []
    for k in range(num_lines):
        a, b, c = rng.sample(_WORDS, 3)
        kind = k % 6
        if kind == 0:
            text = f"def {a}_{b}(self, {c}: int) -> int:"
        elif kind == 1:
            text = f'    """Return the {a} {b} of one {c}."""'
        elif kind == 2:
            text = f"    {a} = self.{b}_table.get({c}, 0)"
        elif kind == 3:
            text = f"    if {a} > self.num_{c}s:"
        elif kind == 4:
            text = f"        raise {a.title()}Error(f'{b} {{{a}}} > {{self.num_{c}s}}')"
        else:
            text = f"    return {a} + {rng.randint(1, 64)}"
        out.append(f"{start + k:4d}  {text}")
    return "\n".join(out)


def build_transcript(
    num_user_turns: int = 3, steps_per_turn: int = 3, file_lines: int = 40, num_tools: int = 5, seed: int = 0
) -> Transcript:
    """A synthetic agent transcript: per user turn, `steps_per_turn` tool calls then a final answer.

    The calls cycle through read_file, search_code, run_tests (num_tools >= 3 when steps_per_turn >= 2).
    """
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = []
    call_no = 0
    for turn in range(num_user_turns):
        module = f"services/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py"
        messages.append({"role": "user", "content": (
            f"Task {turn + 1}: the test tests/test_{rng.choice(_WORDS)}.py::test_{rng.choice(_WORDS)} fails "
            f"after the last change to {module}. Find the cause and fix it; keep the change small.")})  # fmt: skip
        for step in range(steps_per_turn):
            call_no += 1
            name = ("read_file", "search_code", "run_tests", "read_file")[step % 4]
            args: dict[str, Any]
            if name == "read_file":
                start = rng.randint(1, 300)
                args = {"path": module, "start_line": start, "num_lines": file_lines}
                result = _code_lines(rng, file_lines, start)
            elif name == "search_code":
                args = {"pattern": f"def {rng.choice(_WORDS)}_", "path_glob": "services/**/*.py"}
                hits = [
                    f"services/{rng.choice(_WORDS)}.py:{rng.randint(1, 500)}: "
                    f"def {rng.choice(_WORDS)}_{rng.choice(_WORDS)}(self):"
                    for _ in range(max(4, file_lines // 4))
                ]
                result = "\n".join(hits)
            else:
                args = {"selector": f"tests/test_{rng.choice(_WORDS)}.py", "timeout_s": 120}
                result = (f"{rng.randint(5, 40)} passed, 1 failed in {rng.uniform(0.5, 9):.2f}s\n"
                          f"FAILED tests/test_{rng.choice(_WORDS)}.py::test_{rng.choice(_WORDS)} - AssertionError: "
                          f"{rng.randint(2, 99)} != {rng.randint(2, 99)}")  # fmt: skip
            reasoning = (
                f"Step {step + 1}: I need to look at the {rng.choice(_WORDS)} {rng.choice(_WORDS)} handling in "
                f"{module}. The failure mentions the {rng.choice(_WORDS)} count, so {name} is the next thing to do."
            )
            call = {"id": f"call_{call_no}", "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)}}  # fmt: skip
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"call_{call_no}", "content": result})
        messages.append({
            "role": "assistant",
            "reasoning_content": f"The {rng.choice(_WORDS)} bound was off by one; the patch fixes it.",
            "content": f"Fixed: {module} compared with > where >= was meant. The test passes now.",
        })  # fmt: skip
    return Transcript(_INSTRUCTIONS, _tools(num_tools), messages)


# ---------------------------------------------------------------- the client


def client_request(transcript: Transcript, k: int, perturbation: str, run_tag: str) -> dict[str, Any]:
    """The chat request body a client sends for request k, with its perturbation."""
    timestamp = perturbation in ("timestamp", "all")
    reorder = perturbation in ("tool_order", "all")
    drop = perturbation in ("reasoning", "all")
    clock = time.gmtime(1_795_939_200 + (41 * k if timestamp else 0))  # 2026-11-29 08:00:00 UTC, +41 s a request
    now = time.strftime("%Y-%m-%d %H:%M:%S", clock)
    system = f"Current date and time: {now} UTC\n\n[run {run_tag}] {transcript.instructions}"
    tools = list(transcript.tools)
    if reorder:  # rotated by one more place in every request: never the previous request's order
        shift = k % len(tools)
        tools = tools[shift:] + tools[:shift]
    messages = [dict(m) for m in transcript.messages[: transcript.request_ends[k]]]
    if drop:
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        for m in messages[:last_user]:
            m.pop("reasoning_content", None)
    return {"messages": [{"role": "system", "content": system}, *messages], "tools": tools}


@dataclass
class TurnResult:
    prompt_tokens: int
    cached_tokens: int
    prefix: dict[str, Any]  # the kvmem.prefix object of the response

    def ratio_to(self, previous: TurnResult) -> float:
        return self.cached_tokens / previous.prompt_tokens


def replay(
    http: httpx.Client,
    transcript: Transcript,
    perturbation: str,
    guard_on: bool,
    num_requests: int | None = None,
    model: str = "SmolLM2-135M-Instruct",
) -> list[TurnResult]:
    """Send the transcript's requests in order (one session); the usage and prefix report of each."""
    run_tag = uuid.uuid4().hex[:8]
    headers = {"X-Session-Id": f"replay-{perturbation}-{'on' if guard_on else 'off'}-{run_tag}"}
    if not guard_on:
        headers["X-KVMem-Normalize"] = "off"
    results = []
    for k in range(num_requests or len(transcript.request_ends)):
        body = {
            "model": model,
            "max_tokens": 1,
            "temperature": 0,
            **client_request(transcript, k, perturbation, run_tag),
        }
        r = http.post("/v1/chat/completions", json=body, headers=headers)
        r.raise_for_status()
        data = r.json()
        usage = data["usage"]
        results.append(
            TurnResult(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], data["kvmem"]["prefix"])
        )
        logger.info("%s %s request %d: %d prompt, %d cached", perturbation, "on" if guard_on else "off", k,
                    usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])  # fmt: skip
    return results


def ratios(results: list[TurnResult]) -> list[float]:
    """cached_tokens(k) / prompt_tokens(k-1) for k >= 1."""
    return [cur.ratio_to(prev) for prev, cur in zip(results, results[1:], strict=False)]


def ceilings(results: list[TurnResult]) -> list[float]:
    """The best possible ratio of each request: whole pages of the previous prompt."""
    return [(p.prompt_tokens // PAGE_SIZE) * PAGE_SIZE / p.prompt_tokens for p in results[:-1]]


# ---------------------------------------------------------------- the benchmark


def _table(runs: dict[tuple[str, bool], list[TurnResult]]) -> str:
    lines = [
        "| perturbation | guard | requests | prompt tokens (first → last) "
        "| cached / previous prompt, per request | min | mean | ceiling min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (perturbation, on), results in runs.items():
        rs = ratios(results)
        per = " ".join(f"{r:.0%}" for r in rs)
        tokens = f"{results[0].prompt_tokens} → {results[-1].prompt_tokens}"
        summary = f"{min(rs):.1%} | {statistics.mean(rs):.1%} | {min(ceilings(results)):.1%}"
        lines.append(f"| {perturbation} | {'on' if on else 'off'} | {len(results)} | {tokens} | {per} | {summary} |")
    return "\n".join(lines)


def _divergences(runs: dict[tuple[str, bool], list[TurnResult]]) -> str:
    lines = ["| perturbation | guard | divergences reported (request: field, reason) |", "|---|---|---|"]
    for (perturbation, on), results in runs.items():
        seen = [
            f"{k}: {r.prefix['divergence_field']}, {r.prefix['divergence_reason']}"
            for k, r in enumerate(results)
            if r.prefix["diverged"]
        ]
        shown = "; ".join(seen[:3]) + (f"; ... ({len(seen)} in all)" if len(seen) > 3 else "")
        lines.append(f"| {perturbation} | {'on' if on else 'off'} | {shown or 'none'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--url", default="", help="a running stack's gateway (started with --chat-template); default: start one"
    )
    p.add_argument("--user-turns", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="tool calls per user turn")
    p.add_argument("--file-lines", type=int, default=40, help="lines per read_file result")
    p.add_argument("--perturbations", default=",".join(PERTURBATIONS))
    p.add_argument("--api-key", default="")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    transcript = build_transcript(a.user_turns, a.steps, a.file_lines)
    stack = None
    url = a.url
    if not url:
        from deploy.launcher import LaunchConfig, Stack, free_port

        cfg = LaunchConfig(port=free_port(), max_context=8192, kv_capacity=16384, host_kv_mib=512,
                           chat_template=str(AGENT_TEMPLATE), ready_timeout_s=600)  # fmt: skip
        stack = Stack(cfg, echo=False)
        stack.start()
        url = stack.url
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    runs: dict[tuple[str, bool], list[TurnResult]] = {}
    started = time.perf_counter()
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
            for perturbation in a.perturbations.split(","):
                for on in (True, False):
                    runs[(perturbation, on)] = replay(http, transcript, perturbation, on)
    finally:
        if stack is not None:
            stack.stop()
    print(f"\ntranscript: {a.user_turns} user turns x {a.steps} tool calls, {len(transcript.request_ends)} requests; "
          f"{time.perf_counter() - started:.0f} s\n")  # fmt: skip
    print(_table(runs))
    print()
    print(_divergences(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
