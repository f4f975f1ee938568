"""The fixed tuning / held-out split: needle templates, question phrasings, haystack sources and seeds.

Selection is tuned on TUNING only; numbers are reported on HELDOUT only. The two share no template, no
phrasing, no haystack source (prose and code come from disjoint halves of the standard library's modules,
logs only tune, tables only test) and no seed.
"""

from __future__ import annotations

from dataclasses import dataclass

# {key} and {value}; every template states the fact once, in its own words
VALUE_TEMPLATES = (
    "One of the special magic numbers for {key} is: {value}.",
    "Remember this for later: the access code assigned to {key} is {value}.",
    "According to the registry, {key} has the identifier {value}.",
    "Note from the operator: the value stored under {key} is {value}, do not lose it.",
    "The secret passphrase of {key} is {value}.",
    "For the record, {key} was given the reference {value} yesterday.",
    "Important: {key} maps to {value}.",
    "The vault label written on the box of {key} reads {value}.",
    "In the appendix it says that the tag for {key} equals {value}.",
    "Keep in mind that {key} corresponds to {value}.",
    "A handwritten note says the code of {key} is {value}.",
    "The ledger lists {value} as the entry for {key}.",
)
# (question, answer prefix for completions); {key}
QUESTIONS = (
    ("What is the special magic number for {key} mentioned in the text?", "The value for {key} is"),
    ("Which value is associated with {key} in the document above?", "The value associated with {key} is"),
    ("Tell me the code given for {key}.", "The code for {key} is"),
    ("What value does the text give for {key}? Answer with the value only.", "{key}:"),
    ("According to the document, what is recorded for {key}?", "Recorded for {key}:"),
    ("Find the value of {key} in the text and state it.", "The value of {key} is"),
    ("I need the entry for {key}. What is it?", "The entry for {key} is"),
    ("What does the document say {key} is mapped to?", "{key} is mapped to"),
    ("Look up {key}: which value belongs to it?", "The value belonging to {key} is"),
    ("Quote the value that the text assigns to {key}.", "The value assigned to {key} is"),
)
MULTI_QUESTIONS = (
    "What are all the values given for {key} in the text? List every one.",
    "List every value that the document associates with {key}.",
    "The text mentions {key} several times with different values. Name all of them.",
    "Give me all values recorded for {key}.",
)
# the long answer (issue 25 item 3): {keys} is the comma-separated key list; the answer writes one line per key
LIST_QUESTIONS = (
    "For each of these keys, in this order, give the value the text assigns to it, one per line as 'key: value':"
    " {keys}.",
    "Write one line per key, in the order given, each 'key: value' with the value from the document: {keys}.",
    "List the values recorded for the following keys, one line each in the form 'key: value', keeping this order:"
    " {keys}.",
    "Go through these keys in order and write 'key: value' for each, on its own line, using the text above: {keys}.",
)
# the long copy (issue 25 item 3, `recite`): {key} names the passage, {noun} what it is; the answer copies it word
# for word, so its later sentences need the passage's later pages, which the prompt's selection may lack
RECITE_NOUNS = ("memo", "notice", "bulletin", "statement", "letter", "circular", "dispatch", "minute")
RECITE_ASKS = (
    ("Copy the {noun} {key} word for word.", "The {noun} {key} begins."),
    ("Reproduce the {noun} {key} in full, exactly as written.", "The {noun} {key} begins."),
    ("Write out the complete text of the {noun} {key}.", "The {noun} {key} begins."),
    ("Repeat the {noun} {key} verbatim, every sentence.", "The {noun} {key} begins."),
)
CODE_QUESTIONS = (
    ("What does the function {name} return?", "{name} returns"),
    ("Which constant is returned by {name}()?", "{name}() returns"),
    ("If I call {name}(), what value do I get back?", "It returns"),
    ("Read the code: what is the return value of {name}?", "The return value of {name} is"),
)
# the classic needle (one fact, no key, one per document): {noun} and {value}
CODE_NOUNS = ("secret code", "pass key", "access number", "vault combination", "launch code", "serial number",
              "ticket number", "reference number", "magic number", "account number", "locker number",
              "badge number")  # fmt: skip
CODE_TEMPLATES = (
    "The {noun} is {value}.",
    "Remember it well: the {noun} is {value}.",
    "Write this down, the {noun} is {value}. It will be asked about.",
    "Here is the {noun}: {value}.",
    "Please note that the {noun} is {value}.",
    "Important! The {noun} you will need is {value}.",
    "Do not forget the {noun}. It is {value}.",
    "Somebody wrote on the wall: the {noun} is {value}.",
)
CODE_ASKS = (
    ("What is the {noun}?", "The {noun} is"),
    ("What is the {noun} mentioned in the text?", "The {noun} mentioned in the text is"),
    ("Which {noun} does the document give?", "The document gives the {noun}"),
    ("Tell me the {noun}.", "The {noun} is"),
    ("What {noun} was written in the text above?", "The {noun} written in the text is"),
    ("Can you find the {noun} in the text? What is it?", "The {noun} is"),
)
INTROS = (
    "Below is a long document. Read it carefully; a question about it follows.",
    "Here is some text. Some facts are hidden in it.",
    "Read the following material.",
    "The following document contains information you will be asked about.",
)


@dataclass(frozen=True)
class Split:
    name: str
    templates: tuple[str, ...]
    questions: tuple[tuple[str, str], ...]
    multi_questions: tuple[str, ...]
    list_questions: tuple[str, ...]
    code_questions: tuple[tuple[str, str], ...]
    intros: tuple[str, ...]
    code_nouns: tuple[str, ...]
    code_templates: tuple[str, ...]
    code_asks: tuple[tuple[str, str], ...]
    recite_nouns: tuple[str, ...]
    recite_asks: tuple[tuple[str, str], ...]
    kinds: tuple[tuple[str, int], ...]  # (haystack kind, standard-library half)
    seed: int


def _half(pool: tuple, parity: int) -> tuple:
    return tuple(x for i, x in enumerate(pool) if i % 2 == parity)


TUNING = Split(
    "tuning", _half(VALUE_TEMPLATES, 0), _half(QUESTIONS, 0), _half(MULTI_QUESTIONS, 0), _half(LIST_QUESTIONS, 0),
    _half(CODE_QUESTIONS, 0),
    _half(INTROS, 0), _half(CODE_NOUNS, 0), _half(CODE_TEMPLATES, 0), _half(CODE_ASKS, 0),
    _half(RECITE_NOUNS, 0), _half(RECITE_ASKS, 0),
    (("prose", 0), ("code", 0), ("logs", 0)), seed=1_000,
)  # fmt: skip
HELDOUT = Split(
    "heldout", _half(VALUE_TEMPLATES, 1), _half(QUESTIONS, 1), _half(MULTI_QUESTIONS, 1), _half(LIST_QUESTIONS, 1),
    _half(CODE_QUESTIONS, 1),
    _half(INTROS, 1), _half(CODE_NOUNS, 1), _half(CODE_TEMPLATES, 1), _half(CODE_ASKS, 1),
    _half(RECITE_NOUNS, 1), _half(RECITE_ASKS, 1),
    (("prose", 1), ("code", 1), ("tables", 1)), seed=2_000,
)  # fmt: skip
SPLITS = {s.name: s for s in (TUNING, HELDOUT)}
