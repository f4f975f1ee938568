"""python -m services.engine: load the model, serve the Engine gRPC API until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from services.common import auth, logs
from services.common.tokenizer import TokenizerError
from services.engine.builder import build_engine
from services.engine.config import ConfigError, EngineConfig
from services.engine.server import serve

logger = logging.getLogger("services.engine")


def main(argv: list[str] | None = None) -> int:
    logs.setup("engine")
    try:
        config = EngineConfig.from_args(argv)
        auth.configure(config.internal_secret)  # the kvstore clients send it
        engine, info = build_engine(config)
    except (ConfigError, FileNotFoundError, TokenizerError) as exc:
        logger.error("refusing to start: %s", exc)
        return 2
    server = serve(engine, info, config.listen_addr, secret=config.internal_secret)
    logger.info(
        "engine ready on %s: model %s, context %d, pool %d tokens (%d pages of %d), %s %s",
        config.listen_addr,
        info.model_id,
        info.max_context,
        info.kv_capacity,
        config.num_slots,
        config.page_size,
        info.device,
        info.dtype,
    )
    stop = threading.Event()
    died = threading.Event()

    def loop_died() -> None:  # exit 1: the launcher restarts the engine
        died.set()
        stop.set()

    engine.on_loop_death = loop_died
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    logger.info("shutting down")
    server.stop(grace=5).wait()
    engine.stop()
    if engine.write_through is not None:
        engine.write_through.close()
    return 1 if died.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
