"""Per-token cost of a JSON-schema token mask: llguidance against xgrammar, batch 1 and 32, same run.

Each of `batch` sequences walks a fixed valid JSON document for the schema token by token; per step the
bench times (a) filling every sequence's bitmask, (b) applying it to a [batch, V] logits tensor on the
device, (c) advancing the matchers; and, in the same run, the unconstrained sampler step (argmax of the
same logits) as the baseline. Also compiles the 200 random schemas of tests/engine/schema_gen.py with each
library and counts the ones it accepts (coverage).

    python -m bench.grammar_mask --device cpu --batches 1 32
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

logger = logging.getLogger(__name__)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "address"],
}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "c", "b"], "address": {"city": "London", "zip": "W1"},
       "score": 0.75}  # fmt: skip


def _hf_tokenizer(tokenizer_json: str = ""):  # noqa: ANN202
    from tokenizers import Tokenizer as FastTokenizer
    from transformers import PreTrainedTokenizerFast

    from services.common.tokenizer import Tokenizer, TokenizerInfo

    if tokenizer_json:  # a machine without the model package: SmolLM2's tokenizer saved as JSON
        info = TokenizerInfo(None, None, "<|im_end|>", None, (2,), False)
        tok = Tokenizer(FastTokenizer.from_file(tokenizer_json), info)
    else:
        from services.common.model_files import resolve_model_path
        from services.common.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model_path("embedded:smollm2"))
    return tok, PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.info.eos_token)


def bench_llguidance(hf, tokens: list[int], batch: int, device: torch.device, vocab: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    executor = llguidance.LLExecutor()
    bitmask = lt.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab, device=device)
    fill, apply, advance = [], [], []
    for t in tokens:
        t0 = time.perf_counter()
        if batch == 1:
            lt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        t1 = time.perf_counter()
        lt.apply_token_bitmask_inplace(logits, bitmask.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        for m in matchers:
            assert m.consume_token(t), m.get_error()
        t3 = time.perf_counter()
        fill.append(t1 - t0), apply.append(t2 - t1), advance.append(t3 - t2)
    assert all(m.is_accepting() for m in matchers)
    return _summary(fill, apply, advance)


def bench_xgrammar(hf, tokens: list[int], batch: int, device: torch.device, vocab: int) -> dict[str, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    batcher = xgr.BatchGrammarMatcher() if batch > 1 else None
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab, device=device)
    fill, apply, advance = [], [], []
    for t in tokens:
        t0 = time.perf_counter()
        if batcher is None:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            batcher.batch_fill_next_token_bitmask(matchers, bitmask)
        t1 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        for m in matchers:
            assert m.accept_token(t)
        t3 = time.perf_counter()
        fill.append(t1 - t0), apply.append(t2 - t1), advance.append(t3 - t2)
    return _summary(fill, apply, advance)


def bench_plain(tokens: list[int], batch: int, device: torch.device, vocab: int) -> dict[str, float]:
    logits = torch.randn(batch, vocab, device=device)
    times = []
    for _ in tokens:
        t0 = time.perf_counter()
        torch.argmax(logits, dim=-1).tolist()
        times.append(time.perf_counter() - t0)
    return _summary([0.0] * len(times), times, [0.0] * len(times))


def _summary(fill: list[float], apply: list[float], advance: list[float]) -> dict[str, float]:
    total = [a + b + c for a, b, c in zip(fill, apply, advance, strict=True)]
    us = 1e6
    return {
        "fill_us": statistics.median(fill) * us,
        "apply_us": statistics.median(apply) * us,
        "advance_us": statistics.median(advance) * us,
        "total_us": statistics.median(total) * us,
        "p99_us": sorted(total)[int(len(total) * 0.99) - 1] * us,
    }


def coverage(hf, vocab: int, count: int) -> dict[str, int]:
    import llguidance
    import llguidance.hf
    import xgrammar as xgr

    from tests.engine.schema_gen import random_schema

    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    ok = {"llguidance": 0, "xgrammar": 0}
    for i in range(count):
        schema = json.dumps(random_schema(i))
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        ok["llguidance"] += not m.is_error()
        try:
            compiler.compile_json_schema(schema)
            ok["xgrammar"] += 1
        except Exception:  # noqa: BLE001 - counting refusals
            pass
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--schemas", type=int, default=200)
    ap.add_argument("--tokenizer-json", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(args.device)
    tok, hf = _hf_tokenizer(args.tokenizer_json)
    vocab = tok.vocab_size
    tokens = tok.encode(json.dumps(DOC))
    print(f"device={device} vocab={vocab} tokens/doc={len(tokens)} torch={torch.__version__}")
    print(f"{'lib':<12}{'batch':>6}{'fill us':>10}{'apply us':>10}{'advance us':>12}{'total us':>10}{'p99 us':>10}")
    for batch in args.batches:
        rows = {
            "none": bench_plain(tokens, batch, device, vocab),
            "llguidance": bench_llguidance(hf, tokens, batch, device, vocab),
            "xgrammar": bench_xgrammar(hf, tokens, batch, device, vocab),
        }
        for lib, r in rows.items():
            print(f"{lib:<12}{batch:>6}{r['fill_us']:>10.1f}{r['apply_us']:>10.1f}{r['advance_us']:>12.1f}"
                  f"{r['total_us']:>10.1f}{r['p99_us']:>10.1f}")  # fmt: skip
    if args.schemas:
        print(f"schemas compiled (of {args.schemas}):", coverage(hf, vocab, args.schemas))


if __name__ == "__main__":
    main()
