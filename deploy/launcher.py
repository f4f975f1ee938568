"""The local launcher: redis, kvstore(s), engine, cacheguard and gateway as processes on loopback.

`python -m deploy.launcher` (what `make run` calls). docker-compose.yml runs the same entry points
with the same environment variables; tests/deploy/test_compose.py keeps the two in step.

Supervision: a child that exits on its own (a crash, kill -9) is started again on the same port with
the same environment (a kvstore keeps its replica id, so it replaces its arena file and re-registers),
after a backoff that doubles while it keeps dying young (0.5 s .. 10 s); the other services keep
serving meanwhile. A private redis-server is supervised the same way (same port and password).
Every launch generates an internal secret (KVMEM_INTERNAL_SECRET, required on every gRPC call between
the services) and a redis password; everything listens on loopback unless --host says otherwise
(the gateway only).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.common import auth
from services.common.model_files import DEFAULT_MODEL
from services.kvstore.arena import remove_if_stale

logger = logging.getLogger("kvmem.launcher")
REPO_ROOT = Path(__file__).resolve().parents[1]


class LaunchError(RuntimeError):
    """A service did not start; the message names it and quotes its last log lines."""


@dataclass(frozen=True)
class LaunchConfig:
    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8000  # the gateway's; internal services take free ports
    num_kvstores: int = 1
    num_engines: int = 1  # engine replicas behind the cache guard (named engine0.. when more than one)
    redis_url: str = ""  # empty: start a private redis-server
    api_keys: str = ""
    host_kv_mib: int = 1024
    arena_dir: str = "/dev/shm"
    max_context: int = 8192
    kv_capacity: int = 8192
    chat_template: str = ""  # the cache guard's --chat-template ("": the model's own)
    ready_timeout_s: float = 600.0
    supervise: bool = True  # restart a child that died (with backoff) instead of stopping the stack
    restart_backoff_s: float = 0.5  # first restart delay; doubles while a child keeps dying young
    max_backoff_s: float = 10.0
    internal_secret: str = field(default="", repr=False)  # "": a fresh one per launch
    catalog_prefix: str = ""  # the kvstore catalog's keys in redis ("": `catalog_prefix` picks one)
    # extra environment for every service (name, value), over the launcher's own: how benches start stacks with
    # different engine options side by side in one process
    extra_env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> LaunchConfig:
        env = os.environ.get
        p = argparse.ArgumentParser(prog="python -m deploy.launcher", description=__doc__)
        p.add_argument("--model", default=env("KVMEM_MODEL", DEFAULT_MODEL))
        p.add_argument("--host", default=env("KVMEM_GATEWAY_HOST", "127.0.0.1"))
        p.add_argument("--port", type=int, default=int(env("KVMEM_GATEWAY_PORT", "8000")))
        p.add_argument("--kvstores", type=int, default=1, help="number of kvstore replicas")
        p.add_argument("--engines", type=int, default=1, help="number of engine replicas")
        p.add_argument("--redis-url", default=env("KVMEM_REDIS_URL", ""))
        p.add_argument(
            "--catalog-prefix",
            default=env("KVMEM_CATALOG_PREFIX", ""),
            help="key prefix of the kvstore catalog in redis (default: kvmem: with the private redis; on a shared "
            "--redis-url, one of this deployment's own)",
        )
        p.add_argument("--api-keys", default=env("KVMEM_API_KEYS", ""))
        p.add_argument("--host-kv-mib", type=int, default=int(env("KVMEM_HOST_KV_MIB", "1024")))
        p.add_argument("--arena-dir", default=env("KVMEM_ARENA_DIR", "/dev/shm"))
        p.add_argument("--max-context", type=int, default=int(env("KVMEM_MAX_CONTEXT", "8192")))
        p.add_argument("--kv-capacity", type=int, default=int(env("KVMEM_KV_CAPACITY", "8192")))
        p.add_argument(
            "--chat-template",
            default=env("KVMEM_CHAT_TEMPLATE", ""),
            help="Jinja chat template file the cache guard renders with instead of the model's",
        )
        p.add_argument("--ready-timeout", type=float, default=600.0)
        p.add_argument(
            "--no-supervise",
            action="store_true",
            help="stop the whole stack when a service exits (default: restart it with backoff)",
        )
        a = p.parse_args(argv)
        if a.kvstores < 1:
            p.error(f"--kvstores must be >= 1, got {a.kvstores}")
        if a.engines < 1:
            p.error(f"--engines must be >= 1, got {a.engines}")
        return cls(
            model=a.model,
            host=a.host,
            port=a.port,
            num_kvstores=a.kvstores,
            num_engines=a.engines,
            redis_url=a.redis_url,
            catalog_prefix=a.catalog_prefix,
            api_keys=a.api_keys,
            host_kv_mib=a.host_kv_mib,
            arena_dir=a.arena_dir,
            max_context=a.max_context,
            kv_capacity=a.kv_capacity,
            chat_template=a.chat_template,
            ready_timeout_s=a.ready_timeout,
            supervise=not a.no_supervise,
            internal_secret=auth.secret_from_env(),
        )


@dataclass(frozen=True)
class ServiceSpec:
    """One process: a name, the module it runs (`python -m <module>`) and its KVMEM_* environment."""

    name: str
    module: str
    env: dict[str, str] = field(default_factory=dict)


_handed_ports: set[int] = set()  # every port free_port returned in this process
_handed_lock = threading.Lock()


def free_port() -> int:
    """A loopback port free now and not handed out before in this process: stacks started at once in one process
    (bench/longeval/run.py --parallel-stacks) pick their ports before their services bind them, and the kernel
    may offer one stack's picked port to the next."""
    with _handed_lock:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _handed_ports:
                _handed_ports.add(port)
                return port


def engine_names(cfg: LaunchConfig) -> list[str]:
    """The engine services' names: "engine", or engine0, engine1, ... when there are several."""
    return ["engine"] if cfg.num_engines == 1 else [f"engine{i}" for i in range(cfg.num_engines)]


DEFAULT_CATALOG_PREFIX = "kvmem:"


def catalog_prefix(cfg: LaunchConfig, secret: str) -> str:
    """The kvstore catalog's key prefix every service of the stack uses: cfg.catalog_prefix when set, the default
    with the launcher's private redis, and on a shared redis (cfg.redis_url) one of the deployment's own, derived
    from its internal secret: two stacks on one redis under one prefix each saw the other's kvstores, which refuse
    calls signed with another secret (the cluster drops such a replica, then tries it again after its next
    heartbeat: a failed call and a warning each time)."""
    if cfg.catalog_prefix:
        return cfg.catalog_prefix
    if not cfg.redis_url or not secret:
        return DEFAULT_CATALOG_PREFIX
    return f"{DEFAULT_CATALOG_PREFIX}{hashlib.sha256(secret.encode()).hexdigest()[:12]}:"


def service_specs(cfg: LaunchConfig, redis_url: str, ports: dict[str, int], secret: str = "") -> list[ServiceSpec]:
    """The services in start order. `ports` has kvstore0.., the engine_names, cacheguard; `secret` goes to
    every service as KVMEM_INTERNAL_SECRET, `catalog_prefix` to the ones that read redis."""
    prefix = catalog_prefix(cfg, secret)
    kvstore_addrs = [f"127.0.0.1:{ports[f'kvstore{i}']}" for i in range(cfg.num_kvstores)]
    specs = [
        ServiceSpec(
            f"kvstore{i}" if cfg.num_kvstores > 1 else "kvstore",
            "services.kvstore",
            {
                "KVMEM_KVSTORE_ADDR": addr,
                "KVMEM_HOST_KV_MIB": str(cfg.host_kv_mib),
                "KVMEM_REDIS_URL": redis_url,
                "KVMEM_CATALOG_PREFIX": prefix,
                "KVMEM_ARENA_DIR": cfg.arena_dir,
                "KVMEM_REPLICA_ID": f"kvstore-{i}-{ports[f'kvstore{i}']}",
                auth.SECRET_ENV: secret,
            },
        )
        for i, addr in enumerate(kvstore_addrs)
    ]
    engine_addrs = [f"127.0.0.1:{ports[name]}" for name in engine_names(cfg)]
    guard_addr = f"127.0.0.1:{ports['cacheguard']}"
    specs += [
        ServiceSpec(
            name,
            "services.engine",
            {
                "KVMEM_ENGINE_ADDR": addr,
                "KVMEM_MODEL": cfg.model,
                "KVMEM_KVSTORE_ADDRS": ",".join(kvstore_addrs),
                "KVMEM_REDIS_URL": redis_url,  # pages spread over every kvstore replica registered there
                "KVMEM_CATALOG_PREFIX": prefix,
                "KVMEM_HOST_KV_MIB": str(cfg.host_kv_mib * cfg.num_kvstores),
                "KVMEM_MAX_CONTEXT": str(cfg.max_context),
                "KVMEM_KV_CAPACITY": str(cfg.kv_capacity),
                auth.SECRET_ENV: secret,
            },
        )
        for name, addr in zip(engine_names(cfg), engine_addrs, strict=True)
    ]
    specs.append(
        ServiceSpec(
            "cacheguard",
            "services.cacheguard",
            {
                "KVMEM_CACHEGUARD_ADDR": guard_addr,
                "KVMEM_ENGINE_ADDRS": ",".join(engine_addrs),
                "KVMEM_MODEL": cfg.model,
                "KVMEM_REDIS_URL": redis_url,
                "KVMEM_CATALOG_PREFIX": prefix,
                "KVMEM_CHAT_TEMPLATE": cfg.chat_template,
                auth.SECRET_ENV: secret,
            },
        )
    )
    specs.append(
        ServiceSpec(
            "gateway",
            "services.gateway",
            {
                "KVMEM_GATEWAY_HOST": cfg.host,
                "KVMEM_GATEWAY_PORT": str(cfg.port),
                "KVMEM_CACHEGUARD_ADDR": guard_addr,
                "KVMEM_API_KEYS": cfg.api_keys,
                auth.SECRET_ENV: secret,
            },
        )
    )
    if cfg.extra_env:
        specs = [replace(s, env={**s.env, **dict(cfg.extra_env)}) for s in specs]
    return specs


class _Child:
    """A running service: its process, a thread echoing its output, and whether it said `ready`."""

    def __init__(self, spec: ServiceSpec, echo: bool) -> None:
        self.spec = spec
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", spec.module],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.started_at = time.monotonic()
        self.ready = threading.Event()
        self.tail: deque[str] = deque(maxlen=30)
        self._echo = echo
        threading.Thread(target=self._pump, name=f"log-{spec.name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            if self._echo:
                sys.stdout.write(f"[{self.spec.name}] {line}\n")
                sys.stdout.flush()
            if " ready" in line:
                self.ready.set()

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Backoff:
    """Restart delays of one service: `first_s`, doubled per death within `young_s` of its start, at most
    `max_s`; a service that lived longer than `young_s` starts again from `first_s`."""

    def __init__(self, first_s: float, max_s: float, young_s: float = 30.0) -> None:
        self.first_s, self.max_s, self.young_s = first_s, max_s, young_s
        self._next_s = first_s

    def delay(self, lived_s: float) -> float:
        """The delay before the next start of a service that died after living `lived_s`."""
        if lived_s >= self.young_s:
            self._next_s = self.first_s
        delay = self._next_s
        self._next_s = min(self.max_s, self._next_s * 2)
        return delay


class _Redis:
    """A private redis-server on loopback with a password (restarted on the same port by the supervisor)."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise LaunchError("redis-server is not installed: run scripts/setup.sh (apt-get install redis-server)")
        self.exe = exe
        self.port = free_port()
        self.password = auth.new_secret()
        self.dir = tempfile.mkdtemp(prefix="kvmem-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", self.dir, "--requirepass", self.password]
        self.proc = subprocess.Popen(
            [self.exe, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self.started_at = time.monotonic()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                logger.info("redis-server on 127.0.0.1:%d (password protected)", self.port)
                return
            except OSError:
                time.sleep(0.05)
        raise LaunchError("redis-server did not start within 10 s")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


class Stack:
    """Starts the whole stack, supervises it, and stops it in reverse order (also used by the end-to-end tests)."""

    def __init__(self, cfg: LaunchConfig, echo: bool = True) -> None:
        self.cfg = cfg
        self.echo = echo
        self.children: list[_Child] = []
        self._redis: _Redis | None = None
        self.redis_url = cfg.redis_url
        self.ports: dict[str, int] = {}
        self.secret = cfg.internal_secret or auth.new_secret()
        self.restarts: dict[str, int] = {}  # service name -> restarts so far
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._backoff: dict[str, Backoff] = {}
        self._due: dict[str, float] = {}  # service name -> monotonic time of its next start

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def start(self) -> None:
        try:
            if not self.redis_url:
                self._redis = _Redis()
                self._redis.start()
                self.redis_url = self._redis.url
            self.ports = {f"kvstore{i}": free_port() for i in range(self.cfg.num_kvstores)}
            self.ports |= {name: free_port() for name in engine_names(self.cfg)}
            self.ports |= {"cacheguard": free_port()}
            for spec in service_specs(self.cfg, self.redis_url, self.ports, self.secret):
                logger.info("starting %s (python -m %s)", spec.name, spec.module)
                child = _Child(spec, self.echo)
                self.children.append(child)
                self._wait_ready(child)
        except BaseException:
            self.stop()
            raise
        if self.cfg.supervise:
            self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
            self._supervisor.start()

    def _wait_ready(self, child: _Child) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while not child.ready.wait(0.2):
            if child.proc.poll() is not None:
                raise LaunchError(
                    f"{child.spec.name} exited with code {child.proc.returncode}:\n" + "\n".join(child.tail)
                )
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{child.spec.name} not ready after {self.cfg.ready_timeout_s:.0f} s:\n" + "\n".join(child.tail)
                )

    # ---- supervision --------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._stopping.wait(0.25):
            try:
                self.supervise_once()
            except Exception:
                logger.exception("supervisor round failed")

    def supervise_once(self) -> None:
        """One round: notice dead children (and redis), start the ones whose backoff is over."""
        with self._lock:
            if self._stopping.is_set():
                return
            now = time.monotonic()
            if self._redis is not None and self._redis.proc is not None and self._redis.proc.poll() is not None:
                self._restart_redis(now)
            for index, child in enumerate(self.children):
                name = child.spec.name
                if child.proc.poll() is None:
                    continue
                if name not in self._due:
                    self._on_death(child, now)
                elif now >= self._due[name]:
                    del self._due[name]
                    logger.info("restarting %s (restart %d)", name, self.restarts.get(name, 0) + 1)
                    self.children[index] = _Child(child.spec, self.echo)
                    self.restarts[name] = self.restarts.get(name, 0) + 1

    def _on_death(self, child: _Child, now: float) -> None:
        name = child.spec.name
        lived = now - child.started_at
        delay = self._backoff.setdefault(name, Backoff(self.cfg.restart_backoff_s, self.cfg.max_backoff_s)).delay(lived)
        self._due[name] = now + delay
        logger.error(
            "%s exited with code %s after %.1f s; restarting in %.1f s. Last lines:\n%s",
            name, child.proc.returncode, lived, delay, "\n".join(list(child.tail)[-5:]),
        )  # fmt: skip
        if child.spec.module == "services.kvstore":
            self._remove_arena(child.spec)

    def _remove_arena(self, spec: ServiceSpec) -> None:
        """A dead store's arena file goes at once (unless a living store holds it)."""
        path = os.path.join(spec.env["KVMEM_ARENA_DIR"], f"kvmem-arena-{spec.env['KVMEM_REPLICA_ID']}")
        if remove_if_stale(path):
            logger.info("removed the arena %s of dead %s", path, spec.name)

    def _restart_redis(self, now: float) -> None:
        assert self._redis is not None and self._redis.proc is not None
        if "redis" not in self._due:
            backoff = self._backoff.setdefault("redis", Backoff(self.cfg.restart_backoff_s, self.cfg.max_backoff_s))
            delay = backoff.delay(now - self._redis.started_at)
            self._due["redis"] = now + delay
            logger.error("redis-server exited with code %s; restarting in %.1f s", self._redis.proc.returncode, delay)
        elif now >= self._due["redis"]:
            del self._due["redis"]
            self._redis.start()
            self.restarts["redis"] = self.restarts.get("redis", 0) + 1

    # ---- for tests and the drill --------------------------------------------------------------

    def child(self, name: str) -> _Child:
        """The current process of a service; raises KeyError for an unknown name."""
        with self._lock:
            found = next((c for c in self.children if c.spec.name == name), None)
        if found is None:
            raise KeyError(f"no service {name!r}: {', '.join(c.spec.name for c in self.children)}")
        return found

    def pid(self, name: str) -> int:
        """The pid of a service's current process ("redis": the private redis-server)."""
        if name == "redis":
            assert self._redis is not None and self._redis.proc is not None, "no private redis"
            return int(self._redis.proc.pid)
        return int(self.child(name).proc.pid)

    def kill(self, name: str) -> None:
        """SIGKILL one service (a crash, for tests); the others keep running (and the supervisor, when on,
        starts it again). "redis" kills the private redis-server. Raises KeyError for an unknown name."""
        if name == "redis":
            assert self._redis is not None and self._redis.proc is not None, "no private redis"
            self._redis.proc.kill()
            self._redis.proc.wait(timeout=30)
            logger.info("killed redis-server")
            return
        child = self.child(name)
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.wait(timeout=30)
        logger.info("killed %s (exit code %s)", name, child.proc.returncode)

    def failed_child(self) -> _Child | None:
        """A service that has exited on its own, if any."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=10)
            self._supervisor = None
        with self._lock:
            for child in reversed(self.children):
                child.stop()
            self.children.clear()
            if self._redis is not None:
                self._redis.stop()
                self._redis = None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s: %(message)s")
    cfg = LaunchConfig.from_args(argv)
    stack = Stack(cfg)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    # Ctrl-C (KeyboardInterrupt) stops the stack; installed explicitly because Python leaves SIGINT ignored when
    # the launcher was started with it ignored (a background job of a non-interactive shell: `make run &`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stack.start()
        print(f"\nKVMem is up: {stack.url}/v1  (model list: curl {stack.url}/v1/models; Ctrl-C stops)\n", flush=True)
        while not stopping.wait(0.5):
            dead = None if cfg.supervise else stack.failed_child()
            if dead is not None:
                logger.error("%s exited with code %s; stopping the stack", dead.spec.name, dead.proc.returncode)
                return 1
    except KeyboardInterrupt:
        pass
    except LaunchError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        logger.info("stopping")
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
