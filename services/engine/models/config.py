"""ModelConfig: the shape of a Llama-family or Gemma 3 model, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinearAttentionShape:
    """qwen3_5's Gated DeltaNet layers: which layers, key/value heads and head dims, the conv kernel size."""

    layers: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim


ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3_5")


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its options is not implemented by the engine."""

    def __init__(self, architecture: str, detail: str = "") -> None:
        self.architecture = architecture
        supported = ", ".join(ARCHITECTURES)
        msg = f"unsupported model architecture {architecture!r}"
        super().__init__(f"{msg}: {detail}" if detail else f"{msg} (supported: {supported})")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a Llama / Qwen2 / Qwen3 / Gemma 3 model.

    rope_scaling is None (plain RoPE), {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}, or {"rope_type": "freq_factors",
    "factors": tuple[float, ...]} (llama.cpp's precomputed per-frequency divisors, `rope_freqs.weight`;
    linear scaling by f is read as factors all equal to f).
    attention_bias is the q/k/v projection bias; o_proj_bias says whether o_proj has one too.

    Gemma 3 only (refused for the Llama family, whose forward ignores them):
    layer_windows[i] is layer i's sliding window (None: a global layer; filled with None when not
    given); rope_local_theta is the RoPE base of the sliding layers (rope_theta and rope_scaling are
    the global layers'); query_pre_attn_scalar sets the attention scale to its -1/2 power;
    final_logit_softcapping caps logits at +-c with c * tanh(x / c).
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
    layer_windows: tuple[int | None, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    linear: LinearAttentionShape | None = None  # qwen3_5: the Gated DeltaNet layers' shape (layers in linear.layers)
    rotary_dim: int | None = None  # qwen3_5: RoPE on the first rotary_dim dims of each head (partial rotary)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(self.architecture)
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        self._check_windows()
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                self.architecture,
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}",
            )
        if self.head_dim % 2 != 0:
            raise UnsupportedModelError(self.architecture, f"odd head_dim {self.head_dim}")

    def _check_windows(self) -> None:
        if len(self.layer_windows) != self.num_layers:
            raise UnsupportedModelError(
                self.architecture, f"{len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise UnsupportedModelError(self.architecture, f"sliding windows {self.layer_windows} must be >= 1")
        gemma_only = {
            "sliding windows": any(w is not None for w in self.layer_windows),
            "rope_local_theta": self.rope_local_theta is not None,
            "query_pre_attn_scalar": self.query_pre_attn_scalar is not None,
            "final_logit_softcapping": self.final_logit_softcapping is not None,
        }
        used = [name for name, is_set in gemma_only.items() if is_set]
        if used and self.architecture != "gemma3":
            raise UnsupportedModelError(self.architecture, f"{', '.join(used)} (gemma3 only)")
        if (self.linear is not None or self.rotary_dim is not None) and self.architecture != "qwen3_5":
            raise UnsupportedModelError(self.architecture, "linear-attention layers / partial rotary (qwen3_5 only)")

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that carry K/V (attention layers): every layer but qwen3_5's linear-attention ones."""
        linear = self.linear.layers if self.linear is not None else ()
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @property
    def kv_layer_windows(self) -> tuple[int | None, ...]:
        """layer_windows of the KV layers, in order (the KV pool's layers)."""
        return tuple(self.layer_windows[i] for i in self.kv_layers)

    @property
    def attention_scale(self) -> float:
        """Softmax scale of q.k: query_pre_attn_scalar^-1/2 (Gemma), else head_dim^-1/2."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        if arch in QWEN3_5_MODEL_TYPES:
            from services.engine.models.qwen3_5_config import qwen3_5_config

            return qwen3_5_config(cls, cfg)
        if arch in GEMMA3_MODEL_TYPES:
            return cls._from_gemma3_hf_config(gemma3_text_config(cfg))
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(arch)
        _check_hf_options(arch, cfg)
        num_heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads
        rope_theta, rope_scaling = _hf_rope(arch, cfg, int(head_dim))
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
    def _from_gemma3_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Gemma 3 text config with transformers' defaults filled in (gemma3_text_config)."""
        _check_gemma3_options(cfg)
        head_dim = int(cfg["head_dim"])
        rope_theta, rope_scaling, rope_local_theta = _gemma3_hf_rope(cfg, head_dim)
        return cls(
            architecture="gemma3",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg["num_key_value_heads"]),
            head_dim=head_dim,
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
            attention_bias=bool(cfg["attention_bias"]),
            qk_norm=True,
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            bos_token_id=_first_id(cfg.get("bos_token_id")),
            eos_token_id=_first_id(cfg.get("eos_token_id")),
            layer_windows=_gemma3_hf_windows(cfg),
            rope_local_theta=rope_local_theta,
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
            final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping")),
        )

    @classmethod
    def from_gguf_metadata(cls, reader: Any) -> ModelConfig:
        """From a gguf.GGUFReader: `{arch}.*` keys, tokenizer ids, and which tensors exist."""
        meta = _GgufMeta(reader)
        arch = str(meta.get("general.architecture", "?"))
        tensor_shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
        if arch == QWEN3_5_GGUF_ARCH:
            from services.engine.models.qwen3_5_config import qwen3_5_config, qwen3_5_gguf_hf_config

            return qwen3_5_config(cls, qwen3_5_gguf_hf_config(meta, tensor_shapes))
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(arch)
        hidden = int(meta.arch("embedding_length"))
        num_heads = int(meta.arch("attention.head_count"))
        head_dim = meta.arch("attention.key_length", None) or meta.arch("rope.dimension_count", None)
        vocab = meta.arch("vocab_size", None) or tensor_shapes["token_embd.weight"][1]
        num_layers = int(meta.arch("block_count"))
        head_dim = int(head_dim or hidden // num_heads)
        gemma3 = _gemma3_gguf_fields(meta, num_layers, hidden, num_heads, head_dim) if arch == "gemma3" else {}
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta.arch("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(meta.arch("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta.arch("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta.arch("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(arch, meta, reader, head_dim),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
            max_position_embeddings=int(meta.arch("context_length", 2048)),
            bos_token_id=_first_id(meta.get("tokenizer.ggml.bos_token_id", None)),
            eos_token_id=_first_id(meta.get("tokenizer.ggml.eos_token_id", None)),
            **gemma3,
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


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _hf_rope(arch: str, cfg: dict[str, Any], head_dim: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config style."""
    params = cfg.get("rope_parameters") or {}
    if "rope_parameters" in cfg and isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = params
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
    return theta, _normalise_scaling(arch, scaling, head_dim)


def _normalise_scaling(arch: str, scaling: dict[str, Any] | None, head_dim: int) -> dict[str, Any] | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return linear_freq_factors(float(scaling["factor"]), head_dim)
    if rope_type != "llama3":
        raise UnsupportedModelError(arch, f"rope scaling {rope_type!r} (only llama3, linear or none)")
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


def linear_freq_factors(factor: float, head_dim: int) -> dict[str, Any]:
    """Linear RoPE scaling (positions / factor) is every inverse frequency divided by factor."""
    return {"rope_type": "freq_factors", "factors": (factor,) * (head_dim // 2)}


def _gguf_rope_scaling(arch: str, meta: _GgufMeta, reader: Any, head_dim: int) -> dict[str, Any] | None:
    """llama.cpp stores Llama 3 scaling as a `rope_freqs.weight` tensor of per-frequency divisors,
    linear scaling (Gemma 3 4B+, global layers) as `rope.scaling.type` = linear and its factor."""
    kind = meta.arch("rope.scaling.type", "none")
    if kind == "linear":
        return linear_freq_factors(float(meta.arch("rope.scaling.factor")), head_dim)
    if kind not in ("none", None):
        raise UnsupportedModelError(arch, f"GGUF rope scaling {kind!r}")
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
            return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}
    return None


QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
QWEN3_5_GGUF_ARCH = "qwen35"  # llama.cpp's name (gguf.MODEL_ARCH.QWEN35)

# --- Gemma 3 -------------------------------------------------------------------------------------

GEMMA3_MODEL_TYPES = ("gemma3_text", "gemma3")
# transformers' Gemma3TextConfig defaults: configs (e.g. the text_config of multimodal checkpoints)
# leave out what equals them, and transformers fills them in the same way.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}  # fmt: skip
# Not in GGUF metadata (llama.cpp hard-codes them for gemma3; transformers takes the defaults above)
GEMMA3_GGUF_SLIDING_PATTERN = 6
GEMMA3_GGUF_LOCAL_ROPE_THETA = 10_000.0
_GEMMA3_LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def gemma3_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text part of a gemma3_text config, or of a multimodal gemma3 one (`text_config`), with defaults."""
    text = dict(cfg.get("text_config") or {}) if cfg.get("model_type") == "gemma3" else dict(cfg)
    outer = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in cfg}
    return {**GEMMA3_TEXT_DEFAULTS, **outer, **text}


def _check_gemma3_options(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError("gemma3", f"hidden_activation {act!r} (only gelu_pytorch_tanh)")
    if cfg.get("attn_logit_softcapping") is not None:
        # F.scaled_dot_product_attention cannot cap scores; no Gemma 3 release sets it
        raise UnsupportedModelError("gemma3", f"attn_logit_softcapping={cfg['attn_logit_softcapping']}")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("gemma3", "use_bidirectional_attention=true")


def _gemma3_hf_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Per layer: the sliding window, or None for a global layer (`layer_types`, else the old int pattern)."""
    num_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg["sliding_window_pattern"])
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - set(_GEMMA3_LAYER_TYPES))
    if unknown or len(types) != num_layers:
        raise UnsupportedModelError("gemma3", f"layer_types {types} (need {num_layers} of {list(_GEMMA3_LAYER_TYPES)})")
    window = cfg.get("sliding_window")
    sliding = [_GEMMA3_LAYER_TYPES[t] for t in types]
    if window is None:
        if any(sliding):
            raise UnsupportedModelError("gemma3", "sliding_attention layers without a sliding_window")
        return (None,) * num_layers
    return tuple(int(window) if s else None for s in sliding)


def _gemma3_hf_rope(cfg: dict[str, Any], head_dim: int) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling, local theta): 5.x `rope_parameters` per layer type, or 4.x
    `rope_theta` + `rope_scaling` (global layers) + `rope_local_base_freq`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta = float(full.get("rope_theta", GEMMA3_TEXT_DEFAULTS["rope_theta"]))
        local_theta = float(local.get("rope_theta", GEMMA3_TEXT_DEFAULTS["rope_local_base_freq"]))
        scaling, local_scaling = full, local
    else:
        theta, local_theta = float(cfg["rope_theta"]), float(cfg["rope_local_base_freq"])
        scaling, local_scaling = cfg.get("rope_scaling"), None
    if _normalise_scaling("gemma3", local_scaling, head_dim) is not None:
        raise UnsupportedModelError("gemma3", f"rope scaling on sliding layers {local_scaling}")
    return theta, _normalise_scaling("gemma3", scaling, head_dim), local_theta


def _gemma3_gguf_fields(meta: _GgufMeta, num_layers: int, hidden: int, num_heads: int, head_dim: int) -> dict[str, Any]:
    """The Gemma-only fields from GGUF metadata, with llama.cpp's values for what it does not store:
    sliding pattern 6 (5 sliding, 1 global) unless `attention.sliding_window_pattern` says otherwise,
    local rope theta 10K unless `rope.freq_base_swa`, attention scale head_dim^-1/2 (hidden/heads for
    the 62-layer 27B, as llama.cpp does)."""
    if meta.arch("attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError("gemma3", "attn_logit_softcapping in GGUF metadata")
    window = int(meta.arch("attention.sliding_window"))
    pattern = meta.arch("attention.sliding_window_pattern", GEMMA3_GGUF_SLIDING_PATTERN)
    if isinstance(pattern, (list, tuple)):  # one bool per layer, True = sliding
        if len(pattern) != num_layers:
            raise UnsupportedModelError("gemma3", f"sliding_window_pattern of {len(pattern)} for {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern(n): layer i slides iff i % n < n - 1 (n = 0: all slide)
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    return {
        "layer_windows": tuple(window if s else None for s in sliding),
        "rope_local_theta": float(meta.arch("rope.freq_base_swa", GEMMA3_GGUF_LOCAL_ROPE_THETA)),
        "query_pre_attn_scalar": float(hidden // num_heads if num_layers == 62 else head_dim),
        "final_logit_softcapping": _optional_float(meta.arch("final_logit_softcapping", None)),
    }
