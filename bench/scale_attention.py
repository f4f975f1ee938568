"""bench/scale.py --attn-bench / --only-attn: the prefill attention variants alone on the last chunk of a prompt."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bench.scale_engine import tag_len

if TYPE_CHECKING:
    from bench.scale import Run


def attention_bench(run: Run) -> None:
    """The prefill attention alone on the last chunk of a --ttft-len prompt (every key visible but the
    chunk's own causal triangle): the engine's masked path, causal_sdpa, flex_attention, the Triton kernel."""
    total = run.a.ttft_len
    for n, t in ((2048, total), (8192, total), (8192, 8192), (total, total)):
        if n <= t <= total:
            res = _attention_case(run, n, t)
            run.rows[f"attention_{n}x{tag_len(t)}"] = res
            print(f"attention {n} x {t}: {res}", flush=True)


def _attention_case(run: Run, n: int, total: int) -> dict[str, Any]:
    import triton.testing as tt

    from services.engine.kernels.attention import prefill_attention_triton as pat
    from services.engine.kv.attention import causal_sdpa, grouped_sdpa, position_mask

    sh, dev = run.shape, run.device
    q = torch.randn(n, sh.heads, sh.head_dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(sh.kv_heads, total, sh.head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scale = sh.head_dim**-0.5
    group = sh.heads // sh.kv_heads
    flops = 4 * sh.heads * sh.head_dim * (n * (total - n) + n * n / 2)
    res: dict[str, Any] = {}
    fns = {"causal_sdpa": lambda: causal_sdpa(q, k, v, scale)}
    if n * total <= 8192 * 32768:  # the [G * n, T] mask of a whole 32K prompt would be 8.6 GB
        allowed = position_mask(torch.arange(total - n, total, device=dev), torch.arange(total, device=dev))
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=dev).masked_fill_(~allowed, float("-inf"))
        mask = mask.repeat(group, 1)
        fns["masked_sdpa"] = lambda: grouped_sdpa(q, k, v, mask, scale)
    ref = causal_sdpa(q, k, v, scale)
    fns.update(_cudnn_variants(q, k, v, scale, n, total))
    try:
        if not run.a.attn_flex:
            raise RuntimeError("not asked for (--attn-flex: it compiles per shape)")
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        off = total - n
        bm = create_block_mask(lambda b, h, qi, ki: ki <= qi + off, None, None, n, total, device=dev)
        flex = torch.compile(flex_attention)
        qh = q.transpose(0, 1)[None].contiguous()
        fns["flex_attention"] = lambda: flex(qh, k[None], v[None], block_mask=bm, scale=scale, enable_gqa=True)[
            0
        ].transpose(0, 1)
    except Exception as exc:  # noqa: BLE001 -- a bench row records why a variant did not run
        res["flex_not_run"] = repr(exc)[:200]

    pool_rows = torch.randperm(total + 4096, device=dev)[:total]  # scattered rows, as pages are
    k_pool = torch.empty(total + 4096, sh.kv_heads, sh.head_dim, device=dev, dtype=k.dtype)
    v_pool = torch.empty_like(k_pool)
    k_pool[pool_rows], v_pool[pool_rows] = k.transpose(0, 1), v.transpose(0, 1)
    for cfg in ((128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 4, 3), (64, 128, 4, 3)):
        fns[f"triton_paged_{'_'.join(map(str, cfg))}"] = lambda cfg=cfg: pat.prefill_attention(
            q, k_pool, v_pool, pool_rows, scale, cfg=cfg
        )
    fns["gather_kv"] = lambda: (k_pool.index_select(0, pool_rows), v_pool.index_select(0, pool_rows))
    fns.update(_fa4_variants(q, k, v, scale, k_pool, v_pool, pool_rows, res))
    for name, fn in fns.items():
        try:
            out = fn()
            err = -1.0 if isinstance(out, tuple) else ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = tt.do_bench(fn, warmup=50, rep=300, return_mode="median")
            res[name] = dict(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), rel_err=round(err, 5))
        except Exception as exc:  # noqa: BLE001
            res[name] = dict(not_run=repr(exc)[:200])
    res["matmul_tflops"] = round(run.tflops, 1)
    return res


def _cudnn_variants(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, n: int, total: int) -> dict:
    """cuDNN's fused attention (torch's CUDNN_ATTENTION backend) on contiguous K/V: the lower-right causal bias
    (a chunk after a prefix) and, when the chunk is the whole prompt, is_causal; GQA native, or with K/V heads
    repeated when the backend refuses enable_gqa."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    group = q.shape[1] // k.shape[0]
    kr, vr = k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None]

    def run(kind: str, gqa: bool) -> torch.Tensor:
        kk, vv = (k[None], v[None]) if gqa else (kr, vr)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if kind == "causal":
                out = F.scaled_dot_product_attention(qh, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                bias = causal_lower_right(n, total)
                out = F.scaled_dot_product_attention(qh, kk, vv, attn_mask=bias, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)

    fns = {
        "cudnn_lower_right_gqa": lambda: run("lower_right", True),
        "cudnn_lower_right_rep": lambda: run("lower_right", False),
    }
    if n == total:
        fns["cudnn_causal_gqa"] = lambda: run("causal", True)
        fns["cudnn_causal_rep"] = lambda: run("causal", False)
    else:  # the prefix without a mask and the chunk's own triangle, two cuDNN calls merged by their LSE

        def split(gqa: bool) -> torch.Tensor:
            kk, vv = (k[None], v[None]) if gqa else (kr, vr)
            op = torch.ops.aten._scaled_dot_product_cudnn_attention
            past = total - n
            o1, l1 = op(qh, kk[:, :, :past], vv[:, :, :past], None, True, 0.0, False, False, scale=scale)[:2]
            o2, l2 = op(qh, kk[:, :, past:], vv[:, :, past:], None, True, 0.0, True, False, scale=scale)[:2]
            l1, l2 = (x.reshape(1, qh.shape[1], n, 1).float() for x in (l1, l2))
            m = torch.maximum(l1, l2)
            w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
            out = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
            return out.to(q.dtype)[0].transpose(0, 1)

        fns["cudnn_split_gqa"] = lambda: split(True)
        fns["cudnn_split_rep"] = lambda: split(False)
    return fns


def _fa4_variants(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    pool_rows: torch.Tensor,
    res: dict[str, Any],
) -> dict:
    """FlashAttention-4's CuTe DSL forward (`flash_attn.cute`, the flash-attn-4 wheel; its SM90 kernel on a
    Hopper) where it is installed: the chunk over contiguous K/V [1, T, Hkv, D] (causal aligned bottom-right, so
    a chunk after a prefix is one call), and over the pool's pages through a page table (pages of 64 rows, the
    pool's; the kernel needs whole key tiles a page, so it may refuse them). Absent: the reason in `res`."""
    try:
        from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 -- a bench row records why a variant did not run
        res["fa4_not_run"] = repr(exc)[:200]
        return {}
    qb = q[None]  # [1, n, Hq, D]
    kc, vc = k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()  # [1, T, Hkv, D]
    fns = {"fa4": lambda: flash_attn_func(qb, kc, vc, softmax_scale=scale, causal=True)[0][0]}
    total = k.shape[1]
    for page in (64, 128):
        if pool_rows.shape[0] % page or k_pool.shape[0] % page:
            continue
        # the pool's rows in pages: the prompt's keys in scattered whole pages (a permutation of page ids)
        n_pages = k_pool.shape[0] // page
        order = torch.randperm(n_pages, device=q.device)[: total // page]
        rows = (order[:, None] * page + torch.arange(page, device=q.device)).reshape(-1)
        kp, vp = k_pool.clone(), v_pool.clone()
        kp[rows], vp[rows] = k.transpose(0, 1), v.transpose(0, 1)
        kp4, vp4 = kp.view(n_pages, page, *kp.shape[1:]), vp.view(n_pages, page, *vp.shape[1:])
        table = order.to(torch.int32)[None]
        used = torch.tensor([total], dtype=torch.int32, device=q.device)
        fns[f"fa4_paged{page}"] = lambda kp4=kp4, vp4=vp4, table=table, used=used: flash_attn_varlen_func(
            qb, kp4, vp4, page_table=table, seqused_k=used, softmax_scale=scale, causal=True
        )[0][0]
    return fns
