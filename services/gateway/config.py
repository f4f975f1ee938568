"""GatewayConfig: the gateway's one frozen config, built from CLI flags whose defaults come from env."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
from dataclasses import dataclass, field

from services.common import auth
from services.gateway.planner.plan import OVER_POOL_POLICIES, PlannerSettings

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """An impossible gateway setting; the message carries the offending value."""


@dataclass(frozen=True)
class ApiKey:
    """One accepted bearer key and the tenant name it maps to."""

    name: str
    key: str

    def __repr__(self) -> str:  # never print the secret
        return f"ApiKey(name={self.name!r}, key='***')"


def key_tenant(key: str) -> str:
    """Tenant name of a key given without a name: a short sha256 of the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_api_keys(text: str) -> tuple[ApiKey, ...]:
    """Parse KVMEM_API_KEYS: a comma list of `key` or `name:key` (split at the first colon)."""
    keys: list[ApiKey] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, key = item.partition(":")
        if not sep:
            name, key = key_tenant(item), item
        name, key = name.strip(), key.strip()
        if not name or not key:
            raise ConfigError(f"api key entry {item.split(':')[0]!r}...: name and key must be non-empty")
        keys.append(ApiKey(name=name, key=key))
    seen: set[str] = set()
    for k in keys:
        if k.key in seen:
            raise ConfigError(f"api key of {k.name!r} is listed twice")
        seen.add(k.key)
    return tuple(keys)


def parse_addr(addr: str, what: str) -> tuple[str, int]:
    """Split and check a "host:port" address."""
    host, sep, port_text = addr.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{what} must be host:port with a port in 1..65535, got {addr!r}")
    return host, int(port_text)


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway reads from its environment, validated once at start-up."""

    host: str = "127.0.0.1"
    port: int = 8000
    cacheguard_addr: str = "127.0.0.1:50051"
    api_keys: tuple[ApiKey, ...] = ()
    request_timeout_s: float = 600.0  # gRPC deadline of one Generate call
    model_info_ttl_s: float = 5.0  # how long a GetModelInfo answer is reused
    health_timeout_s: float = 2.0  # deadline of the GetModelInfo call behind /health
    max_body_bytes: int = 32 << 20  # a request body over this is a 413 naming the limit
    internal_secret: str = field(default="", repr=False)  # sent on every gRPC call to the guard (auth.py)
    # names a request's `model` may use besides the served model's id ("*": any); others get 404 model_not_found
    model_aliases: tuple[str, ...] = ()
    # segment planner (DESIGN.md §5): what happens to a prompt over the device pool
    over_pool_policy: str = "shard"  # shard, sparse, exact, refuse; a request's kvmem.over_pool_policy wins
    planner_max_calls: int = 32  # model calls per request; a request's kvmem.max_calls wins
    planner_map_concurrency: int = 4  # map calls in flight per request
    planner_answer_reserve: int = 128  # tokens kept for the answer when a request sets no max_tokens
    planner_map_max_tokens: int = 48  # answer length of one map call

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        parse_addr(self.cacheguard_addr, "cacheguard_addr")
        for name in ("request_timeout_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.model_info_ttl_s < 0:
            raise ConfigError(f"model_info_ttl_s must be >= 0, got {self.model_info_ttl_s}")
        if self.over_pool_policy not in OVER_POOL_POLICIES:
            raise ConfigError(
                f"over_pool_policy must be one of {', '.join(OVER_POOL_POLICIES)}, got {self.over_pool_policy!r}"
            )
        for name in (
            "planner_max_calls",
            "planner_map_concurrency",
            "planner_answer_reserve",
            "planner_map_max_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def planner(self) -> PlannerSettings:
        """The planner's server-side defaults."""
        return PlannerSettings(
            over_pool_policy=self.over_pool_policy,
            max_calls=self.planner_max_calls,
            map_concurrency=self.planner_map_concurrency,
            answer_reserve=self.planner_answer_reserve,
            map_max_tokens=self.planner_map_max_tokens,
        )

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> GatewayConfig:
        """Build from CLI flags (defaults from KVMEM_* env vars); raises ConfigError on bad values."""
        env = os.environ
        p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
        p.add_argument("--host", default=env.get("KVMEM_GATEWAY_HOST", cls.host))
        p.add_argument("--port", type=int, default=_env_int("KVMEM_GATEWAY_PORT", cls.port))
        p.add_argument("--cacheguard-addr", default=env.get("KVMEM_CACHEGUARD_ADDR", cls.cacheguard_addr))
        p.add_argument(
            "--api-keys",
            default=env.get("KVMEM_API_KEYS", ""),
            help="comma list of `key` or `name:key`; empty: no auth",
        )
        p.add_argument(
            "--request-timeout-s",
            type=float,
            default=_env_float("KVMEM_GATEWAY_REQUEST_TIMEOUT_S", cls.request_timeout_s),
        )
        p.add_argument(
            "--model-info-ttl-s",
            type=float,
            default=_env_float("KVMEM_GATEWAY_MODEL_INFO_TTL_S", cls.model_info_ttl_s),
        )
        p.add_argument(
            "--health-timeout-s",
            type=float,
            default=_env_float("KVMEM_GATEWAY_HEALTH_TIMEOUT_S", cls.health_timeout_s),
        )
        p.add_argument(
            "--max-body-bytes",
            type=int,
            default=_env_int("KVMEM_GATEWAY_MAX_BODY_BYTES", cls.max_body_bytes),
            help="request bodies over this many bytes are refused with a 413",
        )
        p.add_argument(
            "--over-pool-policy",
            default=env.get("KVMEM_OVER_POOL_POLICY", cls.over_pool_policy),
            help="what to do with a prompt over the device pool: shard, sparse, exact or refuse",
        )
        p.add_argument(
            "--planner-max-calls", type=int, default=_env_int("KVMEM_PLANNER_MAX_CALLS", cls.planner_max_calls)
        )
        p.add_argument(
            "--planner-map-concurrency",
            type=int,
            default=_env_int("KVMEM_PLANNER_MAP_CONCURRENCY", cls.planner_map_concurrency),
        )
        p.add_argument(
            "--planner-answer-reserve",
            type=int,
            default=_env_int("KVMEM_PLANNER_ANSWER_RESERVE", cls.planner_answer_reserve),
        )
        p.add_argument(
            "--planner-map-max-tokens",
            type=int,
            default=_env_int("KVMEM_PLANNER_MAP_MAX_TOKENS", cls.planner_map_max_tokens),
        )
        p.add_argument(
            "--model-aliases",
            default=env.get("KVMEM_MODEL_ALIASES", ""),
            help="comma list of model names accepted besides the served id ('*': any name)",
        )
        a = p.parse_args(argv)
        return cls(
            model_aliases=tuple(n.strip() for n in a.model_aliases.split(",") if n.strip()),
            host=a.host,
            port=a.port,
            cacheguard_addr=a.cacheguard_addr,
            api_keys=parse_api_keys(a.api_keys),
            request_timeout_s=a.request_timeout_s,
            model_info_ttl_s=a.model_info_ttl_s,
            health_timeout_s=a.health_timeout_s,
            max_body_bytes=a.max_body_bytes,
            internal_secret=auth.secret_from_env(),
            over_pool_policy=a.over_pool_policy,
            planner_max_calls=a.planner_max_calls,
            planner_map_concurrency=a.planner_map_concurrency,
            planner_answer_reserve=a.planner_answer_reserve,
            planner_map_max_tokens=a.planner_map_max_tokens,
        )


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {text!r}") from None


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {text!r}") from None
