"""Sampling parameters (validated) and the sampler: logit bias, penalties, grammar masks, temperature, top-k,
top-p, seeds, log-probabilities.

The processed logits of a row are: the model's logits + logit_bias, then the repetition penalty (HF/CTRL: a
positive logit of a token seen in prompt or output is divided by it, a negative one multiplied), then
OpenAI's presence and frequency penalties over the output (logit - count * frequency - (count > 0) * presence),
then the grammar's mask (disallowed tokens -inf). Greedy takes their argmax; sampling divides them by the
temperature and applies top-k and top-p. Log-probabilities are the log-softmax of the processed logits
(before temperature): a constrained request's alternatives are only tokens its grammar allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from services.common.limits import MAX_STOP_STRINGS

if TYPE_CHECKING:
    from services.engine.step.grammar import GrammarMatcher, GrammarSpec

MAX_TOP_LOGPROBS = 20


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: GrammarSpec | None = None

    @property
    def device_greedy(self) -> bool:
        """The token is the plain argmax of the model's logits: the device may choose it (decode bursts)."""
        return self.temperature == 0.0 and not self.needs_processing and not self.logprobs

    @property
    def needs_processing(self) -> bool:
        """The logits are changed before choosing (bias, penalties, grammar)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.grammar is not None
        )

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
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise InvalidRequestError(
                f"stop takes at most {MAX_STOP_STRINGS} non-empty strings, got {list(self.stop)!r}"
            )
        for tid in (*self.stop_token_ids, *self.logit_bias):
            if not 0 <= tid < vocab_size:
                raise InvalidRequestError(f"token id {tid} is outside the vocabulary [0, {vocab_size})")
        for tid, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias[{tid}] = {bias} is outside [-100, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs")

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


class Row(NamedTuple):
    """One sampling row of a step: its parameters and what the logits processors read."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int] = []
    output_ids: list[int] = []  # known output tokens (no PENDING)
    matcher: GrammarMatcher | None = None
    budget: int | None = None  # tokens the answer may still take, this one included (a grammar closes within it)


class Sampled(NamedTuple):
    token: int
    logprob: float | None = None  # when params.logprobs
    top: list[tuple[int, float]] = []  # params.top_logprobs most likely (token, logprob), most likely first


def process(logits: torch.Tensor, row: Row, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V] float32 -> the processed logits of the module docstring (bitmask: the row's grammar mask)."""
    p = row.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=logits.device)
        bias = torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    if p.repetition_penalty != 1.0 and (row.prompt_ids or row.output_ids):
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), device=logits.device)
        values = logits[seen]
        values = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        logits = logits.index_copy(0, seen, values)
    if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
        counts = torch.bincount(torch.tensor(row.output_ids, device=logits.device), minlength=logits.shape[0])
        counts = counts[: logits.shape[0]].to(logits.dtype)
        logits = logits - counts * p.frequency_penalty - (counts > 0).to(logits.dtype) * p.presence_penalty
    if bitmask is not None:
        from services.engine.step.grammar import apply_token_bitmask

        logits = apply_token_bitmask(logits.unsqueeze(0), bitmask.unsqueeze(0))[0]
    return logits


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Processed logits [V] float32 -> one token id (greedy, or temperature, top-k, top-p)."""
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


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] float32 -> one token id (no penalties' history, no grammar)."""
    return choose(process(logits, Row(params, generator)), params, generator)


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
    """logits: [M, V] float32, one row per sampling sequence -> M token ids (rows without history or grammar)."""
    return [s.token for s in sample_batch(logits, [Row(p, g) for p, g in zip(params, generators, strict=True)])]


def sample_batch(logits: torch.Tensor, rows: list[Row]) -> list[Sampled]:
    """logits: [M, V] float32, one row per sampling sequence -> M tokens (with log-probabilities when asked).

    Greedy rows that need no processing and no logprobs take one argmax over all of them and one device-to-host
    copy (the step's only sync); the grammar rows' masks are filled on the host in one batch; the other rows go
    through process and choose one by one. A grammar row with a budget is steered (GrammarMatcher.steer): its
    token may be the closing plan's instead of the chosen one, and its matcher is advanced here.
    """
    plain = [i for i, r in enumerate(rows) if r.params.device_greedy]
    out: list[Sampled] = [Sampled(0)] * len(rows)
    if plain:
        picked = logits if len(plain) == len(rows) else logits[torch.tensor(plain, device=logits.device)]
        for i, token in zip(plain, torch.argmax(picked, dim=-1).tolist(), strict=True):
            out[i] = Sampled(int(token))
    constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
    masks: dict[int, torch.Tensor] = {}
    if constrained:
        from services.engine.step.grammar import bitmask_words

        bitmask = torch.zeros(len(constrained), bitmask_words(logits.shape[1]), dtype=torch.int32)
        for k, i in enumerate(constrained):
            matcher = rows[i].matcher
            assert matcher is not None
            matcher.fill(bitmask, k)
        masks = {i: bitmask[k] for k, i in enumerate(constrained)}
    plain_set = set(plain)
    for i, row in enumerate(rows):
        if i in plain_set:
            continue
        processed = process(logits[i], row, masks.get(i))
        token = choose(processed, row.params, row.generator)
        if row.matcher is not None and row.budget is not None:
            token = row.matcher.steer(token, row.budget)  # the plan's token where the model's would not fit
        if not row.params.logprobs:
            out[i] = Sampled(token)
            continue
        logp = torch.log_softmax(processed, dim=-1)
        top: list[tuple[int, float]] = []
        if row.params.top_logprobs:
            values, ids = torch.topk(logp, row.params.top_logprobs)
            top = [(int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist(), strict=True)]
        out[i] = Sampled(token, float(logp[token]), top)
    return out
