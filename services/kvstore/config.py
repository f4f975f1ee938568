"""KVStoreConfig: the one place where the kvstore reads its flags and environment."""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
from dataclasses import dataclass, field

from services.common import auth

logger = logging.getLogger(__name__)

MIB = 1 << 20
_REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class ConfigError(ValueError):
    """An impossible configuration value; the message carries the numbers."""


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port); raises ConfigError when malformed."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ConfigError(f"address must be host:port, got {address!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ConfigError(f"port must be in 1..65535, got {port} in {address!r}")
    return host, port


def default_replica_id(listen_addr: str) -> str:
    """A replica id derived from this host's name and the listen port (file-name safe)."""
    _, port = split_address(listen_addr)
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:80] or "host"
    return f"{host}-{port}"


def default_advertise_addr(listen_addr: str) -> str:
    """The address other processes should dial: the listen address; for a wildcard, this host's
    address (what its name resolves to: a container's own IP under compose, where replicas scaled
    with `--scale kvstore=N` share a service name), or its name when that resolves to loopback."""
    host, port = split_address(listen_addr)
    if host not in _WILDCARD_HOSTS:
        return listen_addr
    name = socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError:
        return f"{name}:{port}"
    return f"{name}:{port}" if ip.startswith("127.") else f"{ip}:{port}"


@dataclass(frozen=True)
class KVStoreConfig:
    """Everything the kvstore process needs; built by `from_args`, validated on construction."""

    listen_addr: str = "127.0.0.1:50053"
    host_kv_mib: int = 1024
    arena_dir: str = "/dev/shm"
    replica_id: str = ""  # "" -> derived from hostname + port
    redis_url: str = "redis://127.0.0.1:6379/0"
    advertise_addr: str = ""  # "" -> listen_addr (hostname:port when listening on a wildcard)
    catalog_prefix: str = "kvmem:"
    heartbeat_s: float = 2.0
    max_workers: int = 16
    cold_after_s: float = 120.0  # compress pages not read for this long; 0: no cold tier
    pin_ttl_s: float = 30.0  # an owner's pins lapse when it does not renew them within this
    zstd_level: int = 1
    internal_secret: str = field(default="", repr=False)  # required on every call (auth.py); "": no check

    def __post_init__(self) -> None:
        split_address(self.listen_addr)
        if not self.replica_id:
            object.__setattr__(self, "replica_id", default_replica_id(self.listen_addr))
        if not self.advertise_addr:
            object.__setattr__(self, "advertise_addr", default_advertise_addr(self.listen_addr))
        self._validate()

    def _validate(self) -> None:
        if self.host_kv_mib < 1:
            raise ConfigError(f"host_kv_mib must be >= 1, got {self.host_kv_mib}")
        if not os.path.isdir(self.arena_dir):
            raise ConfigError(f"arena_dir {self.arena_dir!r} is not a directory")
        if not _REPLICA_ID_RE.match(self.replica_id):
            raise ConfigError(f"replica_id must match {_REPLICA_ID_RE.pattern}, got {self.replica_id!r}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        split_address(self.advertise_addr)
        if not self.catalog_prefix:
            raise ConfigError("catalog_prefix must not be empty")
        if self.heartbeat_s <= 0:
            raise ConfigError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.max_workers < 1:
            raise ConfigError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.cold_after_s < 0:
            raise ConfigError(f"cold_after_s must be >= 0 (0: no cold tier), got {self.cold_after_s}")
        if not 0 < self.pin_ttl_s <= 3600:
            raise ConfigError(f"pin_ttl_s must be in (0, 3600], got {self.pin_ttl_s}")
        if not 1 <= self.zstd_level <= 19:
            raise ConfigError(f"zstd_level must be in 1..19, got {self.zstd_level}")

    @property
    def maintenance_s(self) -> float:
        """How often the maintenance thread expires pins and compresses cold pages."""
        return min(1.0, self.pin_ttl_s / 4, self.cold_after_s / 4 if self.cold_after_s else 1.0)

    @property
    def arena_bytes(self) -> int:
        """The page budget in bytes (host_kv_mib MiB)."""
        return self.host_kv_mib * MIB

    @property
    def arena_path(self) -> str:
        """The arena file a same-host client maps."""
        return os.path.join(self.arena_dir, f"kvmem-arena-{self.replica_id}")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> KVStoreConfig:
        """Parse CLI flags (defaults from KVMEM_* env vars) into a validated config."""
        env = os.environ
        p = argparse.ArgumentParser(prog="python -m services.kvstore", description=__doc__)
        p.add_argument("--listen-addr", default=env.get("KVMEM_KVSTORE_ADDR", cls.listen_addr))
        p.add_argument("--host-kv-mib", type=int, default=env.get("KVMEM_HOST_KV_MIB", str(cls.host_kv_mib)))
        p.add_argument("--arena-dir", default=env.get("KVMEM_ARENA_DIR", cls.arena_dir))
        p.add_argument("--replica-id", default=env.get("KVMEM_REPLICA_ID", ""))
        p.add_argument("--redis-url", default=env.get("KVMEM_REDIS_URL", cls.redis_url))
        p.add_argument("--advertise-addr", default=env.get("KVMEM_KVSTORE_ADVERTISE_ADDR", ""))
        p.add_argument("--catalog-prefix", default=env.get("KVMEM_CATALOG_PREFIX", cls.catalog_prefix))
        # String defaults go through `type`, so a bad env value fails like a bad flag.
        p.add_argument("--heartbeat-s", type=float, default=env.get("KVMEM_KVSTORE_HEARTBEAT_S", "2.0"))
        p.add_argument("--max-workers", type=int, default=env.get("KVMEM_KVSTORE_WORKERS", "16"))
        p.add_argument("--cold-after-s", type=float, default=env.get("KVMEM_COLD_AFTER_S", "120"))
        p.add_argument("--pin-ttl-s", type=float, default=env.get("KVMEM_PIN_TTL_S", "30"))
        p.add_argument("--zstd-level", type=int, default=env.get("KVMEM_ZSTD_LEVEL", "1"))
        a = p.parse_args(argv)
        return cls(
            listen_addr=a.listen_addr,
            host_kv_mib=a.host_kv_mib,
            arena_dir=a.arena_dir,
            replica_id=a.replica_id,
            redis_url=a.redis_url,
            advertise_addr=a.advertise_addr,
            catalog_prefix=a.catalog_prefix,
            heartbeat_s=a.heartbeat_s,
            max_workers=a.max_workers,
            cold_after_s=a.cold_after_s,
            pin_ttl_s=a.pin_ttl_s,
            zstd_level=a.zstd_level,
            internal_secret=auth.secret_from_env(),
        )
