"""KVPool: the device tensors that hold K and V for every slot of every KV-bearing layer.

With LocalRings (local_ring.py) the sliding-window layers keep their K/V in a small ring per running
sequence instead of the slots: their tensors have the rings' row space, the slots hold the global
(paged) layers only, and a page's host copy still carries every layer (read_pages takes the pages'
local rows from `local_stage` when the step that finished them staged them, else from the ring).

Each layer keeps its own format (services/engine/kv/kv_formats.py): plain formats as tensors of their
dtype (the fast path, unchanged), quantised ones as packed uint8 rows with their scales. Tokens are
quantised when written and dequantised when gathered (the attention window, page summaries); whole
pages move as bytes in the stored format. Quantised layers use the Triton kernels when the process's
kernel tier is Triton, else the torch reference.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Sequence

import torch

from services.engine.kernels import active_tier, triton_module
from services.engine.kv.kv_formats import KVFormat, fp4_table, hadamard, hadamard_matrix
from services.engine.kv.transfers import device_index
from services.engine.ring.local_ring import LocalRings

logger = logging.getLogger(__name__)
HOST_PAGES_ON_DEVICE = 256 << 20  # bytes of host pages fetched to the device at once (host_pages_fit)


@functools.cache
def fp8_in_place() -> bool:
    """Whether the attention kernels read fp8 layers in place (`KVPool.fp8_kv`): yes unless KVMEM_FP8_ATTENTION=0
    (then fp8 layers take the gather + dequantise path). On by default since round 14 (2026-12-07): the first
    kernels loaded the codes byte by byte and ran at a quarter of bf16's speed; with 16-byte rows, fp16 dots and
    128-row steps the decode kernel reads 32 x 4K fp8 rows in 143 us against 195 for bf16 rows (H100), and an fp8
    dense engine's 32 x 8K + 128 row took 32.1 s gathered against 9.1 s in place (bench/RESULTS.md). Decided once."""
    on = os.environ.get("KVMEM_FP8_ATTENTION", "1") != "0"
    logger.info("fp8 KV read in place by the attention kernels: %s", "on" if on else "off (KVMEM_FP8_ATTENTION=0)")
    return on


_PLAIN_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class KVPool:
    """Per layer, K and V as [num_slots * page_size, num_kv_heads, W] (token-major rows): W = head_dim
    values of a plain dtype, or W = row_bytes uint8 of a quantised format (formats[layer]).

    Row `slot * page_size + offset` holds the token at `offset` inside the page stored in `slot`.
    `formats` (one per layer) defaults to the plain format of `dtype` in every layer. With `local`,
    the layers in local.layers have local.num_rows rows addressed by LocalRings instead.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        formats: Sequence[KVFormat] | None = None,
        local: LocalRings | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.local = local
        local_layers = local.layers if local is not None else frozenset()
        self.paged_layers = tuple(i for i in range(num_layers) if i not in local_layers)  # K/V in the slots
        # (ring id, local layer) -> (first position, K, V stored rows [n, Hkv, W]): the whole pages a prefill
        # step finished, positions first .. first + n - 1, kept for their write-through (StepAttention fills
        # it; cleared before each step)
        self.local_stage: dict[tuple[int, int], tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # the plain dtype of a pool built without `formats`
        self.device = device
        self.formats = tuple(formats) if formats is not None else (KVFormat(_PLAIN_NAMES[dtype]),) * num_layers
        assert len(self.formats) == num_layers, f"{len(self.formats)} formats for {num_layers} layers"
        indexed = torch.empty(0, device=device).device  # cuda -> cuda:N, the device tensors report
        for fmt in set(self.formats):
            fmt.check_head_dim(head_dim)
            if fmt.hadamard:  # constants made now, not inside a captured CUDA graph
                hadamard_matrix(head_dim, indexed)
            if fmt.base == "nvfp4":
                fp4_table(indexed)
        # per layer: the plain dtype (the fast path) or None (quantised rows), and the stored row width
        self._plain = [fmt.dtype if fmt.plain else None for fmt in self.formats]
        self._uniform_plain = len(set(self.formats)) == 1 and self.formats[0].plain
        self._row_nbytes = [fmt.row_bytes(head_dim) for fmt in self.formats]
        self._layer_offsets = [0]  # byte offset of each layer's K inside a page
        for nb in self._row_nbytes:
            self._layer_offsets.append(self._layer_offsets[-1] + 2 * page_size * num_kv_heads * nb)
        # layers of one format and row count share one tensor [G, 2 (K, V), rows, Hkv, W]; self.k[i] and self.v[i]
        # are views of it, so a batch of pages moves in or out of every such layer with one indexed copy
        groups: dict[tuple[KVFormat, int], list[int]] = {}
        for layer, fmt in enumerate(self.formats):
            rows = local.num_rows if local is not None and layer in local.layers else num_slots * page_size
            groups.setdefault((fmt, rows), []).append(layer)
        self.k: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self.v: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self._slot_stack: torch.Tensor | None = None  # the one stack of every paged layer, if they are one group
        self._stack_key_base: torch.Tensor | None = None  # paged_keys: [G, 1] where layer j's K rows start in it
        # pages through the stack in one copy, on CUDA by default (KVMEM_STACK_COPIES=0: per layer; on the CPU the
        # per-layer copies are faster, a 16-page write of the 8B shape 33 vs 70 ms): the ring's 32 x 8K fp8 row on an
        # H100 decoded 2,246.9 / 2,259.7 tok/s with it against 2,200.6 without, prefill 15,582 / 16,202 against
        # 14,831 (bench/RESULTS.md round 15); an fp8 layer's K and V in one launch stays off (round 15: no gain)
        self.stack_copies = device.type == "cuda" and os.environ.get("KVMEM_STACK_COPIES", "1") != "0"
        self.fp8_kv_one_launch = os.environ.get("KVMEM_FP8_KV_ONE_LAUNCH", "0") == "1"
        for (fmt, rows), layers in groups.items():
            width = head_dim if fmt.plain else fmt.row_bytes(head_dim)
            stack = torch.zeros((len(layers), 2, rows, num_kv_heads, width), dtype=fmt.dtype, device=device)
            for j, layer in enumerate(layers):
                self.k[layer], self.v[layer] = stack[j, 0], stack[j, 1]
            if tuple(layers) == self.paged_layers:
                self._slot_stack = stack
                # the flat row (of the stack viewed [G * 2 * rows, Hkv, W]) where paged layer j's K rows start
                self._stack_key_base = (torch.arange(len(layers), device=device) * (2 * rows))[:, None]
        logger.info(
            "KV pool: %d slots x %d tokens, %d paged layers, %d kv heads x %d, %s on %s: %.1f MiB",
            num_slots,
            page_size,
            len(self.paged_layers),
            num_kv_heads,
            head_dim,
            self.format_summary,
            device,
            self.nbytes / 2**20,
        )
        if local is not None:
            logger.info(
                "local rings: %d layers (window %d) in %d rings x %d rows: %.1f MiB",
                len(local.layers), local.window, local.num_rings, local.span, self.local_nbytes / 2**20,
            )  # fmt: skip

    @property
    def format_summary(self) -> str:
        """e.g. `fp8 x 15, bf16 x 3` (formats and their layer counts, in order of first use)."""
        counts: dict[str, int] = {}
        for fmt in self.formats:
            counts[fmt.name] = counts.get(fmt.name, 0) + 1
        return ", ".join(f"{name} x {n}" for name, n in counts.items())

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page in its stored format: K and V of every layer (the host copy's size)."""
        return self._layer_offsets[-1]

    def _page_nbytes_of(self, layers: Iterable[int]) -> int:
        """Bytes of these layers' K and V in one page."""
        return sum(self._layer_offsets[i + 1] - self._layer_offsets[i] for i in layers)

    def layer_parts(self, layers: Iterable[int]) -> tuple[tuple[int, int], ...]:
        """The byte ranges of a page that hold these layers' K and V, in layer order, adjacent ones merged:
        what a restore of just these layers reads (kernels/pages/restore.py `parts`)."""
        parts: list[tuple[int, int]] = []
        for i in sorted(layers):
            lo, hi = self._layer_offsets[i], self._layer_offsets[i + 1]
            if parts and parts[-1][1] == lo:
                parts[-1] = (parts[-1][0], hi)
            else:
                parts.append((lo, hi))
        return tuple(parts)

    @property
    def slot_parts(self) -> tuple[tuple[int, int], ...]:
        """The bytes of a page a slot keeps (its paged layers): what a restore into slots needs."""
        return self.layer_parts(self.paged_layers)

    @property
    def local_parts(self) -> tuple[tuple[int, int], ...]:
        """The bytes of a page the local rings keep (the sliding layers); () without local rings."""
        return self.layer_parts(self.local.layers) if self.local is not None else ()

    @property
    def slot_nbytes(self) -> int:
        """Device bytes of one slot: K and V of the paged layers (page_nbytes without local rings)."""
        return self._page_nbytes_of(self.paged_layers)

    @property
    def nbytes(self) -> int:
        """Device bytes of the slots."""
        return self.slot_nbytes * self.num_slots

    @property
    def local_nbytes(self) -> int:
        """Device bytes of the local rings (0 without)."""
        if self.local is None:
            return 0
        return self._page_nbytes_of(self.local.layers) // self.page_size * self.local.num_rows

    def is_local(self, layer: int) -> bool:
        """The layer's rows are in the local rings, not in the slots."""
        return self.local is not None and layer in self.local.layers

    def rows(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Row indices of whole pages: [P] slots -> [P * page_size]."""
        offsets = torch.arange(self.page_size, device=slot_ids.device)
        return (slot_ids[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    # -- token rows (the attention pass) -------------------------------------------------------------

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of new tokens: rows [N] pool rows; k, v [N, Hkv, D] in the compute dtype."""
        dtype = self._plain[layer]
        if dtype is not None:
            kernels = triton_module("pages.kv_triton", self.device)
            if kernels is not None and kernels.write_supported(self.k[layer]) and k.stride(2) == v.stride(2) == 1:
                kernels.write_kv(self.k[layer], self.v[layer], rows, k, v)  # K and V in one launch
                return
            self.k[layer].index_copy_(0, rows, k.to(dtype))
            self.v[layer].index_copy_(0, rows, v.to(dtype))
            return
        fmt = self.formats[layer]
        k = hadamard(k) if fmt.hadamard else k
        kernels = self._kernels(fmt) if self.fp8_kv_one_launch else None
        if kernels is not None and kernels.quantize_scatter_kv(fmt, k, v, rows, self.k[layer], self.v[layer]):
            return  # K and V in one launch
        self._quantize_into(fmt, self.k[layer], rows, k)
        self._quantize_into(fmt, self.v[layer], rows, v)

    def gather(self, layer: int, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `rows` [T] as [T, Hkv, D] each in `dtype` (the attention window, dequantised)."""
        if self._plain[layer] is not None:
            return self.k[layer].index_select(0, rows).to(dtype), self.v[layer].index_select(0, rows).to(dtype)
        return self.gather_keys(layer, rows, dtype), self._dequantize_rows(
            self.formats[layer], self.v[layer], rows, dtype
        )

    def encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows `write` would store for k, v [N, Hkv, D]: the layer's stored format (torch code)."""
        dtype = self._plain[layer]
        if dtype is not None:
            return k.to(dtype), v.to(dtype)
        fmt = self.formats[layer]
        return fmt.quantize(hadamard(k) if fmt.hadamard else k), fmt.quantize(v)

    def decode(
        self, layer: int, k_rows: torch.Tensor, v_rows: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `gather` returns for stored rows: K and V [N, Hkv, D] in `dtype`."""
        if self._plain[layer] is not None:
            return k_rows.to(dtype), v_rows.to(dtype)
        fmt = self.formats[layer]
        return _keys(fmt, lambda dt: fmt.dequantize(k_rows, dt), dtype), fmt.dequantize(v_rows, dtype)

    def write_stored(self, layer: int, rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> None:
        """Store rows already in the layer's stored format (from `encode`)."""
        self.k[layer].index_copy_(0, rows, k_rows)
        self.v[layer].index_copy_(0, rows, v_rows)

    def plain_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's K and V rows [R, Hkv, D] when stored in a plain float dtype (attention kernels read
        them in place); None for a quantised layer (use gather)."""
        return (self.k[layer], self.v[layer]) if self._plain[layer] is not None else None

    def fp8_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's K and V rows (uint8 [R, Hkv, 16 + D]: an fp32 scale padded to 16 bytes, then D e4m3fn
        codes) when stored in plain fp8 (no Hadamard keys) and `fp8_in_place` (unless KVMEM_FP8_ATTENTION=0), which the
        attention kernels then read in place; else None."""
        fmt = self.formats[layer]
        if fmt.base != "fp8" or fmt.hadamard or fmt.pad_bytes(self.head_dim) or not fp8_in_place():
            return None
        return self.k[layer], self.v[layer]

    def plain_keys(self, layer: int) -> torch.Tensor | None:
        """The layer's key rows [R, Hkv, D] when stored in a plain float dtype (summary kernels read them
        in place); None for a quantised layer (use gather_keys)."""
        return self.k[layer] if self._plain[layer] is not None else None

    def gather_keys(self, layer: int, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Only the keys of `rows` [T] -> [T, Hkv, D] in `dtype` (page summaries)."""
        if self._plain[layer] is not None:
            return self.k[layer].index_select(0, rows).to(dtype)
        fmt = self.formats[layer]
        return _keys(fmt, lambda dt: self._dequantize_rows(fmt, self.k[layer], rows, dt), dtype)

    def paged_keys(
        self, rows: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Every paged layer's keys of `rows` [T] in one read, when they share one stack (page summaries of a
        decode step's filled pages: two launches, not two a layer): (src, src_rows), where src [N, Hkv, W] read
        at src_rows [G * T] (layer-major: paged layer j's rows at j * T) gives the keys of plain layers in place;
        src_rows is None when src is already those keys, [G * T, Hkv, D] in `dtype` (a quantised stack
        dequantised in one gather). None: no common stack (per layer: gather_keys)."""
        stack, base = self._slot_stack, self._stack_key_base
        if stack is None or base is None:
            return None
        h, w = stack.shape[-2:]
        flat = stack.view(-1, h, w)  # row r of paged layer j's K is flat row base[j] + r
        src_rows = (base + rows[None, :]).reshape(-1)
        fmt = self.formats[self.paged_layers[0]]
        if fmt.plain:
            return flat, src_rows
        return _keys(fmt, lambda dt: self._dequantize_rows(fmt, flat, src_rows, dt), dtype), None

    def copy_rows(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` rows of one slot into another, in every paged layer."""
        src, dst = src_slot * self.page_size, dst_slot * self.page_size
        for i in self.paged_layers:
            self.k[i][dst : dst + num_tokens].copy_(self.k[i][src : src + num_tokens])
            self.v[i][dst : dst + num_tokens].copy_(self.v[i][src : src + num_tokens])

    def _quantize_into(self, fmt: KVFormat, store: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
        kernels = self._kernels(fmt)
        if kernels is not None:
            kernels.quantize_scatter(fmt, x, rows, store)
        else:
            store.index_copy_(0, rows, fmt.quantize(x))

    def _dequantize_rows(
        self, fmt: KVFormat, store: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        kernels = self._kernels(fmt)
        if kernels is not None:
            return kernels.gather_dequantize(fmt, store, rows, self.head_dim, dtype)
        return fmt.dequantize(store.index_select(0, rows), dtype)

    def _kernels(self, fmt: KVFormat):  # type: ignore[no-untyped-def]
        """The Triton kernel module when the process's tier is Triton on this pool's device, else None."""
        tier = active_tier()
        if tier.backend != "triton" or (tier.capability is None) != (self.device.type == "cpu"):
            return None
        from services.engine.kernels.pages import kv_triton

        return kv_triton if kv_triton.supported(fmt, self.head_dim) else None

    # -- whole pages (write-through, restore): flat bytes in the stored format -----------------------

    def read_page(self, slot: int, local: tuple[int, int] | None = None) -> torch.Tensor:
        """`read_pages` of one page: uint8 [page_nbytes]; `local` = (ring id, logical page)."""
        return self.read_pages([slot], None if local is None else (local[0], [local[1]]))[0]

    def read_pages(self, slots: list[int], local: tuple[int, list[int]] | None = None) -> torch.Tensor:
        """A copy of pages as uint8 [P, page_nbytes] on the pool's device, one row per page: layer by layer,
        K then V, each [page_size, Hkv, W] in the layer's stored format (the bytes the host store keeps);
        a few launches per layer whatever P. With local rings, `local` = (ring id, the pages' logical
        numbers): the local layers' rows come from the stage when the step that finished the pages staged
        them, else from the ring."""
        assert (local is None) == (self.local is None), "pages of a local-ring pool need their ring"
        count = len(slots)
        stack = self._slot_stack if self.stack_copies else None
        if local is None and stack is not None and count:  # every layer in one stack: one gather, one copy
            g, _, _, h, w = stack.shape
            rows = self.rows(device_index(slots, self.device))
            got = stack.view(2 * g, -1, h, w).index_select(1, rows).view(g, 2, count, self.page_size, h, w)
            return got.permute(2, 0, 1, 3, 4, 5).contiguous().view(torch.uint8).view(count, -1)
        parts: list[torch.Tensor] = []
        slot_rows: torch.Tensor | None = None
        local_rows: dict[int, torch.Tensor] = {}  # stage start (-1: the ring) -> the pages' rows in it
        for i in range(self.num_layers):
            if local is not None and self.local is not None and i in self.local.layers:
                ring_id, pages = local
                staged = self.local_stage.get((ring_id, i))
                if staged is not None and self._all_staged(staged, pages):
                    first, k_src, v_src = staged
                else:
                    first, k_src, v_src = -1, self.k[i], self.v[i]
                if first not in local_rows:
                    local_rows[first] = self._local_rows(ring_id, pages, first)
                rows = local_rows[first]
            else:
                if slot_rows is None:
                    slot_rows = self.rows(device_index(slots, self.device))
                rows, k_src, v_src = slot_rows, self.k[i], self.v[i]
            parts.extend(t.index_select(0, rows).reshape(count, -1) for t in (k_src, v_src))
        if self._uniform_plain:
            return torch.cat(parts, dim=1).view(torch.uint8)
        return torch.cat([p.view(torch.uint8) for p in parts], dim=1)

    def _all_staged(self, staged: tuple[int, torch.Tensor, torch.Tensor], pages: list[int]) -> bool:
        """Whether the stage holds every page (a step stages all the pages it finishes, and a read is of
        one step's pages: all of them or none)."""
        first, k_rows, _ = staged
        inside = [first <= p * self.page_size and (p + 1) * self.page_size <= first + k_rows.shape[0] for p in pages]
        assert all(inside) or not any(inside), f"pages {pages}: only some staged (stage from position {first})"
        return all(inside)

    def _local_rows(self, ring_id: int, pages: list[int], first: int) -> torch.Tensor:
        """Rows of whole pages: into the stage starting at position `first`, or (first < 0) into the ring."""
        assert self.local is not None
        size = self.page_size
        starts = [p * size - first for p in pages] if first >= 0 else [self.local.page_row(ring_id, p) for p in pages]
        base = device_index(starts, self.device)
        return (base[:, None] + torch.arange(size, device=self.device)).reshape(-1)

    def write_pages(self, slots: list[int], pages: torch.Tensor) -> None:
        """Inverse of read_page for a batch: pages uint8 [P, page_nbytes] (any device), or just their
        `slot_parts` [P, slot_nbytes], into `slots`: the paged layers only (a restored page's local rows
        are not needed: its window has passed)."""
        self._write_rows(slots, None, pages, self.paged_layers)

    def write_local_pages(self, local_rows: list[int], pages: torch.Tensor) -> None:
        """The local layers of whole pages (uint8 [P, page_nbytes], or just their `local_parts`) into ring
        rows starting at `local_rows` (LocalRings.page_row): a reused prefix's last pages, for the window
        of the first new token."""
        assert self.local is not None
        self._write_rows(None, local_rows, pages, sorted(self.local.layers))

    def _write_rows(
        self, slots: list[int] | None, starts: list[int] | None, pages: torch.Tensor, layers: Sequence[int]
    ) -> None:
        count = len(slots) if slots is not None else len(starts or [])
        if count == 0:
            return
        if slots is not None:
            rows = self.rows(device_index(slots, self.device))
        else:
            base = device_index(starts, self.device)  # type: ignore[arg-type]
            rows = (base[:, None] + torch.arange(self.page_size, device=self.device)).reshape(-1)
        h, d = self.num_kv_heads, self.head_dim
        whole = pages.shape[-1] == self.page_nbytes  # else the pages hold `layers` only, in order
        if not whole and pages.shape[-1] != self._page_nbytes_of(layers):
            raise ValueError(f"pages of {pages.shape[-1]} bytes hold neither a whole page nor layers {list(layers)}")
        index = {i: i if whole else j for j, i in enumerate(sorted(layers))}  # a layer's place in the page
        if slots is not None and self._write_stack(rows, pages, count, whole, layers):
            return
        if self._uniform_plain:
            data = pages.to(self.device, non_blocking=True).view(self.k[0].dtype)
            data = data.view(count, self.num_layers if whole else len(layers), 2, self.page_size, h, d)
            for i in layers:
                self.k[i].index_copy_(0, rows, data[:, index[i], 0].reshape(-1, h, d))
                self.v[i].index_copy_(0, rows, data[:, index[i], 1].reshape(-1, h, d))
            return
        data = pages.to(self.device, non_blocking=True).reshape(count, pages.shape[-1])
        ranges = self._layer_ranges(range(self.num_layers) if whole else layers)
        for i in layers:
            k_bytes, v_bytes = self._layer_bytes(data, ranges[i])
            self.k[i].index_copy_(0, rows, self._rows_of(i, k_bytes))
            self.v[i].index_copy_(0, rows, self._rows_of(i, v_bytes))

    def _write_stack(
        self, rows: torch.Tensor, pages: torch.Tensor, count: int, whole: bool, layers: Sequence[int]
    ) -> bool:
        """_write_rows into the slots of every paged layer at once, when they share one stack and every layer the
        pages hold has their row width (a page is then [layers, K|V, page_size, Hkv, W]): one reorder of the
        pages' bytes and one indexed copy, instead of two of each a layer. False: not this pool or these pages."""
        stack = self._slot_stack
        if stack is None or not self.stack_copies or tuple(sorted(layers)) != self.paged_layers:
            return False
        held = range(self.num_layers) if whole else self.paged_layers
        if len({self._row_nbytes[i] for i in held}) != 1:
            return False
        g, _, _, h, w = stack.shape
        data = pages.to(self.device, non_blocking=True).contiguous().view(stack.dtype)
        data = data.view(count, len(held), 2, self.page_size, h, w)
        if len(held) != g:  # whole pages of a pool with local rings: the paged layers' places
            data = data[:, list(self.paged_layers)]
        src = data.permute(1, 2, 0, 3, 4, 5).reshape(2 * g, count * self.page_size, h, w)
        stack.view(2 * g, -1, h, w).index_copy_(1, rows, src)
        return True

    def host_pages_fit(self, count: int) -> bool:
        """Whether `count` host pages that are read a layer at a time (pages_kv) are best fetched to the device whole:
        while they fit in HOST_PAGES_ON_DEVICE bytes. Beyond, a long context's (3.5 GB at 32K on an 8B shape, more
        than the device should hold for one sequence at once) stay in the store, held, each layer's bytes read
        straight to the device (HostPages.hold)."""
        return count * self.page_nbytes <= HOST_PAGES_ON_DEVICE

    def page_kv(self, page: torch.Tensor, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer of a page held as bytes (a host page): [page_size, Hkv, D] each in `dtype`,
        on the page's device."""
        return self.pages_kv([page], layer, dtype, page.device)

    def pages_kv(
        self, pages: Sequence[torch.Tensor], layer: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer of pages held as bytes (uint8 [page_nbytes] each, on any device): only that
        layer's bytes of each travel to `device`, where they are decoded: [P * page_size, Hkv, D] each."""
        return self.layer_kv(self.pages_layer_bytes(pages, layer, device), layer, dtype)

    def pages_layer_bytes(self, pages: Sequence[torch.Tensor], layer: int, device: torch.device) -> torch.Tensor:
        """One layer's bytes of pages held as bytes (uint8 [page_nbytes] each, on any device) on `device`:
        uint8 [P, layer bytes] (layer_part's range of each)."""
        lo, hi = self.layer_part(layer)
        return torch.stack([p.reshape(-1)[lo:hi] for p in pages]).to(device, non_blocking=True)

    def layer_part(self, layer: int) -> tuple[int, int]:
        """Bytes [lo, hi) of a page (KVPool.read_page's layout) that hold this layer's K and V."""
        return self._layer_offsets[layer], self._layer_offsets[layer + 1]

    def layer_kv(self, data: torch.Tensor, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's bytes of P pages, uint8 [P, layer bytes] (layer_part's range of each), decoded on their
        device: K and V [P * page_size, Hkv, D] each in `dtype`."""
        lo, hi = self.layer_part(layer)
        pages = data.shape[0]
        plain = self._plain[layer]
        if plain is not None:  # [P, K|V, page, Hkv, D] of the stored dtype
            kv = data.view(plain).view(pages, 2, self.page_size, self.num_kv_heads, self.head_dim)
            return (kv[:, 0].reshape(-1, self.num_kv_heads, self.head_dim).to(dtype),
                    kv[:, 1].reshape(-1, self.num_kv_heads, self.head_dim).to(dtype))  # fmt: skip
        fmt = self.formats[layer]
        k_bytes, v_bytes = self._layer_bytes(data, (0, hi - lo))
        k_rows, v_rows = self._rows_of(layer, k_bytes), self._rows_of(layer, v_bytes)
        return _keys(fmt, lambda dt: fmt.dequantize(k_rows, dt), dtype), fmt.dequantize(v_rows, dtype)

    def layer_rows(self, data: torch.Tensor, layer: int) -> torch.Tensor:
        """One layer's bytes of P pages, uint8 [P, layer bytes] (contiguous), as that layer's stored rows
        [2 * P * page_size, Hkv, W] (a view): each page's page_size K rows, then its V rows. An attention kernel
        that reads the layer in place reads them the same way (K row b * 2 * page_size + t, its V row page_size
        further)."""
        return self._rows_of(layer, data)

    def _layer_ranges(self, layers: Iterable[int]) -> dict[int, tuple[int, int]]:
        """Byte range of each layer's K and V in pages that hold these layers, in layer order (every layer:
        a whole page)."""
        out, at = {}, 0
        for i in sorted(layers):
            n = self._layer_offsets[i + 1] - self._layer_offsets[i]
            out[i] = (at, at + n)
            at += n
        return out

    def _layer_bytes(self, data: torch.Tensor, span: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V bytes of one layer, bytes `span` of pages uint8 [P, n]: [P, n_layer / 2] each."""
        lo, hi = span
        mid = (lo + hi) // 2
        return data[:, lo:mid], data[:, mid:hi]

    def _rows_of(self, layer: int, data: torch.Tensor) -> torch.Tensor:
        """Bytes [P, page_size * Hkv * row_nbytes] -> stored rows [P * page_size, Hkv, W] of that layer."""
        store = self.k[layer]
        return data.contiguous().view(store.dtype).view(-1, self.num_kv_heads, store.shape[-1])


def _keys(fmt: KVFormat, dequantize: Callable[[torch.dtype], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Dequantised keys in `dtype`; a `+h` format stores them rotated: rotated back (the normalised
    Hadamard matrix is its own inverse) in fp32 first."""
    if fmt.hadamard:
        return hadamard(dequantize(torch.float32)).to(dtype)
    return dequantize(dtype)
