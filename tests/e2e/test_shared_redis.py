"""A stack on a redis that another deployment uses too (`--redis-url`): the launcher gives its services a catalog
prefix of their own (derived from the stack's internal secret), the kvstore registers under it, the engine finds
its kvstore there and writes its pages through, and the other deployment's kvstore (the default prefix, another
secret) is never seen: before, the engine read only the default prefix and both deployments' replicas were one
cluster, each refusing the other's calls."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from deploy.launcher import DEFAULT_CATALOG_PREFIX, LaunchConfig, Stack, _Redis, catalog_prefix
from services.common import auth
from tests.conftest import REPO_ROOT, free_port

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[str]:
    server = _Redis()
    server.start()
    yield server.url
    assert server.proc is not None
    server.proc.terminate()
    server.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def foreign_kvstore(shared_redis: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Another deployment's kvstore: the default catalog prefix, another internal secret."""
    addr = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "services.kvstore", "--listen-addr", addr, "--host-kv-mib", "8",
            "--arena-dir", str(tmp_path_factory.mktemp("foreign")), "--replica-id", "foreign",
            "--redis-url", shared_redis]  # fmt: skip
    env = {**os.environ, auth.SECRET_ENV: "another-deployment"}
    env.pop("KVMEM_CATALOG_PREFIX", None)
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    while " ready on " not in (line := proc.stderr.readline()):
        assert line, "the foreign kvstore exited"
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # a full pipe would block it
    yield "foreign"
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def stack(shared_redis: str, foreign_kvstore: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = LaunchConfig(
        port=free_port(), redis_url=shared_redis, host_kv_mib=64, max_context=2048, kv_capacity=4096,
        arena_dir=str(tmp_path_factory.mktemp("arenas")), ready_timeout_s=300,
    )  # fmt: skip
    s = Stack(cfg, echo=False)
    s.start()
    yield s
    s.stop()


def test_a_stack_on_a_shared_redis_keeps_to_its_own_catalog(stack: Stack, shared_redis: str) -> None:
    prefix = catalog_prefix(stack.cfg, stack.secret)
    assert prefix.startswith(DEFAULT_CATALOG_PREFIX) and prefix != DEFAULT_CATALOG_PREFIX
    db = redis.Redis.from_url(shared_redis, decode_responses=True)
    assert set(db.hkeys(f"{prefix}replicas")) == {spec.env["KVMEM_REPLICA_ID"] for spec in stack_kvstores(stack)}
    assert set(db.hkeys(f"{DEFAULT_CATALOG_PREFIX}replicas")) == {"foreign"}
    http = httpx.Client(base_url=stack.url, timeout=120)
    for i in range(3):  # prompts of several pages: write-throughs to the stack's kvstore
        text = f"Request {i}. " + " ".join(f"Fact {i}.{j}: the value is {i * 31 + j}." for j in range(40))
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while not db.keys(f"{prefix}page:*") and time.monotonic() < deadline:  # the catalog is written off the put path
        time.sleep(0.2)
    assert db.keys(f"{prefix}page:*"), "the engine wrote no page through its kvstore"
    assert not db.keys(f"{DEFAULT_CATALOG_PREFIX}page:*")  # nothing went to the other deployment's kvstore
    assert httpx.get(f"{stack.url}/health", timeout=5).json() == {"status": "ok"}


def stack_kvstores(stack: Stack) -> list:  # type: ignore[type-arg]
    return [c.spec for c in stack.children if c.spec.module == "services.kvstore"]
