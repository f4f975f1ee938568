"""bench/scale.py's peer: transformers (sdpa, a StaticCache, generate's torch.compile of the decode step) on the
same random weights, in the same process after the engine's rows."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.scale_engine import leading_equal, tag_len
from bench.scale_model import peer_generate

if TYPE_CHECKING:
    from bench.scale import Run

ROWS = {"ttft", "decode", "concurrent", "logits"}  # the rows peer_rows measures


def peer_rows(run: Run, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    a = run.a
    rows = set(a.rows.split(","))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to(run.device).eval()
    print(f"transformers loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        for n, engine_logits in getattr(run, "engine_logits", {}).items() if "logits" in rows else ():
            with torch.inference_mode():
                ids = torch.tensor([run.logit_prompts[n]], device=run.device)
                ref = model(ids, logits_to_keep=1).logits[0, -1].float().cpu()
            cos = torch.nn.functional.cosine_similarity(ref, engine_logits, dim=0).item()
            name = f"{run.names['logits']}_{tag_len(n)}"
            run.rows[name] = dict(
                cosine=round(cos, 5),
                same_argmax=bool(ref.argmax() == engine_logits.argmax()),
                max_abs_diff=round((ref - engine_logits).abs().max().item(), 4),
                prompt_tokens=n,
            )
            print(f"logits at {n}: {run.rows[name]}", flush=True)
        if "ttft" in rows or "decode" in rows:
            r = peer_generate(model, run.prompts["ttft"][:1], a.new_tokens, run.device)
            run.row("ttft")["peer_s"] = round(r["ttft_s"], 4)
            run.row("decode").update(
                peer_tok_s=round(r["decode_tok_s"], 2),
                peer_max_step_s=round(r["max_step_s"], 4),
                peer_median_step_s=round(r["median_step_s"], 4),
                same_tokens_as_engine=leading_equal(r["tokens"], run.engine_tokens),
            )
            print(f"transformers ttft {r['ttft_s']:.3f} s, decode {r['decode_tok_s']:.1f} tok/s", flush=True)
            run.save()
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
        if "concurrent" in rows:
            r = peer_generate(model, run.prompts["concurrent"], a.new_tokens, run.device)
            run.row("concurrent").update(
                peer_wall_s=round(r["wall_s"], 3),
                peer_decode_agg_tok_s=round(r["decode_tok_s"], 1),
                peer_ttft_s=round(r["ttft_s"], 3),
                peer_max_step_s=round(r["max_step_s"], 4),
            )
            print(f"transformers concurrent {run.conc}x{run.conc_len}: wall {r['wall_s']:.2f} s", flush=True)
    except torch.OutOfMemoryError as exc:
        print(f"transformers ran out of memory: {exc}", flush=True)
    finally:
        del model
        gc.collect()
