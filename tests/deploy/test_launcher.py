"""The launcher's service list: several engine replicas behind the cache guard."""

from __future__ import annotations

import types

import pytest

from deploy import launcher
from deploy.launcher import DEFAULT_CATALOG_PREFIX, LaunchConfig, catalog_prefix, engine_names, service_specs

PORTS = {"kvstore0": 1, "engine0": 2, "engine1": 3, "cacheguard": 4}


def test_two_engines_are_named_and_all_handed_to_the_guard() -> None:
    cfg = LaunchConfig.from_args(["--engines", "2", "--chat-template", "t.jinja"])
    assert cfg.num_engines == 2 and engine_names(cfg) == ["engine0", "engine1"]
    specs = {s.name: s for s in service_specs(cfg, "redis://r:1/0", PORTS)}
    assert list(specs) == ["kvstore", "engine0", "engine1", "cacheguard", "gateway"]
    assert specs["engine0"].env["KVMEM_ENGINE_ADDR"] == "127.0.0.1:2"
    assert specs["engine1"].env["KVMEM_ENGINE_ADDR"] == "127.0.0.1:3"
    guard = specs["cacheguard"].env
    assert guard["KVMEM_ENGINE_ADDRS"] == "127.0.0.1:2,127.0.0.1:3"
    assert guard["KVMEM_REDIS_URL"] == "redis://r:1/0"
    assert guard["KVMEM_CHAT_TEMPLATE"] == "t.jinja"


def test_one_engine_keeps_its_plain_name() -> None:
    cfg = LaunchConfig()
    assert engine_names(cfg) == ["engine"]
    specs = service_specs(cfg, "redis://r:1/0", {"kvstore0": 1, "engine": 2, "cacheguard": 3})
    assert [s.name for s in specs if s.module == "services.engine"] == ["engine"]


def test_zero_engines_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        LaunchConfig.from_args(["--engines", "0"])
    assert "--engines must be >= 1, got 0" in capsys.readouterr().err


def test_restart_backoff_doubles_while_a_service_dies_young_and_resets() -> None:
    from deploy.launcher import Backoff

    b = Backoff(0.5, 4.0, young_s=30)
    assert [b.delay(1.0) for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert b.delay(31.0) == 0.5  # it had lived long: start over
    assert b.delay(1.0) == 1.0


def test_every_service_gets_the_secret_and_supervision_is_on_by_default() -> None:
    cfg = LaunchConfig.from_args([])
    assert cfg.supervise and not LaunchConfig.from_args(["--no-supervise"]).supervise
    specs = service_specs(cfg, "redis://:pw@r:1/0", {"kvstore0": 1, "engine": 2, "cacheguard": 3}, "s3cret")
    assert {s.name: s.env["KVMEM_INTERNAL_SECRET"] for s in specs} == dict.fromkeys(
        ["kvstore", "engine", "cacheguard", "gateway"], "s3cret"
    )
    assert all(s.env.get("KVMEM_REDIS_URL", "redis://:pw@r:1/0") == "redis://:pw@r:1/0" for s in specs)
    assert "s3cret" not in repr(cfg) and "s3cret" not in repr(LaunchConfig(internal_secret="s3cret"))


def test_secrets_env_file_has_both_secrets() -> None:
    from deploy.secrets import env_file

    lines = dict(line.split("=", 1) for line in env_file().splitlines())
    assert set(lines) == {"KVMEM_INTERNAL_SECRET", "KVMEM_REDIS_PASSWORD"}
    assert all(len(v) >= 32 for v in lines.values()) and env_file() != env_file()


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stacks started at once in one process pick ports before binding them: a port the kernel offers again
    (here 40001 twice) is skipped, not given to a second service."""
    offered = iter([40001, 40001, 40002])

    class FakeSocket:
        def __enter__(self) -> FakeSocket:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def bind(self, addr: tuple[str, int]) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launcher, "_handed_ports", set())
    monkeypatch.setattr(launcher, "socket", types.SimpleNamespace(socket=FakeSocket))
    assert [launcher.free_port(), launcher.free_port()] == [40001, 40002]


def test_the_catalog_prefix_is_the_deployments_own_on_a_shared_redis() -> None:
    """With the private redis the default; on a shared one (--redis-url) derived from the stack's secret (the same
    for the same secret, another for another), unless --catalog-prefix names one; every redis reader gets it."""
    shared = LaunchConfig.from_args(["--redis-url", "redis://r:1/0"])
    assert catalog_prefix(shared, "a") == catalog_prefix(shared, "a") != catalog_prefix(shared, "b")
    assert catalog_prefix(shared, "a").startswith(DEFAULT_CATALOG_PREFIX) and catalog_prefix(shared, "a") != "kvmem:"
    assert catalog_prefix(LaunchConfig(), "a") == DEFAULT_CATALOG_PREFIX
    named = LaunchConfig.from_args(["--redis-url", "redis://r:1/0", "--catalog-prefix", "mine:"])
    assert catalog_prefix(named, "a") == "mine:"
    specs = {
        s.name: s.env
        for s in service_specs(shared, "redis://r:1/0", {"kvstore0": 1, "engine": 2, "cacheguard": 3}, "a")
    }
    assert {n: e.get("KVMEM_CATALOG_PREFIX") for n, e in specs.items()} == {
        "kvstore": catalog_prefix(shared, "a"), "engine": catalog_prefix(shared, "a"),
        "cacheguard": catalog_prefix(shared, "a"), "gateway": None,
    }  # fmt: skip
