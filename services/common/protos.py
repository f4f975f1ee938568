"""Import point of the generated gRPC modules: `from services.common.protos import engine_pb2, ...`."""

from __future__ import annotations

import sys

from services.common import protogen

protogen.ensure()
if str(protogen.GEN_ROOT) not in sys.path:
    sys.path.insert(0, str(protogen.GEN_ROOT))

from kvmem.cacheguard.v1 import cacheguard_pb2, cacheguard_pb2_grpc  # noqa: E402
from kvmem.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from kvmem.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc  # noqa: E402

__all__ = [
    "cacheguard_pb2",
    "cacheguard_pb2_grpc",
    "engine_pb2",
    "engine_pb2_grpc",
    "kvstore_pb2",
    "kvstore_pb2_grpc",
]
