"""Our Qwen3.5 forward against transformers' Qwen3_5ForCausalLM on tiny random configs (CPU, float32): a
saved checkpoint loads through our loader, and the logits of a prefill, of chunked prefills and of decode
steps (the linear layers' conv and delta-rule states carried in RecurrentStates) match transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.tiny_qwen3_5 import random_model, tiny_text_config
from services.engine.kernels.layer.gated_delta import reference_gated_delta_rule
from services.engine.kv.attention import ContiguousKV
from services.engine.kv.recurrent_state import RecurrentStates
from services.engine.models.config import ModelConfig, UnsupportedModelError
from services.engine.models.loader import load_model
from services.engine.models.qwen3_5 import Qwen3_5ForCausalLM

VOCAB = 300


def _pair(tmp_path: Path, seed: int, **overrides: object) -> tuple[torch.nn.Module, ModelConfig, Qwen3_5ForCausalLM]:
    hf = random_model(tiny_text_config(VOCAB, **overrides), seed)  # type: ignore[arg-type]
    hf.save_pretrained(str(tmp_path / "ckpt"))
    config, model = load_model(tmp_path / "ckpt", torch.device("cpu"), torch.float32)
    assert isinstance(model, Qwen3_5ForCausalLM)
    return hf, config, model


def run_chunks(model: Qwen3_5ForCausalLM, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of every token of ids [T], fed in the given chunk sizes (one sequence)."""
    cfg = model.config
    assert cfg.linear is not None
    states = RecurrentStates(cfg.linear, 1, ids.device, model.embed_tokens.weight.dtype, 16)
    kv = ContiguousKV(len(cfg.kv_layers))
    out, start = [], 0
    with torch.inference_mode():
        for n in chunks:
            batch = states.batch([0], [n], [start == 0], [True])
            hidden = model(ids[start : start + n], torch.arange(start, start + n, device=ids.device), kv, batch)
            out.append(model.logits(hidden))
            start += n
    return torch.cat(out)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # float32 with std-0.5 weights: activations reach ~500, so summation-order noise reaches ~1e-5 relative
    assert (ours - ref).abs().max().item() <= 2e-4 * ref.abs().max().item()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    "case",
    [
        {},  # 3 linear + 1 full layer, grouped value heads (4 over 2 key heads)
        {
            "layers": 5,
            "layer_types": [
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
                "linear_attention",
            ],
            "linear_num_value_heads": 2,
            "tie_word_embeddings": True,
        },
    ],
)
def test_logits_match_transformers(tmp_path: Path, case: dict[str, object]) -> None:
    hf, config, model = _pair(tmp_path, 3, **case)
    assert config.kv_layers == tuple(i for i, t in enumerate(hf.config.layer_types) if t == "full_attention")
    ids = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    _close(run_chunks(model, ids, [150]), ref)  # one prefill (chunked delta rule over 3 chunks of 64)
    _close(run_chunks(model, ids, [70, 33, 1, 1, 45]), ref)  # the state carried across chunks and single tokens
    _close(run_chunks(model, ids, [1] * 20 + [130]), ref)  # decode-like steps first (the recurrent form)


def test_states_are_per_sequence(tmp_path: Path) -> None:
    """Two sequences in one step, each in its own slot, get what each gets alone."""
    _, config, model = _pair(tmp_path, 4)
    assert config.linear is not None
    a = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2))
    b = torch.randint(0, VOCAB, (25,), generator=torch.Generator().manual_seed(3))
    alone_a, alone_b = run_chunks(model, a, [30, 1, 9]), run_chunks(model, b, [20, 1, 4])
    states = RecurrentStates(config.linear, 3, torch.device("cpu"), torch.float32, 16)
    states.ssm.fill_(7.0)  # stale content of fresh slots is never read
    kvs = [ContiguousKV(len(config.kv_layers)) for _ in range(2)]

    class Two:  # attends each sequence's tokens in its own ContiguousKV
        def kv_sink(self, layer_idx: int) -> None:
            return None

        def attend(self, layer_idx: int, q, k, v, scale, **kw):  # type: ignore[no-untyped-def]
            out, start = [], 0
            for kv, n in zip(kvs, self.lengths, strict=True):
                out.append(
                    kv.attend(layer_idx, q[start : start + n], k[start : start + n], v[start : start + n], scale)
                )
                start += n
            return torch.cat(out)

    two = Two()
    got_a, got_b = [], []
    with torch.inference_mode():
        for (sa, na), (sb, nb) in [((0, 30), (0, 20)), ((30, 1), (20, 1)), ((31, 9), (21, 4))]:
            two.lengths = [na, nb]
            ids = torch.cat((a[sa : sa + na], b[sb : sb + nb]))
            pos = torch.cat((torch.arange(sa, sa + na), torch.arange(sb, sb + nb)))
            logits = model.logits(
                model(ids, pos, two, states.batch([2, 0], [na, nb], [sa == 0, sb == 0], [True, True]))
            )
            got_a.append(logits[:na])
            got_b.append(logits[na:])
    torch.testing.assert_close(torch.cat(got_a), alone_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(got_b), alone_b, rtol=1e-4, atol=1e-4)


def test_reference_kernel_chunked_equals_recurrent() -> None:
    """The torch reference's two forms (chunks of 64; token by token) give the same output and final state."""
    gen = torch.Generator().manual_seed(0)
    t, hk, hv, dk, dv = 100, 2, 4, 16, 8
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen)
    beta = torch.rand(t, hv, generator=gen)
    h0 = torch.randn(1, hv, dk, dv, generator=gen)
    chunked, h_chunked = reference_gated_delta_rule(q, k, v, g, beta, h0, [t])
    steps, h = [], h0
    for i in range(t):
        o, h = reference_gated_delta_rule(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], h, [1]
        )
        steps.append(o)
    torch.testing.assert_close(chunked, torch.cat(steps), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h_chunked, h, rtol=1e-4, atol=1e-4)


def test_config_refuses_what_we_do_not_run() -> None:
    base = tiny_text_config(VOCAB).to_dict()
    assert ModelConfig.from_hf_config(base).kv_layers == (3,)
    wrapped = ModelConfig.from_hf_config({"model_type": "qwen3_5", "text_config": base})
    assert wrapped.linear is not None and wrapped.linear.layers == (0, 1, 2) and wrapped.rotary_dim == 8
    with pytest.raises(UnsupportedModelError, match="no full_attention"):
        ModelConfig.from_hf_config({**base, "layer_types": ["linear_attention"] * 4})
    with pytest.raises(UnsupportedModelError, match="rope scaling"):
        ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.slow
def test_triton_tier_matches_the_torch_code(tmp_path: Path, triton_tier: None) -> None:
    """On the Triton tier (interpreted here) the norms, skinny projections and the head take the kernels; the
    logits of a prefill and of decode steps stay the torch code's."""
    from services.engine import kernels

    _, _, model = _pair(tmp_path, 5, hidden=32)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(4))
    on_triton = run_chunks(model, ids, [20, 1, 1, 1, 1])
    kernels.use_tier(kernels.KernelTier("torch", "cpu", None, False))
    _close(on_triton, run_chunks(model, ids, [20, 1, 1, 1, 1]))
