"""CacheGuardConfig: the cache guard's one frozen config, from CLI flags whose defaults come from env."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Long prompts travel as token lists or long chat histories: lift gRPC's 4 MiB default (as the gateway).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class ConfigError(ValueError):
    """An impossible cache guard setting; the message carries the offending value."""


def parse_addr(addr: str, what: str, allow_port_zero: bool = False) -> tuple[str, int]:
    """Split and check a "host:port" address (port 0: any free port, for listening only)."""
    host, sep, port_text = addr.rpartition(":")
    low = 0 if allow_port_zero else 1
    if not sep or not host or not port_text.isdigit() or not low <= int(port_text) < 65536:
        raise ConfigError(f"{what} must be host:port with a port in {low}..65535, got {addr!r}")
    return host, int(port_text)


@dataclass(frozen=True)
class CacheGuardConfig:
    """Everything the cache guard reads from its environment, validated once at start-up."""

    listen_addr: str = "127.0.0.1:50051"
    engine_addrs: tuple[str, ...] = ("127.0.0.1:50052",)
    model: str = "embedded:smollm2"
    max_sessions: int = 10000
    engine_connect_timeout_s: float = 5.0  # how long a request waits for an engine replica to be ready

    def __post_init__(self) -> None:
        parse_addr(self.listen_addr, "listen_addr", allow_port_zero=True)
        if not self.engine_addrs:
            raise ConfigError("engine_addrs is empty: give at least one engine host:port")
        for addr in self.engine_addrs:
            parse_addr(addr, "engine address")
        if len(set(self.engine_addrs)) != len(self.engine_addrs):
            raise ConfigError(f"engine_addrs lists an address twice: {','.join(self.engine_addrs)}")
        if not self.model:
            raise ConfigError("model is empty")
        if self.max_sessions < 1:
            raise ConfigError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not self.engine_connect_timeout_s > 0:
            raise ConfigError(f"engine_connect_timeout_s must be > 0, got {self.engine_connect_timeout_s}")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> CacheGuardConfig:
        """Build from CLI flags (defaults from KVMEM_* env vars); raises ConfigError on bad values."""
        env = os.environ
        p = argparse.ArgumentParser(prog="python -m services.cacheguard", description=__doc__)
        p.add_argument("--listen-addr", default=env.get("KVMEM_CACHEGUARD_ADDR", cls.listen_addr))
        p.add_argument(
            "--engine-addrs",
            default=env.get("KVMEM_ENGINE_ADDRS", ",".join(cls.engine_addrs)),
            help="comma list of engine host:port",
        )
        p.add_argument("--model", default=env.get("KVMEM_MODEL", cls.model))
        p.add_argument("--max-sessions", default=env.get("KVMEM_CACHEGUARD_MAX_SESSIONS", str(cls.max_sessions)))
        p.add_argument(
            "--engine-connect-timeout-s",
            default=env.get("KVMEM_ENGINE_CONNECT_TIMEOUT_S", str(cls.engine_connect_timeout_s)),
        )
        a = p.parse_args(argv)
        return cls(
            listen_addr=a.listen_addr.strip(),
            engine_addrs=tuple(x.strip() for x in a.engine_addrs.split(",") if x.strip()),
            model=a.model.strip(),
            max_sessions=_number(a.max_sessions, int, "max_sessions"),
            engine_connect_timeout_s=_number(a.engine_connect_timeout_s, float, "engine_connect_timeout_s"),
        )


def _number(text: str, kind: Callable[[str], _T], what: str) -> _T:
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{what} must be a number, got {text!r}") from None
