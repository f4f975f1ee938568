"""ModelRunner: turns a step's work into tensors, runs the forward pass, returns the logits to sample."""

from __future__ import annotations

import logging

import torch

from services.engine.kv_pool import KVPool
from services.engine.models.llama import LlamaForCausalLM
from services.engine.paged_attention import SeqSpan, StepAttention
from services.engine.scheduler import Work

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.device = device

    @torch.inference_mode()
    def run(self, works: list[Work]) -> torch.Tensor:
        """Forward every work item; logits [num_sampling_works, V] (float32), in work order."""
        token_ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        for w in works:
            token_ids.extend(w.seq.token_ids[w.start : w.start + w.num_new])
            positions.extend(range(w.start, w.start + w.num_new))
            slot_ids = torch.tensor(w.seq.page_table.slot_ids, dtype=torch.long, device=self.device)
            rows = self.pool.rows(slot_ids)[: w.start + w.num_new]
            spans.append(SeqSpan(num_past=w.start, num_new=w.num_new, read_rows=rows))
            if w.samples:
                sample_rows.append(len(token_ids) - 1)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        cfg = self.model.config
        attn = StepAttention(self.pool, spans, cfg.num_heads // cfg.num_kv_heads, self.model.embed_tokens.weight.dtype)
        hidden = self.model(ids, pos, attn)  # [N, hidden]
        if not sample_rows:
            return torch.empty(0, device=self.device)
        rows_t = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.logits(hidden.index_select(0, rows_t))  # [M, V]
