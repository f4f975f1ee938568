"""CacheGuardConfig: the cache guard's one frozen config, from CLI flags whose defaults come from env."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from services.cacheguard.normalize import NORMALIZATIONS
from services.common import auth
from services.common.limits import GRPC_CHANNEL_OPTIONS, GRPC_MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Long prompts travel as token lists or long chat histories: the shared limits (services/common/limits.py).
MAX_MESSAGE_BYTES = GRPC_MAX_MESSAGE_BYTES
CHANNEL_OPTIONS = GRPC_CHANNEL_OPTIONS


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
    # Session -> engine replica (affinity), shared by every guard process; "" keeps it in this process only.
    redis_url: str = ""
    catalog_prefix: str = "kvmem:"  # key prefix in redis (as the kvstore catalog)
    session_ttl_s: float = 3600.0  # an idle session's affinity is forgotten after this
    normalizations: tuple[str, ...] = NORMALIZATIONS  # see normalize.py; () turns them all off
    chat_template: str = ""  # path of a Jinja chat template replacing the model's own; "": the model's
    # the ring's query: "question" (core.question_start; the default since 2026-12-02) or "turn" (the last user turn)
    query_span: str = "question"
    internal_secret: str = field(default="", repr=False)  # required on calls in, sent on calls out (auth.py)

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
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if not self.catalog_prefix:
            raise ConfigError("catalog_prefix must not be empty")
        if not self.session_ttl_s > 0:
            raise ConfigError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")
        unknown = [n for n in self.normalizations if n not in NORMALIZATIONS]
        if unknown:
            raise ConfigError(f"unknown normalization(s) {','.join(unknown)}; known: {','.join(NORMALIZATIONS)}")
        if self.query_span not in ("question", "turn"):
            raise ConfigError(f"query_span must be question or turn, got {self.query_span!r}")
        if self.chat_template and not Path(self.chat_template).is_file():
            raise ConfigError(f"chat_template {self.chat_template!r} is not a file")

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
        p.add_argument(
            "--redis-url",
            default=env.get("KVMEM_REDIS_URL", cls.redis_url),
            help="session affinity catalog; empty: kept in this process only",
        )
        p.add_argument("--catalog-prefix", default=env.get("KVMEM_CATALOG_PREFIX", cls.catalog_prefix))
        p.add_argument("--session-ttl-s", default=env.get("KVMEM_CACHEGUARD_SESSION_TTL_S", str(cls.session_ttl_s)))
        p.add_argument(
            "--normalizations",
            default=env.get("KVMEM_CACHEGUARD_NORMALIZATIONS", ",".join(cls.normalizations)),
            help=f"comma list of {','.join(NORMALIZATIONS)}, or 'none'",
        )
        p.add_argument(
            "--chat-template",
            default=env.get("KVMEM_CHAT_TEMPLATE", cls.chat_template),
            help="Jinja chat template file replacing the model's own",
        )
        p.add_argument(
            "--query-span",
            default=env.get("KVMEM_CACHEGUARD_QUERY_SPAN", cls.query_span),
            help="the ring's query span: question (found in the last user message) or turn (all of it)",
        )
        a = p.parse_args(argv)
        names = a.normalizations.strip()
        return cls(
            listen_addr=a.listen_addr.strip(),
            engine_addrs=tuple(x.strip() for x in a.engine_addrs.split(",") if x.strip()),
            model=a.model.strip(),
            max_sessions=_number(a.max_sessions, int, "max_sessions"),
            engine_connect_timeout_s=_number(a.engine_connect_timeout_s, float, "engine_connect_timeout_s"),
            redis_url=a.redis_url.strip(),
            catalog_prefix=a.catalog_prefix,
            session_ttl_s=_number(a.session_ttl_s, float, "session_ttl_s"),
            normalizations=() if names == "none" else tuple(x.strip() for x in names.split(",") if x.strip()),
            chat_template=a.chat_template.strip(),
            query_span=a.query_span.strip(),
            internal_secret=auth.secret_from_env(),
        )


def _number(text: str, kind: Callable[[str], _T], what: str) -> _T:
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{what} must be a number, got {text!r}") from None
