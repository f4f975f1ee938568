"""Write a random-weight Qwen3.5 hybrid text checkpoint (transformers' save_pretrained) that the stack serves.

    python -m bench.tiny_qwen3_5 DIR [--layers 4] [--hidden 64] [--seed 0] [--tokenizer smollm2|words]

The tokenizer: `smollm2` (default) converts the embedded SmolLM2-135M-Instruct GGUF's tokenizer (with its chat
template) through transformers and saves it into DIR, and the model gets SmolLM2's vocabulary size and
special ids; `words` is a word-level `t0 .. t{V-1}` tokenizer (prompts as token ids in tests). Weights are
transformers' own init of a seeded Qwen3_5ForCausalLM, widened (std 0.5) so that greedy tokens are far apart
and do not depend on summation order.
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
    a = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    write_tiny_qwen3_5(a.directory, a.tokenizer, a.layers, a.hidden, a.seed)
    logger.info("wrote a random qwen3_5 checkpoint to %s", a.directory)


if __name__ == "__main__":
    main()
