"""Host cost per token of budget-aware completion (grammar.py): xgrammar's own fill + accept against our
GrammarMatcher's fill + steer + accept, walking bench/grammar_mask.py's 54-token document of its nested schema.

Three budgets: `raw` (xgrammar alone, what the sampler paid before), `far` (max_tokens 10,000: only the first
plan, at set_budget, outside the timed steps; the steps pay the bookkeeping), `window` (max_tokens = the document's
length + 10: every step is inside the closing window, so a plan is computed after each token that is not string
text, and the document still fits, so the model's tokens are never replaced: the worst case of the check).
Also the first plan (set_budget, on the RPC thread at submit) of each of the 200 random schemas.

    python -m bench.grammar_budget --repeats 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.grammar_mask import DOC, SCHEMA, _hf_tokenizer
from services.engine.step.grammar import GrammarSpec, bitmask_words, compiler_for
from tests.engine.schema_gen import random_schema

VOCAB = 49152


def walk(compiler, spec: GrammarSpec, tokens: list[int], budget: int | None) -> list[float]:  # noqa: ANN001
    """Seconds per step of one walk of `tokens` (fill + steer + accept; budget None: xgrammar's own calls)."""
    m = compiler.matcher(spec)
    raw = m._matcher
    if budget is not None:
        m.set_budget(budget)
    mask = torch.zeros(1, bitmask_words(VOCAB), dtype=torch.int32)
    out: list[float] = []
    for i, t in enumerate(tokens):
        t0 = time.perf_counter()
        if budget is None:
            raw.fill_next_token_bitmask(mask, 0)
            ok = raw.accept_token(t)
        else:
            m.fill(mask, 0)
            chosen = m.steer(t, budget - i)
            ok = chosen == t and m.accept(t)
        out.append(time.perf_counter() - t0)
        assert ok, (i, t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    tok, _ = _hf_tokenizer()
    compiler = compiler_for(tok, VOCAB)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    tokens = tok.encode(json.dumps(DOC))
    eos = tok.info.eos_token_ids[0]
    tokens = [*tokens, eos]
    rows = {"raw": None, "far": 10_000, "window": len(tokens) + 10}
    print(f"document: {len(tokens)} tokens (with the stop token); first plan: "
          f"{compiler.matcher(spec).set_budget(10_000)} tokens")  # fmt: skip
    for name, budget in rows.items():
        steps: list[float] = []
        for _ in range(a.repeats):
            steps += walk(compiler, spec, tokens, budget)
        us = [s * 1e6 for s in steps]
        print(f"{name:>6}: median {statistics.median(us):7.1f} us, mean {statistics.fmean(us):7.1f} us, "
              f"max {max(us):8.1f} us per token")  # fmt: skip
    firsts, lengths = [], []
    for i in range(200):
        m = compiler.matcher(GrammarSpec("json_schema", json.dumps(random_schema(i))))
        t0 = time.perf_counter()
        lengths.append(m.set_budget(10_000))
        firsts.append((time.perf_counter() - t0) * 1e3)
    print(f"first plan of 200 random schemas: median {statistics.median(firsts):.2f} ms, max {max(firsts):.1f} ms; "
          f"length median {statistics.median(lengths):.0f}, max {max(lengths)} tokens")  # fmt: skip


if __name__ == "__main__":
    main()
