"""gRPC health checking (grpc.health.v1, the `grpcio-health-checking` package) for every gRPC service.

Each server registers the standard Health service: "" (the whole server) is SERVING once it listens and
NOT_SERVING while it drains; services that use redis also report `kvmem.redis` (SERVING while redis
answers, NOT_SERVING while it is gone: the service goes on, degraded). `python -m services.common.health
ADDR [--service NAME]` is the probe of compose's healthchecks (exit 0 when SERVING).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from collections.abc import Callable

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

OVERALL = ""
REDIS = "kvmem.redis"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def add_health(server: grpc.Server) -> health.HealthServicer:
    """Register the Health service on a sync server; the whole server is SERVING."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set(OVERALL, SERVING)
    return servicer


async def add_aio_health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """Register the Health service on a grpc.aio server; the whole server is SERVING."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set(OVERALL, SERVING)
    return servicer


class RedisProbe:
    """Pings redis every `interval_s` on a thread and calls `on_change(up)` when reachability changes
    (first call: the first answer). `up` says whether the last ping answered."""

    def __init__(self, redis_url: str, on_change: Callable[[bool], None], interval_s: float = 1.0) -> None:
        self.up: bool | None = None
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._on_change = on_change
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                up = bool(self._redis.ping())
            except redis.RedisError:
                up = False
            if up != self.up:
                if self.up is not None:
                    logger.warning("redis %s", "is back" if up else "is unreachable: serving degraded")
                self.up = up
                try:
                    self._on_change(up)
                except Exception:
                    logger.exception("redis probe callback failed")
            if self._stop.wait(self._interval_s):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._redis.close()


def redis_status_setter(servicer: health.HealthServicer) -> Callable[[bool], None]:
    """on_change for a sync server's Health service: kvmem.redis follows redis."""
    return lambda up: servicer.set(REDIS, SERVING if up else NOT_SERVING)


def aio_redis_status_setter(
    servicer: health.aio.HealthServicer, loop: asyncio.AbstractEventLoop
) -> Callable[[bool], None]:
    """on_change for a grpc.aio server's Health service (called from the probe thread)."""

    def set_status(up: bool) -> None:
        asyncio.run_coroutine_threadsafe(servicer.set(REDIS, SERVING if up else NOT_SERVING), loop)

    return set_status


def check(addr: str, service: str = OVERALL, timeout_s: float = 2.0) -> str:
    """The status name of `service` at `addr` (SERVING, NOT_SERVING, ...), or the gRPC error's code name."""
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.common.health", description=__doc__)
    p.add_argument("addr", help="host:port of a gRPC service")
    p.add_argument("--service", default=OVERALL, help="service name ('' = the whole server)")
    p.add_argument("--timeout-s", type=float, default=2.0)
    a = p.parse_args(argv)
    status = check(a.addr, a.service, a.timeout_s)
    sys.stdout.write(f"{status}\n")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
