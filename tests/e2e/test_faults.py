"""The fault drill: one supervised stack (two engines, two kvstores, its own password-protected redis); each
service kind is killed with SIGKILL while streams are in flight.

After every kill: each in-flight stream ends with `[DONE]` (after its finish chunk or an OpenAI-shaped
error event), never a hang or a plain-text 500 (the gateway's own death cuts its connections: nobody is
left to answer, so those streams must fail at once, not hang); a new request succeeds within 30 s; the
supervisor has replaced the dead process within 60 s; no arena file outlives its store; while redis is gone
/health says degraded, and once it is back the stores' membership and page entries and the session
affinity are in redis again. Also: internal gRPC calls and redis refuse callers without the secret.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import redis

from deploy.launcher import LaunchConfig, Stack
from services.cacheguard.affinity import session_digest
from services.common import auth, health
from services.common.protos import cacheguard_pb2_grpc, engine_pb2, engine_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.arena import remove_if_stale
from tests.conftest import REPO_ROOT, free_port

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's id: the gateway answers 404 model_not_found to others

NUM_STREAMS = 3
RECOVER_S = 30.0  # a new request succeeds within this after the kill
REPLACE_S = 60.0  # the dead process is replaced (a new pid that said ready) within this
FIRST_DELTA_S = 60.0  # every stream of a round has produced text within this
STREAM_END_S = 180.0  # an in-flight stream has ended within this after the kill (seconds alone; minutes when shared)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    arena_dir = tmp_path_factory.mktemp("arenas")
    cfg = LaunchConfig(
        port=free_port(), num_engines=2, num_kvstores=2, host_kv_mib=64, max_context=2048, kv_capacity=4096,
        arena_dir=str(arena_dir), ready_timeout_s=300,
        restart_backoff_s=2.0,  # long enough for /health to see redis gone
    )  # fmt: skip
    s = Stack(cfg, echo=bool(os.environ.get("KVMEM_DRILL_ECHO")))  # 1: the services' logs on stdout (with -s)
    s.start()
    yield s
    s.stop()
    assert not list(arena_dir.iterdir()), "arena files left after the stack stopped"


def chat(stack: Stack, text: str, *, stream: bool, max_tokens: int, session: str = "") -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, "ignore_eos": True}  # fmt: skip
    return {"json": body, "headers": {"X-Session-Id": session} if session else {}}


class StreamWatch:
    """One streamed request on a thread: what came back, and how it ended."""

    def __init__(self, stack: Stack, index: int) -> None:
        self.stack = stack
        self.index = index
        self.first_delta = threading.Event()
        self.events: list[Any] = []
        self.outcome = "running"  # done | cut | http <status>
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        req = chat(self.stack, f"Tell a long story about lighthouse keeper number {self.index}.", stream=True,
                   max_tokens=64)  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.stack.url}/v1/chat/completions", timeout=90, **req) as r:
                if r.status_code != 200:
                    self.outcome = f"http {r.status_code}"
                    self.events.append(r.read().decode())
                    self.first_delta.set()
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line.removeprefix("data: ")
                    if payload == "[DONE]":
                        self.outcome = "done"
                        return
                    event = json.loads(payload)
                    self.events.append(event)
                    if "choices" in event and any(c.get("delta", {}).get("content") for c in event["choices"]):
                        self.first_delta.set()
                self.outcome = "cut"  # the body ended without [DONE]
        except httpx.HTTPError as exc:
            self.outcome = "cut"
            self.events.append(repr(exc))
        finally:
            self.first_delta.set()

    def ended_cleanly(self) -> bool:
        """[DONE] after a finish chunk or after one OpenAI error event (the last thing before [DONE])."""
        if self.outcome != "done" or not self.events:
            return False
        last = self.events[-1]
        if "error" in last:
            err = last["error"]
            return {"message", "type", "code", "request_id"} <= set(err) and "127.0.0.1" not in err["message"]
        return any(c.get("finish_reason") for e in self.events for c in e.get("choices", []))


def arena_files(stack: Stack) -> list[Path]:
    return sorted(Path(stack.cfg.arena_dir).glob("kvmem-arena-*"))


def assert_arenas_belong_to_live_stores(stack: Stack) -> None:
    files = arena_files(stack)
    assert len(files) == stack.cfg.num_kvstores, files
    for path in files:
        assert not remove_if_stale(str(path)), f"{path} had no living store"


def recover(stack: Stack, killed_at: float) -> float:
    """Seconds from the kill until a new (non-streamed) request answered 200."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=20)
    while True:
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
            return time.monotonic() - killed_at
        except (openai.APIError, httpx.HTTPError):
            if time.monotonic() - killed_at > RECOVER_S:
                raise
            time.sleep(0.5)


def wait_replaced(stack: Stack, name: str, old_pid: int, killed_at: float) -> float:
    while time.monotonic() - killed_at < REPLACE_S:
        if name == "redis":
            try:
                if stack.pid("redis") != old_pid and redis.Redis.from_url(stack.redis_url).ping():
                    return time.monotonic() - killed_at
            except (AssertionError, redis.RedisError):
                pass
        else:
            child = stack.child(name)
            if child.proc.pid != old_pid and child.ready.is_set():
                return time.monotonic() - killed_at
        time.sleep(0.2)
    raise AssertionError(f"{name} not replaced within {REPLACE_S:.0f} s")


def _watch(fn: Any, args: tuple[Any, ...], out: list[float | BaseException]) -> None:
    try:
        out.append(fn(*args))
    except BaseException as exc:
        out.append(exc)


@pytest.mark.parametrize("victim", ["kvstore0", "engine0", "cacheguard", "redis", "gateway"])
def test_kill_mid_stream(stack: Stack, victim: str) -> None:
    streams = [StreamWatch(stack, i) for i in range(NUM_STREAMS)]
    for s in streams:
        assert s.first_delta.wait(FIRST_DELTA_S), f"stream {s.index} produced nothing: {s.outcome} {s.events[-1:]}"
    assert all(s.outcome == "running" for s in streams), [(s.outcome, s.events[-1:]) for s in streams]
    old_pid = stack.pid(victim)
    old_arena = {p: p.stat().st_ino for p in arena_files(stack)}
    stack.kill(victim)
    killed_at = time.monotonic()
    # watched from the kill on, while the in-flight streams end
    replaced: list[float | BaseException] = []
    recovered: list[float | BaseException] = []
    watchers = [
        threading.Thread(target=_watch, args=(wait_replaced, (stack, victim, old_pid, killed_at), replaced)),
        threading.Thread(target=_watch, args=(recover, (stack, killed_at), recovered)),
    ]
    for w in watchers:
        w.start()

    degraded_seen = False
    if victim == "redis":  # the supervisor waits restart_backoff_s before starting it again
        while time.monotonic() - killed_at < 2.0 and not degraded_seen:
            degraded_seen = httpx.get(f"{stack.url}/health", timeout=5).json().get("status") == "degraded"
            time.sleep(0.1)

    for s in streams:
        s.thread.join(timeout=max(1.0, STREAM_END_S - (time.monotonic() - killed_at)))
        assert not s.thread.is_alive(), f"stream {s.index} still open {STREAM_END_S:.0f} s after the kill of {victim}"
    if victim == "gateway":  # the process holding the connections is gone: they are cut, at once
        assert all(s.outcome in ("cut", "done") for s in streams), [s.outcome for s in streams]
    else:
        bad = [(s.outcome, s.events[-1:]) for s in streams if not s.ended_cleanly()]
        assert not bad, f"after the kill of {victim}: {bad}"

    for w in watchers:
        w.join()
    for result in (recovered[0], replaced[0]):
        if isinstance(result, BaseException):
            raise result
    recovered_s, replaced_s = float(recovered[0]), float(replaced[0])  # type: ignore[arg-type]
    print(f"\n{victim}: recovered in {recovered_s:.1f} s, replaced in {replaced_s:.1f} s")  # noqa: T201
    if victim.startswith("kvstore"):
        for path, inode in old_arena.items():  # the dead store's file is gone or is its successor's
            assert not path.exists() or path.stat().st_ino != inode or "kvstore-0" not in path.name
        assert_arenas_belong_to_live_stores(stack)
    if victim == "redis":
        assert degraded_seen, "/health never said degraded while redis was down"
        check_redis_healed(stack)


def check_redis_healed(stack: Stack) -> None:
    """After a redis restart: both stores registered with their pages again, affinity written back."""
    table = redis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        members = table.hgetall("kvmem:replicas")
        pages = sum(1 for _ in table.scan_iter("kvmem:page:*", count=1000))
        if len(members) == 2 and pages > 0:
            break
        time.sleep(0.5)
    assert len(members) == 2 and pages > 0, (members, pages)
    assert httpx.get(f"{stack.url}/health", timeout=5).json() == {"status": "ok"}


def test_affinity_is_rebuilt_after_redis_restart(stack: Stack) -> None:
    http = httpx.Client(base_url=stack.url, timeout=60)
    sid = "faults-affinity"
    first = http.post("/v1/chat/completions", **chat(stack, "Hello there.", stream=False, max_tokens=4, session=sid))
    assert first.status_code == 200
    replica = first.json()["kvmem"]["engine_replica"]
    key = f"kvmem:guard:session:{session_digest('', sid)}"
    table = redis.Redis.from_url(stack.redis_url)
    assert table.get(key) == replica.encode()
    stack.kill("redis")
    wait_replaced(stack, "redis", -1, time.monotonic())
    assert table.get(key) is None  # a fresh redis: empty
    again = http.post("/v1/chat/completions", **chat(stack, "Hello again.", stream=False, max_tokens=4, session=sid))
    assert again.status_code == 200
    assert (again.json()["kvmem"]["routing"], again.json()["kvmem"]["engine_replica"]) == ("affinity", replica)
    assert table.get(key) == replica.encode()  # written back from the guard's mirror


def test_internal_calls_without_the_secret_are_refused(stack: Stack) -> None:
    engine = f"127.0.0.1:{stack.ports['engine0']}"
    store = f"127.0.0.1:{stack.ports['kvstore0']}"
    guard = f"127.0.0.1:{stack.ports['cacheguard']}"
    calls = [
        (engine, lambda ch: engine_pb2_grpc.EngineStub(ch).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)),
        (store, lambda ch: kvstore_pb2_grpc.KVStoreStub(ch).GetInfo(kvstore_pb2.GetInfoRequest(), timeout=10)),
        (guard, lambda ch: cacheguard_pb2_grpc.CacheGuardStub(ch).GetModelInfo(engine_pb2.GetModelInfoRequest(),
                                                                                timeout=10)),
    ]  # fmt: skip
    for addr, call in calls:
        for secret in ("", "wrong-secret"):
            with auth.channel(addr, secret=secret) as ch, pytest.raises(grpc.RpcError) as info:
                call(ch)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (addr, secret)
        with auth.channel(addr, secret=stack.secret) as ch:
            assert call(ch) is not None
        assert health.check(addr) == "SERVING"  # health checks need no secret
    host, port = "127.0.0.1", int(stack.redis_url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=host, port=port, socket_timeout=5).ping()
    assert os.environ.get(auth.SECRET_ENV) is None  # the secret stays in the children's environment


def test_stop_list_over_the_limit_is_a_400(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stop=["x" * 1024] * 17
        )
    assert "at most 16 stop strings, got 17" in info.value.message
    assert info.value.response.headers.get("retry-after") is None


def test_a_kvstore_of_another_deployment_in_the_catalog_stops_no_request(stack: Stack, tmp_path: Path) -> None:
    """A kvstore started with another internal secret registers in this stack's redis (one redis shared by two
    deployments): every call to it is refused. The engines drop it as they drop a dead replica and answer; before,
    the refusal raised out of a prompt's prefix lookup and ended the engine's loop, and every request after it
    hung on an engine that still passed its health checks."""
    addr = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "services.kvstore", "--listen-addr", addr, "--host-kv-mib", "8",
            "--arena-dir", str(tmp_path), "--replica-id", "foreign", "--redis-url", stack.redis_url]  # fmt: skip
    env = {**os.environ, auth.SECRET_ENV: "another-deployment"}
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        while " ready on " not in (line := proc.stderr.readline()):
            assert line, "the foreign kvstore exited"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # a full pipe would block it
        time.sleep(2)  # the engines' clusters read the membership again (every second)
        http = httpx.Client(base_url=stack.url, timeout=60)
        for i in range(6):  # fresh prompts of several pages each: prefix lookups and write-throughs on every replica
            text = f"Request {i}. " + " ".join(f"Fact {i}.{j}: the value is {i * 31 + j}." for j in range(40))
            r = http.post("/v1/chat/completions", **chat(stack, text, stream=False, max_tokens=4))
            assert r.status_code == 200, r.text
        assert httpx.get(f"{stack.url}/health", timeout=5).json() == {"status": "ok"}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
