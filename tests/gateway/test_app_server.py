"""The gateway under a real uvicorn server against the fake CacheGuard: the OpenAI SDK, curl, disconnects, main."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.fake_guard import ANSWER, MODEL_ID, FakeGuard, FakeGuardServer, chat_body

# ---------------------------------------------------------------- real server: SDK, disconnects


def test_openai_sdk(server_url: str, fake: FakeGuard) -> None:
    sdk = openai.OpenAI(base_url=f"{server_url}/v1", api_key="sk-alice", max_retries=0)
    assert [m.id for m in sdk.models.list()] == [MODEL_ID]

    chat = sdk.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        temperature=0.2,
        max_completion_tokens=16,
        extra_headers={"X-Session-Id": "sdk-session"},
    )
    assert chat.choices[0].message.content == ANSWER
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 8
    assert chat.model_extra is not None and chat.model_extra["kvmem"]["prefix"]["session_id"] == "sdk-session"

    stream = sdk.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 16

    completion = sdk.completions.create(model=MODEL_ID, prompt="Once", max_tokens=4)
    assert completion.choices[0].text == ANSWER

    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], n=17)
    assert bad.value.code is None and bad.value.param == "n"
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "status:OUT_OF_RANGE"}])
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.APIError, match="server had an error"):
        list(
            sdk.chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": "midstream-error"}], stream=True
            )
        )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server_url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert [r.tenant for r in fake.requests] == ["alice"] * 5
    assert [m.role for m in fake.requests[0].chat.messages] == ["system", "user"]
    assert fake.requests[0].sampling.max_tokens == 16


def test_curl_style_request(server_url: str) -> None:
    """A plain HTTP client, as curl would send it (raw JSON bytes, bearer header)."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
    headers = {"Authorization": "Bearer sk-alice", "Content-Type": "application/json"}
    with httpx.Client(base_url=server_url) as http:
        r = http.post("/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 200
    assert r.text.endswith("data: [DONE]\n\n")


def test_stream_disconnect_cancels_guard_call(
    server_url: str, fake: FakeGuard, caplog: pytest.LogCaptureFixture
) -> None:
    """The guard call of a stream the client leaves is cancelled; a call that ended (its done event read)
    is closed without logging a cancellation (every request logged one)."""
    headers = {"Authorization": "Bearer sk-alice"}
    with caplog.at_level(logging.INFO), httpx.Client(base_url=server_url, headers=headers) as http:
        assert http.post("/v1/chat/completions", json=chat_body("hi")).status_code == 200
        assert "guard call cancelled" not in caplog.text
        with http.stream("POST", "/v1/chat/completions", json=chat_body("hang", stream=True)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk: generation has started
    assert fake.cancelled.wait(5), "the gateway did not cancel the guard call"


def test_non_stream_disconnect_cancels_guard_call(
    server_url: str, fake: FakeGuard, caplog: pytest.LogCaptureFixture
) -> None:
    """The guard call is cancelled, and the handler returns quietly (it raised InvalidStateError, logged as
    an unhandled error, reading the result of a task whose cancellation had not run yet)."""
    headers = {"Authorization": "Bearer sk-alice"}
    with caplog.at_level(logging.INFO):
        with httpx.Client(base_url=server_url, headers=headers, timeout=0.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json=chat_body("hang"))
        assert fake.cancelled.wait(5), "the gateway did not cancel the guard call"
        deadline = time.monotonic() + 5
        while "client disconnected" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the handler's return, after the cancellation
    assert "client disconnected; request cancelled" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_main_serves_until_sigterm(fake_guard_server: FakeGuardServer) -> None:
    """`python -m services.gateway` logs ready with its URL, answers, and exits 0 on SIGTERM."""
    repo_root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "services.gateway", "--port", "0", "--cacheguard-addr", fake_guard_server.addr]
    proc = subprocess.Popen(cmd, cwd=repo_root, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = None
        deadline = time.monotonic() + 30
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "the gateway exited before it was ready"
            if "ready on " in line:
                url = line.split("ready on ")[1].split()[0]
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_main_refuses_bad_config() -> None:
    repo_root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "services.gateway", "--cacheguard-addr", "no-port"]
    result = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "cacheguard_addr must be host:port" in result.stderr
