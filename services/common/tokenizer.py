"""Tokenizer and chat template of a model file (GGUF or HF directory), shared by engine and cacheguard."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as _FastTokenizer

logger = logging.getLogger(__name__)

# A GGUF file carries its vocabulary, not a tokenizer: transformers' converter builds one, and not every release
# builds it right (5.17 makes Gemma 3's a Unigram over the BPE merge ranks: "quick" -> "qu" "ick", a quarter of
# the vocabulary's own pieces encode to something else, and the model reads text it never saw). A faithful
# tokenizer encodes (nearly) every piece of its vocabulary back to that piece.
ROUNDTRIP_SAMPLE = 2000  # pieces tried, evenly spread over the vocabulary
ROUNDTRIP_MIN = 0.9  # the share that must come back as themselves (measured: 100% right, 24% for the 5.17 build)


class TokenizerError(ValueError):
    """A model file's tokenizer cannot be built faithfully here; the message says why and what to change."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What the rest of the stack needs to know about a model's tokenizer."""

    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool


class Tokenizer:
    """A fast (Rust) tokenizer plus the model's special tokens and chat template."""

    def __init__(self, backend: _FastTokenizer, info: TokenizerInfo) -> None:
        self._backend = backend
        self.info = info

    @property
    def backend(self) -> _FastTokenizer:
        """The `tokenizers` object (grammar libraries build their token tables from it)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token text (e.g. `<|im_start|>`) maps to its id."""
        ids = list(self._backend.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.info.add_bos and self.info.bos_token_id is not None:
            if not ids or ids[0] != self.info.bos_token_id:
                ids.insert(0, self.info.bos_token_id)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)


def load_tokenizer(model_path: Path) -> Tokenizer:
    """Build the tokenizer from a GGUF file's metadata or an HF directory's tokenizer files.

    The conversion (transformers' GGUF converter, several seconds) runs once per model file; its
    result is kept under $KVMEM_CACHE_DIR (default ~/.cache/kvmem) keyed by path, size, mtime and the
    converter's (transformers') version.
    A tokenizer converted from a GGUF is checked (`check_vocabulary`, a few ms) whether built now or cached:
    TokenizerError when it does not reproduce its own vocabulary.
    """
    cache = _cache_dir(model_path)
    converted = not model_path.is_dir()
    cached = (cache / "tokenizer.json").exists() and (cache / "info.json").exists()
    if cached:
        fields = json.loads((cache / "info.json").read_text())
        info = TokenizerInfo(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"])})
        tok = Tokenizer(_FastTokenizer.from_file(str(cache / "tokenizer.json")), info)
    else:
        tok = _load_gguf(model_path) if converted else _load_hf_dir(model_path)
    if converted:
        check_vocabulary(tok.backend, model_path)  # before caching: a refused conversion is not kept
    if cached:
        return tok
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tok._backend.save(str(cache / "tokenizer.json.tmp"))
        (cache / "info.json").write_text(json.dumps(dataclasses.asdict(tok.info)))
        os.replace(cache / "tokenizer.json.tmp", cache / "tokenizer.json")
    except OSError as exc:
        logger.warning("cannot cache the tokenizer in %s: %s", cache, exc)
    return tok


def _cache_dir(model_path: Path) -> Path:
    root = Path(os.environ.get("KVMEM_CACHE_DIR", Path.home() / ".cache" / "kvmem"))
    st = model_path.stat()
    converter = "" if model_path.is_dir() else _transformers_version()
    key = f"{model_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{converter}"
    key = hashlib.sha256(key.encode()).hexdigest()[:20]
    return root / "tokenizers" / key


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def vocabulary_roundtrip(backend: _FastTokenizer, sample: int = ROUNDTRIP_SAMPLE) -> tuple[int, int]:
    """(pieces that encode back to exactly their own id, pieces tried): every k-th id of the vocabulary whose
    text is two characters or more, not a control token and valid UTF-8 on its own."""
    size = backend.get_vocab_size(with_added_tokens=False)
    same = tried = 0
    for token_id in range(0, size, max(1, size // sample)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if len(text.strip()) < 2 or text.startswith("<") or "\ufffd" in text:
            continue
        tried += 1
        same += backend.encode(text, add_special_tokens=False).ids == [token_id]
    return same, tried


def check_vocabulary(backend: _FastTokenizer, model_path: Path) -> None:
    """TokenizerError when fewer than ROUNDTRIP_MIN of the sampled pieces encode back to themselves."""
    same, tried = vocabulary_roundtrip(backend)
    if tried and same < ROUNDTRIP_MIN * tried:
        raise TokenizerError(
            f"the tokenizer built from {model_path.name} by transformers {_transformers_version()} encodes only "
            f"{same} of {tried} of its own vocabulary pieces back to themselves (a faithful one: all); this "
            f"converter mis-builds the model's tokenizer: install the transformers version requirements.txt asks for"
        )


def _load_gguf(path: Path) -> Tokenizer:
    from transformers import AutoTokenizer  # the GGUF -> fast tokenizer converter lives there

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return _from_hf(hf, add_bos=_gguf_add_bos(path))


def _gguf_add_bos(path: Path) -> bool:
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.contents()) if field is not None else False


def _load_hf_dir(path: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path))
    add_bos = False
    cfg = path / "tokenizer_config.json"
    if cfg.exists():
        add_bos = bool(json.loads(cfg.read_text()).get("add_bos_token", False))
    return _from_hf(hf, add_bos=add_bos)


def _from_hf(hf: object, add_bos: bool) -> Tokenizer:
    backend: _FastTokenizer = hf.backend_tokenizer  # type: ignore[attr-defined]
    eos_ids: list[int] = []
    eos_id = getattr(hf, "eos_token_id", None)
    if eos_id is not None:
        eos_ids.append(int(eos_id))
    for extra in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>"):
        tid = backend.token_to_id(extra)
        if tid is not None and tid not in eos_ids and extra in str(getattr(hf, "chat_template", "") or ""):
            eos_ids.append(int(tid))
    template = getattr(hf, "chat_template", None)
    info = TokenizerInfo(
        chat_template=template if isinstance(template, str) else None,
        bos_token=getattr(hf, "bos_token", None),
        eos_token=getattr(hf, "eos_token", None),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=tuple(eos_ids),
        add_bos=add_bos,
    )
    logger.info(
        "tokenizer: vocab %d, eos %s, chat template %s",
        backend.get_vocab_size(),
        eos_ids,
        "yes" if info.chat_template else "no",
    )
    return Tokenizer(backend, info)
