"""`python -m services.cacheguard`: load the tokenizer, serve CacheGuard until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from services.cacheguard.config import CacheGuardConfig, ConfigError
from services.cacheguard.renderer import RenderError
from services.cacheguard.server import GuardServer
from services.common import auth, logs
from services.common.model_files import ModelNotFoundError, resolve_model_path
from services.common.tokenizer import TokenizerError, load_tokenizer

logger = logging.getLogger(__name__)


async def serve(config: CacheGuardConfig) -> None:
    """Run the server until SIGINT or SIGTERM, then stop it cleanly."""
    path = resolve_model_path(config.model)
    logger.info("loading tokenizer of %s", path)
    tokenizer = await asyncio.to_thread(load_tokenizer, path)
    server = GuardServer(config, tokenizer)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    support = server.core.renderer.support
    logger.info(
        "normalizations: %s; template renders tools %s, reasoning %s%s; affinity in %s",
        ",".join(config.normalizations) or "none", support.tools, support.reasoning,
        f" ({config.chat_template})" if config.chat_template else "",
        "redis" if config.redis_url else "this process only (no KVMEM_REDIS_URL)",
    )  # fmt: skip
    logger.info("cacheguard ready on %s (engines %s)", server.addr, ",".join(config.engine_addrs))
    await stop.wait()
    logger.info("cacheguard shutting down")
    await server.stop(grace_s=5.0)
    logger.info("cacheguard stopped")


def main(argv: list[str] | None = None) -> int:
    logs.setup("cacheguard")
    try:
        config = CacheGuardConfig.from_args(argv)
    except ConfigError as exc:
        logger.error("bad configuration: %s", exc)
        return 2
    auth.configure(config.internal_secret)
    try:
        asyncio.run(serve(config))
    except (ModelNotFoundError, OSError, RenderError, TokenizerError) as exc:
        logger.error("cannot start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
