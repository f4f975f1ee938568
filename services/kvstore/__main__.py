"""`python -m services.kvstore [flags]`: serve the host KV store until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from services.common import auth, logs
from services.common.logs import redact_url
from services.kvstore.config import ConfigError, KVStoreConfig

logger = logging.getLogger("services.kvstore")


def main(argv: list[str] | None = None) -> int:
    logs.setup("kvstore")
    try:
        config = KVStoreConfig.from_args(argv)
    except ConfigError as e:
        logger.error("bad configuration: %s", e)
        return 2
    auth.configure(config.internal_secret)
    from services.kvstore.server import serve  # after config: grpc import is the slow part

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        service = serve(config)
    except Exception as e:
        logger.error("kvstore failed to start: %s: %s", type(e).__name__, e)
        return 1
    logger.info(
        "kvstore ready on %s (replica %s, arena %s, %d MiB, redis %s)",
        config.listen_addr,
        config.replica_id,
        config.arena_path,
        config.host_kv_mib,
        redact_url(config.redis_url),
    )
    while not stop.wait(1.0):
        pass
    logger.info("kvstore shutting down")
    service.stop(grace=2.0)
    logger.info("kvstore stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
