"""What one constrained, penalised or logprobs request costs the greedy requests decoding beside it: an in-process
engine (SmolLM2) decodes `--neighbours` greedy requests (ignore_eos, `--tokens` each) alone, then beside one odd
request that runs for their whole decode (a JSON schema whose string is at least `--tokens` characters long; a
frequency penalty; logprobs with top 5). Per scenario: the neighbours' decode tokens/s (from each one's first token
to its last, summed over them) and the odd request's own, at each `--bursts` decode burst (1: the CPU default; 4:
what the GPU path does with bursts).

    python -m bench.neighbour_decode --neighbours 4 --tokens 64 --bursts 1 4 --repeats 2 --threads 1

`--split-bursts` turns split steps on (scheduler.py): the greedy neighbours burst beside the odd request (at
a533893..a92a520 they were on by default, which is how bench/results/neighbour_decode_cpu_*.txt measured them).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field

from services.engine.builder import build_engine
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.step.grammar import GrammarSpec
from services.engine.step.sampling import SamplingParams
from services.engine.step.sequence import Chunk, Sequence

logger = logging.getLogger(__name__)


@dataclass
class Timeline:
    times: list[float] = field(default_factory=list)  # one entry per token, when the host read it
    tokens: int = 0

    def rate(self, start: float | None = None, end: float | None = None) -> float:
        """Decode tokens/s between the first and last token (or within [start, end])."""
        ts = [t for t in self.times if (start is None or t >= start) and (end is None or t <= end)]
        return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else 0.0


def _reader(seq: Sequence, tl: Timeline) -> None:
    while True:
        ev = seq.events.get(timeout=600)
        if not isinstance(ev, Chunk):
            return
        now = time.perf_counter()
        tl.times.extend([now] * len(ev.token_ids))
        tl.tokens += len(ev.token_ids)


def odd_params(kind: str, tokens: int) -> SamplingParams | None:
    if kind == "none":
        return None
    if kind == "json_schema":
        schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": tokens * 4}},
                  "required": ["story"], "additionalProperties": False}  # fmt: skip
        grammar = GrammarSpec("json_schema", json.dumps(schema))
        return SamplingParams(temperature=0.0, max_tokens=tokens * 8, grammar=grammar)
    if kind == "penalty":
        return SamplingParams(temperature=0.0, max_tokens=tokens * 8, ignore_eos=True, frequency_penalty=0.5)
    if kind == "logprobs":
        return SamplingParams(temperature=0.0, max_tokens=tokens * 8, ignore_eos=True, logprobs=True, top_logprobs=5)
    raise ValueError(kind)


def scenario(engine: Engine, neighbours: int, tokens: int, kind: str, tag: str) -> tuple[float, float]:
    """(neighbours' summed decode tok/s, the odd request's decode tok/s over the neighbours' window)."""
    tok = engine.tokenizer
    seqs, lines = [], []
    odd = odd_params(kind, tokens)
    odd_seq = odd_line = None
    if odd is not None:
        prompt = tok.encode("<|im_start|>user\nWrite a long story as JSON.<|im_end|>\n<|im_start|>assistant\n")
        odd_seq, odd_line = engine.submit(f"odd-{tag}", prompt, odd), Timeline()
        threading.Thread(target=_reader, args=(odd_seq, odd_line), daemon=True).start()
        while not odd_line.times:  # decoding before the neighbours arrive
            time.sleep(0.01)
    for i in range(neighbours):
        prompt = tok.encode(f"<|im_start|>user\nTell story number {i} about a {tag} lighthouse.<|im_end|>\n")
        seq = engine.submit(f"n{i}-{tag}", prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        seqs.append(seq)
        lines.append(Timeline())
    threads = [threading.Thread(target=_reader, args=(s, t), daemon=True) for s, t in zip(seqs, lines, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the window in which every neighbour decodes: from the last one's first token to the first one's last token
    start = max(t.times[0] for t in lines)
    end = min(t.times[-1] for t in lines)
    total = sum(t.rate(start, end) for t in lines)
    odd_rate = 0.0
    if odd_seq is not None and odd_line is not None:
        odd_rate = odd_line.rate(start, end)
        engine.abort(odd_seq)
        time.sleep(0.2)
    return total, odd_rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--neighbours", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--bursts", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--kinds", nargs="+", default=["none", "json_schema", "penalty", "logprobs"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--split-bursts", action="store_true", help="split steps on (scheduler.py; off by default)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for burst in a.bursts:
        cfg = EngineConfig(
            device=a.device,
            max_context=2048,
            kv_capacity=8192,
            decode_burst=burst,
            num_threads=a.threads,
            split_bursts=a.split_bursts,
        )
        engine, info = build_engine(cfg)
        tables = getattr(engine, "grammar_tables", None)  # (absent before 7aff6a0: built at the first grammar)
        if tables is not None:
            tables.compiler()  # built at start-up; not part of any scenario
        try:
            scenario(engine, a.neighbours, 8, "json_schema", "warm")  # warm-up: compile the odd grammar once
            for kind in a.kinds:
                runs = [scenario(engine, a.neighbours, a.tokens, kind, f"{kind}{r}") for r in range(a.repeats)]
                rows.append((burst, kind, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)))
                print(f"burst {burst} {kind}: {runs}", flush=True)
        finally:
            engine.stop()
    print(f"model={info.model_id} device={a.device} neighbours={a.neighbours} tokens={a.tokens} repeats={a.repeats}")
    print(f"{'burst':>5}  {'odd request':<12}{'neighbours tok/s':>18}{'vs alone':>10}{'odd tok/s':>11}")
    alone = {b: r for b, k, r, _ in rows if k == "none"}
    for burst, kind, rate, odd in rows:
        ratio = rate / alone[burst] if alone.get(burst) else float("nan")
        print(f"{burst:>5}  {kind:<12}{rate:>18.1f}{ratio:>10.2f}{odd:>11.1f}")


if __name__ == "__main__":
    main()
