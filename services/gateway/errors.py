"""GatewayError and the one place that maps gRPC status codes and engine error codes to HTTP errors."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from services.common.limits import cut_details
from services.common.protos import engine_pb2

logger = logging.getLogger(__name__)

GENERIC_500 = "The server had an error while processing your request."
UNAVAILABLE_503 = "The model backend is unavailable or timed out; try again."


class GatewayError(Exception):
    """An error with its HTTP status and OpenAI error fields; what the client sees."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.code = code
        self.request_id: str | None = None  # set where the request is known (edge.py, the routes)

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: {"error": {message, type, param, code}}, plus the request id when known
        (the same id as the x-request-id header and the server's log lines)."""
        error: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.request_id:
            error["request_id"] = self.request_id
        return {"error": error}

    @property
    def retryable(self) -> bool:
        """Whether trying the same request again may succeed (what Retry-After says)."""
        return self.status in (429, 503)

    def headers(self) -> dict[str, str]:
        """Extra response headers (retry hint on overload/unavailable, auth scheme on 401)."""
        if self.retryable:
            return {"Retry-After": "1"}
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        return {}

    def __repr__(self) -> str:
        return f"GatewayError({self.status}, {self.type!r}, {self.message!r}, {self.param!r}, {self.code!r})"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    """A 400 invalid_request_error."""
    return GatewayError(400, "invalid_request_error", message, param, code)


def internal_error() -> GatewayError:
    """A 500 with the generic message (the cause is logged, never sent)."""
    return GatewayError(500, "server_error", GENERIC_500)


# gRPC status -> (http status, type, code, default message)
_GRPC_TABLE: dict[grpc.StatusCode, tuple[int, str, str | None, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None, "Invalid request."),
    grpc.StatusCode.OUT_OF_RANGE: (
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "The prompt plus max_tokens exceeds the model's context length.",
    ),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (
        429,
        "rate_limit_error",
        "overloaded",
        "The server is overloaded; try again.",
    ),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "unavailable", UNAVAILABLE_503),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "service_unavailable", "timeout", UNAVAILABLE_503),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key", "Unauthenticated."),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found", "Not found."),
}
_INTERNAL = (500, "server_error", None, GENERIC_500)

# engine ErrorCode (stream error events) -> the gRPC status with the same meaning
_ENGINE_TO_GRPC: dict[int, grpc.StatusCode] = {
    engine_pb2.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    engine_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: grpc.StatusCode.OUT_OF_RANGE,
    engine_pb2.ERROR_CODE_OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    engine_pb2.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
    engine_pb2.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


# gRPC's own text when a message is over a channel's limit (RESOURCE_EXHAUSTED, but no overload: never a 429)
_MESSAGE_TOO_LARGE = ("Received message larger than max", "Sent message larger than max")


def map_grpc_error(code: grpc.StatusCode | None, details: str | None) -> GatewayError:
    """The one mapping of a gRPC status (or an engine stream error) to the client's HTTP error.

    4xx errors carry the status details (the guard/engine wrote them for the client); 5xx errors
    carry a generic message and the details go to the log only. A message over a gRPC size limit is a
    413 naming the limit, never a retryable 429.
    """
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and (details or "").startswith(_MESSAGE_TOO_LARGE):
        logger.warning("internal message over a gRPC size limit: %s", details)
        return GatewayError(
            413,
            "invalid_request_error",
            "The request is larger than an internal message may be (the gRPC message size limit).",
            None,
            "request_too_large",
        )
    details = cut_details(details) if details else details
    status, type_, err_code, default = _GRPC_TABLE.get(code, _INTERNAL) if code else _INTERNAL
    if status >= 500:
        logger.warning("cache guard error %s: %s", code.name if code else None, details)
        return GatewayError(status, type_, default, None, err_code)
    return GatewayError(status, type_, details or default, None, err_code)


def map_stream_error(error: engine_pb2.GenerateError) -> GatewayError:
    """Map an `error` event of the Generate stream through the same table as gRPC statuses."""
    return map_grpc_error(_ENGINE_TO_GRPC.get(error.code, grpc.StatusCode.INTERNAL), error.message)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """OpenAI-style parameter path of a pydantic error location: ('messages', 0, 'content') ->
    'messages[0].content'. Drops FastAPI's leading 'body' and pydantic's union member tags."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    param = ""
    for item in parts:
        if isinstance(item, int):
            param += f"[{item}]"
        elif item.lower() in _UNION_TAGS or "[" in item or "-" in item:
            continue
        else:
            param += f".{item}" if param else item
    return param or None


def map_validation_errors(errors: Sequence[Mapping[str, Any]]) -> GatewayError:
    """A 400 invalid_request_error from pydantic/FastAPI validation errors, naming the field."""
    if not errors:
        return invalid_request("Invalid request body.")
    if any(e.get("type") == "json_invalid" for e in errors):
        return invalid_request("We could not parse the JSON body of your request: it is not valid JSON.")
    err = max(errors, key=lambda e: len(e.get("loc", ())))  # the most specific (union branches)
    param = _param_of(tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        return invalid_request("The request body must be a JSON object.")
    if err.get("type") == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param)
    return invalid_request(f"Invalid value for '{param}': {msg}", param)
