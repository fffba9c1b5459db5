"""Errors of the comparison models before and after a correction, paired by seed.

    python scripts/before_after.py AFTER BEFORE [--evals DIR] [--names BEFORE AFTER]

``AFTER`` and ``BEFORE`` are two sweep directories with the same preset, data and seeds,
trained by the corrected code and by the code before the correction (issue 33: the study
``baselines-darcy`` of docs/results/plan.json, and ``flarepp sweep`` of the changed models
at the commit before it). A model whose training did not change and whose evaluation did
(Transolver++) has no BEFORE run: ``--evals DIR`` holds ``DIR/<point>.json``, the
``flarepp eval --json`` of the AFTER point's checkpoint under the earlier code. Prints a
Markdown table: per model, mean ± sample std before and after, and the paired difference
after - before with its 95% t interval (the paired report's :func:`interval`). ``--names``
relabels the two columns (e.g. ``default option`` for a study of one option's effect).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from flarepp.experiments.reports.common import fmt, markdown, spread
from flarepp.experiments.reports.rows import collect
from flarepp.experiments.reports.stats import interval


def by_seed(rows, model: str) -> dict[int, float]:
    return {r.seed: r.value for r in rows if r.mixer == model and r.status == "done"}


def evaluated_before(rows, model: str, evals: Path) -> dict[int, float]:
    found = {}
    for r in rows:
        path = evals / f"{r.point}.json"
        if r.mixer == model and r.status == "done" and path.exists():
            found[r.seed] = json.loads(path.read_text())["test_rel_l2"]
    return found


def mean_std(values: dict[int, float]) -> str:
    v = np.asarray(list(values.values()), float)
    return spread(v.mean(), v.std(ddof=1) if len(v) > 1 else math.nan) if len(v) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("after", type=Path)
    parser.add_argument("before", type=Path)
    parser.add_argument("--evals", type=Path, help="earlier-code evaluations of AFTER points")
    parser.add_argument("--names", nargs=2, default=["before", "after"],
                        metavar=("BEFORE", "AFTER"), help="the two columns' names")
    args = parser.parse_args()
    _, after = collect(args.after)
    _, before = collect(args.before)
    in_after = {r.mixer for r in after}
    models = [m for m in dict.fromkeys(r.mixer for r in before) if m in in_after]
    if args.evals is not None:
        models += [m for m in dict.fromkeys(r.mixer for r in after)
                   if m not in models and evaluated_before(after, m, args.evals)]
    body = []
    for model in models:
        new = by_seed(after, model)
        old = by_seed(before, model)
        if not old and args.evals is not None:
            old = evaluated_before(after, model, args.evals)
        seeds = sorted(set(new) & set(old))
        stats = interval(np.asarray([new[s] - old[s] for s in seeds], float))
        body.append([model, f"{len(old)} / {len(new)}", mean_std(old), mean_std(new),
                     stats["n"], fmt(stats["mean"]),
                     f"[{fmt(stats['low'])}, {fmt(stats['high'])}]"])
    old, new = args.names
    print("\n".join(markdown(["model", f"runs {old} / {new}", f"test {old}", f"test {new}",
                              "pairs", f"{new} - {old}", "95% interval"], body)))


if __name__ == "__main__":
    main()
