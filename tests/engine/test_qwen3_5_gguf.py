"""Qwen3.5 from a llama.cpp `qwen35` GGUF: bench/tiny_qwen3_5.write_gguf writes a random transformers model as
llama.cpp's converter does (its tensor names from gguf's TensorNameMap, value heads tiled, A_log as -exp, norms
as 1 + w, the metadata keys), and the loader undoes it: the same config and parameters as loading the model's
safetensors directory, with and without grouped value heads, MTP blocks skipped."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from bench.tiny_qwen3_5 import gguf_tensors, random_model, tiny_text_config, write_gguf
from services.engine.models.loader import load_model
from services.engine.models.qwen3_5 import Qwen3_5ForCausalLM

pytest.importorskip("gguf")


@pytest.mark.parametrize("value_heads", [4, 2])  # 2 value heads per key head (reordered by llama.cpp), or 1
def test_gguf_loads_as_the_safetensors_directory(tmp_path: Path, value_heads: int) -> None:
    config = tiny_text_config(512, layers=4, hidden=64, linear_num_value_heads=value_heads, bos_token_id=1,
                              eos_token_id=2)  # fmt: skip
    model = random_model(config, seed=3)
    with torch.no_grad():  # per-head decays and biases that differ, so a head order mix-up shows
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(torch.rand(value_heads) * 2)
                layer.linear_attn.dt_bias.copy_(torch.randn(value_heads))
    model.save_pretrained(str(tmp_path / "hf"))
    path = write_gguf(model, tmp_path / "q35.gguf", mtp_blocks=1)
    if value_heads > 2:  # the file holds llama.cpp's tiled order, not transformers' rows
        qkv = gguf_tensors(model, config)["blk.0.attn_qkv.weight"]
        assert not torch.equal(qkv, model.state_dict()["model.layers.0.linear_attn.in_proj_qkv.weight"])

    cfg_hf, ours_hf = load_model(tmp_path / "hf", torch.device("cpu"), torch.float32)
    cfg_gguf, ours_gguf = load_model(path, torch.device("cpu"), torch.float32)
    assert isinstance(ours_gguf, Qwen3_5ForCausalLM)
    fields_gguf, fields_hf = dataclasses.asdict(cfg_gguf), dataclasses.asdict(cfg_hf)
    for key in ("rms_norm_eps", "rope_theta"):  # float32 in the GGUF
        assert fields_gguf.pop(key) == pytest.approx(fields_hf.pop(key), rel=1e-6)
    assert fields_gguf == fields_hf
    want = ours_hf.state_dict()
    got = ours_gguf.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_transformers_reads_the_written_file_as_the_model(tmp_path: Path) -> None:
    """transformers' own qwen35 GGUF conversion (an independent reading of llama.cpp's layout) recovers the
    model from write_gguf's file: the writer lays tensors out as llama.cpp does, not merely as our loader
    expects."""
    pytest.importorskip("transformers.integrations.gguf.gguf_conversion_mapping")
    from transformers import Qwen3_5ForCausalLM as HFQwen3_5

    config = tiny_text_config(512, layers=4, hidden=64, bos_token_id=1, eos_token_id=2)
    model = random_model(config, seed=4)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(torch.rand(4) * 2)
                layer.linear_attn.dt_bias.copy_(torch.randn(4))
    write_gguf(model, tmp_path / "q35.gguf")
    theirs = HFQwen3_5.from_pretrained(str(tmp_path), gguf_file="q35.gguf", dtype=torch.float32)
    got = theirs.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
