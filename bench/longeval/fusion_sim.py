"""Replays the ring's prompt selection offline over per-head page masses dumped by probe.py (`--dump-mass`):
for each head-fusion rule, neighbour reach, recent-window exclusion and layer subset, how often the needle's
page lands in the evidence. Tuning split only (probe.py never reads the held-out split).

    .venv/bin/python -m bench.longeval.fusion_sim /tmp/mass.pt --evidence-pages 9 --recent-pages 5 --layers 30
"""

from __future__ import annotations

import argparse
import itertools

import torch

from services.engine.ring.selection import page_ranking, pick_pages


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dump")
    p.add_argument("--evidence-pages", type=int, default=9)
    p.add_argument("--recent-pages", type=int, default=5)
    p.add_argument("--layers", type=int, default=30, help="paged layers in the dump (rows = layers x heads)")
    a = p.parse_args(argv)
    cases = torch.load(a.dump)
    rules = ["sum", "norm", "rrf:1", "rrf:4", "rrf:16", "max", "peak"]
    print(f"{len(cases)} cases; evidence {a.evidence_pages} pages")
    print(f"{'rule':8s} {'reach':>5s} {'recent out':>10s} {'layers':>8s} {'needle selected':>16s}")
    firsts = sorted({0, 2, a.layers // 6, a.layers // 3, a.layers // 2, 2 * a.layers // 3})
    for rule, reach, recent_out, first_layer in itertools.product(rules, (0, 1), (False, True), firsts):
        hits = 0
        for c in cases:
            mass = c["mass"]
            heads = mass.shape[0] // a.layers
            mass = mass[first_layer * heads :]
            num = mass.shape[-1]
            excluded = set(c["excluded"])
            if recent_out:  # the recent window holds the prompt's last pages; the scored pages end where it starts
                excluded |= set(range(max(0, num - (a.recent_pages - 1)), num))
            scores = page_ranking(mass, num, excluded, rule)
            order = [p for p in torch.argsort(scores, descending=True, stable=True).tolist() if p not in excluded]
            chosen = pick_pages(order, num, excluded, a.evidence_pages, reach)
            hits += all(n in chosen for n in c["needle_pages"])
        print(f"{rule:8s} {reach:5d} {recent_out!s:>10s} {first_layer:8d} {hits:>10d}/{len(cases)}")


if __name__ == "__main__":
    main()
