"""PageCodec: byte-for-byte round trips for every format and size, a ratio on KV-like data, bad blobs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from services.kvstore.codec import CodecError, PageCodec, num_planes


def kv(dtype: torch.dtype, n: int = 8192) -> bytes:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, generator=g) * 3).to(dtype).view(torch.uint8).numpy().tobytes()


def round_trip(codec: PageCodec, raw: bytes, kv_format: str) -> tuple[bytes, int]:
    blob = codec.compress(memoryview(raw), kv_format)
    out = bytearray(len(raw))
    codec.decompress_into(memoryview(blob), memoryview(out))
    return bytes(out), len(blob)


@pytest.mark.parametrize(
    ("kv_format", "dtype", "planes", "min_ratio"),
    [("fp32", torch.float32, 4, 1.1), ("bf16", torch.bfloat16, 2, 1.3), ("fp16", torch.float16, 2, 1.1)],
)
def test_round_trip_and_ratio_on_kv_like_values(kv_format: str, dtype: torch.dtype, planes: int, min_ratio: float):
    raw = kv(dtype)
    assert num_planes(kv_format, len(raw)) == planes
    out, blob_nbytes = round_trip(PageCodec(), raw, kv_format)
    assert out == raw
    assert len(raw) / blob_nbytes > min_ratio


@pytest.mark.parametrize(("kv_format", "nbytes"), [("fp32", 4097), ("bf16", 1), ("int8", 300), ("q4", 4096)])
def test_odd_sizes_and_formats_are_not_shuffled_and_round_trip(kv_format: str, nbytes: int) -> None:
    raw = os.urandom(nbytes)
    assert num_planes(kv_format, nbytes) == 1
    assert round_trip(PageCodec(level=3), raw, kv_format)[0] == raw


def test_shuffling_beats_plain_zstd_on_floats() -> None:
    raw = kv(torch.bfloat16, 1 << 16)
    shuffled = len(PageCodec().compress(memoryview(raw), "bf16"))
    plain = len(PageCodec().compress(memoryview(raw), "not-a-float"))
    assert shuffled < plain * 0.95


def test_bad_blobs_are_refused() -> None:
    codec = PageCodec()
    raw = kv(torch.float32, 256)
    blob = codec.compress(memoryview(raw), "fp32")
    with pytest.raises(CodecError, match="shorter than"):
        codec.decompress_into(memoryview(b"KV"), memoryview(bytearray(len(raw))))
    with pytest.raises(CodecError, match="does not fit a 1020-byte page"):
        codec.decompress_into(memoryview(blob), memoryview(bytearray(1020)))
    bad = bytearray(blob)
    bad[:4] = b"XXXX"
    with pytest.raises(CodecError, match="XXXX"):
        codec.decompress_into(memoryview(bytes(bad)), memoryview(bytearray(len(raw))))
    out = np.zeros(len(raw), np.uint8)
    codec.decompress_into(memoryview(blob), memoryview(out))
    assert out.tobytes() == raw
