"""End to end: a replayed agent transcript keeps its cached prefix with the cache guard on and loses
it with the guard off, for each way a client breaks its own prefix (bench/guard_replay.py).

The stack renders with deploy/templates/smollm2-agent.jinja (tools and reasoning rendered; SmolLM2's
own template renders neither). Three requests per run, all under 1,500 tokens:
  0: [system, user 1]
  1: + assistant (reasoning, tool call) + tool result       (a step of the tool loop)
  2: + assistant (reasoning, answer) + user 2               (a new user turn: the reasoning client drops
                                                             the reasoning of the turn before)
Guard on, a request reuses at least every full 64-token page of the previous prompt (an engine that
also keeps partial pages reuses all of it), so >= 95% holds whenever the previous prompt has >= 1,280
tokens (request 1), whatever the engine does with partial pages.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from bench.guard_replay import AGENT_TEMPLATE, PAGE_SIZE, TurnResult, build_transcript, ratios, replay
from deploy.launcher import LaunchConfig, Stack
from tests.conftest import free_port

TRANSCRIPT = build_transcript(num_user_turns=2, steps_per_turn=1, file_lines=30, num_tools=3)
NUM_REQUESTS = 3


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    cfg = LaunchConfig(
        port=free_port(),
        host_kv_mib=256,
        max_context=2048,
        kv_capacity=4096,
        chat_template=str(AGENT_TEMPLATE),
        ready_timeout_s=300,
    )
    stack = Stack(cfg, echo=False)  # its own redis: nothing shared with other modules' stacks
    stack.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=300) as client:
            yield client
    finally:
        stack.stop()


def full_pages(tokens: int) -> int:
    return tokens // PAGE_SIZE * PAGE_SIZE


def check_never_beyond_the_common_prefix(results: list[TurnResult]) -> None:
    """KV is reused only for tokens equal to an earlier request's: here no earlier request of a run shares
    more with a request than the previous one (three tool orders, one clock per request), and no other
    run shares the run's tag."""
    for r in results[1:]:
        assert r.cached_tokens <= r.prefix["common_prefix_tokens"], r


@pytest.mark.parametrize("perturbation", ["timestamp", "tool_order", "reasoning"])
def test_guard_on_keeps_the_prefix_the_client_breaks(http: httpx.Client, perturbation: str) -> None:
    on = replay(http, TRANSCRIPT, perturbation, guard_on=True, num_requests=NUM_REQUESTS)
    assert max(r.prompt_tokens for r in on) < 1500
    for k, (prev, cur) in enumerate(zip(on, on[1:], strict=False), start=1):
        assert not cur.prefix["diverged"], (k, cur.prefix)
        assert cur.prefix["common_prefix_tokens"] == prev.prompt_tokens
        assert cur.cached_tokens >= full_pages(prev.prompt_tokens), (k, cur)  # every full page reused
    assert on[1].prompt_tokens >= 1280
    assert ratios(on)[1] >= 0.95
    expected = {"timestamp": "volatile_lines", "tool_order": "tool_order", "reasoning": "reasoning"}[perturbation]
    changed_at = 2 if perturbation == "reasoning" else 1  # reasoning is dropped at the new user turn
    assert expected in on[changed_at].prefix["normalizations"]
    check_never_beyond_the_common_prefix(on)


def test_guard_off_timestamp_collapses_and_says_why(http: httpx.Client) -> None:
    off = replay(http, TRANSCRIPT, "timestamp", guard_on=False, num_requests=NUM_REQUESTS)
    for r in off[1:]:
        assert r.cached_tokens < 32  # the clock is in the first line: at most its label is reused
        assert r.prefix["diverged"] and r.prefix["divergence_field"] == "content"
        assert r.prefix["divergence_message_index"] == 0
        assert "message 0 (system) content changed" in r.prefix["divergence_reason"]
        assert "(a date/time line)" in r.prefix["divergence_reason"]
    check_never_beyond_the_common_prefix(off)


def test_guard_off_tool_order_collapses_and_says_why(http: httpx.Client) -> None:
    off = replay(http, TRANSCRIPT, "tool_order", guard_on=False, num_requests=NUM_REQUESTS)
    for r in off[1:]:
        assert r.cached_tokens <= 192  # only the system text before the tool list (about 180 tokens) is reused
        assert r.prefix["divergence_field"] == "tools"
        assert r.prefix["divergence_reason"].startswith("tool definitions reordered (")
    assert ratios(off)[1] < 0.15
    check_never_beyond_the_common_prefix(off)


def test_guard_off_dropped_reasoning_collapses_and_says_why(http: httpx.Client) -> None:
    off = replay(http, TRANSCRIPT, "reasoning", guard_on=False, num_requests=NUM_REQUESTS)
    assert not off[1].prefix["diverged"]  # inside the tool loop the client keeps the reasoning
    assert off[1].cached_tokens >= full_pages(off[0].prompt_tokens)
    dropped = off[2].prefix
    assert dropped["diverged"] and dropped["divergence_field"] == "reasoning_content"
    assert dropped["divergence_message_index"] == 2  # [system, user, assistant, ...]: the first assistant
    assert dropped["divergence_reason"] == "message 2 (assistant) reasoning_content removed"
    # Everything from the first assistant message on is prefilled again (about half of this short prompt).
    assert dropped["common_prefix_tokens"] <= off[0].prompt_tokens
    assert full_pages(dropped["common_prefix_tokens"]) <= off[2].cached_tokens <= dropped["common_prefix_tokens"]
    assert ratios(off)[1] < 0.55
    check_never_beyond_the_common_prefix(off)


def test_prefix_metrics_count_divergences_normalisations_and_routing(http: httpx.Client) -> None:
    def counters() -> dict[str, float]:
        text = http.get("/metrics").text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}

    before = counters()
    replay(http, TRANSCRIPT, "tool_order", guard_on=False, num_requests=2)
    replay(http, TRANSCRIPT, "tool_order", guard_on=True, num_requests=2)
    after = counters()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('kvmem_guard_prefix_requests_total{outcome="new_session"}') == 2
    assert delta('kvmem_guard_prefix_requests_total{outcome="diverged"}') == 1
    assert delta('kvmem_guard_prefix_requests_total{outcome="extended"}') == 1
    assert delta('kvmem_guard_prefix_divergences_total{field="tools"}') == 1
    assert delta('kvmem_guard_normalizations_total{name="tool_order"}') == 1
    assert delta('kvmem_guard_normalizations_total{name="volatile_lines"}') == 2
    assert delta('kvmem_guard_routing_total{decision="least_loaded"}') == 2
    assert delta('kvmem_guard_routing_total{decision="affinity"}') == 2
