"""CacheGuardConfig: flags and KVMEM_* defaults, and the values it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cacheguard.config import CacheGuardConfig, ConfigError
from services.cacheguard.normalize import NORMALIZATIONS


def test_defaults_and_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = CacheGuardConfig.from_args([])
    assert (cfg.redis_url, cfg.catalog_prefix, cfg.normalizations, cfg.chat_template) == (
        "",
        "kvmem:",
        NORMALIZATIONS,
        "",
    )
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    monkeypatch.setenv("KVMEM_REDIS_URL", "redis://127.0.0.1:6379/1")
    monkeypatch.setenv("KVMEM_ENGINE_ADDRS", "127.0.0.1:1, 127.0.0.1:2")
    monkeypatch.setenv("KVMEM_CACHEGUARD_NORMALIZATIONS", "tool_order, reasoning")
    monkeypatch.setenv("KVMEM_CHAT_TEMPLATE", str(template))
    cfg = CacheGuardConfig.from_args(["--session-ttl-s", "60"])
    assert cfg.redis_url == "redis://127.0.0.1:6379/1"
    assert cfg.engine_addrs == ("127.0.0.1:1", "127.0.0.1:2")
    assert cfg.normalizations == ("tool_order", "reasoning")
    assert cfg.chat_template == str(template) and cfg.session_ttl_s == 60
    assert CacheGuardConfig.from_args(["--normalizations", "none"]).normalizations == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--normalizations", "tool_order,sorting"], "unknown normalization(s) sorting"),
        (["--redis-url", "http://x"], "redis_url must start with redis://"),
        (["--session-ttl-s", "0"], "session_ttl_s must be > 0, got 0.0"),
        (["--chat-template", "/no/such/file.jinja"], "is not a file"),
        (["--catalog-prefix", ""], "catalog_prefix must not be empty"),
        (["--engine-addrs", "127.0.0.1:1,127.0.0.1:1"], "lists an address twice"),
    ],
)
def test_impossible_values_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CacheGuardConfig.from_args(argv)
