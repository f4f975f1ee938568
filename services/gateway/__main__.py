"""`python -m services.gateway`: serve the OpenAI-compatible API until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvicorn

from services.common import auth, logs
from services.gateway.app import create_app
from services.gateway.config import ConfigError, GatewayConfig

logger = logging.getLogger("services.gateway")


async def _serve(server: uvicorn.Server, config: GatewayConfig) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else config.port
        url = f"http://{config.host}:{port}"
        logger.info(
            "ready on %s (cacheguard %s, auth %s)",
            url,
            config.cacheguard_addr,
            f"on, {len(config.api_keys)} keys" if config.auth_enabled else "off",
        )
    await task


def main(argv: list[str] | None = None) -> int:
    logs.setup("gateway")
    try:
        config = GatewayConfig.from_args(argv)
    except ConfigError as exc:
        logger.error("bad configuration: %s", exc)
        return 2
    auth.configure(config.internal_secret)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            log_config=None,  # keep services.common.logs formatting
            access_log=False,
            timeout_graceful_shutdown=10,
        )
    )
    # uvicorn re-raises the signal that stopped it; a no-op handler turns that into a clean exit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    asyncio.run(_serve(server, config))
    if not server.started:
        logger.error("could not listen on %s:%d", config.host, config.port)
        return 1
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
