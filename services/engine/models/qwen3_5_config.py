"""ModelConfig of a Qwen3.5 hybrid text model (`qwen3_5_text`, or the text_config of a `qwen3_5` checkpoint).

transformers' Qwen3_5TextConfig defaults fill what a config leaves out (as transformers fills them). Text
positions are the same for mrope's three grids, so its sections collapse to plain RoPE on the first
head_dim * partial_rotary_factor dims of each head (ModelConfig.rotary_dim).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from services.engine.models.config import LinearAttentionShape, UnsupportedModelError

if TYPE_CHECKING:
    from services.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

# transformers 5.x Qwen3_5TextConfig defaults (the Qwen3.5-9B text shape)
QWEN3_5_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248_320, "hidden_size": 4096, "intermediate_size": 12_288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
}  # fmt: skip
_LAYER_TYPES = ("linear_attention", "full_attention")


def qwen3_5_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text part of a qwen3_5_text config or of a multimodal qwen3_5 one (`text_config`), with defaults."""
    text = dict(cfg.get("text_config") or {}) if cfg.get("model_type") == "qwen3_5" else dict(cfg)
    outer = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in cfg and k not in text}
    return {**QWEN3_5_TEXT_DEFAULTS, **outer, **text}


def qwen3_5_gguf_hf_config(meta: Any, tensor_shapes: dict[str, list[int]]) -> dict[str, Any]:
    """The HF text config of a llama.cpp `qwen35` GGUF, from the keys its converter writes (convert_hf_to_gguf:
    Qwen3NextModel's ssm.* and full_attention_interval, TextModel's). `meta`: config._GgufMeta. MTP blocks
    (nextn_predict_layers) follow the model's layers in block_count and are not counted."""
    head_dim = int(meta.arch("attention.key_length"))
    num_v_heads = int(meta.arch("ssm.time_step_rank"))
    sections = meta.arch("rope.dimension_sections", None)
    rotary = int(meta.arch("rope.dimension_count"))
    if sections is not None and 2 * sum(int(s) for s in sections) != rotary:
        logger.warning("qwen35 GGUF: mrope sections %s do not cover the %d rotary dims", list(sections), rotary)
    from services.engine.models.config import _first_id

    return {
        "model_type": "qwen3_5_text",
        "vocab_size": int(meta.arch("vocab_size", None) or tensor_shapes["token_embd.weight"][1]),
        "hidden_size": int(meta.arch("embedding_length")),
        "intermediate_size": int(meta.arch("feed_forward_length")),
        "num_hidden_layers": int(meta.arch("block_count")) - int(meta.arch("nextn_predict_layers", 0)),
        "num_attention_heads": int(meta.arch("attention.head_count")),
        "num_key_value_heads": int(meta.arch("attention.head_count_kv")),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.arch("context_length", 32_768)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "linear_conv_kernel_dim": int(meta.arch("ssm.conv_kernel")),
        "linear_key_head_dim": int(meta.arch("ssm.state_size")),
        "linear_num_key_heads": int(meta.arch("ssm.group_count")),
        "linear_num_value_heads": num_v_heads,
        "linear_value_head_dim": int(meta.arch("ssm.inner_size")) // num_v_heads,
        "full_attention_interval": int(meta.arch("full_attention_interval", 4)),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(meta.arch("rope.freq_base", 10_000_000.0)),
            "partial_rotary_factor": rotary / head_dim,
        },  # fmt: skip
        "bos_token_id": _first_id(meta.get("tokenizer.ggml.bos_token_id", None)),
        "eos_token_id": _first_id(meta.get("tokenizer.ggml.eos_token_id", None)),
    }


def qwen3_5_config(cls: type[ModelConfig], raw: dict[str, Any]) -> ModelConfig:
    cfg = qwen3_5_text_config(raw)
    arch = "qwen3_5"
    if cfg.get("hidden_act") != "silu":
        raise UnsupportedModelError(arch, f"hidden_act {cfg.get('hidden_act')!r} (only silu)")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(arch, "attention_bias=true")
    num_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg["full_attention_interval"])
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - set(_LAYER_TYPES):
        raise UnsupportedModelError(arch, f"layer_types {types} (need {num_layers} of {list(_LAYER_TYPES)})")
    if "full_attention" not in types:
        raise UnsupportedModelError(arch, "no full_attention layer (the engine pages at least one KV layer)")
    head_dim = int(cfg["head_dim"])
    params = cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedModelError(arch, f"rope scaling {rope_type!r} (only default)")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedModelError(arch, f"partial_rotary_factor {partial} of head_dim {head_dim}")
    linear = LinearAttentionShape(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        num_k_heads=int(cfg["linear_num_key_heads"]),
        num_v_heads=int(cfg["linear_num_value_heads"]),
        k_head_dim=int(cfg["linear_key_head_dim"]),
        v_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg["linear_conv_kernel_dim"]),
    )
    if linear.num_v_heads % linear.num_k_heads:
        raise UnsupportedModelError(arch, f"{linear.num_v_heads} value heads for {linear.num_k_heads} key heads")
    from services.engine.models.config import _first_id

    return cls(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=head_dim,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=None,
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        attention_bias=False,
        qk_norm=True,
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        bos_token_id=_first_id(cfg.get("bos_token_id")),
        eos_token_id=_first_id(cfg.get("eos_token_id")),
        linear=linear,
        rotary_dim=rotary_dim,
    )
