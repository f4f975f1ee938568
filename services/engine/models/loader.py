"""Load a Llama-family, Gemma 3 or Qwen3.5 model from a GGUF file (dequantised) or an HF safetensors directory.

Both formats are first read as HF-named float tensors (`model.layers.3.self_attn.q_proj.weight`),
then fused into our parameters (qkv_proj, gate_up_proj), cast and moved tensor by tensor.
Gemma 3 norm weights are kept as transformers keeps them (used as 1 + w): llama.cpp's GGUF stores
w + 1, so 1 is subtracted from them (in float32, as transformers' GGUF loader does). Qwen3.5 (llama.cpp's
`qwen35`): the converter's changes are undone in qwen3_5_from_gguf.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from services.engine.models.config import ModelConfig, UnsupportedModelError
from services.engine.models.gemma3 import Gemma3ForCausalLM
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.qwen3_5 import Qwen3_5ForCausalLM, qwen3_5_from_gguf, qwen3_5_tensors

logger = logging.getLogger(__name__)

__all__ = ["CausalLM", "ModelFormatError", "UnsupportedModelError", "load_model"]

# Both expose forward(input_ids, positions, attn) -> hidden, logits(hidden), head(hidden, argmax) -> (logits,
# argmax), config, embed_tokens.
CausalLM = LlamaForCausalLM | Gemma3ForCausalLM | Qwen3_5ForCausalLM
# A source returns the float tensor stored under an HF name, or raises KeyError.
TensorSource = Callable[[str], Tensor]

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP there
_GGUF_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Qwen3.5 hybrids (llama.cpp `qwen35`): gguf's TensorNameMap for MODEL_ARCH.QWEN35
_GGUF_QWEN3_5_LAYER_NAMES = {
    **{k: v for k, v in _GGUF_LAYER_NAMES.items() if not k.endswith(".bias") and k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_GGUF_ARCH_LAYER_NAMES = {"gemma3": _GGUF_GEMMA3_LAYER_NAMES, "qwen3_5": _GGUF_QWEN3_5_LAYER_NAMES}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


class ModelFormatError(ValueError):
    """The model file is readable but lacks a tensor or has one of the wrong shape."""


def load_model(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[ModelConfig, CausalLM]:
    """Config and model (eval mode, no grad) from a `.gguf` file or an HF directory."""
    start = time.perf_counter()
    path = Path(path)
    opener = _open_hf_dir if path.is_dir() else _open_gguf
    with opener(path) as (config, source):
        model = _build(config, source, device, dtype)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (%s, %d layers) in %.2f s: %.1fM parameters, %s on %s",
        path.name, config.architecture, config.num_layers, time.perf_counter() - start,
        num_params / 1e6, dtype, device,
    )  # fmt: skip
    return config, model


def _build(config: ModelConfig, source: TensorSource, device: torch.device, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        classes: dict[str, type[CausalLM]] = {"gemma3": Gemma3ForCausalLM, "qwen3_5": Qwen3_5ForCausalLM}
        model: CausalLM = classes.get(config.architecture, LlamaForCausalLM)(config)
    state = dict(_our_tensors(config, source))
    expected = {name: p.shape for name, p in model.named_parameters()}
    for name, tensor in state.items():
        if name not in expected or tuple(tensor.shape) != tuple(expected[name]):
            raise ModelFormatError(f"{name}: shape {tuple(tensor.shape)}, expected {expected.get(name)}")
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    missing = set(expected) - set(state)
    if missing:
        raise ModelFormatError(f"tensors missing for {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _our_tensors(config: ModelConfig, get: TensorSource) -> Iterator[tuple[str, Tensor]]:
    """Our parameter names and tensors from HF-named ones, fusing q/k/v and gate/up."""
    if config.architecture == "qwen3_5":
        yield from qwen3_5_tensors(config, get, _need)
        return
    yield "embed_tokens.weight", _need(get, "model.embed_tokens.weight")
    yield "norm.weight", _need(get, "model.norm.weight")
    if not config.tie_word_embeddings:
        yield "lm_head.weight", _need(get, "lm_head.weight")
    for i in range(config.num_layers):
        yield from _layer_tensors(config, get, i)


def _layer_tensors(config: ModelConfig, get: TensorSource, i: int) -> Iterator[tuple[str, Tensor]]:
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.architecture == "gemma3":
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for norm in norms:
        yield ours + f"{norm}.weight", _need(get, hf + f"{norm}.weight")
    qkv = [hf + f"self_attn.{p}_proj" for p in "qkv"]
    yield ours + "self_attn.qkv_proj.weight", torch.cat([_need(get, n + ".weight") for n in qkv])
    if config.attention_bias:
        yield ours + "self_attn.qkv_proj.bias", torch.cat([_need(get, n + ".bias") for n in qkv])
    yield ours + "self_attn.o_proj.weight", _need(get, hf + "self_attn.o_proj.weight")
    if config.o_proj_bias:
        yield ours + "self_attn.o_proj.bias", _need(get, hf + "self_attn.o_proj.bias")
    if config.qk_norm:
        for norm in ("q_norm", "k_norm"):
            yield ours + f"self_attn.{norm}.weight", _need(get, hf + f"self_attn.{norm}.weight")
    gate_up = [_need(get, hf + f"mlp.{p}_proj.weight") for p in ("gate", "up")]
    yield ours + "mlp.gate_up_proj.weight", torch.cat(gate_up)
    yield ours + "mlp.down_proj.weight", _need(get, hf + "mlp.down_proj.weight")


def _need(get: TensorSource, name: str) -> Tensor:
    try:
        return get(name)
    except KeyError:
        raise ModelFormatError(f"model file has no tensor for {name}") from None


# --- HF safetensors directories ---------------------------------------------------------------


@contextmanager
def _open_hf_dir(path: Path) -> Iterator[tuple[ModelConfig, TensorSource]]:
    from safetensors import safe_open

    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    files = _safetensors_files(path)
    handles = {f: safe_open(str(path / f), framework="pt", device="cpu") for f in set(files.values())}
    stored = _stored_name_function(files)
    yield config, lambda name: handles[files[stored(name)]].get_tensor(stored(name))


# Where a text model's `model.*` tensors live: text-only checkpoints, then multimodal Gemma 3 ones
# (transformers >= 4.52 saves `model.language_model.*`, the original release `language_model.model.*`).
_TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def _stored_name_function(files: dict[str, str]) -> Callable[[str], str]:
    """Maps an HF text-model name (`model.layers.0...`, `lm_head.weight`) to the name stored in the files."""
    prefix = next((p for p in _TEXT_PREFIXES if p + "embed_tokens.weight" in files), "model.")
    head = "language_model.lm_head.weight" if prefix == "language_model.model." else "lm_head.weight"

    def stored(name: str) -> str:
        if name == "lm_head.weight":
            return head
        return prefix + name.removeprefix("model.") if name.startswith("model.") else name

    return stored


def _safetensors_files(path: Path) -> dict[str, str]:
    """Tensor name -> file name, from the shard index or the single / all safetensors files."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    candidates = [single] if single.exists() else sorted(path.glob("*.safetensors"))
    if not candidates:
        raise ModelFormatError(f"{path}: no *.safetensors files")
    files: dict[str, str] = {}
    for file in candidates:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            files.update({name: file.name for name in handle.keys()})  # noqa: SIM118 (not a dict)
    return files


# --- GGUF files ---------------------------------------------------------------------------------


@contextmanager
def _open_gguf(path: Path) -> Iterator[tuple[ModelConfig, TensorSource]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = ModelConfig.from_gguf_metadata(reader)
    tensors = {}
    extra_blocks = 0  # qwen35: the multi-token-prediction blocks after the model's layers
    for tensor in reader.tensors:
        hf_name = _gguf_to_hf_name(tensor.name, config.architecture)
        match = _GGUF_LAYER_RE.fullmatch(tensor.name)
        if match is not None and int(match.group(1)) >= config.num_layers:
            extra_blocks += 1
        elif hf_name is not None:
            tensors[hf_name] = tensor
        elif tensor.name != "rope_freqs.weight":  # read into the config's rope scaling
            logger.warning("GGUF tensor %s is not used", tensor.name)
    if extra_blocks:
        logger.info("%d GGUF tensors of blocks past the %d layers (MTP) are not used", extra_blocks, config.num_layers)
    yield config, lambda name: _gguf_tensor(config, name, tensors[name])


def _gguf_to_hf_name(name: str, arch: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    layer_names = _GGUF_ARCH_LAYER_NAMES.get(arch, _GGUF_LAYER_NAMES)
    match = _GGUF_LAYER_RE.fullmatch(name)
    if match is None or match.group(2) not in layer_names:
        return None
    return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"


def _gguf_tensor(config: ModelConfig, hf_name: str, tensor: Any) -> Tensor:
    """Dequantised float32, in torch's [out, in] order (GGUF lists dims reversed), un-permuted (llama),
    norm weights - 1 (gemma3)."""
    from gguf.quants import dequantize

    array = dequantize(tensor.data, tensor.tensor_type)
    array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    if not array.flags.writeable:
        array = array.copy()  # F32 tensors come back as views of the memory-mapped file
    if config.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
        num_heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads
        array = _unpermute_rope(array, num_heads)
    if config.architecture == "gemma3" and hf_name.endswith("norm.weight"):
        array = array - np.float32(1.0)  # llama.cpp stores Gemma's (1 + w)
    if config.architecture == "qwen3_5":
        array = qwen3_5_from_gguf(config, hf_name, array)
    return torch.from_numpy(array)


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs) back to HF's half-split layout.

    llama.cpp: w.reshape(H, 2, D/2, ...).swapaxes(1, 2); the inverse is
    w.reshape(H, D/2, 2, ...).swapaxes(1, 2). Works for weights [H*D, in] and biases [H*D].
    """
    half = w.shape[0] // num_heads // 2
    return np.ascontiguousarray(w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)).reshape(w.shape)
