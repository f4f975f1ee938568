"""Logging set-up shared by the service entry points."""

from __future__ import annotations

import logging
import os
import re


def setup(service: str) -> None:
    """Configure the root logger once: level from KVMEM_LOG_LEVEL (default INFO)."""
    level = os.environ.get("KVMEM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )


_URL_PASSWORD = re.compile(r"(://[^:/@]*:)[^@/]*@")


def redact_url(url: str) -> str:
    """A URL with its password replaced by *** (redis://:secret@host -> redis://:***@host), for logs."""
    return _URL_PASSWORD.sub(r"\1***@", url)
