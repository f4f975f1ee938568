"""The local launcher: redis, kvstore(s), engine, cacheguard and gateway as processes on loopback.

`python -m deploy.launcher` (what `make run` calls). docker-compose.yml runs the same entry points
with the same environment variables; tests/deploy/test_compose.py keeps the two in step.
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass, field
from pathlib import Path

from services.common.model_files import DEFAULT_MODEL

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
            api_keys=a.api_keys,
            host_kv_mib=a.host_kv_mib,
            arena_dir=a.arena_dir,
            max_context=a.max_context,
            kv_capacity=a.kv_capacity,
            chat_template=a.chat_template,
            ready_timeout_s=a.ready_timeout,
        )


@dataclass(frozen=True)
class ServiceSpec:
    """One process: a name, the module it runs (`python -m <module>`) and its KVMEM_* environment."""

    name: str
    module: str
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_names(cfg: LaunchConfig) -> list[str]:
    """The engine services' names: "engine", or engine0, engine1, ... when there are several."""
    return ["engine"] if cfg.num_engines == 1 else [f"engine{i}" for i in range(cfg.num_engines)]


def service_specs(cfg: LaunchConfig, redis_url: str, ports: dict[str, int]) -> list[ServiceSpec]:
    """The services in start order. `ports` has kvstore0.., the engine_names, cacheguard."""
    kvstore_addrs = [f"127.0.0.1:{ports[f'kvstore{i}']}" for i in range(cfg.num_kvstores)]
    specs = [
        ServiceSpec(
            f"kvstore{i}" if cfg.num_kvstores > 1 else "kvstore",
            "services.kvstore",
            {
                "KVMEM_KVSTORE_ADDR": addr,
                "KVMEM_HOST_KV_MIB": str(cfg.host_kv_mib),
                "KVMEM_REDIS_URL": redis_url,
                "KVMEM_ARENA_DIR": cfg.arena_dir,
                "KVMEM_REPLICA_ID": f"kvstore-{i}-{ports[f'kvstore{i}']}",
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
                "KVMEM_HOST_KV_MIB": str(cfg.host_kv_mib * cfg.num_kvstores),
                "KVMEM_MAX_CONTEXT": str(cfg.max_context),
                "KVMEM_KV_CAPACITY": str(cfg.kv_capacity),
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
                "KVMEM_CHAT_TEMPLATE": cfg.chat_template,
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
            },
        )
    )
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


class Stack:
    """Starts the whole stack and stops it in reverse order (also used by the end-to-end tests)."""

    def __init__(self, cfg: LaunchConfig, echo: bool = True) -> None:
        self.cfg = cfg
        self.echo = echo
        self.children: list[_Child] = []
        self._redis: subprocess.Popen[bytes] | None = None
        self._redis_dir: str | None = None
        self.redis_url = cfg.redis_url
        self.ports: dict[str, int] = {}

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def start(self) -> None:
        try:
            if not self.redis_url:
                self.redis_url = self._start_redis()
            self.ports = {f"kvstore{i}": free_port() for i in range(self.cfg.num_kvstores)}
            self.ports |= {name: free_port() for name in engine_names(self.cfg)}
            self.ports |= {"cacheguard": free_port()}
            for spec in service_specs(self.cfg, self.redis_url, self.ports):
                logger.info("starting %s (python -m %s)", spec.name, spec.module)
                child = _Child(spec, self.echo)
                self.children.append(child)
                self._wait_ready(child)
        except BaseException:
            self.stop()
            raise

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

    def _start_redis(self) -> str:
        exe = shutil.which("redis-server")
        if exe is None:
            raise LaunchError("redis-server is not installed: run scripts/setup.sh (apt-get install redis-server)")
        port = free_port()
        self._redis_dir = tempfile.mkdtemp(prefix="kvmem-redis-")
        self._redis = subprocess.Popen(
            [
                exe,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._redis_dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                logger.info("redis-server on 127.0.0.1:%d", port)
                return f"redis://127.0.0.1:{port}/0"
            except OSError:
                time.sleep(0.05)
        raise LaunchError("redis-server did not start within 10 s")

    def kill(self, name: str) -> None:
        """SIGKILL one service (a crash, for tests); the others keep running. Raises KeyError for an unknown name."""
        child = next((c for c in self.children if c.spec.name == name), None)
        if child is None:
            raise KeyError(f"no running service {name!r}: {', '.join(c.spec.name for c in self.children)}")
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.wait(timeout=30)
        logger.info("killed %s (exit code %s)", name, child.proc.returncode)

    def failed_child(self) -> _Child | None:
        """A service that has exited on its own, if any."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        if self._redis is not None:
            self._redis.terminate()
            self._redis.wait(timeout=10)
            self._redis = None
        if self._redis_dir is not None:
            shutil.rmtree(self._redis_dir, ignore_errors=True)
            self._redis_dir = None


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
            dead = stack.failed_child()
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
