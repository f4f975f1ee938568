"""Does the engine compute what the model computes on the evaluation's own prompts? (issue 25)

Gemma 3 270M's answers through the stack on the H200 are odd at 8K-30K ("tthe", "Hhere", "vialue"), for dense
and the ring alike; a base model this small may simply do that, or the GPU path may be wrong. This runs the
prompts the cache guard sends for some tuning-split cases (document and question, a completion shape and a chat
shape) through the engine in-process, per variant (dtype, kernel tier), greedy, and through transformers loaded
from the same GGUF in float32 (the reference): the reference's own greedy continuation, and the reference
teacher-forced on each variant's continuation (at every generated position: is the variant's token the
reference's argmax, and how many nats below the reference's best it is).

    python -m bench.longeval.numerics --model /tmp/gemma3.gguf --device cuda --lengths 2048,8192,30000 \
        --variants bf16,bf16+kernels=torch,fp32+kernels=torch

A variant is a dtype (`bf16`, `fp32`) followed by `+key=value` EngineConfig overrides. It prints one table and
writes a JSON of every continuation (`--out`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.longeval import tasks
from bench.longeval.probe import _parse_variant, build_requests, stream
from bench.longeval.split import SPLITS
from services.engine.builder import build_engine
from services.engine.config import EngineConfig
from services.engine.step.sampling import SamplingParams


def cases_for(tok, lengths: list[int], shapes: list[str], per: int) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    """The cache guard's token ids for `per` tuning cases of each length x shape (single_code, prose or code)."""
    split = SPLITS["tuning"]
    digits = tasks.digit_tokens(tok.encode)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    cases = []
    for length in lengths:
        for shape in shapes:
            for i in range(per):
                rng = random.Random(f"numerics:{length}:{shape}:{i}")
                kind, half = split.kinds[rng.randrange(len(split.kinds))]
                depth = (0.2, 0.5, 0.8)[i % 3]
                cases.append(tasks.make_case(split, "single_code", kind, half, length, depth, shape, i, count, digits))
    return build_requests(tok, cases, "question")


def generate(engine, req: dict[str, Any], new: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy, the stack's path (device argmax where the engine takes it), `new` tokens, EOS ignored."""
    return stream(engine, req, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))[0]


@torch.inference_mode()
def teacher(hf, prompt: list[int], cont: list[int], dev: torch.device) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The reference on prompt + cont: per position of cont, its argmax and cont's token's gap below the best."""
    ids = torch.tensor([prompt + cont[:-1]], device=dev)
    logits = hf(ids, logits_to_keep=len(cont), use_cache=False).logits[0].float()  # [len(cont), V]
    logp = torch.log_softmax(logits, dim=-1)
    best = logp.max(dim=-1)
    mine = logp[torch.arange(len(cont), device=dev), torch.tensor(cont, device=dev)]
    gaps = (best.values - mine).tolist()
    return {"agree": [int(a == c) for a, c in zip(best.indices.tolist(), cont, strict=True)],
            "gap_nats": [round(g, 3) for g in gaps], "ref_argmax": best.indices.tolist()}  # fmt: skip


def load_reference(model: str, dev: torch.device):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    path = Path(model)
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return hf.to(dev).eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file (transformers loads the same file)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", default="2048")
    p.add_argument("--shapes", default="completion,chat_doc_earlier")
    p.add_argument("--per", type=int, default=1, help="cases per length x shape")
    p.add_argument("--new", type=int, default=32, help="tokens generated")
    p.add_argument("--variants", default="bf16,fp32+kernels=torch")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    lengths = [int(x) for x in a.lengths.split(",")]
    context = -(-(max(lengths) + 512) // 64) * 64
    dev = torch.device(a.device)
    base = EngineConfig(model=a.model, device=a.device, max_context=context, kv_capacity=context,
                        prefill_chunk=512, max_running=1)  # fmt: skip
    reqs: list[dict[str, Any]] = []
    conts: dict[str, list[list[int]]] = {}
    tok = None
    for spec in a.variants.split(","):
        dtype, _, rest = spec.partition("+")
        if dtype not in ("bf16", "fp32"):
            raise SystemExit(f"variant {spec!r}: the dtype first, bf16 or fp32")
        _, cfg, _, _ = _parse_variant("dense" + (f"+{rest}" if rest else ""), base, context)
        cfg = replace(cfg, dtype=dtype)
        t0 = time.perf_counter()
        engine, _ = build_engine(cfg)
        tok = engine.tokenizer
        if not reqs:
            reqs = cases_for(tok, lengths, a.shapes.split(","), a.per)
        conts[spec] = [generate(engine, r, a.new) for r in reqs]
        engine.stop()
        del engine
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{spec}: {len(reqs)} cases in {time.perf_counter() - t0:.1f} s", flush=True)
    assert tok is not None
    hf = load_reference(a.model, dev)
    rows: list[dict[str, Any]] = []
    for i, req in enumerate(reqs):
        case = req["case"]
        with torch.inference_mode():
            ids = torch.tensor([req["ids"]], device=dev)
            ref = hf.generate(ids, max_new_tokens=a.new, do_sample=False, min_new_tokens=a.new)[0, len(req["ids"]) :]
        ref_cont = ref.tolist()
        row: dict[str, Any] = {"case_id": case.case_id, "tokens": len(req["ids"]), "answer": case.answers,
                               "reference": tok.decode(ref_cont), "variants": {}}  # fmt: skip
        for spec, cs in conts.items():
            t = teacher(hf, req["ids"], cs[i], dev)
            lead = next((j for j, (x, y) in enumerate(zip(cs[i], ref_cont, strict=False)) if x != y), len(cs[i]))
            row["variants"][spec] = {"text": tok.decode(cs[i]), "leading_equal": lead, **t}
        rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'case':58} {'tok':>6} {'variant':24} {'lead=ref':>8} {'argmax%':>7} {'max gap':>7}  text")
    for row in rows:
        print(f"{row['case_id'][:58]:58} {row['tokens']:6} {'reference fp32':24} {'':>8} {'':>7} {'':>7}  "
              f"{row['reference'][:60]!r}")  # fmt: skip
        for spec, v in row["variants"].items():
            agree = 100.0 * sum(v["agree"]) / max(1, len(v["agree"]))
            print(f"{'':58} {'':6} {spec:24} {v['leading_equal']:8} {agree:7.0f} {max(v['gap_nats']):7.2f}  "
                  f"{v['text'][:60]!r}")  # fmt: skip
    summary = {
        spec: {"argmax_agree": sum(sum(r["variants"][spec]["agree"]) for r in rows)
               / max(1, sum(len(r["variants"][spec]["agree"]) for r in rows)),
               "mean_gap_nats": sum(sum(r["variants"][spec]["gap_nats"]) for r in rows)
               / max(1, sum(len(r["variants"][spec]["gap_nats"]) for r in rows)),
               "positions_gap_over_1nat": sum(sum(g > 1.0 for g in r["variants"][spec]["gap_nats"]) for r in rows)}
        for spec in conts
    }  # fmt: skip
    for spec, s in summary.items():
        print(
            f"{spec:24} argmax agrees with the reference at {100 * s['argmax_agree']:.1f}% of generated positions; "
            f"mean gap {s['mean_gap_nats']:.3f} nats; {s['positions_gap_over_1nat']} positions > 1 nat"
        )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"argv": argv, "summary": summary, "rows": rows}, indent=1))
    if not math.isfinite(sum(s["mean_gap_nats"] for s in summary.values())):
        raise SystemExit("non-finite gap")


if __name__ == "__main__":
    main()
