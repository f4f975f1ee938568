"""docker-compose.yml and the local launcher run the same entry points with the same variables.

No Docker engine runs here, so this is how compose is kept correct: every service's command must be
`python -m <module>` of a module that exists and starts (`--help` exits 0), and its KVMEM_* variables
must be exactly the ones the launcher sets for that service.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from deploy.launcher import LaunchConfig, service_specs
from tests.conftest import REPO_ROOT

COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
SPECS = {
    s.name: s for s in service_specs(LaunchConfig(), "redis://x:1/0", {"kvstore0": 1, "engine": 2, "cacheguard": 3})
}


def test_compose_has_every_launcher_service_and_redis() -> None:
    assert set(COMPOSE["services"]) == set(SPECS) | {"redis"}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_service_command_and_environment_match_the_launcher(name: str) -> None:
    svc = COMPOSE["services"][name]
    assert svc["command"] == ["python", "-m", SPECS[name].module]
    assert set(svc["environment"]) == set(SPECS[name].env)


@pytest.mark.parametrize("module", sorted({s.module for s in SPECS.values()}))
def test_entry_point_exists_and_parses_its_flags(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout.lower()


def test_engine_gets_a_gpu_and_shares_the_arena_with_the_store() -> None:
    engine, store = COMPOSE["services"]["engine"], COMPOSE["services"]["kvstore"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    arena = store["environment"]["KVMEM_ARENA_DIR"]
    assert f"kv-arena:{arena}" in store["volumes"] and f"kv-arena:{arena}" in engine["volumes"]
    assert COMPOSE["volumes"]["kv-arena"]["driver_opts"]["type"] == "tmpfs"


def test_dockerfile_builds_what_setup_installs() -> None:
    text = (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    for needle in ("requirements.txt", "requirements-models.txt", "services.common.protogen"):
        assert needle in text
