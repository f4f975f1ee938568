"""RULER-style tasks over a haystack, in every request shape a user sends.

Tasks: `single_code` (the classic needle: one unkeyed fact per document, "the pass key is N"),
`single_number`, `single_word`, `single_uuid` (one needle), `multikey` (the needle among three
distractor needles of other keys, same template), `multivalue` (one key, three values at spread depths:
all must be named), `multiquery` (three keys asked at once), `listing` (sixteen keys, one answer line each),
`recite` (a passage of ~720 tokens copied word for word: a long answer whose later sentences need the
passage's later pages, issue 25 item 3), `vartrack` (a two-hop chain of variable
assignments), `codeqa` (what a function planted in the text returns) and `fwe` (the three most frequent
words of a word list: aggregation, expected to need `shard`).

Shapes: `chat_qlast` (one user message, document then question), `chat_qfirst` (question, then the
document), `chat_doc_earlier` (the document as an earlier user message, acknowledged, the question as
the last), `completion` (raw text, free decoding) and `completion_digits` (raw text, only digit tokens
may be sampled: logit_bias; numeric answers only).
"""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from bench.longeval import haystacks
from bench.longeval.split import Split

TASKS = ("single_code", "single_number", "single_word",
         "single_uuid", "multikey", "multivalue", "multiquery", "listing", "recite", "vartrack", "codeqa",
         "fwe")  # fmt: skip
NUMERIC = frozenset({"single_code", "single_number", "multikey", "vartrack", "codeqa"})
LIST_KEYS = 16  # listing: ~14 tokens a line, an answer of ~220 tokens over 16 needles (more than a 1K pool's evidence)
# recite: a passage of about this many tokens (~11 pages of 64, more than a 1K pool's nine evidence pages) of
# docstring sentences in a new order, copied word for word: the answer's later sentences need the passage's later
# pages, which the prompt's selection may lack. Prose, not a table of codes: dense Gemma 3 270M copied 20 of 32
# such sentences (CPU, 2.2K tokens), but 4 of 64 rows of "row 07: 1869953" before repeating one; SmolLM2 8 and 18
RECITE_TOKENS = 720
SHAPES = ("chat_qlast", "chat_qfirst", "chat_doc_earlier", "completion", "completion_digits")
_ADJ = ["amber", "silent", "brisk", "hollow", "crimson", "gentle", "rapid", "frozen", "golden", "lucky", "misty",
        "noble", "quiet", "rustic", "sunny", "tidal", "vivid", "wooden", "young", "zesty"]  # fmt: skip
_NOUN = ["falcon", "harbor", "meadow", "lantern", "pebble", "comet", "orchard", "canyon", "beacon", "thistle",
         "glacier", "willow", "anchor", "summit", "ember", "prairie", "violin", "basalt", "kestrel",
         "quarry"]  # fmt: skip
_WORDS = ["apple", "river", "copper", "tiger", "violet", "engine", "marble", "planet", "silver", "forest", "rocket",
          "candle", "dragon", "pillow", "island", "yellow", "wizard", "turnip", "saddle", "guitar"]  # fmt: skip


@dataclass(frozen=True)
class Case:
    case_id: str
    split: str
    task: str
    kind: str
    length: int  # target prompt tokens (recite: prompt + answer)
    depth: float
    shape: str
    answers: tuple[str, ...]  # every one must appear in the answer text (case-insensitive)
    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    logit_bias: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    def record(self) -> dict:
        """What a results file keeps of the case: every field but the prompt's text (hundreds of KB at 30K
        tokens, and rebuilt from the split's seed), with its sha256 to tell whether two runs asked the same text
        (the haystacks come from the running interpreter's standard library)."""
        out = self.to_json()
        text = json.dumps([out.pop("prompt"), out.pop("messages")])
        out["text_sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return out


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}-{rng.randrange(10, 99)}"


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 9_999_999))


def _value(task: str, rng: random.Random) -> str:
    if task == "single_word":
        return rng.choice(_WORDS) + "-" + rng.choice(_WORDS)
    if task == "single_uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return _number(rng)


def _place(paras: list[str], needles: list[tuple[float, str]]) -> str:
    out = list(paras)
    for depth, text in sorted(needles, key=lambda n: -n[0]):  # deepest first: earlier indices stay valid
        out.insert(round(depth * len(paras)), text)
    return "\n\n".join(out)


def _fwe_doc(rng: random.Random, target: int, count: Callable[[str], int]) -> tuple[str, tuple[str, ...]]:
    vocab = [f"{rng.choice(_ADJ)}{rng.choice(_NOUN)}" for _ in range(400)]
    top = rng.sample(vocab, 3)
    words: list[str] = []
    per_line = 12
    while count(" ".join(words)) < target:  # grows in lines: the count is rechecked every 200 words
        for _ in range(200):
            r = rng.random()
            words.append(top[0] if r < 0.06 else top[1] if r < 0.10 else top[2] if r < 0.13 else rng.choice(vocab))
    lines = [" ".join(words[i : i + per_line]) for i in range(0, len(words), per_line)]
    return "\n".join(lines), tuple(top)


def make_case(
    split: Split, task: str, kind: str, half: int, length: int, depth: float, shape: str, index: int,
    count: Callable[[str], int], digits: tuple[int, ...],
) -> Case:  # fmt: skip
    """One case, fully determined by its arguments (the seed comes from the split and the index); `digits` are the
    model's token ids of "0".."9" (`digit_tokens`; completion_digits biases them)."""
    rng = random.Random(f"{split.seed}:{task}:{kind}:{length}:{depth}:{shape}:{index}")
    intro = rng.choice(split.intros)
    budget = length - 140
    max_tokens = 32
    if task == "fwe":
        doc, answers = _fwe_doc(rng, budget, count)
        question = "Which three words appear most often in the list above? Name the three words."
        prefix = "The three most frequent words are"
        max_tokens = 48
    else:
        template = rng.choice(split.templates)
        key = _key(rng)
        question, prefix = rng.choice(split.questions)
        needles: list[tuple[float, str]]
        if task == "single_code":
            noun, value = rng.choice(split.code_nouns), _number(rng)
            question, prefix = rng.choice(split.code_asks)
            question, prefix = question.format(noun=noun), prefix.format(noun=noun)
            needles, answers = [(depth, rng.choice(split.code_templates).format(noun=noun, value=value))], (value,)
        elif task in ("single_number", "single_word", "single_uuid"):
            value = _value(task, rng)
            needles, answers = [(depth, template.format(key=key, value=value))], (value,)
        elif task == "multikey":
            value = _number(rng)
            needles = [(depth, template.format(key=key, value=value))]
            for _ in range(3):
                other = _key(rng)
                while other == key:
                    other = _key(rng)
                needles.append((rng.random(), template.format(key=other, value=_number(rng))))
            answers = (value,)
        elif task == "multivalue":
            values = [_number(rng) for _ in range(3)]
            depths = sorted({depth, (depth + 0.33) % 1.0, (depth + 0.66) % 1.0})
            needles = [(d, template.format(key=key, value=v)) for d, v in zip(depths, values, strict=False)]
            answers = tuple(values[: len(needles)])
            question, prefix = rng.choice(split.multi_questions).format(key=key), f"The values for {key} are"
            max_tokens = 96
        elif task == "multiquery":
            keys = [key, _key(rng), _key(rng)]
            values = [_number(rng) for _ in keys]
            spots = [depth, rng.random(), rng.random()]
            needles = [(d, template.format(key=k, value=v)) for d, k, v in zip(spots, keys, values, strict=True)]
            answers = tuple(values)
            question = f"What are the values for {keys[0]}, {keys[1]} and {keys[2]} in the text? Give all three."
            prefix = "The values are"
            max_tokens = 64
        elif task == "listing":  # a long answer: LIST_KEYS lines, each needing its own distant needle
            keys = [key]
            while len(keys) < LIST_KEYS:
                other = _key(rng)
                if other not in keys:
                    keys.append(other)
            values = [_number(rng) for _ in keys]
            spots = [(depth + i / LIST_KEYS) % 1.0 for i in range(LIST_KEYS)]
            needles = [(d, rng.choice(split.templates).format(key=k, value=v))
                       for d, k, v in zip(spots, keys, values, strict=True)]  # fmt: skip
            answers = tuple(values)
            question, prefix = rng.choice(split.list_questions).format(keys=", ".join(keys)), f"{keys[0]}:"
            max_tokens = 24 * LIST_KEYS
        elif task == "recite":  # the long copy: every sentence after the first (the answer's start) is an answer
            noun = rng.choice(split.recite_nouns)
            prose_half = next(h for k, h in split.kinds if k == "prose")
            sentences = haystacks.sentences(prose_half, rng)
            passage: list[str] = []
            while count(" ".join(passage)) < RECITE_TOKENS:
                passage.append(next(sentences))
            head, tail = f"The {noun} {key} begins.", f"The {noun} {key} ends."
            needles, answers = [(depth, "\n".join([head, " ".join(passage), tail]))], tuple(passage[1:])
            question, prefix = rng.choice(split.recite_asks)
            question = question.format(noun=noun, key=key)
            prefix = prefix.format(noun=noun, key=key) + "\n" + passage[0]
            max_tokens = count(" ".join(passage[1:])) + 32
            budget -= max_tokens  # the prompt and its answer together fill `length` (SmolLM2 has 8,192 positions)
        elif task == "vartrack":
            a, b = rng.sample(_NOUN, 2)
            var_a, var_b = f"VAR_{a.upper()}", f"VAR_{b.upper()}"
            value = _number(rng)
            later = depth + (1 - depth) * rng.uniform(0.2, 0.8)
            needles = [(depth, f"{var_a} = {value}"), (later, f"{var_b} = {var_a}")]
            answers = (value,)
            question, prefix = f"What is the numeric value of {var_b}? Follow the assignments.", f"{var_b} ="
        elif task == "codeqa":
            name = f"get_{rng.choice(_ADJ)}_{rng.choice(_NOUN)}_limit"
            value = _number(rng)
            code = f'def {name}():\n    """The configured limit."""\n    return {value}'
            needles, answers = [(depth, code)], (value,)
            question, prefix = rng.choice(split.code_questions)
            question, prefix = question.format(name=name), prefix.format(name=name)
        else:
            raise ValueError(f"unknown task {task!r}; one of {TASKS}")
        question = question.format(key=key)
        prefix = prefix.format(key=key)
        paras = haystacks.build(kind, half, rng, budget - sum(count(n) for _, n in needles), count)
        doc = _place(paras, needles)
    cid = f"{split.name}-{task}-{kind}-{length}-{depth:.2f}-{shape}-{index}"
    common = dict(case_id=cid, split=split.name, task=task, kind=kind, length=length, depth=depth, shape=shape,
                  answers=answers, max_tokens=max_tokens)  # fmt: skip
    if shape == "chat_qlast":
        return Case(**common, messages=[{"role": "user", "content": f"{intro}\n\n{doc}\n\n{question}"}])
    if shape == "chat_qfirst":
        return Case(**common, messages=[{"role": "user", "content": f"{question}\n\n{intro}\n\n{doc}"}])
    if shape == "chat_doc_earlier":
        return Case(**common, messages=[
            {"role": "user", "content": f"{intro}\n\n{doc}"},
            {"role": "assistant", "content": "I have read the document. What would you like to know?"},
            {"role": "user", "content": question},
        ])  # fmt: skip
    text = f"{intro}\n\n{doc}\n\nQuestion: {question}\nAnswer: {prefix}"
    if shape == "completion":
        return Case(**common, prompt=text)
    if shape == "completion_digits":
        if task not in NUMERIC:
            raise ValueError(f"completion_digits needs a numeric answer; {task!r} has none")
        common["max_tokens"] = 8
        return Case(**common, prompt=text + " ", logit_bias={str(t): 100 for t in digits})
    raise ValueError(f"unknown shape {shape!r}; one of {SHAPES}")


def digit_tokens(encode: Callable[[str], list[int]]) -> tuple[int, ...]:
    """The token ids of "0".."9" under a tokenizer (each must be one token, as in SmolLM2's and Gemma's: 32..41 and
    236771..; the one model's ids are the other's <unused> tokens)."""
    ids = [encode(str(d)) for d in range(10)]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"digits are not single tokens under this tokenizer: {ids}")
    return tuple(i[0] for i in ids)


def found(case: Case, text: str) -> list[bool]:
    """For each answer, whether it appears in the text (case-insensitive)."""
    low = text.lower()
    return [a.lower() in low for a in case.answers]


def score(case: Case, text: str) -> bool:
    """Right when every answer appears in the text (case-insensitive)."""
    return all(found(case, text))
