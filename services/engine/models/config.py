"""ModelConfig: the shape of a Llama-family model, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its options is not implemented by the engine."""

    def __init__(self, architecture: str, detail: str = "") -> None:
        self.architecture = architecture
        supported = ", ".join(ARCHITECTURES)
        msg = f"unsupported model architecture {architecture!r}"
        super().__init__(f"{msg}: {detail}" if detail else f"{msg} (supported: {supported})")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a Llama / Qwen2 / Qwen3 model.

    rope_scaling is None (plain RoPE), {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}, or {"rope_type": "freq_factors",
    "factors": tuple[float, ...]} (llama.cpp's precomputed per-frequency divisors, `rope_freqs.weight`).
    attention_bias is the q/k/v projection bias; o_proj_bias says whether o_proj has one too.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(self.architecture)
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                self.architecture,
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}",
            )
        if self.head_dim % 2 != 0:
            raise UnsupportedModelError(self.architecture, f"odd head_dim {self.head_dim}")

    @property
    def o_proj_bias(self) -> bool:
        """Llama and Qwen3 put attention_bias on o_proj too; Qwen2 has q/k/v bias only."""
        return self.attention_bias and self.architecture != "qwen2"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a parsed HF config.json (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        arch = str(cfg.get("model_type", "?"))
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(arch)
        _check_hf_options(arch, cfg)
        rope_theta, rope_scaling = _hf_rope(arch, cfg)
        num_heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=_first_id(cfg.get("bos_token_id")),
            eos_token_id=_first_id(cfg.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(cls, reader: Any) -> ModelConfig:
        """From a gguf.GGUFReader: `{arch}.*` keys, tokenizer ids, and which tensors exist."""
        meta = _GgufMeta(reader)
        arch = str(meta.get("general.architecture", "?"))
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(arch)
        tensor_shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
        hidden = int(meta.arch("embedding_length"))
        num_heads = int(meta.arch("attention.head_count"))
        head_dim = meta.arch("attention.key_length", None) or meta.arch("rope.dimension_count", None)
        vocab = meta.arch("vocab_size", None) or tensor_shapes["token_embd.weight"][1]
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta.arch("feed_forward_length")),
            num_layers=int(meta.arch("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(meta.arch("attention.head_count_kv", num_heads)),
            head_dim=int(head_dim or hidden // num_heads),
            rms_norm_eps=float(meta.arch("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta.arch("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(arch, meta, reader),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
            max_position_embeddings=int(meta.arch("context_length", 2048)),
            bos_token_id=_first_id(meta.get("tokenizer.ggml.bos_token_id", None)),
            eos_token_id=_first_id(meta.get("tokenizer.ggml.eos_token_id", None)),
        )


def _first_id(value: Any) -> int | None:
    """Token ids may be an int, a list (Llama 3 lists several eos ids) or absent."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return int(value)


def _check_hf_options(arch: str, cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(arch, f"hidden_act {act!r} (only silu)")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(arch, "mlp_bias=true")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(arch, "use_sliding_window=true")


def _hf_rope(arch: str, cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config style."""
    params = cfg.get("rope_parameters") or {}
    if "rope_parameters" in cfg and isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = params
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
    return theta, _normalise_scaling(arch, scaling)


def _normalise_scaling(arch: str, scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise UnsupportedModelError(arch, f"rope scaling {rope_type!r} (only llama3 or none)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return {"rope_type": "llama3", **{k: float(scaling[k]) for k in keys}}


class _GgufMeta:
    """Typed access to a GGUFReader's key/value fields."""

    _MISSING = object()

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields
        self._arch = str(self.get("general.architecture", "?"))

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is self._MISSING:
                raise UnsupportedModelError(self._arch, f"GGUF metadata lacks {key!r}")
            return default
        return field.contents()

    def arch(self, key: str, default: Any = _MISSING) -> Any:
        return self.get(f"{self._arch}.{key}", default)


def _gguf_rope_scaling(arch: str, meta: _GgufMeta, reader: Any) -> dict[str, Any] | None:
    """llama.cpp stores Llama 3 scaling as a `rope_freqs.weight` tensor of per-frequency divisors."""
    kind = meta.arch("rope.scaling.type", "none")
    if kind not in ("none", None):
        raise UnsupportedModelError(arch, f"GGUF rope scaling {kind!r}")
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
            return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}
    return None
