"""Generates the gRPC Python code from proto/ into services/_gen (run at install time)."""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
GEN_ROOT = REPO_ROOT / "services" / "_gen"
_STAMP = GEN_ROOT / ".stamp"


def proto_files() -> list[Path]:
    """All .proto files under proto/, sorted."""
    return sorted(PROTO_ROOT.rglob("*.proto"))


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(PROTO_ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def is_current() -> bool:
    """True when services/_gen was generated from the protos as they are now."""
    return _STAMP.exists() and _STAMP.read_text() == _digest(proto_files())


def generate() -> None:
    """Compile every proto (messages + gRPC stubs) into GEN_ROOT; raises on protoc failure."""
    from grpc_tools import protoc  # imported lazily: only needed at build time

    files = proto_files()
    GEN_ROOT.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={GEN_ROOT}",
        f"--pyi_out={GEN_ROOT}",
        f"--grpc_python_out={GEN_ROOT}",
        *[str(f) for f in files],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    for d in [GEN_ROOT, *[p for p in GEN_ROOT.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    _STAMP.write_text(_digest(files))
    logger.info("generated %d protos into %s", len(files), GEN_ROOT)


def ensure() -> None:
    """Generate when missing or stale (a checkout without the install step still works)."""
    if not is_current():
        generate()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    generate()
    sys.exit(0)
