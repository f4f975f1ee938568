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

Budget-aware completion: a constrained answer parses and matches its grammar even when max_tokens (or the context
limit) ends it. GrammarMatcher keeps a closing plan (the tokens of a short completion from its state) and `steer`
replaces the model's token by the plan's when the plan after the model's token would not fit in the tokens left;
from then on the plan is followed to the end. The answer is complete and valid, and its finish_reason is still
"length" (the budget, not the model, ended the content: a forced tool call closed this way is "length", not
"tool_calls"). A budget below the first plan (the shortest document the strategy finds) is refused at submit
(InvalidRequestError naming max_tokens). The plan is only kept near the budget's end (CLOSE_MARGIN), so the far
steps pay about a microsecond a token; within the window a plan is computed after each token that is not string
text (bench/grammar_budget.py on the 2-core CPU: +107 us a token on average over a nested schema's 55-token walk;
the first plans of the 200 random schemas, at submit: median 0.8 ms, at most 53 ms). The closing vocabulary is
JSON's; for an EBNF grammar it may find no plan, and then the budget is not checked (the answer may be cut, as
before).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
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


# Closing vocabulary (budget-aware completion): the tokens the closing plan tries, most progress first. Inside a free
# string (most of the vocabulary allowed) only string closers; elsewhere structural closers, then the separator,
# then the shortest values and their openers. Tokens missing from a vocabulary are skipped.
_STRING_CLOSERS = ('"}}}', '"}}', '"}]', '"]}', '"}', '"]', '"')
_STRUCTURAL = (
    "}}}", "}}", "}]", "]}", "]]", "}", "]", ",",
    "0", '""', "[]", "{}", "true", "false", "null", '"', "[", "{", "-", *"123456789",
)  # fmt: skip
_LOOKAHEAD_OPTIONS = 8  # a choice between at most this many tokens outside the vocabulary (keys, enum values) is
# decided by planning each one; with more, the lowest token id is taken
_PLAN_LIMIT = 512  # steps of one plan before it gives up (a grammar whose completion the strategy cannot find)
CLOSE_MARGIN = 32  # the plan is kept fresh once the budget left is within its length + margin + 2 x the first plan's
# (the window); within twice the window it is refreshed every _STALE_REFRESH tokens; farther, nothing is kept
_STALE_REFRESH = 16


@dataclass(frozen=True)
class ClosingVocab:
    """The token ids of the closing plan's candidates and every token's bytes (one tokenizer's)."""

    string_closers: tuple[int, ...]
    structural: tuple[int, ...]
    token_bytes: tuple[bytes, ...]

    @classmethod
    def of(cls, token_bytes: list[bytes]) -> ClosingVocab:
        first: dict[bytes, int] = {}
        for i, b in enumerate(token_bytes):
            first.setdefault(b, i)

        def ids(texts: tuple[str, ...]) -> tuple[int, ...]:
            return tuple(first[t.encode()] for t in texts if t.encode() in first)

        return cls(ids(_STRING_CLOSERS), ids(_STRUCTURAL), tuple(token_bytes))


class GrammarMatcher:
    """One sequence's position in its grammar, and its budget-aware completion.

    Budget-aware completion: a constrained answer must parse and match its grammar even when max_tokens (or the
    context) ends it. The matcher keeps a *closing plan*, a short token sequence from its state to a complete
    document (`closing_plan`: jump-forward strings where the grammar forces text, elsewhere the first allowed token
    of a fixed closing vocabulary, small choices such as keys planned both ways). `steer` checks the model's
    token against the budget: when the plan after it would not fit in the tokens left, the token is taken back
    (rollback) and the plan is followed from the state before it; the answer ends complete, with finish_reason
    "length" (`closed_by_budget`). `set_budget` refuses a budget below the first plan's length.
    """

    def __init__(self, matcher: Any, vocab_size: int, vocab: ClosingVocab | None = None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._vocab = vocab
        self._words = bitmask_words(vocab_size)
        self._pre: int | None = None  # accepted by steer, not yet by accept
        self._plan: list[int] | None = None  # a completion from the current state (None: stale)
        self._known = 0  # the length of the last plan computed (the stale plan's estimate)
        self._refreshed_at = 0  # the budget left at the last refresh
        self._window = CLOSE_MARGIN
        self._mask: torch.Tensor | None = None  # the last filled mask's row
        self.closing = False  # following the plan: the budget ends the answer
        self.plans_computed = 0
        self.budget_misses = 0  # a plan found longer than the budget left (logged; never expected)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next position into row `row` of an int32 [M, ceil(V / 32)] CPU
        tensor (bit j of word w: token 32 w + j)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._mask = bitmask[row]  # read only where a plan is kept (steer, near the budget's end)

    def accept(self, token: int) -> bool:
        """Advance by the chosen token; False when the grammar does not allow it (the matcher is unchanged).
        The token `steer` returned was accepted there already."""
        if self._pre is not None and token == self._pre:
            self._pre = None
            return True
        self._pre = None
        return bool(self._matcher.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    @property
    def closed_by_budget(self) -> bool:
        """The budget ended the answer: the plan closed it (finish_reason stays "length")."""
        return self.closing

    # -- budget-aware completion -------------------------------------------------------------------

    def closing_plan(self) -> list[int] | None:
        """A short completion from the current state (token ids; [] when complete), the matcher unchanged;
        None when the strategy finds none within its step limit (or there is no closing vocabulary)."""
        if self._vocab is None:
            return None
        self.plans_computed += 1
        return _plan(self._matcher.fork(), self._vocab, self._words, lookahead=True, limit=_PLAN_LIMIT)

    def set_budget(self, max_tokens: int) -> int:
        """Plan from the start; raises InvalidRequestError when the shortest document the plan knows does not fit
        in max_tokens. Returns the plan's length."""
        plan = self.closing_plan()
        if plan is None:
            return 0  # no plan (a grammar outside the strategy): the budget is not checked
        if len(plan) > max_tokens:
            raise InvalidRequestError(
                f"max_tokens {max_tokens} is below the {len(plan)} tokens of the shortest answer this grammar "
                "allows: raise max_tokens"
            )
        self._plan, self._known, self._refreshed_at = plan, len(plan), max_tokens
        self._window = CLOSE_MARGIN + 2 * len(plan)
        return len(plan)

    def steer(self, token: int, left: int) -> int:
        """The token to emit where the model chose `token` with `left` tokens of budget (this one included):
        `token` itself when the plan after it fits in left - 1, else the plan's next token. The returned token
        is accepted (accept() of it is then free); a token outside the grammar is returned unaccepted."""
        if self._vocab is None:
            return token
        if self.closing:  # the plan to its end, then a stop token (a framed grammar may allow more calls)
            nxt = self._plan.pop(0) if self._plan else self._stop_token()
            self._accept_now(nxt)
            return nxt
        before = self._plan
        if not self._matcher.accept_token(token):
            return token
        self._pre = token
        if left - 1 > 2 * (self._known + self._window):  # far from the budget's end: nothing to keep
            self._plan = None
            return token
        self._advance_plan(before, token)
        inner = left - 1 <= self._known + self._window
        if self._plan is None and (inner or left <= self._refreshed_at - _STALE_REFRESH):
            self._refresh(left)
        if self._plan is None or len(self._plan) <= left - 1:
            return token
        # the model's token leaves too little: take it back and close from the state before it
        self._matcher.rollback(1)
        self._pre = None
        plan = before if before is not None else self.closing_plan()
        if plan is None:  # never expected: the state before had a plan (the check came after it)
            self._matcher.accept_token(token)
            self._pre = token
            return token
        if len(plan) > left:
            self.budget_misses += 1
            logger.warning("closing plan of %d tokens with %d left: the answer will be cut", len(plan), left)
        self.closing = True
        nxt = plan[0] if plan else self._stop_token()  # complete already: a stop token ends it
        self._plan = plan[1:]
        self._accept_now(nxt)
        return nxt

    def _stop_token(self) -> int:
        return int(self._matcher.stop_token_ids[0])

    def _accept_now(self, token: int) -> None:
        ok = self._matcher.accept_token(token)
        assert ok, "a closing plan's token was refused"
        self._pre = token

    def _advance_plan(self, before: list[int] | None, token: int) -> None:
        """The plan after the model's token: the rest of the old plan when the token was its first; the same
        plan when the token is text inside a free string (no quote, no escape: the string stays open, its
        closing unchanged); else stale."""
        assert self._vocab is not None
        if before is not None and before and before[0] == token:
            self._plan = before[1:]
            self._known = len(self._plan)
        elif before is not None and self._free_text(token):
            self._plan = before
        else:
            self._plan = None

    def _free_text(self, token: int) -> bool:
        """The last filled mask allowed most of the vocabulary (inside a free string) and the token has no quote
        or escape: the string stays open."""
        assert self._vocab is not None
        if any(c in self._vocab.token_bytes[token] for c in b'"\\') or self._mask is None:
            return False
        words = self._mask.numpy()
        return int(np.count_nonzero(words == -1)) > words.shape[0] // 2

    def _refresh(self, left: int) -> None:
        self._plan = self.closing_plan()
        self._refreshed_at = left
        if self._plan is not None:
            self._known = len(self._plan)


def _options(words: np.ndarray, cap: int) -> list[int]:
    """The first `cap` + 1 allowed token ids of a bitmask row (lowest first)."""
    out: list[int] = []
    for w in np.flatnonzero(words).tolist():
        x = int(words[w]) & 0xFFFFFFFF
        while x:
            low = x & -x
            out.append(32 * w + low.bit_length() - 1)
            if len(out) > cap:
                return out
            x ^= low
    return out


def _plan(m: Any, vocab: ClosingVocab, words_n: int, lookahead: bool, limit: int) -> list[int] | None:
    """The closing strategy on matcher `m` (consumed): forced text by jump-forward, else the first allowed closing
    token (string closers inside a free string), else the one of a few allowed tokens whose own plan (without
    lookahead) is shortest, else the lowest allowed id."""
    buf = torch.zeros(1, words_n, dtype=torch.int32)
    words = buf.numpy()[0]
    plan: list[int] = []
    while len(plan) < limit:
        if m.is_completed():
            return plan
        forced = m.find_jump_forward_tokens() if m.find_jump_forward_string() else []
        if forced:
            for t in forced:
                if not m.accept_token(t):
                    return None
                plan.append(t)
            continue
        m.fill_next_token_bitmask(buf, 0)
        free = int(np.count_nonzero(words == -1)) > words_n // 2
        pick = next(
            (t for t in (vocab.string_closers if free else vocab.structural) if (words[t >> 5] >> (t & 31)) & 1),
            None,
        )
        if pick is None:
            options = _options(words, _LOOKAHEAD_OPTIONS)
            if not options:
                return None
            pick = options[0]
            if lookahead and 1 < len(options) <= _LOOKAHEAD_OPTIONS:
                best: int | None = None
                for t in options:
                    f = m.fork()
                    if not f.accept_token(t):
                        continue
                    bound = limit - len(plan) - 1 if best is None else best - 1  # only a shorter one matters
                    rest = _plan(f, vocab, words_n, lookahead=False, limit=bound)
                    if rest is not None and (best is None or len(rest) < best):
                        best, pick = len(rest), t
        if not m.accept_token(pick):
            return None
        plan.append(pick)
    return plan if m.is_completed() else None


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
        self._closing = ClosingVocab.of(self._token_bytes)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token as the vocabulary holds them (b"" past the tokenizer's own vocabulary)."""
        return self._token_bytes[token] if 0 <= token < len(self._token_bytes) else b""

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`; raises GrammarError when it does not compile."""
        return GrammarMatcher(self._xgr.GrammarMatcher(self._compile(spec)), self.vocab_size, self._closing)

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
