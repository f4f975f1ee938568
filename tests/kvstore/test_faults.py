"""What heals in the kvstore: stale arena files of dead stores are swept, the catalog is published again
after redis lost it, and the gRPC server refuses calls without the internal secret."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import redis

from services.common import auth, health
from services.common.protos import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.arena import Arena, remove_if_stale, sweep_stale_arenas
from services.kvstore.catalog import Catalog
from services.kvstore.pages import PageLocation, PageMeta
from tests.conftest import REPO_ROOT

MIB = 1 << 20


def _old(path: Path) -> None:
    past = time.time() - 60
    os.utime(path, (past, past))


def test_sweep_removes_only_arenas_without_a_living_store(tmp_path: Path) -> None:
    live = Arena(str(tmp_path / "kvmem-arena-live"), MIB, "live")
    dead = tmp_path / "kvmem-arena-dead"
    dead.write_bytes(b"\0" * 4096)  # a store killed with SIGKILL leaves its file, unlocked
    young = tmp_path / "kvmem-arena-young"
    young.write_bytes(b"\0" * 4096)  # unlocked but just created: maybe a store between create and flock
    other = tmp_path / "unrelated"
    other.write_bytes(b"x")
    for p in (Path(live.path), dead, other):
        _old(p)
    assert sweep_stale_arenas(str(tmp_path)) == [str(dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvmem-arena-live", "kvmem-arena-young", "unrelated"]
    assert not remove_if_stale(live.path)  # held
    live.close()
    assert not Path(live.path).exists()


def test_a_killed_store_leaves_a_file_that_the_next_start_sweeps(tmp_path: Path) -> None:
    path = tmp_path / "kvmem-arena-killed"
    holder = subprocess.Popen(  # holds the lock like a store, then dies by SIGKILL
        [sys.executable, "-c", f"import fcntl,os,time; fd=os.open({str(path)!r}, os.O_RDWR|os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    assert not remove_if_stale(str(path))
    holder.kill()
    holder.wait()
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel released the dead owner's lock
    os.close(fd)
    assert remove_if_stale(str(path)) and not path.exists()


def _location(i: int, replica: str) -> PageLocation:
    h = bytes([i]) * 32
    return PageLocation(True, replica, 4096 * (i + 1), PageMeta(h, "bf16", 64, 4096), False)


def test_catalog_publishes_its_pages_again_after_redis_lost_them(redis_url: str) -> None:
    prefix = f"kvmem-test-{uuid.uuid4().hex[:8]}:"
    pages = [_location(i, "r1") for i in range(3)]
    catalog = Catalog(redis_url, "r1", "127.0.0.1:1", prefix, heartbeat_s=0.1)
    catalog.pages_source = lambda: pages
    table = redis.Redis.from_url(redis_url)
    try:
        catalog.register()
        catalog.update(pages, [])
        assert catalog.flush()
        assert len(list(table.scan_iter(f"{prefix}page:*"))) == 3
        # what a restarted redis holds: nothing, lost at once (one DEL: deleting key by key raced the catalog's
        # heartbeat, which could republish between two deletes and then see its marker back)
        table.delete(*table.scan_iter(f"{prefix}*"))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(list(table.scan_iter(f"{prefix}page:*"))) < 3:
            time.sleep(0.05)
        assert len(list(table.scan_iter(f"{prefix}page:*"))) == 3
        assert table.hget(f"{prefix}replicas", "r1") == b"127.0.0.1:1"
        assert catalog.num_republished == 1
        assert catalog.entry(pages[0].meta.page_hash) is not None
    finally:
        catalog.unregister()
        catalog.close()


def test_catalog_writer_and_heartbeat_survive_an_unexpected_failure(redis_url: str, monkeypatch) -> None:
    """A batch that fails with something other than a redis error (a bug, a bad value) is dropped and counted; the
    writer goes on with the next ones and flush returns. Before, it ended the writer thread: every later update
    stayed queued and the catalog went stale while the store held the pages. The heartbeat goes on the same way."""
    prefix = f"kvmem-test-{uuid.uuid4().hex[:8]}:"
    catalog = Catalog(redis_url, "r1", "127.0.0.1:1", prefix, heartbeat_s=0.05)
    table = redis.Redis.from_url(redis_url)
    real_write, real_beat, fail = catalog._write, catalog._beat, {"write": 1, "beat": 2}

    def write(updates):  # type: ignore[no-untyped-def]
        if fail["write"]:
            fail["write"] -= 1
            raise ValueError("not a redis error")
        real_write(updates)

    def beat() -> bool:
        if fail["beat"] and catalog._registered:
            fail["beat"] -= 1
            raise TypeError("not a redis error either")
        return real_beat()

    monkeypatch.setattr(catalog, "_write", write)
    monkeypatch.setattr(catalog, "_beat", beat)
    try:
        catalog.register()
        catalog.update([_location(0, "r1")], [])  # this batch fails
        assert catalog.flush(timeout_s=5)
        catalog.update([_location(i, "r1") for i in (1, 2)], [])
        assert catalog.flush(timeout_s=5)
        assert len(list(table.scan_iter(f"{prefix}page:*"))) == 2
        assert catalog.num_errors >= 1 and catalog._writer.is_alive()
        deadline = time.monotonic() + 5
        while fail["beat"] and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # beats after the failures
        assert fail["beat"] == 0 and catalog._thread is not None and catalog._thread.is_alive()
        assert time.time() - float(table.hget(f"{prefix}replicas:heartbeat", "r1") or 0) < 1.0
    finally:
        catalog.unregister()
        catalog.close()


def test_store_refuses_calls_without_the_secret(redis_url: str, tmp_path: Path) -> None:
    from tests.conftest import free_port

    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, auth.SECRET_ENV: "store-secret"}
    argv = [sys.executable, "-m", "services.kvstore", "--listen-addr", addr, "--host-kv-mib", "8",
            "--arena-dir", str(tmp_path), "--replica-id", "auth-test", "--redis-url", redis_url,
            "--catalog-prefix", f"kvmem-test-{uuid.uuid4().hex[:8]}:"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        while " ready on " not in (line := proc.stderr.readline()):
            assert line, "kvstore exited"
        for secret, code in (("", grpc.StatusCode.UNAUTHENTICATED), ("nope", grpc.StatusCode.UNAUTHENTICATED)):
            with auth.channel(addr, secret=secret) as ch:
                try:
                    kvstore_pb2_grpc.KVStoreStub(ch).GetInfo(kvstore_pb2.GetInfoRequest(), timeout=10)
                    got = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    got = exc.code()
            assert got == code
        with auth.channel(addr, secret="store-secret") as ch:
            assert kvstore_pb2_grpc.KVStoreStub(ch).GetInfo(kvstore_pb2.GetInfoRequest(), timeout=10).replica_id
        assert health.check(addr) == "SERVING"
        deadline = time.monotonic() + 5  # kvmem.redis is set by the store's first redis ping
        while health.check(addr, health.REDIS) != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health.check(addr, health.REDIS) == "SERVING"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert not (tmp_path / "kvmem-arena-auth-test").exists()
