"""Constrained decoding: grammars (JSON object, JSON schema, EBNF) compiled by xgrammar into per-token masks.

xgrammar was chosen over llguidance by bench/grammar_mask.py (bench/results/grammar_mask_*.txt; SmolLM2's 49,152
tokens, a nested schema's document walked token by token, mask fill + apply + advance per step). H200 host (16
cores): batch 1, 107 us per token against llguidance's 225 us (fill 6.7 against 54 us); batch 32, 705 against 577 us
(xgrammar's batch fill is slower there: 407 against 246 us, llguidance's executor spreads the 32 fills over the
cores). The 2-core CPU: batch 1, fill 9.6 against 204 us; batch 32, 247 against 6,800 us. Both compiled all 200
random schemas of tests/engine/schema_gen.py. xgrammar is the faster at the batch sizes constrained requests come in
(one agent, a few concurrent), and its JSON-schema and EBNF compilers cover the tool-call
framing (`Grammar.concat` / `union`); outlines-core was not measured (a regex index per schema, built up front).

A request's grammar becomes a `GrammarMatcher` on its Sequence (engine.submit): before each host-sampled token the
sampler asks it for the bitmask of allowed tokens (`fill`), applies it to the logits row on the device
(`apply_token_bitmask`, a torch op: CPU and CUDA alike) and the engine advances it with the chosen token. When the
grammar is complete only the model's end-of-sequence tokens are allowed, so the answer stops there.

Reading the vocabulary for xgrammar takes seconds: the engine's `GrammarTables` builds the compiler (and every
token's bytes, which logprobs report) on a background thread from Engine.start; a first constrained request waits
for what is left of that build. A constrained request's tokens are chosen on the host, so it cannot run inside a
decode burst; split steps (scheduler.py) let the greedy requests beside it keep bursting.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from services.engine.step.sampling import InvalidRequestError

if TYPE_CHECKING:
    from services.common.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "ebnf")


class GrammarError(InvalidRequestError):
    """The grammar does not compile (an invalid or unsupported schema); the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    text: str = ""  # the JSON schema (json_schema) or the EBNF grammar (ebnf); empty for json_object
    prefix: str = ""  # json_schema: prefix + value + suffix, 1..max_repeats times joined by separator
    suffix: str = ""
    separator: str = ""
    max_repeats: int = 1

    @property
    def framed(self) -> bool:
        return bool(self.prefix or self.suffix or self.max_repeats > 1)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next position into row `row` of an int32 [M, ceil(V / 32)] CPU
        tensor (bit j of word w: token 32 w + j)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by the chosen token; False when the grammar does not allow it (the matcher is unchanged)."""
        return bool(self._matcher.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [M, V] with every token whose bit is 0 in bitmask [M, ceil(V / 32)] (int32) set to -inf."""
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    mask = bitmask.to(logits.device, non_blocking=True).unsqueeze(-1)
    allowed = ((mask >> bits) & 1).bool().reshape(logits.shape[0], -1)[:, : logits.shape[1]]
    return logits.masked_fill(~allowed, float("-inf"))


class GrammarCompiler:
    """Compiles grammar specs against one tokenizer (xgrammar keeps a cache of compiled grammars). Thread-safe:
    engine.submit runs on the RPC threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token=tokenizer.info.eos_token)
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(tokenizer.info.eos_token_ids) or None
        )
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._token_bytes: list[bytes] = list(info.decoded_vocab)  # byte-level / byte-fallback pieces as bytes
        self.vocab_size = vocab_size
        self._lock = threading.Lock()

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token as the vocabulary holds them (b"" past the tokenizer's own vocabulary)."""
        return self._token_bytes[token] if 0 <= token < len(self._token_bytes) else b""

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`; raises GrammarError when it does not compile."""
        return GrammarMatcher(self._xgr.GrammarMatcher(self._compile(spec)), self.vocab_size)

    def _framed(self, spec: GrammarSpec) -> Any:
        """prefix value suffix (separator prefix value suffix)* up to max_repeats, as one xgrammar Grammar."""
        g = self._xgr.Grammar

        def literal(text: str) -> Any:
            return g.from_ebnf("root ::= " + json.dumps(text))

        parts = [literal(spec.prefix)] if spec.prefix else []
        parts.append(g.from_json_schema(spec.text, any_whitespace=False))
        if spec.suffix:
            parts.append(literal(spec.suffix))
        one = g.concat(*parts) if len(parts) > 1 else parts[0]
        if not 1 <= spec.max_repeats <= 16:
            raise GrammarError(f"max_repeats must be in [1, 16], got {spec.max_repeats}")
        options, seq = [one], [one]
        for _ in range(spec.max_repeats - 1):
            seq = [*seq, *([literal(spec.separator)] if spec.separator else []), one]
            options.append(g.concat(*seq))
        return g.union(*options) if len(options) > 1 else one

    def _compile(self, spec: GrammarSpec) -> Any:
        if spec.kind not in KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")
        try:
            with self._lock:
                if spec.kind == "json_object":  # any object (the builtin JSON grammar allows any value)
                    return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                if spec.kind == "json_schema":
                    schema = json.loads(spec.text)
                    if not isinstance(schema, dict):
                        raise GrammarError("a JSON schema must be a JSON object")
                    if spec.framed:
                        return self._compiler.compile_grammar(self._framed(spec))
                    return self._compiler.compile_json_schema(spec.text, any_whitespace=False)
                return self._compiler.compile_grammar(spec.text)
        except GrammarError:
            raise
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with a description
            raise GrammarError(f"the {spec.kind} grammar does not compile: {str(exc)[:300]}") from None


class GrammarTables:
    """The grammar compiler of one tokenizer and every token's bytes (xgrammar's reading of the vocabulary), built
    once: `start` builds them on a background thread (the engine does at start-up: reading the vocabulary takes
    seconds, off every request's path); `compiler` and `token_bytes` wait for that build, or build on the calling
    thread when nothing was started (tests driving an engine by hand). A failed build (xgrammar not installed)
    is a GrammarError on every call."""

    def __init__(self, build: Callable[[], GrammarCompiler]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False
        self._compiler: GrammarCompiler | None = None
        self._error: GrammarError | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarTables:
        return cls(lambda: compiler_for(tokenizer, vocab_size))

    def start(self) -> threading.Thread | None:
        """Begin the build on a daemon thread (None when it was already begun)."""
        with self._lock:
            if self._started:
                return None
            self._started = True
        thread = threading.Thread(target=self._run, name="grammar-tables", daemon=True)
        thread.start()
        return thread

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def compiler(self) -> GrammarCompiler:
        """The compiler, once built (waits for the build; raises GrammarError when it failed)."""
        with self._lock:
            inline = not self._started
            self._started = True
        if inline:
            self._run()
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._compiler is not None
        return self._compiler

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes (a piece of a multi-byte character is its bytes, not replacement text)."""
        return self.compiler().token_bytes(token)

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._compiler = self._build()
            logger.info("grammar tables built in %.1f s", time.perf_counter() - t0)
        except ImportError as exc:
            self._error = GrammarError(f"constrained decoding is not installed on this engine ({exc})")
        except Exception as exc:  # never leave a waiting request hanging
            logger.exception("building the grammar tables failed")
            self._error = GrammarError(f"the grammar tables could not be built: {str(exc)[:200]}")
        finally:
            self._done.set()


_compilers: dict[tuple[int, int], GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
    """The process's compiler for this tokenizer (building one reads the whole vocabulary: seconds)."""
    key = (id(tokenizer.backend), vocab_size)
    with _compilers_lock:
        if key not in _compilers:
            _compilers[key] = GrammarCompiler(tokenizer, vocab_size)
        return _compilers[key]
