"""Constrained decoding on the real model: N random JSON schemas (tests/engine/schema_gen.py: nested objects,
arrays, enums, numbers, required and optional fields) through an in-process engine with SmolLM2, in waves of
`--batch` concurrent requests; every finished answer must parse and validate against its schema. Then, in the
same run and on the same prompts, the decode time per token of the constrained requests against the same requests
unconstrained (greedy: decode bursts where the device allows; and sampled at temperature 1: the host sampler).

    python -m bench.schema_validity --count 200 --batch 16 --max-tokens 200
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import jsonschema

from services.engine.builder import build_engine
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.grammar import GrammarSpec
from services.engine.sampling import SamplingParams
from services.engine.sequence import Chunk, Done, Failed, FinishReason
from tests.engine.schema_gen import random_schema

logger = logging.getLogger(__name__)


def _prompt(engine: Engine, schema: dict) -> list[int]:
    text = (
        "<|im_start|>system\nYou answer with one JSON object.<|im_end|>\n<|im_start|>user\n"
        f"Give an example object for this JSON schema: {json.dumps(schema)}<|im_end|>\n<|im_start|>assistant\n"
    )
    return engine.tokenizer.encode(text)


def _run_wave(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[tuple], float]:
    t0 = time.perf_counter()
    pairs = enumerate(zip(prompts, params, strict=True))
    seqs = [engine.submit(f"s{i}-{time.monotonic_ns()}", p, q) for i, (p, q) in pairs]
    out = []
    for seq in seqs:
        text, tokens = [], 0
        while True:
            ev = seq.events.get(timeout=600)
            if isinstance(ev, Chunk):
                text.append(ev.text)
                tokens += len(ev.token_ids)
                continue
            out.append(("".join(text), tokens, ev))
            break
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timing-waves", type=int, default=1, help="waves also run unconstrained, for the cost table")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine, info = build_engine(EngineConfig(device=a.device, max_context=2048, kv_capacity=16384,
                                             max_running=a.batch, max_waiting=4 * a.batch))  # fmt: skip
    valid = finished = truncated = 0
    failures: list[str] = []
    timing: dict[str, list[float]] = {"constrained": [0, 0], "greedy": [0, 0], "sampled": [0, 0]}
    t_start = time.perf_counter()
    try:
        for start in range(0, a.count, a.batch):
            ids = list(range(start, min(start + a.batch, a.count)))
            schemas = [random_schema(i) for i in ids]
            prompts = [_prompt(engine, s) for s in schemas]
            params = [SamplingParams(temperature=0.0, max_tokens=a.max_tokens,
                                     grammar=GrammarSpec("json_schema", json.dumps(s))) for s in schemas]  # fmt: skip
            results, secs = _run_wave(engine, prompts, params)
            if start // a.batch < a.timing_waves:
                timing["constrained"][0] += secs
                timing["constrained"][1] += sum(r[1] for r in results)
                for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
                    free = [SamplingParams(temperature=temp, seed=7, max_tokens=r[1], ignore_eos=True) for r in results]
                    res, s = _run_wave(engine, prompts, free)
                    timing[name][0] += s
                    timing[name][1] += sum(r[1] for r in res)
            for i, schema, (text, _, done) in zip(ids, schemas, results, strict=True):
                if isinstance(done, Failed):
                    failures.append(f"schema {i}: failed {done}")
                    continue
                assert isinstance(done, Done)
                if done.finish_reason is FinishReason.LENGTH:
                    truncated += 1
                    continue
                finished += 1
                try:
                    jsonschema.validate(json.loads(text), schema)
                    valid += 1
                except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                    failures.append(f"schema {i}: {type(exc).__name__}: {str(exc)[:120]} :: {text[:200]!r}")
            print(f"schemas {ids[0]}-{ids[-1]}: finished={finished} valid={valid} cut={truncated} "
                  f"failed={len(failures)} ({time.perf_counter() - t_start:.0f} s)", flush=True)  # fmt: skip
    finally:
        engine.stop()
    print(f"model={info.model_id} device={a.device} schemas={a.count} batch={a.batch} max_tokens={a.max_tokens}")
    print(f"finished={finished} valid={valid} ({100.0 * valid / max(finished, 1):.1f}% of finished) "
          f"cut_by_max_tokens={truncated} failed={len(failures)}")  # fmt: skip
    for f in failures[:20]:
        print("  ", f)
    print(f"{'requests':<14}{'tokens':>8}{'seconds':>10}{'ms/token':>10}{'tok/s':>9}")
    for name, (secs, toks) in timing.items():
        if toks:
            print(f"{name:<14}{int(toks):>8}{secs:>10.2f}{1000 * secs / toks:>10.2f}{toks / secs:>9.1f}")


if __name__ == "__main__":
    main()
