"""End to end with two engine replicas: sessions stick to the replica holding their prefix; killing
one moves its sessions to the other, where they are prefilled again and answered correctly; the
session -> replica table in redis follows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from deploy.launcher import LaunchConfig, Stack
from services.cacheguard.affinity import session_digest
from tests.conftest import free_port

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's id: the gateway answers 404 model_not_found to others

PAGE_SIZE = 64
QUESTIONS = [("What is the capital of France?", "Paris"), ("What is the capital of Italy?", "Rome")]
NUM_SESSIONS = 4


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    cfg = LaunchConfig(
        port=free_port(),
        num_engines=2,
        host_kv_mib=256,
        max_context=2048,
        kv_capacity=4096,
        ready_timeout_s=300,
        supervise=False,  # this test follows the guard moving sessions off a dead replica, which stays dead
    )
    s = Stack(cfg, echo=False)  # its own redis, so the table below holds only this module's sessions
    s.start()
    yield s
    s.stop()


def system_prompt(session: int) -> str:
    """A different ~300-token system prompt per session, so no two sessions share a page."""
    rules = " ".join(f"Rule {session}.{i}: answer in one short sentence." for i in range(30))
    return f"You are assistant number {session}. {rules}"


def ask(http: httpx.Client, session_id: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12}
    r = http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session_id})
    r.raise_for_status()
    return dict(r.json())


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_sessions_stick_to_their_replica_and_move_when_it_dies(stack: Stack) -> None:
    engine0, engine1 = (f"127.0.0.1:{stack.ports[name]}" for name in ("engine0", "engine1"))
    table = redis.Redis.from_url(stack.redis_url)
    sessions = [f"affinity-{k}" for k in range(NUM_SESSIONS)]
    chats: dict[str, list[dict[str, str]]] = {}
    replica: dict[str, str] = {}
    turn2_tokens: dict[str, int] = {}
    with httpx.Client(base_url=stack.url, timeout=300) as http:
        # Turn 1: new sessions go to the least-loaded replica; idle replicas take turns.
        for k, sid in enumerate(sessions):
            chats[sid] = [{"role": "system", "content": system_prompt(k)}, {"role": "user", "content": QUESTIONS[0][0]}]
            answer = ask(http, sid, chats[sid])
            assert answer["kvmem"]["routing"] == "least_loaded"
            replica[sid] = answer["kvmem"]["engine_replica"]
            chats[sid].append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        assert set(replica.values()) == {engine0, engine1}
        for sid in sessions:  # the table in redis names each session's replica
            assert table.get(f"kvmem:guard:session:{session_digest('', sid)}") == replica[sid].encode()

        # Turn 2: every session goes back to its replica and reuses its prefix there.
        for sid in sessions:
            chats[sid].append({"role": "user", "content": QUESTIONS[1][0]})
            answer = ask(http, sid, chats[sid])
            assert (answer["kvmem"]["routing"], answer["kvmem"]["engine_replica"]) == ("affinity", replica[sid])
            assert cached(answer) >= 256  # the system prompt's pages, at least
            assert QUESTIONS[1][1] in answer["choices"][0]["message"]["content"]
            chats[sid].append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            turn2_tokens[sid] = answer["usage"]["prompt_tokens"]

        stack.kill("engine1")

        # Turn 3: engine1's sessions move to engine0 (reloaded there from the kvstore), engine0's stay.
        for sid in sessions:
            chats[sid].append({"role": "user", "content": QUESTIONS[0][0]})
            answer = ask(http, sid, chats[sid])
            kvmem = answer["kvmem"]
            assert kvmem["engine_replica"] == engine0
            if replica[sid] == engine1:
                assert (kvmem["routing"], kvmem["moved_from"]) == ("moved", engine1)
                # Nothing of this session was ever on engine0's device, but engine1 wrote its pages
                # through to the shared kvstore: engine0 restores them instead of prefilling again.
                assert cached(answer) >= 256
            else:
                assert kvmem["routing"] == "affinity"
                assert cached(answer) >= turn2_tokens[sid] // PAGE_SIZE * PAGE_SIZE  # at least its full pages
            assert QUESTIONS[0][1] in answer["choices"][0]["message"]["content"]
            assert table.get(f"kvmem:guard:session:{session_digest('', sid)}") == engine0.encode()
            chats[sid].append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})

        # Turn 4: the moved sessions now stick to engine0 and reuse what turn 3 prefilled there.
        for sid in (s for s in sessions if replica[s] == engine1):
            chats[sid].append({"role": "user", "content": QUESTIONS[1][0]})
            answer = ask(http, sid, chats[sid])
            assert (answer["kvmem"]["routing"], answer["kvmem"]["engine_replica"]) == ("affinity", engine0)
            assert cached(answer) >= 256
            assert QUESTIONS[1][1] in answer["choices"][0]["message"]["content"]
