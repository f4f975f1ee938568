"""RecurrentStates: the linear-attention layers' state of each running sequence, and snapshots of it.

A Qwen3.5 Gated DeltaNet layer keeps, per sequence, the last conv_kernel - 1 inputs of its causal conv
(conv state, [conv_dim, K - 1] in the model dtype) and the delta rule's state ([Hv, Dk, Dv] float32):
O(1) in the context length, and the only thing of those layers a later step reads. A running sequence
owns one state slot (allocated at admission, like a local ring); a step of one sequence reads its slot's
state (zeros when the step starts at position 0) and writes the state after its last token back.

Prefix reuse: a prefix of the paged layers is reusable only together with the state at its end. So the
state is snapshotted whenever a step ends on a snapshot boundary (every `interval` tokens, a whole number
of pages; the scheduler cuts prefill chunks there), under the hash of the page that ends there: kept on
the device (an LRU of `max_snapshots`) and written through to the kvstore beside the pages under
`state_key(page_hash)`. A request whose cached prefix reaches such a page restores the state into its slot
(from the device, else from the store) and computes from there; any other prefix is cut back to the last
boundary that has a snapshot, or recomputed.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from services.engine.kv.transfers import device_index
from services.engine.models.config import LinearAttentionShape

if TYPE_CHECKING:
    from services.engine.kv.write_through import WriteThrough

logger = logging.getLogger(__name__)

STATE_KEY_SALT = b"kvmem-recurrent-state-v1"


class StatesExhaustedError(RuntimeError):
    """Every state slot is in use (more running sequences than slots: a scheduler bug)."""


def state_key(page_hash: bytes) -> bytes:
    """The kvstore key of the state snapshot at the end of page `page_hash` (same length as a page hash)."""
    return hashlib.sha256(STATE_KEY_SALT + page_hash).digest()[: len(page_hash)]


@dataclass
class RecurrentBatch:
    """One step's view of the states: per sequence (in the step's order) its slot, its token count, whether it
    starts at position 0 (zero state) and whether its final state is kept (a scoring pass keeps nothing)."""

    states: RecurrentStates
    slots: Tensor  # [B] int64 on the device
    lengths: list[int]
    fresh: Tensor  # [B] bool on the device
    keep: list[bool]

    @property
    def keep_rows(self) -> Tensor | None:
        """Rows (of B) whose state is written back; None: all of them."""
        if all(self.keep):
            return None
        return device_index([i for i, k in enumerate(self.keep) if k], self.slots.device)


class RecurrentStates:
    """Per linear layer, per slot: conv [L, S, C, K - 1] (model dtype) and delta-rule [L, S, Hv, Dk, Dv] (fp32)."""

    def __init__(
        self,
        shape: LinearAttentionShape,
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
        interval: int,
        max_snapshots: int = 32,
    ) -> None:
        self.shape = shape
        self.layers = shape.layers
        self.interval = interval  # snapshot boundary every `interval` tokens (a multiple of the page size)
        self.num_slots = num_slots
        self.max_snapshots = max_snapshots
        n = len(shape.layers)
        self.conv = torch.zeros(n, num_slots, shape.conv_dim, shape.conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(
            n, num_slots, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim, dtype=torch.float32, device=device
        )
        self._free = list(range(num_slots - 1, -1, -1))
        self._snapshots: OrderedDict[bytes, tuple[Tensor, Tensor]] = OrderedDict()
        self.num_snapshots_taken = 0
        self.num_restored = 0
        logger.info(
            "recurrent states: %d linear layers x %d slots, %.2f MiB per sequence; snapshot every %d tokens",
            n, num_slots, self.nbytes / 2**20, interval,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state (every linear layer): also a snapshot's size."""
        return (self.conv[:, 0].numel() * self.conv.element_size()) + self.ssm[:, 0].numel() * 4

    @property
    def device(self) -> torch.device:
        return self.conv.device

    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise StatesExhaustedError(f"all {self.num_slots} recurrent state slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, (slot, self._free)
        self._free.append(slot)

    def batch(self, slots: list[int], lengths: list[int], fresh: list[bool], keep: list[bool]) -> RecurrentBatch:
        dev = self.device
        return RecurrentBatch(
            self, device_index(slots, dev), lengths, device_index([int(f) for f in fresh], dev).bool(), keep,
        )  # fmt: skip

    # -- snapshots -------------------------------------------------------------------------------

    def is_boundary(self, position: int) -> bool:
        return position > 0 and position % self.interval == 0

    def snapshot(self, slot: int, page_hash: bytes) -> None:
        """Keep slot's current state as the state at the end of page `page_hash` (device LRU)."""
        self._put(page_hash, self.conv[:, slot].clone(), self.ssm[:, slot].clone())
        self.num_snapshots_taken += 1

    def publish(self, slot: int, page_hash: bytes, write_through: WriteThrough | None) -> None:
        """Snapshot the slot (its state ends at page `page_hash`) and write it through under state_key."""
        self.snapshot(slot, page_hash)
        key = state_key(page_hash)
        if write_through is not None and write_through.wants(key):
            write_through.submit(key, self.to_bytes(page_hash), self.interval)

    def snapshot_keys(self) -> list[bytes]:
        """The page hashes the device holds a snapshot at, oldest first."""
        return list(self._snapshots)

    def has(self, page_hash: bytes) -> bool:
        return page_hash in self._snapshots

    def restore(self, slot: int, page_hash: bytes) -> bool:
        """Copy the snapshot at `page_hash` into `slot`; False when the device holds none."""
        snap = self._snapshots.get(page_hash)
        if snap is None:
            return False
        self._snapshots.move_to_end(page_hash)
        self.conv[:, slot].copy_(snap[0])
        self.ssm[:, slot].copy_(snap[1])
        self.num_restored += 1
        return True

    def to_bytes(self, page_hash: bytes) -> Tensor:
        """The snapshot at `page_hash` as uint8 [nbytes] on the CPU (conv bytes, then the delta-rule state)."""
        conv, ssm = self._snapshots[page_hash]
        return torch.cat([_as_bytes(conv), _as_bytes(ssm)]).cpu()

    def put_bytes(self, page_hash: bytes, data: Tensor) -> None:
        """A snapshot read back from the store (to_bytes' layout), into the device LRU."""
        data = data.to(self.device).reshape(-1)
        conv_like, ssm_like = self.conv[:, 0], self.ssm[:, 0]
        n = conv_like.numel() * conv_like.element_size()
        if data.numel() != n + ssm_like.numel() * 4:
            raise ValueError(f"state snapshot of {data.numel()} bytes, expected {self.nbytes}")
        conv = data[:n].view(conv_like.dtype).view(conv_like.shape).clone()
        ssm = data[n:].view(torch.float32).view(ssm_like.shape).clone()
        self._put(page_hash, conv, ssm)

    def _put(self, page_hash: bytes, conv: Tensor, ssm: Tensor) -> None:
        self._snapshots[page_hash] = (conv, ssm)
        self._snapshots.move_to_end(page_hash)
        while len(self._snapshots) > self.max_snapshots:
            self._snapshots.popitem(last=False)


def _as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
