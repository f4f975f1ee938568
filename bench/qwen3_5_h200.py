"""Qwen3.5 text shapes with random weights on one GPU: our forward against transformers' (logits at 32K and 2K)
and the 9B shape's prefill and batch-1 decode speed at 32K through our engine against transformers, same run.

    python -m bench.qwen3_5_h200 [--contexts 32768,2048] [--decode 64] [--out FILE] [--budget-s S]
    python -m bench.qwen3_5_h200 --device cpu --shapes tiny,tiny --contexts 1024,256 --decode 8   # a dry run

Parts, in this order (the result file is rewritten after every step of each, so a run cut short keeps what it
measured; with --budget-s no part starts past that many seconds): "9B" logits, "speed", "27B" logits, "graphs",
"kernels". Shapes (transformers' Qwen3_5TextConfig fields): the 9B text model whole (32 layers, 8 full
attention), and a stack of the 27B's first 8 layers (6 linear + 2 full; the whole 27B and a second copy do not
fit with 32K activations). The 9B's models are built once (transformers' bf16 model and ours from its state
dict, sharing the tensors ours does not fuse) and stay for the speed and graphs parts.

Logits, on the last 256 positions: ours (bf16) and transformers' (bf16) each against transformers in float32
on a float32 copy of the same weights, so "within bf16 rounding" reads as our error being no larger than
transformers' own bf16 error. The float32 reference is plain float32: transformers' torch chunked delta rule
(fla-core's, which transformers takes when importable, runs some fp32 dots in tf32), tf32 off, and causal
attention in blocks of 1,024 queries (sdpa's fp32 math path builds the whole [heads, T, T] matrix: 64 GiB).

Speed: our engine (paged pool, fla-core kernels; "speed": eager StepAttention decode steps) against
transformers' generate-style loop with its cache (sdpa attention, fla-core's kernels where importable: its
fastest eager path; a compiled static-cache peer is left out, its compile alone would exceed the run's time),
and against the physical limits: decode reads the weights (less the embedding table), the 32K KV and the
recurrent state once a token (bytes / 4.8 TB/s); prefill does 2 FLOPs a weight a token plus causal attention
(FLOPs / 790 TFLOP/s, the measured bf16 matmul rate). "graphs": the decode runner with its steps captured in
CUDA graphs (KVMEM_RECURRENT_GRAPHS=1) against the same runner run eagerly, same prompt: tokens and tok/s.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

SHAPES: dict[str, dict[str, Any]] = {
    "9B": dict(vocab_size=248_320, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=32,
               num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
               linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128),
    "27B-8L": dict(vocab_size=248_320, hidden_size=5120, intermediate_size=17_408, num_hidden_layers=8,
                   num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                   linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128),
}  # fmt: skip
SHAPES["tiny"] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)  # fmt: skip (a local smoke run)
KEEP = 256
ATTN_BLOCK = 1024  # queries per block of the float32 reference's attention
HBM_BYTES_S = 4.8e12  # H200 HBM3e bandwidth, spec
MATMUL_FLOP_S = 790e12  # bf16 8192^3 matmul measured on this machine kind (KINDS.md)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(shape: str, dev: torch.device) -> tuple[Any, Any]:
    """(transformers' model, ours) on `dev` in bf16, the same random weights (ours built from its state dict)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from services.engine.models.config import ModelConfig
    from services.engine.models.loader import _build

    cfg = Qwen3_5TextConfig(**SHAPES[shape], max_position_embeddings=65_536, rope_parameters={
        "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})  # fmt: skip
    torch.manual_seed(0)
    with torch.device(dev):
        try:
            hf = Qwen3_5ForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
        except TypeError:  # older transformers
            hf = Qwen3_5ForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16).eval()
    state = hf.state_dict()
    ours = _build(ModelConfig.from_hf_config(cfg.to_dict()), lambda name: state[name], dev, torch.bfloat16)
    return hf, ours


@torch.inference_mode()
def our_logits(model: Any, ids: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    from services.engine.kv.attention import ContiguousKV
    from services.engine.kv.recurrent_state import RecurrentStates

    cfg = model.config
    states = RecurrentStates(cfg.linear, 1, ids.device, torch.bfloat16, chunk)
    kv = ContiguousKV(len(cfg.kv_layers), initial_capacity=ids.numel())
    hidden = None
    for start in range(0, ids.numel(), chunk):
        n = min(chunk, ids.numel() - start)
        batch = states.batch([0], [n], [start == 0], [True])
        hidden = model(ids[start : start + n], torch.arange(start, start + n, device=ids.device), kv, batch)
    assert hidden is not None
    return model.logits(hidden[-KEEP:])


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a.float() - b.float()).abs()
    return {
        "max_abs": d.max().item(), "mean_abs": d.mean().item(), "ref_max": b.abs().max().item(),
        "top1_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }  # fmt: skip


def blocked_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: exact causal attention in blocks of ATTN_BLOCK queries.
    For the float32 reference: sdpa has no fused fp32 kernel at head_dim 256 and its math path would build the
    whole [heads, T, T] score matrix (64 GiB at 32K). query [B, H, T, D], key/value [B, Hkv, S, D] (the last T
    keys are the queries' own); returns ([B, T, H, D], None)."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    t, s = query.shape[2], key.shape[2]
    out = torch.empty_like(query)
    for start in range(0, t, ATTN_BLOCK):
        q = query[:, :, start : start + ATTN_BLOCK]
        end = s - t + start + q.shape[2]  # keys past the block's last query are masked anyway
        if attention_mask is not None:
            mask = attention_mask[:, :, start : start + q.shape[2], :end]
        else:
            rows = torch.arange(start, start + q.shape[2], device=q.device) + (s - t)
            mask = torch.arange(end, device=q.device)[None, :] <= rows[:, None]
        out[:, :, start : start + q.shape[2]] = torch.nn.functional.scaled_dot_product_attention(
            q, key[:, :, :end], value[:, :, :end], attn_mask=mask, scale=scaling
        )
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def blocked_sdpa() -> Iterator[None]:
    """transformers' "sdpa" attention is blocked_attention inside (its interface's local override, then undone)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = blocked_attention
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


class Recorder:
    """The result dict, rewritten to `path` after every change (a run cut short keeps what it measured)."""

    def __init__(self, path: str, **head: Any) -> None:
        self.path = path
        self.result: dict[str, Any] = dict(head)

    def put(self, key: str, value: Any) -> None:
        self.result[key] = value
        line = json.dumps({key: value}, default=str)  # the file has it whole; the log keeps it short
        print(line if len(line) < 600 else line[:300] + " ... " + line[-280:], flush=True)  # noqa: T201 - a CLI
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.result, f, indent=1, default=str)


def peak_gib(dev: torch.device) -> float:
    """The allocator's peak since the last reset (GiB), then reset; 0 on the CPU."""
    if dev.type != "cuda":
        return 0.0
    peak = torch.cuda.max_memory_allocated(dev) / 2**30
    torch.cuda.reset_peak_memory_stats(dev)
    return round(peak, 2)


@contextlib.contextmanager
def float32_reference() -> Iterator[str]:
    """transformers in plain float32: its torch chunked delta rule (fla-core, when importable, replaces it at
    import and its Triton kernels take some fp32 dots in tf32), no tf32 in matmuls or convolutions, and the
    blocked causal attention for its "sdpa" (blocked_attention). Yields the delta rule's qualified name."""
    import inspect

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_module

    wrapped = hf_module.torch_chunk_gated_delta_rule
    plain = inspect.unwrap(wrapped)
    if plain.__module__ != hf_module.__name__:
        raise RuntimeError(f"the float32 reference's delta rule unwrapped to {plain.__module__}.{plain.__name__}")
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    hf_module.torch_chunk_gated_delta_rule = plain
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ALL_ATTENTION_FUNCTIONS["sdpa"] = blocked_attention
    try:
        yield f"{plain.__module__}.{plain.__qualname__}"
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
        hf_module.torch_chunk_gated_delta_rule = wrapped


def logits_rows(hf: Any, ours: Any, shape: str, contexts: list[int], dev: torch.device, rec: Recorder) -> None:
    """rec[shape]: per context, ours (bf16) and transformers (bf16) against each other, then both against
    transformers in float32 on a float32 copy of the same weights (freed before returning; hf and ours stay)."""
    rows: list[dict[str, Any]] = []
    keep: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for ctx in contexts:
        ids = torch.randint(0, hf.config.vocab_size, (ctx,), generator=torch.Generator().manual_seed(ctx)).to(dev)
        peak_gib(dev)
        t0 = time.perf_counter()
        mine = our_logits(ours, ids)
        sync(dev)
        t1 = time.perf_counter()
        ours_peak = peak_gib(dev)
        with torch.inference_mode():
            theirs = hf(ids[None], logits_to_keep=KEEP, use_cache=False).logits[0].float()
        sync(dev)
        t2 = time.perf_counter()
        rows.append({
            "shape": shape, "ctx": ctx, "ours_s": t1 - t0, "hf_s": t2 - t1, "ours_vs_hf": compare(mine, theirs),
            "peak_gib_ours": ours_peak, "peak_gib_hf": peak_gib(dev),
        })  # fmt: skip
        keep.append((ids, mine.cpu(), theirs.cpu()))
        rec.put(shape, rows)  # the bf16 comparison, kept even if the float32 pass below fails
    t0 = time.perf_counter()
    ref_model = copy.deepcopy(hf).float()  # the float32 reference on the same weights; hf stays bf16
    empty_cache(dev)
    rec.put(f"{shape}_fp32_copy_s", time.perf_counter() - t0)
    with float32_reference() as delta_rule:
        for row, (ids, mine, theirs) in zip(rows, keep, strict=True):
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    ref = ref_model(ids[None], logits_to_keep=KEEP, use_cache=False).logits[0].float().cpu()
            except torch.OutOfMemoryError as exc:  # keep the bf16 comparison of this row
                row["fp32"] = f"FAILED: {exc}"[:300]
                empty_cache(dev)
                continue
            row["fp32_s"] = time.perf_counter() - t0
            row["fp32_delta_rule"] = delta_rule
            row["peak_gib_fp32"] = peak_gib(dev)
            row["ours_vs_fp32"] = compare(mine, ref)
            row["hf_bf16_vs_fp32"] = compare(theirs, ref)
            row["cos_ours_fp32"] = cosine(mine, ref)
            row["cos_hf_bf16_fp32"] = cosine(theirs, ref)
            rec.put(shape, rows)
    del ref_model
    empty_cache(dev)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The mean over positions of the cosine similarity of two logit rows."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean().item()


def empty_cache(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


class _Words:
    """A word-level tokenizer t0 .. t{V-1} (the engine detokenizes what it emits)."""

    @staticmethod
    def make(vocab: int) -> Any:
        from tokenizers import Tokenizer as Fast
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import WhitespaceSplit

        from services.common.tokenizer import Tokenizer, TokenizerInfo

        fast = Fast(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
        fast.pre_tokenizer = WhitespaceSplit()
        return Tokenizer(fast, TokenizerInfo(None, None, None, None, (), False))


def our_engine(ours: Any, ctx: int, decode: int, dev: torch.device, runner_kind: str) -> Any:
    """Our engine on `ours`: a paged pool for one sequence of ctx + decode tokens, two state slots.
    runner_kind "step": every decode step through StepAttention, eagerly; "runner": the decode runner (static
    buffers) run eagerly; "graphs": the decode runner captured in CUDA graphs (KVMEM_RECURRENT_GRAPHS=1)."""
    from services.engine.engine import Engine
    from services.engine.kv.kv_pool import KVPool
    from services.engine.kv.recurrent_state import RecurrentStates
    from services.engine.records import EngineLimits
    from services.engine.step.model_runner import ModelRunner

    cfg = ours.config
    page, chunk = 64, min(8192, ctx // 2)
    pool = KVPool(len(cfg.kv_layers), (ctx + 2 * decode) // page + 4, page, cfg.num_kv_heads, cfg.head_dim,
                  torch.bfloat16, dev)  # fmt: skip
    states = RecurrentStates(cfg.linear, 2, dev, torch.bfloat16, chunk, 4)
    limits = EngineLimits(max_context=ctx + 2 * decode, page_size=page, prefill_chunk=chunk, max_running=2,
                          max_waiting=4, vocab_size=cfg.vocab_size, model_id="q35-9b", kv_format="bf16")  # fmt: skip
    saved = os.environ.get("KVMEM_RECURRENT_GRAPHS")
    os.environ["KVMEM_RECURRENT_GRAPHS"] = "1" if runner_kind == "graphs" else "0"  # read by DecodeGraphs
    try:
        runner = ModelRunner(ours, pool, dev, None, decode_runner=runner_kind != "step",
                             cuda_graphs=runner_kind == "graphs", states=states)  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("KVMEM_RECURRENT_GRAPHS", None)
        else:
            os.environ["KVMEM_RECURRENT_GRAPHS"] = saved
    return Engine(limits, runner, _Words.make(cfg.vocab_size), None)


def time_ours(engine: Any, prompt: list[int], decode: int, dev: torch.device, name: str) -> dict[str, Any]:
    """One greedy request through `engine`: TTFT (submit to first token), decode tok/s, the tokens."""
    from services.engine.step.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=decode, ignore_eos=True)
    seq = engine.submit(name, prompt, params)
    sync(dev)
    t0 = time.perf_counter()
    engine.poll()
    first = None
    while not seq.is_finished:
        engine.step()
        if first is None and seq.output_ids:
            sync(dev)
            first = time.perf_counter()
    sync(dev)
    t1 = time.perf_counter()
    assert first is not None
    return {"prefill_s": first - t0, "decode_tok_s": (decode - 1) / (t1 - first), "tokens": list(seq.output_ids)}


def time_hf(hf: Any, prompt: list[int], decode: int, dev: torch.device) -> dict[str, Any]:
    """transformers: one prefill with its cache, then one token at a time (greedy), as generate does."""
    ids = torch.tensor(prompt, device=dev)[None]
    sync(dev)
    h0 = time.perf_counter()
    with torch.inference_mode():
        out = hf(ids, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(dev)
        h1 = time.perf_counter()
        cache, tokens = out.past_key_values, [int(token)]
        for _ in range(decode - 1):
            out = hf(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            cache = out.past_key_values
            tokens.append(int(token))
    sync(dev)
    h2 = time.perf_counter()
    return {"prefill_s": h1 - h0, "decode_tok_s": (decode - 1) / (h2 - h1), "tokens": tokens}


def leading_equal(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def speed_prompt(vocab: int, ctx: int, decode: int, trial: int) -> list[int]:
    gen = torch.Generator().manual_seed(trial)
    return torch.randint(0, vocab, (ctx - decode,), generator=gen).tolist()


def speed_row(hf: Any, ours: Any, shape: str, ctx: int, decode: int, dev: torch.device) -> dict[str, Any]:
    """Prefill (TTFT) and batch-1 decode at `ctx` (prompt ctx - decode, then decode tokens): our engine (eager
    StepAttention steps) and transformers, after a warm-up request of each (Triton autotuning, allocator)."""
    engine = our_engine(ours, ctx, decode, dev, "step")
    vocab = ours.config.vocab_size
    try:
        for trial in range(2):  # the first warms up
            prompt = speed_prompt(vocab, ctx, decode, trial)
            mine = time_ours(engine, prompt, decode, dev, f"s{trial}")
            theirs = time_hf(hf, prompt, decode, dev)
    finally:
        engine.stop()
    n = len(prompt)
    return {
        "shape": shape, "ctx": ctx, "prompt": n, "decode": decode, "ours_runner": "step",
        "ours_prefill_s": mine["prefill_s"], "ours_prefill_tok_s": n / mine["prefill_s"],
        "ours_decode_tok_s": mine["decode_tok_s"], "hf_prefill_s": theirs["prefill_s"],
        "hf_prefill_tok_s": n / theirs["prefill_s"], "hf_decode_tok_s": theirs["decode_tok_s"],
        "greedy_tokens_equal_leading": leading_equal(mine["tokens"], theirs["tokens"]),
        "greedy_tokens_equal": sum(a == b for a, b in zip(mine["tokens"], theirs["tokens"], strict=False)),
        "ours_tokens": mine["tokens"], "hf_tokens": theirs["tokens"], **physical_limits(hf, ours, ctx, n),
        "hf_attn": hf.config._attn_implementation, "hf_fla": fla_version(), "peak_gib": peak_gib(dev),
    }  # fmt: skip


def graphs_row(ours: Any, ctx: int, decode: int, dev: torch.device, step_tokens: list[int] | None) -> dict[str, Any]:
    """The decode runner with its steps captured in CUDA graphs (KVMEM_RECURRENT_GRAPHS=1) against the same
    runner run eagerly on the same prompt (the speed row's measured one): tokens, decode tok/s, graph counts."""
    vocab = ours.config.vocab_size
    row: dict[str, Any] = {"ctx": ctx, "decode": decode}
    engine = our_engine(ours, ctx, decode, dev, "graphs")
    try:
        for trial in range(2):  # the first captures (and warms up)
            graphs = time_ours(engine, speed_prompt(vocab, ctx, decode, trial), decode, dev, f"g{trial}")
        decode_graphs = engine.runner.decode
        row.update({
            "graphs_prefill_s": graphs["prefill_s"], "graphs_decode_tok_s": graphs["decode_tok_s"],
            "graphs_captures": decode_graphs.num_captures, "graphs_replays": decode_graphs.num_replays,
            "graphs_eager_steps": decode_graphs.num_eager, "graphs_tokens": graphs["tokens"],
        })  # fmt: skip
    finally:
        engine.stop()
    engine = our_engine(ours, ctx, decode, dev, "runner")
    try:
        eager = time_ours(engine, speed_prompt(vocab, ctx, decode, 1), decode, dev, "r1")
    finally:
        engine.stop()
    row.update({
        "runner_eager_decode_tok_s": eager["decode_tok_s"],
        "graphs_vs_runner_eager_leading": leading_equal(graphs["tokens"], eager["tokens"]),
        "graphs_vs_runner_eager_equal": sum(a == b for a, b in zip(graphs["tokens"], eager["tokens"], strict=False)),
    })  # fmt: skip
    if step_tokens is not None:
        row["graphs_vs_step_leading"] = leading_equal(graphs["tokens"], step_tokens)
    row["peak_gib"] = peak_gib(dev)
    return row


def fla_version() -> str:
    try:
        import fla

        return str(getattr(fla, "__version__", "?"))
    except ImportError:
        return ""


def physical_limits(hf: Any, ours: Any, ctx: int, prompt: int) -> dict[str, float]:
    """Decode: bytes read a token / HBM bandwidth; prefill: FLOPs of `prompt` tokens / matmul rate."""
    cfg = ours.config
    lin = cfg.linear
    conv_bytes = len(lin.layers) * lin.conv_dim * (lin.conv_kernel - 1) * 2  # bf16
    ssm_bytes = len(lin.layers) * lin.num_v_heads * lin.k_head_dim * lin.v_head_dim * 4  # float32
    params = {p.data_ptr(): p for p in hf.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = hf.get_input_embeddings().weight
    tied = hf.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    decode_weight_bytes = weight_bytes - (0 if tied else embed.numel() * embed.element_size())
    kv_bytes = len(cfg.kv_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * 2 * ctx
    state_bytes = 2 * (conv_bytes + ssm_bytes)  # read and written back
    decode_bytes = decode_weight_bytes + kv_bytes + state_bytes
    matmul_params = decode_weight_bytes // 2  # bf16: every weight but the embedding table is a matmul weight
    heads = hf.config.num_attention_heads
    attn_flops = len(cfg.kv_layers) * 2 * heads * cfg.head_dim * prompt * prompt  # QK^T + PV, causal half
    prefill_flops = 2 * matmul_params * prompt + attn_flops
    return {
        "weight_bytes": weight_bytes, "decode_bytes_per_token": decode_bytes,
        "limit_decode_tok_s": HBM_BYTES_S / decode_bytes, "prefill_flops": prefill_flops,
        "limit_prefill_s": prefill_flops / MATMUL_FLOP_S, "limit_prefill_tok_s": prompt * MATMUL_FLOP_S / prefill_flops,
    }  # fmt: skip


def kernel_rows(dev: torch.device) -> list[dict[str, Any]]:
    from services.engine.kernels.layer.gated_delta import fla_gated_delta_rule, reference_gated_delta_rule

    rows = []
    for lengths in ([300, 1, 77], [1, 1, 1, 1]):
        gen = torch.Generator(device=dev).manual_seed(0)
        n, hk, hv, d = sum(lengths), 16, 32, 128
        q, k = (torch.randn(n, hk, d, device=dev, generator=gen).bfloat16() for _ in range(2))
        v = torch.randn(n, hv, d, device=dev, generator=gen).bfloat16()
        g = -torch.rand(n, hv, device=dev, generator=gen) * 0.5
        beta = torch.rand(n, hv, device=dev, generator=gen).bfloat16()
        h0 = torch.randn(len(lengths), hv, d, d, device=dev, generator=gen) * 0.1
        out, final = fla_gated_delta_rule(q, k, v, g, beta, h0, lengths)
        ref, ref_final = reference_gated_delta_rule(q, k, v, g, beta, h0, lengths)
        rows.append({"lengths": lengths, "out": compare(out, ref), "state": compare(final, ref_final)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="32768,2048", help="logits contexts (the largest: the speed's)")
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--out", default="")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: 9B, speed, 27B, graphs, kernels")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="27B-8L,9B", help="the two logits shapes (tiny,tiny: a CPU smoke run)")
    parser.add_argument("--budget-s", type=float, default=0.0, help="start no part after this many seconds (0: none)")
    a = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import transformers

    from services.engine.kernels import select_tier, use_tier

    began = time.perf_counter()
    skip = set(a.skip.split(",")) - {""}
    dev = torch.device(a.device)
    big, small = a.shapes.split(",")
    use_tier(select_tier(dev))
    if dev.type != "cuda":
        skip.add("kernels")  # fla-core: CUDA only ("graphs" runs its steps eagerly: capture is CUDA only)
    contexts = [int(c) for c in a.contexts.split(",")]
    rec = Recorder(
        a.out, device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
        transformers=transformers.__version__, fla=fla_version(), commit=os.environ.get("KVMEM_COMMIT", ""),
        argv=" ".join(sys.argv[1:]),
    )  # fmt: skip
    models: dict[str, tuple[Any, Any]] = {}

    def built(shape: str) -> tuple[Any, Any]:
        if shape not in models:
            t0 = time.perf_counter()
            models[shape] = build(shape, dev)
            rec.put(f"{shape}_build_s", time.perf_counter() - t0)
        return models[shape]

    def drop(shape: str) -> None:
        models.pop(shape, None)
        empty_cache(dev)

    def stack_logits(shape: str) -> None:
        logits_rows(*built(shape), shape, contexts, dev, rec)
        drop(shape)

    step_tokens: list[list[int]] = []

    def speed() -> None:
        row = speed_row(*built(small), small, max(contexts), a.decode, dev)
        step_tokens.append(row["ours_tokens"])
        rec.put("speed", [row])

    # the 9B's logits, then its speed (the 9B models stay for the graphs part), the 27B stack's logits, the
    # 9B's decode steps in CUDA graphs, fla-core against the torch reference (measured in run 1)
    parts: list[tuple[str, Any]] = [
        ("9B", lambda: logits_rows(*built(small), small, contexts, dev, rec)),
        ("speed", speed),
        ("27B", lambda: stack_logits(big)),
        (
            "graphs",
            lambda: rec.put(
                "graphs",
                [graphs_row(built(small)[1], max(contexts), a.decode, dev, step_tokens[0] if step_tokens else None)],
            ),
        ),  # fmt: skip
        ("kernels", lambda: rec.put("kernels", kernel_rows(dev))),
    ]
    for part, fn in parts:
        if part in skip:
            continue
        if a.budget_s and time.perf_counter() - began > a.budget_s:
            rec.put(f"{part}_wall_s", "skipped: past --budget-s")
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a CLI: report the part that broke, keep the others
            logger.exception("%s failed", part)
            rec.put(f"{part}_error", f"FAILED: {type(exc).__name__}: {exc}"[:2000])
        rec.put(f"{part}_wall_s", time.perf_counter() - t0)
        empty_cache(dev)
    rec.put("total_s", time.perf_counter() - began)


if __name__ == "__main__":
    main()
