"""The page-hash chain, the one definition every service imports.

A page's identity is `hash(parent_hash, token_ids, model_id, kv_format)`. The chain starts from a
root derived from the namespace (tenant), so two namespaces never share a page unless they share
the namespace string. Only full pages get a hash: the partial tail page is never shared.
`kv_format` is the engine's canonical per-layer format spec (EngineConfig.kv_format_name, e.g. `bf16`,
`fp8+h`, `fp8,global=bf16`): an engine never adopts pages stored in another format.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16


def root_hash(namespace: str) -> bytes:
    """The parent of a chain's first page, for one prefix-sharing namespace."""
    return hashlib.blake2b(b"kvmem-root\x00" + namespace.encode(), digest_size=HASH_BYTES).digest()


def page_hash(parent_hash: bytes, token_ids: Sequence[int], model_id: str, kv_format: str) -> bytes:
    """Identity of one page given its predecessor's hash."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent_hash)
    h.update(model_id.encode() + b"\x00" + kv_format.encode() + b"\x00")
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int], page_size: int, model_id: str, kv_format: str, namespace: str = ""
) -> list[bytes]:
    """Hashes of every full page of `token_ids`, in order (the tail page is excluded)."""
    parent = root_hash(namespace)
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_hash(parent, token_ids[start : start + page_size], model_id, kv_format)
        hashes.append(parent)
    return hashes
