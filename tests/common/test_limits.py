"""Shared limits and log redaction."""

from __future__ import annotations

from services.common.limits import MAX_STATUS_DETAILS_CHARS, cut_details
from services.common.logs import redact_url


def test_details_are_cut_to_the_limit() -> None:
    assert cut_details("short") == "short"
    cut = cut_details("x" * 5000)
    assert len(cut) == MAX_STATUS_DETAILS_CHARS and cut.endswith("...")


def test_redis_password_is_redacted() -> None:
    assert redact_url("redis://:pw@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("redis://user:pw@redis:6379/0") == "redis://user:***@redis:6379/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
