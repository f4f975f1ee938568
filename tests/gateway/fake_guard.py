"""A FAKE CacheGuard for the gateway tests: an in-process grpc.aio server with scripted streams.

The fake is the gateway's unit-test double; the real stack is tested end to end elsewhere.
What the fake does is chosen by the request text (last chat message or prompt):
  "status:<CODE>"    abort the RPC with that gRPC status before any event
  "error-first:<n>"  send a stream error event with engine ErrorCode n before any token
  "midstream-error"  two chunks, then an INTERNAL error event
  "no-done"          one chunk, then end the stream without done
  "hang"             one chunk, then wait (records whether the call was cancelled)
  "length"           the default answer with finish_reason length
  anything else      chunks "Hello", ", ", "world", "!" and done (usage 12/4/8 cached)

Also the helpers the gateway app tests share: a gateway client on the ASGI app, request bodies,
SSE parsing and a real uvicorn server in a thread. The fixtures are in conftest.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import httpx
import uvicorn
from fastapi import FastAPI

from services.common.protos import cacheguard_pb2, cacheguard_pb2_grpc, engine_pb2
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.guard_client import GuardClient

PIECES = ["Hello", ", ", "world", "!"]
ANSWER = "".join(PIECES)
MODEL_ID = "m"  # the served id: requests name it (another name is a 404 model_not_found)


def _chunk(text: str, token_id: int) -> cacheguard_pb2.GuardGenerateEvent:
    return cacheguard_pb2.GuardGenerateEvent(chunk=engine_pb2.TokenChunk(token_ids=[token_id], text=text))


def _done(req: cacheguard_pb2.GuardGenerateRequest, reason: int) -> cacheguard_pb2.GuardGenerateEvent:
    engine_done = engine_pb2.GenerateDone(
        finish_reason=reason,
        usage=engine_pb2.Usage(prompt_tokens=12, completion_tokens=4, cached_tokens=8),
        matched_stop="",
    )
    prefix = cacheguard_pb2.PrefixReport(
        session_id=req.session_id or "derived-session",
        previous_tokens=64,
        common_prefix_tokens=60,
        diverged=True,
        divergence_message_index=2,
        divergence_reason="message 2 changed",
        divergence_field="content",
        normalizations=["tool_order"],
    )
    done = cacheguard_pb2.GuardDone(
        engine_done=engine_done, prefix=prefix, engine_replica="engine-0", routing="affinity"
    )
    return cacheguard_pb2.GuardGenerateEvent(done=done)


def _error(code: int, message: str) -> cacheguard_pb2.GuardGenerateEvent:
    return cacheguard_pb2.GuardGenerateEvent(error=engine_pb2.GenerateError(code=code, message=message))


def _script(req: cacheguard_pb2.GuardGenerateRequest) -> str:
    if req.WhichOneof("input") == "chat":
        return req.chat.messages[-1].content
    return req.prompt_text


class FakeGuard(cacheguard_pb2_grpc.CacheGuardServicer):
    """Scripted CacheGuard; records the requests it got and whether a call was cancelled."""

    def __init__(self) -> None:
        self.requests: list[cacheguard_pb2.GuardGenerateRequest] = []
        self.cancelled = threading.Event()

    async def Generate(
        self, request: cacheguard_pb2.GuardGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cacheguard_pb2.GuardGenerateEvent]:
        self.requests.append(request)
        script = _script(request)
        if script.startswith("status:"):
            code = getattr(grpc.StatusCode, script.removeprefix("status:"))
            await context.abort(code, f"scripted {code.name} detail")
        if script.startswith("error-first:"):
            yield _error(int(script.removeprefix("error-first:")), "scripted stream error")
            return
        if script == "midstream-error":
            yield _chunk("Hel", 1)
            yield _chunk("lo", 2)
            yield _error(engine_pb2.ERROR_CODE_INTERNAL, "secret engine detail")
            return
        if script == "no-done":
            yield _chunk("x", 1)
            return
        if script == "hang":
            yield _chunk("a", 1)
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        for i, piece in enumerate(PIECES):
            yield _chunk(piece, 100 + i)
        reason = engine_pb2.FINISH_REASON_LENGTH if script == "length" else engine_pb2.FINISH_REASON_STOP
        yield _done(request, reason)

    async def CountTokens(
        self, request: cacheguard_pb2.CountTokensRequest, context: grpc.aio.ServicerContext
    ) -> cacheguard_pb2.CountTokensResponse:
        return cacheguard_pb2.CountTokensResponse(num_tokens=len(request.prompt_text.split()))

    async def GetModelInfo(
        self, request: engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetModelInfoResponse:
        return engine_pb2.GetModelInfoResponse(
            model_id=MODEL_ID,
            architecture="llama",
            max_context=32768,
            kv_capacity=4096,
            page_size=64,
            kv_format="bf16",
        )


class FakeGuardServer:
    """A fake cache guard (FakeGuard unless another servicer is given) on a free loopback port, served by
    its own event loop in a daemon thread."""

    def __init__(self, servicer: cacheguard_pb2_grpc.CacheGuardServicer | None = None) -> None:
        self.servicer = servicer if servicer is not None else FakeGuard()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.addr = f"127.0.0.1:{port}"

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        cacheguard_pb2_grpc.add_CacheGuardServicer_to_server(self.servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def client_for(config: GatewayConfig, **transport: Any) -> AsyncIterator[httpx.AsyncClient]:
    guard = GuardClient(config.cacheguard_addr, model_info_ttl_s=config.model_info_ttl_s)
    app = create_app(config, guard)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, **transport), base_url="http://gateway"
        ) as client:
            yield client
    finally:
        await guard.close()


KEYS = "alice:sk-alice,sk-anon"


def chat_body(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **fields}


def sse_payloads(text: str) -> list[Any]:
    """The data of each SSE event; the final [DONE] as the string itself."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """Run `app` under uvicorn (with lifespan) on a free port in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
