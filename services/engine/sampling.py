"""Sampling parameters (validated) and the sampler: logit bias, temperature, top-k, top-p, seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class InvalidRequestError(ValueError):
    """A request parameter is out of range; the message names it and the allowed range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the context limit
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first parameter out of range."""
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if len(self.stop) > 16 or any(not s for s in self.stop):
            raise InvalidRequestError(f"stop takes at most 16 non-empty strings, got {list(self.stop)!r}")
        for tid in (*self.stop_token_ids, *self.logit_bias):
            if not 0 <= tid < vocab_size:
                raise InvalidRequestError(f"token id {tid} is outside the vocabulary [0, {vocab_size})")
        for tid, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias[{tid}] = {bias} is outside [-100, 100]")

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        """A private RNG for this request when sampling (seeded when `seed` is set), else None."""
        if self.temperature == 0.0:
            return None
        gen = torch.Generator(device=device)
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] float32 -> one token id."""
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), device=logits.device, dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits: [M, V] float32, one row per sampling sequence -> M token ids.

    Greedy rows without a logit bias take one argmax over all of them and one device-to-host copy
    (the step's only sync); the other rows go through sample_one.
    """
    plain = [i for i, p in enumerate(params) if p.temperature == 0.0 and not p.logit_bias]
    out = [0] * len(params)
    if plain:
        rows = logits if len(plain) == len(params) else logits[torch.tensor(plain, device=logits.device)]
        for i, token in zip(plain, torch.argmax(rows, dim=-1).tolist(), strict=True):
            out[i] = int(token)
    plain_set = set(plain)
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if i not in plain_set:
            out[i] = sample_one(logits[i], p, gen)
    return out
