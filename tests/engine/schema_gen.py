"""Random JSON schemas for the constrained-decoding checks: nested objects, arrays, enums, numbers,
required and optional fields. `random_schema(i)` is the same schema for the same i on every machine."""

from __future__ import annotations

import random
from typing import Any

_WORDS = ("id", "name", "size", "kind", "items", "owner", "score", "tags", "meta", "level", "city", "note")


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(("string", "integer", "number", "boolean", "enum", "bounded", "short"))
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "cyan", "on", "off"], rng.randint(1, 4))}
    if kind == "bounded":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "short":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    return {"type": kind}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth >= 3 or roll < 0.45:
        return _leaf(rng)
    if roll < 0.7:
        return {"type": "array", "items": _node(rng, depth + 1), "maxItems": rng.randint(1, 4)}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = rng.sample(_WORDS, rng.randint(1, 4))
    props = {k: _node(rng, depth) for k in keys}
    required = [k for k in keys if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_schema(i: int) -> dict[str, Any]:
    """The i-th schema: an object at the top (what response_format json_schema and tool parameters take)."""
    return _object(random.Random(f"kvmem-schema-{i}"), 0)
