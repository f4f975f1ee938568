"""Qwen3.5 text shapes with random weights on one GPU: our forward against transformers' (logits at 2K and 32K)
and the 9B shape's prefill and batch-1 decode speed at 32K through our engine against transformers, same run.

    python -m bench.qwen3_5_h200 [--contexts 2048,32768] [--decode 64] [--out FILE]

Shapes (transformers' Qwen3_5TextConfig fields): the 9B text model whole (32 layers, 8 full-attention), and a
stack of the 27B's first 8 layers (6 linear + 2 full; the whole 27B and a second copy do not fit with 32K
activations). Logits are compared on the last 256 positions: ours (bf16) and transformers' (bf16) each against
transformers in float32 on the same weights, so "within bf16 rounding" reads as our error being no larger
than transformers' own bf16 error. Speed: our engine (paged pool, StepAttention, fla-core kernels, eager decode
steps: no CUDA graphs for recurrent models yet) against transformers' generate-style loop with its cache
(sdpa attention, and fla-core's kernels too where `fla` is importable: its fastest eager path; a compiled
static-cache peer is left out, its compile alone would exceed the run's time), and against the physical
limits: decode reads the weights (less the embedding table), the 32K KV and the recurrent state once a token
(bytes / 4.8 TB/s); prefill does 2 FLOPs a weight a token plus causal attention (FLOPs / 790 TFLOP/s, the
measured bf16 matmul rate). The result file is rewritten after every part, so a run cut short keeps its parts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
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
    from services.engine.attention import ContiguousKV
    from services.engine.recurrent_state import RecurrentStates

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


def logits_rows(shape: str, contexts: list[int], dev: torch.device) -> list[dict[str, Any]]:
    hf, ours = build(shape, dev)
    rows = []
    for ctx in contexts:
        ids = torch.randint(0, hf.config.vocab_size, (ctx,), generator=torch.Generator().manual_seed(ctx)).to(dev)
        t0 = time.perf_counter()
        mine = our_logits(ours, ids)
        sync(dev)
        t1 = time.perf_counter()
        with torch.inference_mode():
            theirs = hf(ids[None], logits_to_keep=KEEP, use_cache=False).logits[0].float()
        sync(dev)
        t2 = time.perf_counter()
        row = {"shape": shape, "ctx": ctx, "ours_s": t1 - t0, "hf_s": t2 - t1, "ours_vs_hf": compare(mine, theirs)}
        logger.warning("%s", row)  # kept in the log even if the float32 pass below fails
        rows.append({**row, "mine": mine.cpu(), "theirs": theirs.cpu(), "ids": ids})
    del ours  # its logits are taken; room for the float32 copy
    empty_cache(dev)
    hf.float()  # the float32 reference on the same weights
    for row in rows:
        ids, mine, theirs = row.pop("ids"), row.pop("mine"), row.pop("theirs")
        try:
            with torch.inference_mode(), blocked_sdpa():
                ref = hf(ids[None], logits_to_keep=KEEP, use_cache=False).logits[0].float().cpu()
        except torch.OutOfMemoryError as exc:  # keep the bf16 comparison of this row
            row["fp32"] = f"FAILED: {exc}"[:200]
            empty_cache(dev)
            continue
        row["ours_vs_fp32"] = compare(mine, ref)
        row["hf_bf16_vs_fp32"] = compare(theirs, ref)
    del hf
    empty_cache(dev)
    return rows


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


def speed_rows(shape: str, ctx: int, decode: int, dev: torch.device, runner_kind: str = "step") -> list[dict[str, Any]]:
    from services.engine.engine import Engine, EngineLimits
    from services.engine.kv_pool import KVPool
    from services.engine.model_runner import ModelRunner
    from services.engine.recurrent_state import RecurrentStates
    from services.engine.sampling import SamplingParams

    hf, ours = build(shape, dev)
    cfg = ours.config
    page, chunk = 64, min(8192, ctx // 2)
    pool = KVPool(len(cfg.kv_layers), (ctx + 2 * decode) // page + 4, page, cfg.num_kv_heads, cfg.head_dim,
                  torch.bfloat16, dev)  # fmt: skip
    states = RecurrentStates(cfg.linear, 2, dev, torch.bfloat16, chunk, 4)
    limits = EngineLimits(max_context=ctx + 2 * decode, page_size=page, prefill_chunk=chunk, max_running=2,
                          max_waiting=4, vocab_size=cfg.vocab_size, model_id="q35-9b", kv_format="bf16")  # fmt: skip
    # "step": every decode step through StepAttention, eagerly; "graphs": the decode runner (static buffers,
    # captured in CUDA graphs: KVMEM_RECURRENT_GRAPHS=1, set by main)
    runner = ModelRunner(ours, pool, dev, None, decode_runner=runner_kind == "graphs", states=states)
    engine = Engine(limits, runner, _Words.make(cfg.vocab_size), None)
    prompt_len = ctx - decode
    limits_row = physical_limits(hf, ours, states, ctx, prompt_len)
    rows: list[dict[str, Any]] = []
    for trial in range(2):  # the first warms up (Triton autotuning, allocator)
        prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(trial))
        params = SamplingParams(temperature=0.0, max_tokens=decode, ignore_eos=True)
        seq = engine.submit(f"s{trial}", prompt.tolist(), params)
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
        ours_tokens = list(seq.output_ids)
        # transformers: one prefill with its cache, then one token at a time (greedy)
        ids = prompt.to(dev)[None]
        sync(dev)
        h0 = time.perf_counter()
        with torch.inference_mode():
            out = hf(ids, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            sync(dev)
            h1 = time.perf_counter()
            cache, hf_tokens = out.past_key_values, [int(token)]
            for _ in range(decode - 1):
                out = hf(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                cache = out.past_key_values
                hf_tokens.append(int(token))
        sync(dev)
        h2 = time.perf_counter()
        if trial:
            same = sum(1 for a, b in zip(ours_tokens, hf_tokens, strict=False) if a == b)
            rows.append({
                "shape": shape, "ctx": ctx, "prompt": prompt_len, "decode": decode,
                "ours_prefill_s": first - t0, "ours_prefill_tok_s": prompt_len / (first - t0),
                "ours_decode_tok_s": (decode - 1) / (t1 - first), "hf_prefill_s": h1 - h0,
                "hf_prefill_tok_s": prompt_len / (h1 - h0), "hf_decode_tok_s": (decode - 1) / (h2 - h1),
                "greedy_tokens_equal_leading": next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens,
                                                     strict=False)) if a != b), len(ours_tokens)),
                "greedy_tokens_equal": same, **limits_row,
                "hf_attn": hf.config._attn_implementation, "hf_fla": fla_version(), "ours_runner": runner_kind,
                "ours_captures": runner.decode.num_captures if runner.decode is not None else 0,
            })  # fmt: skip
    engine.stop()
    return rows


def fla_version() -> str:
    try:
        import fla

        return str(getattr(fla, "__version__", "?"))
    except ImportError:
        return ""


def physical_limits(hf: Any, ours: Any, states: Any, ctx: int, prompt: int) -> dict[str, float]:
    """Decode: bytes read a token / HBM bandwidth; prefill: FLOPs of `prompt` tokens / matmul rate."""
    cfg = ours.config
    params = {p.data_ptr(): p for p in hf.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = hf.get_input_embeddings().weight
    tied = hf.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    decode_weight_bytes = weight_bytes - (0 if tied else embed.numel() * embed.element_size())
    kv_bytes = len(cfg.kv_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * 2 * ctx
    state_bytes = 2 * states.nbytes  # read and written back
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
    from services.engine.kernels.gated_delta import fla_gated_delta_rule, reference_gated_delta_rule

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
    parser.add_argument("--contexts", default="2048,32768")
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--out", default="")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: kernels, 27B, 9B, speed")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runner", default="step", choices=["step", "graphs"], help="our decode steps (speed)")
    parser.add_argument("--shapes", default="27B-8L,9B", help="the two logits shapes (tiny,tiny: a CPU smoke run)")
    a = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from services.engine.kernels import select_tier, use_tier

    skip = set(a.skip.split(",")) - {""}
    if a.runner == "graphs":
        os.environ["KVMEM_RECURRENT_GRAPHS"] = "1"  # read by DecodeGraphs (capture of recurrent steps)
    dev = torch.device(a.device)
    big, small = a.shapes.split(",")
    use_tier(select_tier(dev))
    if dev.type != "cuda":
        skip.add("kernels")
    contexts = [int(c) for c in a.contexts.split(",")]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    result: dict[str, Any] = {"device": name, "torch": torch.__version__}
    import transformers

    result["transformers"] = transformers.__version__
    result["fla"] = fla_version()
    result["commit"] = os.environ.get("KVMEM_COMMIT", "")
    for part, fn in (
        ("kernels", lambda: kernel_rows(dev)),
        ("9B", lambda: logits_rows(small, contexts, dev)),
        ("speed", lambda: speed_rows(small, max(contexts), a.decode, dev, a.runner)),
        ("27B", lambda: logits_rows(big, contexts, dev)),
    ):
        if part in skip:
            continue
        t0 = time.perf_counter()
        try:
            result[part] = fn()
        except Exception as exc:  # noqa: BLE001 - a CLI: report the part that broke, keep the others
            logger.exception("%s failed", part)
            result[part] = f"FAILED: {type(exc).__name__}: {exc}"
        result[f"{part}_wall_s"] = time.perf_counter() - t0
        print(json.dumps({part: result[part]}, default=str), flush=True)  # noqa: T201 - a CLI's output
        empty_cache(dev)
        if a.out:  # after every part: a run cut short keeps what it finished
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
