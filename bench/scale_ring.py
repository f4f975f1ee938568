"""bench/scale.py --rows ring: long sessions at batch through the ring against the same sessions dense (issue 26).

Two engines on the run's model, one after the other, both with fp8 KV (bf16 pages for 32 x 32K do not fit in
HBM beside the weights):

- ring: a pool of --ring-sessions x (--ring-budget + --ring-headroom) tokens (each sequence holds at most
  --ring-budget resident, the headroom only while a re-selection takes effect inside a decode burst),
  a real redis-server and kvstore process on loopback (bench/store.py) holding every page's host copy in a
  shared-memory arena (--ring-arena-dir), the engine writing through to it;
- dense: a pool holding every session whole, no kvstore.

Each engine takes --ring-sessions prompts of --ring-len tokens at once (greedy, --ring-new-tokens each, no EOS),
then one prompt of --long-len tokens alone (--new-tokens), and on the ring engine one prompt of --ttft-len tokens
alone (the batch-1 decode row's 32K session through the ring: `ring_*` keys of <shape>_decode_<L>k beside the
dense engine's of --rows decode; --ring-decode-row off skips it). Reported: completed requests, mean and max TTFT,
aggregate decode tok/s `agg_decode_tok_s` over the window where every session decodes (bench/scale_engine.py
`decoding_together`: from the last first token to the first session's last token; sessions admitted early decode
while later ones prefill, so --ring-new-tokens must outlast the others' prefill: 256 does at 32 x 32K), and
`tail_decode_tok_s` (`aggregate_decode`: tokens after the last first token / the time to the last token: the
tail, where fewer and fewer sessions decode; 2a15acb's 344 tok/s was this one), the long session's TTFT and
decode tok/s; and the limits (bytes a step must read / 4.8 TB/s: weights plus each
sequence's resident K/V in the pool's format). A request refused at admission (the pool or the host store full:
a typed error, never an out-of-memory) is counted and its message kept.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.scale_engine import (
    Captures,
    aggregate_decode,
    built,
    decoding_together,
    engine_requests,
    prompts_of,
    single_decode,
    warm_graphs,
)
from bench.scale_model import HBM_BYTES_PER_S
from services.engine.kv.kv_formats import FP8_HEAD_BYTES
from services.engine.kv.kv_pool import fp8_in_place

if TYPE_CHECKING:
    from bench.scale import Run

FP8_ROW_SCALE_BYTES = FP8_HEAD_BYTES  # kv_formats.py: one fp32 scale per row (token x KV head), padded to 16 bytes


def fp8_token_bytes(run: Run) -> int:
    """Pool bytes of one token in fp8 (K and V of every layer, each row with its scale)."""
    sh = run.shape
    return sh.layers * 2 * sh.kv_heads * (sh.head_dim + FP8_ROW_SCALE_BYTES)


def step_limit_tok_s(run: Run, resident: list[int]) -> float:
    """Aggregate decode tok/s at the bandwidth limit: every weight once + each sequence's resident fp8 rows."""
    step = run.shape.decode_bytes([]) + sum(resident) * fp8_token_bytes(run)
    return HBM_BYTES_PER_S / step * len(resident)


def ring_rows(run: Run, model_dir: Path) -> None:
    a, sh = run.a, run.shape
    n, length, budget = a.ring_sessions, a.ring_len, a.ring_budget
    row = run.rows.setdefault(run.names["ring"], {})
    long_row = run.rows.setdefault(run.names["long"], {})
    new = a.ring_new_tokens
    row.update(sessions=n, prompt_tokens=length - new, new_tokens=new, kv_format="fp8", ring_budget=budget,
               fp8_attention_in_place=fp8_in_place())  # fmt: skip
    one_len = a.ttft_len if a.ring_decode_row == "on" else 0
    per_token = fp8_token_bytes(run)
    host_bytes = (n * (length + 256) + (a.long_len + 256) + (one_len + 256)) * per_token
    host_mib = int(host_bytes * 1.1 / 2**20) + 1024
    free = shutil.disk_usage(a.ring_arena_dir).free
    row["host_store_mib"] = host_mib
    if free < host_mib * 2**20:
        row["not_run"] = (
            f"{a.ring_arena_dir} has {free / 2**30:.1f} GiB free, the host copies need {host_mib / 1024:.1f}"
        )
        print(f"ring rows not run: {row['not_run']}", flush=True)
        return
    max_context = max(length, a.long_len, one_len)
    gen_prompts = prompts_of(run.gen, sh.vocab, n, length - new)
    long_prompt = prompts_of(run.gen, sh.vocab, 1, a.long_len - a.new_tokens) if a.long_len else []
    one_prompt = prompts_of(run.gen, sh.vocab, 1, a.ttft_len - a.new_tokens) if one_len else []
    from bench.store import kvstore, redis_server

    with ExitStack() as stack:
        url = stack.enter_context(redis_server())
        stack.enter_context(kvstore(url, host_mib, "--arena-dir", a.ring_arena_dir))
        config: dict[str, Any] = dict(
            kv_format="fp8", max_context=max_context, kv_capacity=n * (budget + a.ring_headroom) + 4 * 64,
            ring_budget=budget, prefill_chunk=a.prefill_chunk, max_running=n, redis_url=url, host_kv_mib=host_mib,
            ring_switch_in_burst=os.environ.get("KVMEM_RING_SWITCH_IN_BURST", "1") != "0",
            restore_method=os.environ.get("KVMEM_RESTORE_METHOD", "copies"),
            held_restore_method=os.environ.get("KVMEM_HELD_RESTORE_METHOD", "triton"),
        )  # fmt: skip
        with built(run, model_dir, **config) as engine:
            _sessions(run, engine, "ring", gen_prompts, row, [budget] * n)
            cuts = engine.scheduler.burst_cuts  # what ended the decode bursts (scheduler.py), all sessions' run
            row.update(ring_headroom=a.ring_headroom, switch_in_burst=engine.limits.ring.switch_in_burst,
                       burst_cuts=dict(cuts), continue_declines=dict(engine.scheduler.continue_declines),
                       continue_leaves=engine.scheduler.continue_leaves, restore_method=config["restore_method"],
                       held_restore_method=config["held_restore_method"],
                       stack_copies=engine.pool.stack_copies)  # fmt: skip
            if long_prompt:
                _long(run, engine, "ring", long_prompt, long_row, budget)
            if one_prompt:
                _long(run, engine, "ring", one_prompt, run.row("decode"), budget)
    run.save()
    if a.ring_no_dense:
        return
    dense_cap = n * (length + 64) + 4 * 64
    if long_prompt:
        dense_cap = max(dense_cap, a.long_len + 256)
    config = dict(kv_format="fp8", max_context=max_context, kv_capacity=dense_cap, prefill_chunk=a.prefill_chunk,
                  max_running=n)  # fmt: skip
    with built(run, model_dir, **config) as engine:
        _sessions(run, engine, "dense", gen_prompts, row, [length] * n)
        if long_prompt:
            _long(run, engine, "dense_fp8", long_prompt, long_row, a.long_len)
    if row.get("agg_decode_tok_s") and row.get("dense_agg_decode_tok_s"):
        row["ring_over_dense"] = round(row["agg_decode_tok_s"] / row["dense_agg_decode_tok_s"], 3)
    if long_row.get("ring_decode_tok_s") and long_row.get("dense_fp8_decode_tok_s"):
        long_row["ring_over_dense_fp8"] = round(long_row["ring_decode_tok_s"] / long_row["dense_fp8_decode_tok_s"], 3)
    long_row.pop("ring_not_run", None)
    run.save()


def _sessions(run: Run, engine, kind: str, prompts: list[list[int]], row: dict[str, Any], resident: list[int]) -> None:  # type: ignore[no-untyped-def]  # noqa: E501
    """All prompts at once on `engine`; the row's keys are prefixed `dense_` for the dense engine."""
    pre = "" if kind == "ring" else "dense_"
    new = run.a.ring_new_tokens
    contexts = [resident[0]] if kind == "ring" else [len(prompts[0]) + 1, len(prompts[0]) + new]
    row.update({f"{pre}{k}": v for k, v in warm_graphs(run, engine, len(prompts), contexts).items()})
    caps = Captures(engine)
    t0 = time.perf_counter()
    try:
        res = engine_requests(engine, prompts, run.a.ring_new_tokens, f"{kind}-sessions", strict=False)
    except Exception as exc:  # noqa: BLE001 -- the row records what refused the sessions (admission), no number
        row[f"{pre}error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"{kind} sessions failed: {row[f'{pre}error']}", flush=True)
        return
    row.update({f"{pre}{k}": v for k, v in caps.since().items()})
    ok = [s for s in res if not s.error and len(s.tokens) == new]
    row[f"{pre}completed"] = len(ok)
    row[f"{pre}failed"] = len(res) - len(ok)
    if len(ok) < len(res):
        row[f"{pre}errors"] = sorted({s.error[:200] for s in res if s.error})[:3]
    if ok:
        row[f"{pre}wall_s"] = round(max(s.end for s in ok) - t0, 3)
        row[f"{pre}mean_ttft_s"] = round(statistics.mean(s.ttft for s in ok), 3)
        row[f"{pre}max_ttft_s"] = round(max(s.ttft for s in ok), 3)
        together, window, tokens = decoding_together(ok)
        row[f"{pre}agg_decode_tok_s"] = round(together, 1) if window else None
        row[f"{pre}together_s"], row[f"{pre}together_tokens"] = round(window, 3), tokens
        row[f"{pre}tail_decode_tok_s"] = round(aggregate_decode(ok), 1)
        row[f"{pre}prefill_tok_s"] = round(sum(len(p) for p in prompts) / max(s.ttft for s in ok))
    row[f"{pre}limit_agg_decode_tok_s"] = round(step_limit_tok_s(run, resident), 1)
    print(f"{kind} {len(prompts)} x {len(prompts[0])}: {({k: v for k, v in row.items() if k.startswith(pre)})}",
          flush=True)  # fmt: skip
    run.save()


def _long(run: Run, engine, kind: str, prompt: list[list[int]], row: dict[str, Any], resident: int) -> None:  # type: ignore[no-untyped-def]  # noqa: E501
    if run.past_deadline(f"the {kind} long session", row, f"{kind}_not_run"):
        return
    contexts = [resident] if kind == "ring" else [len(prompt[0]) + 1, len(prompt[0]) + run.a.new_tokens]
    warm_graphs(run, engine, 1, contexts)
    caps = Captures(engine)
    try:
        st = engine_requests(engine, prompt, run.a.new_tokens, f"{kind}-long")[0]
    except Exception as exc:  # noqa: BLE001 -- recorded, not a number
        row[f"{kind}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"{kind} long failed: {row[f'{kind}_error']}", flush=True)
        return
    row[f"{kind}_captures_in_row"] = caps.since()["captures_in_row"]
    row[f"{kind}_ttft_s"] = round(st.ttft, 3)
    row[f"{kind}_decode_tok_s"] = round(single_decode(st, run.a.new_tokens), 1)
    row[f"{kind}_limit_decode_tok_s"] = round(step_limit_tok_s(run, [resident]), 1)
    print(f"{kind} long {len(prompt[0])}: ttft {st.ttft:.2f} s, decode {row[f'{kind}_decode_tok_s']} tok/s", flush=True)
    run.save()


def arena_dir_default() -> str:
    return os.environ.get("KVMEM_ARENA_DIR", "/dev/shm")
