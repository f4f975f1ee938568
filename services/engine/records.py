"""The engine's plain records and typed errors: its limits (one per engine, from EngineConfig), its counters, the
ring snapshot GetStats reports, and what submit raises (the server maps each to a gRPC status)."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.ring.state import RingLimits


class ContextLengthError(ValueError):
    """prompt + max_tokens does not fit the context limit; the message has the numbers."""


class OverloadedError(RuntimeError):
    """The request queue is full."""


class EngineStoppedError(RuntimeError):
    """The engine's loop has ended (stopping, or died on an error it could not contain): no step will run."""


@dataclass(frozen=True)
class EngineLimits:
    max_context: int
    page_size: int
    prefill_chunk: int
    max_running: int
    max_waiting: int
    vocab_size: int
    model_id: str
    kv_format: str
    default_policy: str = "sparse"
    ring: RingLimits | None = None  # None: every sequence keeps its whole KV resident
    ring_chunk: int = 0
    decode_burst: int = 1  # greedy decode steps one step may run on the device (scheduler.py: decode bursts)
    decode_overlap: bool = True  # launch the next burst before reading the last one's tokens (module docstring)
    split_bursts: bool = False  # split steps around host-sampled requests (scheduler.py)


@dataclass(frozen=True)
class RingSnapshot:
    """Resident pages of running ring sequences by bucket, taken by the engine thread after each step."""

    protect: int = 0
    skeleton: int = 0
    evidence: int = 0
    recent: int = 0
    free: int = 0
    host_only: int = 0  # computed pages of running sequences that live only on the host


@dataclass
class EngineStats:
    requests_total: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    cached_tokens_total: int = 0
    steps_total: int = 0
    step_failures_total: int = 0
    overlapped_steps_total: int = 0  # steps (a burst counts once) launched before the one before was read
