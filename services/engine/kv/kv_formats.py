"""KV page formats: how one row (one token's K or V of one KV head) is stored, and per-layer specs.

Every format is row-local: a row [D] is self-contained with its scales, so pool rows, pages (64 rows)
and the row-based KVPool API work the same for every format. Quantised rows are uint8 [row_bytes]:
scales first (4-byte aligned), then the payload, then padding to a multiple of 4 bytes.

- plain  fp32 / bf16 / fp16: the dtype itself (row_bytes = D * element size).
- fp8    e4m3 values + one fp32 scale per row (= per token and KV head). One scale per row keeps the
         row self-contained and costs 4 bytes per D values (D + 4 bytes: 1.06 B/value at D = 64);
         e4m3 has 3 mantissa bits everywhere in its range, so a shared row scale loses little on
         rows whose values differ by orders of magnitude (the +h rotation spreads outlier channels).
- int8   symmetric int8 values, one fp16 scale per group of 32 values along D (D + D/16 bytes; one
         group per row when D < 32).
- nvfp4  E2M1 values packed two per byte (even element in the low nibble), one E4M3 scale per
         group of 16 values, and an fp32 second-level scale per row that maps the row's largest
         group onto E4M3's range (NVFP4 keeps that one per tensor; per row keeps rows independent).
- +h     keys are rotated by the normalised Walsh-Hadamard matrix along D before quantisation and
         rotated back when gathered (H = H^T = H^-1), so attention and summaries see ordinary keys.

The encoders below are pure torch (the reference). The e4m3 conversion is done with integer
arithmetic on the fp32 bits (round-to-nearest-even for normal values, half-up for subnormals), and
rounding to integers is half-away-from-zero, so the Triton kernels (kernels/pages/kv_triton.py) compute
the same bytes on every device, with or without hardware fp8.

Per-layer spec (``--kv-format`` / KVMEM_KV_FORMAT): comma-separated parts, later parts override
earlier ones. A bare format is the default of every layer (at most one; ``auto`` when absent, the
compute dtype); ``SELECTOR=FORMAT`` sets some layers, where SELECTOR is ``global`` (layers without a
sliding window), ``local`` (sliding-window layers), a layer index ``N`` or a range ``N-M`` (0-based,
inclusive). Examples: ``fp8``, ``nvfp4+h``, ``fp8,global=bf16``, ``int8,0-1=bf16,29=bf16``.
The canonical spelling of a spec (KVSpec.name) is the page format label that enters the page hash.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

MAX_NAME_CHARS = 64  # the kvstore's limit on a page format label
FP8_MAX = 448.0  # largest finite e4m3 (fn) value
FP4_MAX = 6.0  # largest E2M1 value
INT8_GROUP = 32
NVFP4_GROUP = 16
# E2M1 magnitudes by code 0..7, and the decision thresholds between neighbours (ties round down)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
PLAIN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANTISED = ("fp8", "int8", "nvfp4")
# An fp8 row is its fp32 scale, 12 zero bytes, then D e4m3fn codes: the codes start on 16 bytes (D % 16 == 0), so
# the attention kernels read them in place with 16-byte loads. With the scale alone in front (4 + D bytes, until
# 2026-12-03) the loads were 4 bytes wide and the decode kernel read 1.09 TB/s against bf16's 3.71 (H200,
# bench/RESULTS.md). LAYOUT_VERSIONS tags page identities with it: pages written in the old layout never match.
FP8_HEAD_BYTES = 16
LAYOUT_VERSIONS = {"fp8": 2}


class KVFormatError(ValueError):
    """A KV format or per-layer spec that cannot be used; the message names the bad part."""


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def int8_group(head_dim: int) -> int:
    """Values per int8 scale: INT8_GROUP, or the whole row when head_dim is smaller."""
    return min(INT8_GROUP, head_dim)


# -- e4m3 by integer arithmetic (shared by fp8 values and nvfp4 block scales) --------------------------


def e4m3_encode(y: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 `y` (<= 448) -> e4m3fn bytes (int32 in 0..126), same shape."""
    y = y.float().clamp(0.0, FP8_MAX)
    bits = y.view(torch.int32)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)  # round the fp32 mantissa to 3 bits, to even
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # exponent bias 127 -> 7
    sub = torch.floor(y * 512.0 + 0.5).to(torch.int32)  # multiples of 2^-9 (8 = 2^-6, the first normal)
    return torch.where(y < 2.0**-6, sub, normal).clamp(max=0x7E)


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (any integer dtype, sign bit 0x80 allowed) -> fp32, same shape."""
    return code.to(torch.uint8).view(torch.float8_e4m3fn).float()


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to integers, halves away from zero (the kernels' rounding)."""
    return torch.trunc(x + 0.5 * torch.sign(x))


@functools.cache
def _hadamard(d: int, device: str) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device)


@functools.cache
def _fp4_table(device: str) -> torch.Tensor:
    return torch.tensor(FP4_VALUES, device=device)


def fp4_table(device: torch.device) -> torch.Tensor:
    """The E2M1 magnitudes [8] on `device` (made once per device: no host copy inside a CUDA graph)."""
    return _fp4_table(str(device))


def hadamard_matrix(d: int, device: torch.device) -> torch.Tensor:
    """The normalised [d, d] Walsh-Hadamard matrix on `device` (made once per device)."""
    return _hadamard(d, str(device))


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The normalised Walsh-Hadamard rotation along the last dim (a power of two): [..., D] -> fp32 [..., D].
    It is its own inverse."""
    return x.float() @ _hadamard(x.shape[-1], str(x.device))


# -- formats -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVFormat:
    """One row format. `quantize` [N, Hkv, D] float -> uint8 [N, Hkv, row_bytes(D)];
    `dequantize` uint8 [..., row_bytes(D)] -> [..., D] in `dtype`. Plain formats store the dtype itself."""

    base: str  # fp32, bf16, fp16, fp8, int8, nvfp4
    hadamard: bool = False  # rotate keys before quantisation

    @property
    def name(self) -> str:
        return self.base + ("+h" if self.hadamard else "")

    @property
    def plain(self) -> bool:
        return self.base in PLAIN_DTYPES

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype: the plain dtype, uint8 for quantised rows."""
        return PLAIN_DTYPES.get(self.base, torch.uint8)

    def check_head_dim(self, head_dim: int) -> None:
        need = {"int8": int8_group(head_dim), "nvfp4": NVFP4_GROUP, "fp8": 4}.get(self.base, 1)
        if head_dim % need:
            raise KVFormatError(f"kv format {self.name} needs head_dim divisible by {need}, got {head_dim}")
        if self.hadamard and head_dim & (head_dim - 1):
            raise KVFormatError(f"kv format {self.name} needs a power-of-two head_dim, got {head_dim}")

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one row (one token, one KV head) in this format."""
        if self.plain:
            return head_dim * torch.empty((), dtype=self.dtype).element_size()
        return self.scale_bytes(head_dim) + self.payload_bytes(head_dim) + self.pad_bytes(head_dim)

    def scale_bytes(self, head_dim: int) -> int:
        """Bytes of the scales at the start of a quantised row (a multiple of 4; fp8: its fp32 scale padded to
        FP8_HEAD_BYTES, so that the codes of a row start on 16 bytes)."""
        return {
            "fp8": FP8_HEAD_BYTES,
            "int8": _pad4(2 * head_dim // int8_group(head_dim)),
            "nvfp4": 4 + _pad4(head_dim // NVFP4_GROUP),
        }[self.base]

    def payload_bytes(self, head_dim: int) -> int:
        return head_dim // 2 if self.base == "nvfp4" else head_dim

    def pad_bytes(self, head_dim: int) -> int:
        used = self.scale_bytes(head_dim) + self.payload_bytes(head_dim)
        return _pad4(used) - used

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """[N, Hkv, D] -> uint8 [N, Hkv, row_bytes] (the torch reference of the write kernel)."""
        if self.plain:
            return x.to(self.dtype).contiguous().view(torch.uint8)
        return {"fp8": _fp8_quantize, "int8": _int8_quantize, "nvfp4": _nvfp4_quantize}[self.base](x, self)

    def dequantize(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [..., row_bytes] (or a plain-dtype tensor [..., D]) -> [..., D] in `dtype`."""
        if self.plain:
            return (packed if packed.dtype == self.dtype else packed.contiguous().view(self.dtype)).to(dtype)
        fn = {"fp8": _fp8_dequantize, "int8": _int8_dequantize, "nvfp4": _nvfp4_dequantize}[self.base]
        return fn(packed, self).to(dtype)

    def head_dim_of(self, row_bytes: int) -> int:
        """Inverse of row_bytes (a packed row -> D)."""
        return _head_dim_of(self, row_bytes)


@functools.cache
def _head_dim_of(fmt: KVFormat, row_bytes: int) -> int:
    for d in range(1, 4 * row_bytes + 1):
        if fmt.row_bytes(d) == row_bytes and (fmt.plain or d % 16 == 0):
            return d
    raise KVFormatError(f"no head_dim gives {row_bytes} bytes per row in {fmt.name}")


def _pack(scales: torch.Tensor, payload: torch.Tensor, fmt: KVFormat, head_dim: int) -> torch.Tensor:
    """scales uint8 [N, H, s] (padded here to scale_bytes) + payload uint8 [N, H, p] + padding -> a row."""
    n, h = payload.shape[:2]
    pad_s = fmt.scale_bytes(head_dim) - scales.shape[-1]
    parts = [scales]
    if pad_s:
        parts.append(torch.zeros(n, h, pad_s, dtype=torch.uint8, device=payload.device))
    parts.append(payload)
    if fmt.pad_bytes(head_dim):
        parts.append(torch.zeros(n, h, fmt.pad_bytes(head_dim), dtype=torch.uint8, device=payload.device))
    return torch.cat(parts, -1)


def _fp8_quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [N, H, 1]
    y = x / scale
    code = e4m3_encode(y.abs()) | torch.where(y < 0, 0x80, 0).to(torch.int32)
    return _pack(scale.contiguous().view(torch.uint8), code.to(torch.uint8), fmt, x.shape[-1])


def _fp8_dequantize(packed: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    scale = packed[..., :4].contiguous().view(torch.float32)  # [..., 1]
    d = fmt.head_dim_of(packed.shape[-1])
    s0 = fmt.scale_bytes(d)
    return e4m3_decode(packed[..., s0 : s0 + d]) * scale


def _int8_quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    x = x.float()
    n, h, d = x.shape
    xg = x.view(n, h, d // int8_group(d), int8_group(d))
    amax = xg.abs().amax(-1, keepdim=True)
    scale16 = (amax / 127.0).clamp(min=2.0**-24).to(torch.float16)  # [N, H, G, 1]
    q = round_half_away(xg / scale16.float()).clamp(-127, 127).to(torch.int8)
    scales = scale16.reshape(n, h, -1).contiguous().view(torch.uint8)
    return _pack(scales, q.reshape(n, h, d).view(torch.uint8), fmt, d)


def _int8_dequantize(packed: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    d = fmt.head_dim_of(packed.shape[-1])
    g = d // int8_group(d)
    s0 = fmt.scale_bytes(d)
    scale = packed[..., : 2 * g].contiguous().view(torch.float16).float()  # [..., G]
    q = packed[..., s0 : s0 + d].contiguous().view(torch.int8).float()
    return (q.unflatten(-1, (g, int8_group(d))) * scale[..., None]).flatten(-2)


def _nvfp4_quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    x = x.float()
    n, h, d = x.shape
    g = d // NVFP4_GROUP
    xb = x.view(n, h, g, NVFP4_GROUP)
    amax = x.abs().amax(-1, keepdim=True)  # [N, H, 1]
    row_scale = torch.where(amax > 0, amax / (FP4_MAX * FP8_MAX), torch.ones_like(amax))
    bmax = xb.abs().amax(-1)  # [N, H, G]
    bcode = e4m3_encode(bmax / (FP4_MAX * row_scale))
    bscale = e4m3_decode(bcode) * row_scale  # the block scale the decoder will use
    v = xb.abs() / torch.where(bscale > 0, bscale, torch.ones_like(bscale))[..., None]
    code = sum((v > t).to(torch.int32) for t in FP4_THRESHOLDS)
    code = (code | torch.where(xb < 0, 8, 0)).reshape(n, h, d)
    nibbles = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    scales = torch.cat([row_scale.contiguous().view(torch.uint8), bcode.to(torch.uint8)], -1)
    return _pack(scales, nibbles, fmt, d)


def _nvfp4_dequantize(packed: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    d = fmt.head_dim_of(packed.shape[-1])
    g = d // NVFP4_GROUP
    s0 = fmt.scale_bytes(d)
    row_scale = packed[..., :4].contiguous().view(torch.float32)  # [..., 1]
    bscale = e4m3_decode(packed[..., 4 : 4 + g]) * row_scale  # [..., G]
    byte = packed[..., s0 : s0 + d // 2].to(torch.int32)
    code = torch.stack([byte & 15, byte >> 4], -1).flatten(-2)  # [..., D]
    val = fp4_table(packed.device)[code & 7] * torch.where(code >= 8, -1.0, 1.0)
    return (val.unflatten(-1, (g, NVFP4_GROUP)) * bscale[..., None]).flatten(-2)


# -- names and per-layer specs -------------------------------------------------------------------------


def parse_format(text: str, auto: str = "") -> KVFormat:
    """One format name (`fp8`, `nvfp4+h`, `bf16`, `auto` when `auto` names the compute dtype)."""
    name = text.strip().lower()
    if name == "auto" and auto:
        name = auto
    base, plus, suffix = name.partition("+")
    if base not in (*PLAIN_DTYPES, *QUANTISED) or (plus and suffix != "h"):
        raise KVFormatError(
            f"kv format {text.strip()!r} unknown: use one of {', '.join((*PLAIN_DTYPES, *QUANTISED))}, "
            f"auto, or a quantised one with +h"
        )
    if plus and base in PLAIN_DTYPES:
        raise KVFormatError(f"kv format {text.strip()!r}: +h (Hadamard keys) only applies to {', '.join(QUANTISED)}")
    return KVFormat(base, bool(plus))


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class KVSpec:
    """A parsed per-layer spec: a default format and ordered (selector, format) overrides."""

    default: KVFormat
    overrides: tuple[tuple[str, KVFormat], ...] = ()

    @property
    def name(self) -> str:
        """The canonical spelling (model info; the page label with layout versions, `page_label`)."""
        return ",".join([self.default.name, *(f"{sel}={fmt.name}" for sel, fmt in self.overrides)])

    @property
    def page_label(self) -> str:
        """The format label of page identities (page hashes, write-through): the name, plus the byte layout's
        version of each format whose layout changed (`fp8` -> `fp8@2`), so a host copy in an older layout is
        never read as this one."""
        formats = [self.default, *(fmt for _, fmt in self.overrides)]
        tags = sorted({f"{f.base}@{LAYOUT_VERSIONS[f.base]}" for f in formats if f.base in LAYOUT_VERSIONS})
        return ";".join([self.name, *tags])

    @property
    def uniform(self) -> KVFormat | None:
        """The one format of every layer when no override exists."""
        return None if self.overrides else self.default

    def resolve(self, layer_windows: Sequence[int | None]) -> tuple[KVFormat, ...]:
        """Per layer format for a model whose layer i has sliding window layer_windows[i] (None: global)."""
        num_layers = len(layer_windows)
        formats = [self.default] * num_layers
        for sel, fmt in self.overrides:
            for i in _select(sel, layer_windows):
                formats[i] = fmt
        return tuple(formats)


def _select(sel: str, layer_windows: Sequence[int | None]) -> list[int]:
    num_layers = len(layer_windows)
    if sel == "global":
        return [i for i, w in enumerate(layer_windows) if w is None]
    if sel == "local":
        return [i for i, w in enumerate(layer_windows) if w is not None]
    m = _RANGE.match(sel)
    assert m is not None  # parse_spec validated the syntax
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if hi >= num_layers:
        raise KVFormatError(f"kv format part {sel!r}: layer {hi} out of range, the model has {num_layers} layers")
    return list(range(lo, hi + 1))


def parse_spec(text: str, auto: str) -> KVSpec:
    """Parse `--kv-format`; `auto` is the compute dtype's name (what `auto` means). KVFormatError names the bad part."""
    default: KVFormat | None = None
    overrides: list[tuple[str, KVFormat]] = []
    for raw in text.split(","):
        part = raw.strip().lower()
        if not part:
            raise KVFormatError(f"kv format {text!r} has an empty part")
        sel, eq, fmt_text = part.rpartition("=")
        if not eq:
            if default is not None:
                raise KVFormatError(f"kv format {text!r}: two default formats ({default.name!r} and {part!r})")
            default = parse_format(part, auto)
            continue
        sel = sel.strip()
        m = _RANGE.match(sel)
        if sel not in ("global", "local") and not m:
            raise KVFormatError(f"kv format part {raw.strip()!r}: selector {sel!r} is not global, local, N or N-M")
        if m and m.group(2) and int(m.group(2)) < int(m.group(1)):
            raise KVFormatError(f"kv format part {raw.strip()!r}: empty layer range {sel}")
        overrides.append((sel, parse_format(fmt_text, auto)))
    spec = KVSpec(default or parse_format("auto", auto), tuple(overrides))
    if len(spec.name) > MAX_NAME_CHARS:
        raise KVFormatError(
            f"kv format {spec.name!r} is {len(spec.name)} chars, the page label allows {MAX_NAME_CHARS}"
        )
    return spec


def resolve_formats(text: str, auto: str, layer_windows: Sequence[int | None], head_dim: int) -> tuple[KVFormat, ...]:
    """Parse, resolve for a model and check each layer's format against head_dim."""
    formats = parse_spec(text, auto).resolve(layer_windows)
    for fmt in set(formats):
        fmt.check_head_dim(head_dim)
    return formats
