"""Haystacks of real text with different statistics, made without downloads and seeded.

Kinds: `prose` (docstrings of the Python standard library, one half of its modules per split), `code`
(standard-library source files), `logs` (service log lines from a seeded grammar) and `tables` (CSV rows
from a seeded grammar). Each kind yields paragraphs; `build` takes paragraphs in a seeded order until the
token target is met. The standard library of the running interpreter is the source, so the text depends
on the Python version (run.py records it); within one version everything is deterministic.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
import re
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

KINDS = ("prose", "code", "logs", "tables")
_SKIP = ("test", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages", "__pycache__", "pydoc_data")


@functools.cache
def _stdlib_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if not any(s in p.relative_to(root).parts[0] for s in _SKIP)]
    files = [f for f in files if 2_000 < f.stat().st_size < 200_000 and "tests" not in f.parts]
    return tuple(f for f in files if hashlib.sha256(f.name.encode()).digest()[1] < 80)  # a third: parsed fast


def module_half(path: Path) -> int:
    """0 or 1: which split a standard-library module's text belongs to (a stable hash of its name)."""
    return hashlib.sha256(path.name.encode()).digest()[0] & 1


@functools.cache
def _docstrings(half: int) -> tuple[str, ...]:
    """Docstring paragraphs (>= 200 characters) of the modules in one half."""
    out: list[str] = []
    for path in _stdlib_files():
        if module_half(path) != half:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    for para in doc.split("\n\n"):
                        para = " ".join(para.split())
                        if len(para) >= 200 and ">>>" not in para:
                            out.append(para)
    return tuple(out)


@functools.cache
def _code_blocks(half: int) -> tuple[str, ...]:
    """Top-level function and class sources of the modules in one half (no docstring-only text)."""
    out: list[str] = []
    for path in _stdlib_files():
        if module_half(path) != half:
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                seg = ast.get_source_segment(src, node)
                if seg and 200 <= len(seg) <= 4000:
                    out.append(seg)
    return tuple(out)


_SERVICES = ["auth", "billing", "search", "ingest", "scheduler", "mailer", "cache", "gateway", "indexer", "export"]
_LEVELS = ["INFO"] * 6 + ["DEBUG"] * 3 + ["WARN"] * 2 + ["ERROR"]
_EVENTS = [
    "request completed in {ms} ms status={code}", "connection pool size {n} (idle {m})",
    "retrying upstream call attempt={a} backoff={ms}ms", "flushed {n} records to segment {seg}",
    "cache miss for key user:{n}:profile", "job {job} moved from queued to running",
    "tls handshake with 10.{a}.{m}.{n} took {ms} ms", "rotated log file, {n} bytes archived",
    "rate limiter dropped {m} requests from tenant t{n}", "gc pause {ms} ms heap {n} MiB",
]  # fmt: skip


def _log_paragraphs(rng: random.Random, count: int) -> list[str]:
    out = []
    t = rng.randrange(1_600_000_000, 1_700_000_000)
    for _ in range(count):
        lines = []
        for _ in range(rng.randrange(4, 9)):
            t += rng.randrange(1, 900)
            ev = rng.choice(_EVENTS).format(
                ms=rng.randrange(1, 3000), code=rng.choice([200, 200, 201, 204, 404, 500]), n=rng.randrange(1, 999),
                m=rng.randrange(0, 64), a=rng.randrange(1, 6), seg=rng.randrange(100, 999), job=rng.randrange(1, 9999),
            )  # fmt: skip
            lines.append(f"{t} {rng.choice(_LEVELS):5} [{rng.choice(_SERVICES)}] {ev}")
        out.append("\n".join(lines))
    return out


_CITIES = ["Lisbon", "Osaka", "Quito", "Tallinn", "Accra", "Perth", "Bergen", "Leon", "Hanoi", "Cusco", "Graz", "Tunis"]
_ITEMS = ["valve", "bearing", "gasket", "sensor", "relay", "pump", "filter", "hinge", "spring", "nozzle", "clamp"]


def _table_paragraphs(rng: random.Random, count: int) -> list[str]:
    out = []
    for _ in range(count):
        rows = ["order_id,city,item,qty,unit_price,status"]
        for _ in range(rng.randrange(5, 10)):
            rows.append(
                f"{rng.randrange(10000, 99999)},{rng.choice(_CITIES)},{rng.choice(_ITEMS)},{rng.randrange(1, 500)},"
                f"{rng.randrange(1, 9999) / 100:.2f},{rng.choice(['open', 'shipped', 'held', 'returned'])}"
            )
        out.append("\n".join(rows))
    return out


def paragraphs(kind: str, half: int, rng: random.Random, count: int) -> list[str]:
    """`count` paragraphs of `kind` in a seeded order (`half`: which half of the standard library)."""
    if kind == "prose":
        pool = _docstrings(half)
    elif kind == "code":
        pool = _code_blocks(half)
    elif kind == "logs":
        return _log_paragraphs(rng, count)
    elif kind == "tables":
        return _table_paragraphs(rng, count)
    else:
        raise ValueError(f"unknown haystack kind {kind!r}; one of {KINDS}")
    start = rng.randrange(len(pool))
    return [pool[(start + i) % len(pool)] for i in range(count)]  # consecutive: text that reads on


@functools.cache
def _sentence_set(half: int) -> frozenset[str]:
    return frozenset(s for p in _docstrings(half) for s in re.split(r"(?<=[.!?])\s+", p) if 40 <= len(s) <= 200)


@functools.cache
def _sentences(half: int) -> tuple[str, ...]:
    """One half's sentences, none of which the other half has too (shared boilerplate)."""
    return tuple(sorted(_sentence_set(half) - _sentence_set(1 - half)))


def sentences(half: int, rng: random.Random, most: int = 200) -> Iterator[str]:
    """Up to `most` sentences (40-200 characters) of one half's docstrings in a seeded order, each once: a passage
    of them reads as prose but is in no module's order (bench/longeval's `recite` copies one)."""
    pool = _sentences(half)
    yield from (pool[i] for i in rng.sample(range(len(pool)), min(most, len(pool))))


def build(kind: str, half: int, rng: random.Random, target_tokens: int, count: Callable[[str], int]) -> list[str]:
    """Paragraphs whose joined text (blank-line separated) holds about `target_tokens` tokens (`count`):
    a paragraph that would overshoot is skipped while the text is short of 97% of the target."""
    out: list[str] = []
    total = 0
    for _ in range(64):
        for para in paragraphs(kind, half, rng, 16):
            n = count(para) + 2
            if total + n <= target_tokens:
                out.append(para)
                total += n
            if total >= 0.97 * target_tokens:
                return out
    return out
