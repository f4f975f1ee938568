"""The limits every service agrees on: gRPC message sizes between the services, and request limits that more than
one service checks (MAX_STOP_STRINGS: the gateway's schema answers a 400 first, the engine's sampler refuses it too).

Long prompts travel as token lists or long chat histories, so internal channels lift gRPC's 4 MiB
default to GRPC_MAX_MESSAGE_BYTES, the same on both ends of every hop (gateway -> guard -> engine).
A message over it fails with RESOURCE_EXHAUSTED "... larger than max", which the gateway answers as a
413 naming the limit (errors.map_grpc_error), never as an overload. Status details are cut to
MAX_STATUS_DETAILS_CHARS before they are sent (gRPC bounds metadata, and a message may quote input).
"""

from __future__ import annotations

GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
]
MAX_STATUS_DETAILS_CHARS = 1024
MAX_STOP_STRINGS = 16  # stop strings one request may carry


def cut_details(details: str) -> str:
    """Status details at most MAX_STATUS_DETAILS_CHARS long."""
    if len(details) <= MAX_STATUS_DETAILS_CHARS:
        return details
    return details[: MAX_STATUS_DETAILS_CHARS - 3] + "..."
