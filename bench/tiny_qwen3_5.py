"""Write a random-weight Qwen3.5 hybrid text checkpoint (transformers' save_pretrained) that the stack serves.

    python -m bench.tiny_qwen3_5 DIR [--layers 4] [--hidden 64] [--seed 0] [--tokenizer smollm2|words] [--gguf FILE]

The tokenizer: `smollm2` (default) converts the embedded SmolLM2-135M-Instruct GGUF's tokenizer (with its chat
template) through transformers and saves it into DIR, and the model gets SmolLM2's vocabulary size and
special ids; `words` is a word-level `t0 .. t{V-1}` tokenizer (prompts as token ids in tests). Weights are
transformers' own init of a seeded Qwen3_5ForCausalLM, widened (std 0.5) so that greedy tokens are far apart
and do not depend on summation order. --gguf FILE also writes the model as llama.cpp's converter lays out a
`qwen35` GGUF (write_gguf; the tokenizer fields copied from SmolLM2's GGUF): `make run ARGS="--model FILE"`
serves it (keep FILE out of DIR: transformers reads a GGUF's tokenizer beside the directory's own files).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def tiny_text_config(vocab_size: int, layers: int = 4, hidden: int = 64, **overrides: Any) -> Any:
    from transformers import Qwen3_5TextConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-6,
    )  # fmt: skip
    kwargs.update(overrides)
    return Qwen3_5TextConfig(**kwargs)


def random_model(config: Any, seed: int, std: float = 0.5) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log") or name.endswith("dt_bias"):
                continue  # transformers' init keeps the decays in their range
            if "norm" in name:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, std)
    return model


def write_tokenizer(directory: Path, kind: str, vocab_size: int) -> dict[str, int]:
    """Save a tokenizer into `directory`; returns the special ids for the model config."""
    if kind == "words":
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import WhitespaceSplit

        tok = HFTokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t3"))
        tok.pre_tokenizer = WhitespaceSplit()
        tok.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "unk_token": "t3"}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        return {"bos_token_id": 1, "eos_token_id": 2}
    from transformers import AutoTokenizer

    from services.common.model_files import resolve_model_path

    gguf = resolve_model_path("embedded:smollm2")
    hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf.save_pretrained(str(directory))
    return {"bos_token_id": int(hf.bos_token_id), "eos_token_id": int(hf.eos_token_id)}


SMOLLM2_VOCAB = 49_152


def _tiled(t: torch.Tensor, dim: int, num_k: int, per_k: int, head_dim: int) -> torch.Tensor:
    """Value heads along `dim` from grouped (by key head) to tiled order, as llama.cpp's converter stores them
    (convert_hf_to_gguf: _LinearAttentionVReorderBase._reorder_v_heads)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], num_k, per_k, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def gguf_tensors(model: torch.nn.Module, config: Any) -> dict[str, torch.Tensor]:
    """A transformers Qwen3_5ForCausalLM's tensors as llama.cpp's converter writes them for `qwen35`
    (convert_hf_to_gguf: Qwen3_5TextModel = _LinearAttentionVReorderBase over Qwen3NextModel): value heads
    tiled where there are more of them than key heads, A_log as -exp(A_log), dt_bias as ssm_dt.bias, the conv
    weight squeezed, zero-centred norms as 1 + w; names from gguf's TensorNameMap; float32."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, config.num_hidden_layers)
    num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
    per_k, dk, dv = num_v // num_k, config.linear_key_head_dim, config.linear_value_head_dim
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if per_k > 1 and "linear_attn." in name:
            if ".in_proj_qkv." in name:
                t = torch.cat([t[: 2 * num_k * dk], _tiled(t[2 * num_k * dk :], 0, num_k, per_k, dv)])
            elif ".in_proj_z." in name:
                t = _tiled(t, 0, num_k, per_k, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
                t = _tiled(t, 0, num_k, per_k, 1)
            elif ".conv1d." in name:
                t = t.squeeze()
                t = torch.cat([t[: 2 * num_k * dk], _tiled(t[2 * num_k * dk :], 0, num_k, per_k, dv)])
            elif ".out_proj." in name:
                t = _tiled(t, 1, num_k, per_k, dv)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise KeyError(f"no GGUF name for {name}")
        out[mapped] = t.contiguous()
    return out


def write_gguf(model: torch.nn.Module, path: Path, mtp_blocks: int = 0, tokenizer_from: Path | None = None) -> Path:
    """A `qwen35` GGUF of `model` with the metadata llama.cpp's converter writes; `mtp_blocks` extra blocks of
    one dummy tensor each after the layers (as the MTP blocks follow them); the tokenizer.* fields of
    `tokenizer_from` (a GGUF) when given, else placeholder tokens t0 .. t{V-1} (no merges: not for serving)."""
    import gguf

    c = model.config
    rotary = int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 0.25))
    pairs = rotary // 2
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers + mtp_blocks)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(rotary)
    w.add_rope_dimension_sections([pairs // 3 + (pairs % 3 > 0), pairs // 3 + (pairs % 3 > 1), pairs // 3, 0])
    if mtp_blocks:
        w.add_nextn_predict_layers(mtp_blocks)
    if tokenizer_from is not None:
        reader = gguf.GGUFReader(str(tokenizer_from))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    else:  # placeholder tokens: readers take the vocabulary size from the token list, as llama.cpp files carry one
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
        w.add_bos_token_id(c.bos_token_id)
        w.add_eos_token_id(c.eos_token_id)
    tensors = gguf_tensors(model, c)
    for i in range(mtp_blocks):
        tensors[f"blk.{c.num_hidden_layers + i}.nextn.eh_proj.weight"] = torch.zeros(c.hidden_size, 2 * c.hidden_size)
    for name, t in tensors.items():
        w.add_tensor(name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_qwen3_5(
    directory: Path, tokenizer: str = "smollm2", layers: int = 4, hidden: int = 64, seed: int = 0,
    vocab_size: int | None = None,
) -> Path:  # fmt: skip
    """A served checkpoint in `directory` (config.json, model.safetensors, the tokenizer's files)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size or (SMOLLM2_VOCAB if tokenizer == "smollm2" else 512)
    ids = write_tokenizer(directory, tokenizer, vocab)
    model = random_model(tiny_text_config(vocab, layers, hidden, **ids), seed)
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", choices=("smollm2", "words"), default="smollm2")
    parser.add_argument("--gguf", type=Path, help="also this GGUF file (llama.cpp's qwen35 layout), outside DIR")
    a = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    write_tiny_qwen3_5(a.directory, a.tokenizer, a.layers, a.hidden, a.seed)
    logger.info("wrote a random qwen3_5 checkpoint to %s", a.directory)
    if a.gguf:
        from transformers import Qwen3_5ForCausalLM

        from services.common.model_files import resolve_model_path

        model = Qwen3_5ForCausalLM.from_pretrained(str(a.directory), dtype=torch.float32)
        smol = resolve_model_path("embedded:smollm2") if a.tokenizer == "smollm2" else None
        logger.info("wrote %s", write_gguf(model, a.gguf, tokenizer_from=smol))


if __name__ == "__main__":
    main()
