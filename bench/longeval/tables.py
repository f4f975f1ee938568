"""Tables from one or more bench/longeval result files (run.py's JSON): the configurations side by side,
requests that failed (an error, not an answer) left out, optionally only the cases every configuration
answered (--paired: a run stopped early by --budget-s or by hand covers a prefix of the grid).

    .venv/bin/python -m bench.longeval.tables bench/results/longeval_heldout_*.json --paired
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.longeval.run import wilson


def load(paths: list[str]) -> tuple[dict[str, dict], dict[str, dict[str, dict]], list[str]]:
    """(cases by id, results by configuration then case id, the files' heads)."""
    cases: dict[str, dict] = {}
    results: dict[str, dict[str, dict]] = {}
    heads = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        heads.append(data["head"])
        cases.update(data["cases"])
        for config, rows in data["results"].items():
            results.setdefault(config, {}).update({r["case_id"]: r for r in rows if "error" not in r})
    return cases, results, heads


def render(cases: dict[str, dict], results: dict[str, dict[str, dict]], paired: bool, by: tuple[str, ...]) -> list[str]:
    configs = list(results)
    ids = set(cases)
    if paired:
        for config in configs:
            ids &= set(results[config])
    lines = []
    for field in by:
        keys = sorted({str(cases[i][field]) for i in ids})
        lines += [f"| {field} | " + " | ".join(configs) + " |", "|---|" + "---|" * len(configs)]
        for key in [*keys, "all"]:
            cells = []
            for config in configs:
                rows = [
                    r for i, r in results[config].items() if i in ids and (key == "all" or str(cases[i][field]) == key)
                ]
                right = sum(r["correct"] for r in rows)
                lo, hi = wilson(right, len(rows))
                cells.append(
                    f"{right}/{len(rows)} = {100 * right / max(1, len(rows)):.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"
                )
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += recall_lines(cases, results, ids)
    lat = []
    for config in configs:
        rows = [r for i, r in results[config].items() if i in ids]
        if rows:
            secs = sorted(r["latency_s"] for r in rows)
            lat.append(f"{config} {secs[len(secs) // 2]:.0f} s")
    lines.append("median request latency: " + ", ".join(lat))
    return lines


def recall_lines(cases: dict[str, dict], results: dict[str, dict[str, dict]], ids: set[str]) -> list[str]:
    """Values found per configuration over the cases with several answers (listing, multiquery, multivalue), and
    by the answer's place in the list: a long answer's later lines need pages the prompt's selection may lack."""
    multi = {i for i in ids if len(cases[i]["answers"]) > 1}
    if not multi:
        return []
    lines = ["| values found (cases with several answers) | all | first half of the list | second half |",
             "|---|---|---|---|"]  # fmt: skip
    for config, rows in results.items():
        got = [r["found"] for i, r in rows.items() if i in multi and "found" in r]
        if not got:
            continue
        cells = []
        for flags in ([f for g in got for f in g], [f for g in got for f in g[: len(g) // 2]],
                      [f for g in got for f in g[len(g) // 2 :]]):  # fmt: skip
            cells.append(f"{sum(flags)}/{len(flags)} = {100 * sum(flags) / max(1, len(flags)):.0f}%")
        tokens = sorted(r.get("completion_tokens") or 0 for i, r in rows.items() if i in multi)
        lines.append(f"| {config} ({len(got)} cases, median answer {tokens[len(tokens) // 2]} tokens) | " +
                     " | ".join(cells) + " |")  # fmt: skip
    return [*lines, ""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--paired", action="store_true", help="only the cases every configuration answered")
    p.add_argument("--by", default="task,shape,depth,kind")
    a = p.parse_args()
    cases, results, heads = load(a.files)
    print("\n".join([*heads, "", *render(cases, results, a.paired, tuple(a.by.split(",")))]))


if __name__ == "__main__":
    main()
