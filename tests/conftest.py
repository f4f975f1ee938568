"""Shared fixtures: a real redis-server on a free port, free ports, repo paths."""

from __future__ import annotations

import os

# Triton decides at @triton.jit time whether a kernel is compiled or interpreted, so the switch must be
# set before any kernel module is imported: on a machine without CUDA, every Triton kernel in the tests
# runs under the interpreter (compared with its torch reference).
if "TRITON_INTERPRET" not in os.environ and not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# What must stop before a test's kvstores do (`before_stores_stop`): an engine that renews its pins with a
# store logs a failed renewal every 2 s once the store is gone. Autouse fixtures are torn down last, after
# start_store's, so they cannot do this themselves.
_before_stores_stop: list[weakref.WeakMethod[Callable[[], None]]] = []


def before_stores_stop(stop: Callable[[], None]) -> None:
    """Run the bound method `stop` at the end of the current test, before the stores of its start_store
    stop, when it was registered during the test (after start_store was set up: not for a module fixture's
    engine, which outlives the test). Held weakly: the registry keeps no engine alive."""
    _before_stores_stop.append(weakref.WeakMethod(stop))


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server for the test session (started here, stopped at the end)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: run scripts/setup.sh")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


class Store(NamedTuple):
    proc: subprocess.Popen[str]
    address: str
    replica_id: str
    arena_path: str
    prefix: str
    lines: list[str]


StartStore = Callable[..., Store]


def _wait_ready(proc: subprocess.Popen[str], lines: list[str], timeout_s: float = 30) -> None:
    assert proc.stderr is not None
    stream = proc.stderr

    def drain() -> None:
        for line in stream:
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not any(" ready on " in line for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"kvstore did not become ready (rc {proc.poll()}):\n{''.join(lines)}")
        time.sleep(0.05)


def stop_store(store: Store) -> int:
    if store.proc.poll() is None:
        store.proc.send_signal(signal.SIGTERM)
    return store.proc.wait(timeout=20)


@pytest.fixture
def start_store(redis_url: str, tmp_path: Path) -> Iterator[StartStore]:
    """Start kvstore processes (stopped with SIGTERM at the end); each gets its own catalog prefix."""
    started: list[Store] = []
    mark = len(_before_stores_stop)

    def start(
        host_kv_mib: int = 64,
        port: int | None = None,
        replica_id: str = "",
        prefix: str = "",
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> Store:
        port = port or free_port()
        replica_id = replica_id or f"test-{uuid.uuid4().hex[:8]}"
        prefix = prefix or f"kvmem-test-{uuid.uuid4().hex[:8]}:"
        address = f"127.0.0.1:{port}"
        argv = [sys.executable, "-m", "services.kvstore", "--listen-addr", address, "--host-kv-mib",
                str(host_kv_mib), "--arena-dir", str(tmp_path), "--replica-id", replica_id,
                "--redis-url", redis_url, "--catalog-prefix", prefix, "--heartbeat-s", "0.5", *args]  # fmt: skip
        env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True, env=env)
        lines: list[str] = []
        _wait_ready(proc, lines)
        store = Store(proc, address, replica_id, str(tmp_path / f"kvmem-arena-{replica_id}"), prefix, lines)
        started.append(store)
        return store

    yield start
    while len(_before_stores_stop) > mark:
        stop = _before_stores_stop.pop()()
        if stop is not None:
            stop()
    for store in started:
        stop_store(store)
