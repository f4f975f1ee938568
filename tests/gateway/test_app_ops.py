"""The gateway app against the fake CacheGuard (fake_guard.py): models, health, metrics, API keys, guard reports."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.config import ApiKey, ConfigError, GatewayConfig, key_tenant, parse_api_keys
from tests.gateway.fake_guard import MODEL_ID, FakeGuard, chat_body, client_for

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------- models, health, metrics


async def test_models(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert r.json() == {
        "object": "list",
        "data": [
            {
                "id": MODEL_ID,
                "object": "model",
                "created": 0,
                "owned_by": "kvmem",
                "kvmem": {
                    "architecture": "llama",
                    "max_context": 32768,
                    "kv_capacity": 4096,
                    "page_size": 64,
                    "kv_format": "bf16",
                },
            }
        ],
    }
    assert (await client.get(f"/v1/models/{MODEL_ID}")).json()["id"] == MODEL_ID
    r = await client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_health_up(client: httpx.AsyncClient) -> None:
    r = await client.get("/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


async def test_health_down_and_requests_503(free_tcp_port: int) -> None:
    config = GatewayConfig(cacheguard_addr=f"127.0.0.1:{free_tcp_port}", health_timeout_s=1)
    async for client in client_for(config):
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = await client.post("/v1/chat/completions", json=chat_body("hi"))
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert r.headers["retry-after"] == "1"
        assert (await client.get("/v1/models")).status_code == 503


async def test_metrics_text(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json=chat_body("hi"))
    await client.post("/v1/chat/completions", json=chat_body("hi", stream=True))
    await client.post("/v1/chat/completions", json=chat_body("hi", n=17))
    await client.post("/v1/chat/completions", json=chat_body("midstream-error", stream=True))
    text = (await client.get("/metrics")).text
    lines = set(text.splitlines())
    assert 'kvmem_gateway_requests_total{route="/v1/chat/completions",status="200"} 3.0' in lines
    assert 'kvmem_gateway_requests_total{route="/v1/chat/completions",status="400"} 1.0' in lines
    assert "kvmem_gateway_prompt_tokens_total 24.0" in lines
    assert "kvmem_gateway_completion_tokens_total 8.0" in lines
    assert "kvmem_gateway_cached_tokens_total 16.0" in lines
    assert 'kvmem_gateway_time_to_first_token_seconds_count{route="/v1/chat/completions"} 3.0' in lines
    assert 'kvmem_gateway_request_latency_seconds_count{route="/v1/chat/completions"} 4.0' in lines
    assert 'kvmem_gateway_stream_errors_total{route="/v1/chat/completions",type="server_error"} 1.0' in lines
    assert 'kvmem_gateway_requests_in_flight{route="/metrics"} 1.0' in lines
    assert 'kvmem_gateway_requests_in_flight{route="/v1/chat/completions"} 0.0' in lines


# ---------------------------------------------------------------- API keys


async def test_auth_required_on_v1(auth_client: httpx.AsyncClient, fake: FakeGuard) -> None:
    r = await auth_client.post("/v1/chat/completions", json=chat_body("hi"))
    assert r.status_code == 401
    assert r.json()["error"] == {
        "message": "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
        "request_id": r.headers["x-request-id"],
    }
    assert r.headers["x-request-id"].startswith("req_")
    r = await auth_client.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "Incorrect API key provided."
    assert fake.requests == []
    assert (await auth_client.get("/health")).status_code == 200
    assert (await auth_client.get("/metrics")).status_code == 200


async def test_auth_key_names_tenant(auth_client: httpx.AsyncClient, fake: FakeGuard) -> None:
    r = await auth_client.post(
        "/v1/chat/completions", json=chat_body("hi"), headers={"Authorization": "Bearer sk-alice"}
    )
    assert r.status_code == 200
    r = await auth_client.post(
        "/v1/completions", json={"model": "m", "prompt": "x"}, headers={"Authorization": "bearer sk-anon"}
    )
    assert r.status_code == 200
    assert [req.tenant for req in fake.requests] == ["alice", key_tenant("sk-anon")]


def test_parse_api_keys() -> None:
    keys = parse_api_keys(" alice:sk-1 , sk-2,, bob:sk:3 ")
    assert keys == (
        ApiKey("alice", "sk-1"),
        ApiKey(key_tenant("sk-2"), "sk-2"),
        ApiKey("bob", "sk:3"),
    )
    assert key_tenant("sk-2").startswith("key-") and len(key_tenant("sk-2")) == 16
    assert "sk-1" not in repr(keys)
    with pytest.raises(ConfigError, match="listed twice"):
        parse_api_keys("a:k,b:k")
    with pytest.raises(ConfigError, match="non-empty"):
        parse_api_keys("a:")
    assert parse_api_keys("") == ()


def test_config_from_args_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_GATEWAY_PORT", "8123")
    monkeypatch.setenv("KVMEM_API_KEYS", "team:sk-t")
    monkeypatch.setenv("KVMEM_CACHEGUARD_ADDR", "10.0.0.2:6000")
    config = GatewayConfig.from_args(["--host", "0.0.0.0"])
    assert (config.host, config.port, config.cacheguard_addr) == ("0.0.0.0", 8123, "10.0.0.2:6000")
    assert config.api_keys == (ApiKey("team", "sk-t"),) and config.auth_enabled
    assert GatewayConfig.from_args(["--port", "9000"]).port == 9000
    monkeypatch.setenv("KVMEM_GATEWAY_PORT", "eighty")
    with pytest.raises(ConfigError, match="eighty"):
        GatewayConfig.from_args([])
    with pytest.raises(ConfigError, match="'nohost'"):
        GatewayConfig(cacheguard_addr="nohost")
    with pytest.raises(ConfigError, match="request_timeout_s must be > 0, got 0"):
        GatewayConfig(request_timeout_s=0)


# ---------------------------------------------------------------- cache guard reports


async def test_metrics_count_prefix_reports_normalisations_and_routing(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json=chat_body("hi"))
    await client.post("/v1/chat/completions", json=chat_body("hi", stream=True))
    await client.post("/v1/chat/completions", json=chat_body("midstream-error", stream=True))  # no done: not counted
    lines = set((await client.get("/metrics")).text.splitlines())
    assert 'kvmem_guard_prefix_requests_total{outcome="diverged"} 2.0' in lines
    assert 'kvmem_guard_prefix_divergences_total{field="content"} 2.0' in lines
    assert "kvmem_guard_prefix_lost_tokens_total 8.0" in lines  # (64 previous - 60 common) x 2
    assert 'kvmem_guard_normalizations_total{name="tool_order"} 2.0' in lines
    assert 'kvmem_guard_routing_total{decision="affinity"} 2.0' in lines


async def test_normalize_header_turns_the_guard_normalisations_off(client: httpx.AsyncClient, fake: FakeGuard) -> None:
    await client.post("/v1/chat/completions", json=chat_body("hi"))
    await client.post("/v1/chat/completions", json=chat_body("hi"), headers={"X-KVMem-Normalize": "off"})
    await client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"X-KVMem-Normalize": "OFF"})
    await client.post("/v1/chat/completions", json=chat_body("hi"), headers={"X-KVMem-Normalize": "on"})
    assert [r.normalizations_off for r in fake.requests] == [False, True, True, False]
    r = await client.post("/v1/chat/completions", json=chat_body("hi"), headers={"X-KVMem-Normalize": "maybe"})
    assert r.status_code == 400 and "X-KVMem-Normalize is 'maybe'" in r.json()["error"]["message"]
    assert len(fake.requests) == 4  # refused before the guard
