"""`docker compose up --scale kvstore=N` needs a kvstore service that names nothing fixed."""

from __future__ import annotations

import socket

import yaml

from services.kvstore.config import KVStoreConfig, default_advertise_addr, default_replica_id
from tests.conftest import REPO_ROOT

COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def test_kvstore_service_can_be_scaled() -> None:
    store = COMPOSE["services"]["kvstore"]
    assert "container_name" not in store and "ports" not in store
    env = store["environment"]
    assert env["KVMEM_REPLICA_ID"] == ""  # derived from the container's hostname
    assert env["KVMEM_KVSTORE_ADDR"].startswith("0.0.0.0:")
    assert env["KVMEM_REDIS_URL"].startswith("redis://:${KVMEM_REDIS_PASSWORD}@redis:")  # the password from .env


def test_replica_identity_comes_from_the_host(tmp_path) -> None:
    cfg = KVStoreConfig(listen_addr="0.0.0.0:50053", arena_dir=str(tmp_path))
    assert cfg.replica_id == default_replica_id("0.0.0.0:50053")
    assert cfg.replica_id.startswith(socket.gethostname()[:8]) and cfg.replica_id.endswith("-50053")
    host = cfg.advertise_addr.rsplit(":", 1)[0]
    assert host not in ("0.0.0.0", "") and not host.startswith("127.")  # dialable from another container
    assert default_advertise_addr("127.0.0.1:7") == "127.0.0.1:7"
