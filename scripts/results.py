"""docs/results.md: the training protocol's effect and FLARE vs FLARE++ vs simplified FLARE++
on CPU-sized Darcy and Elasticity data generated here, with ``flarepp sweep``.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/results.py [--data data] [--out runs/results]
                                                          [--jobs 2] [--only STUDY ...]

Makes the data if absent (``flarepp data make darcy --train 200 --test 100`` and
``flarepp data make elasticity --train 200 --test 50``), runs each study below as a sweep
with ``--jobs`` processes sharing its directory (an interrupted call continues where it
stopped: finished points are kept, half-finished ones resume), writes each sweep's report
and then ``docs/results.md`` with its figures in ``docs/results/``. On two loaded CPU cores
the 60 runs take hours; ``--only`` runs some studies (the page then shows those done).

Studies (``-tiny`` presets):

* ``protocol-legacy`` / ``protocol-reference``: FLARE and FLARE++ on Darcy at SDPA scale
  1.0 and 1/sqrt(D), 3 seeds, under flarepp's earlier protocol (MSE of normalised outputs,
  standardised inputs, decay on every parameter, fixed beta1) and under the FLARE study's
  (the presets' default);
* ``mixers-darcy`` and ``mixers-elasticity`` (the presets' samples and epochs: 20 and
  25), B = 1, 2: FLARE, FLARE++ and simplified FLARE++, 3 seeds, each mixer at its
  reference scale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEGACY = ["loss=mse", "input_norm=standard", "weight_decay_groups=all", "momentum_cycle=None"]
PROTOCOL_GRID = ["model.mixer=flare,flarepp", "attn_scale=1.0,sqrt", "seed=0,1,2"]
MIXERS = "model.mixer=flare,flarepp,flarepp-simple"


@dataclass
class Study:
    name: str
    preset: str
    dataset: str
    grid: list[str]
    sets: list[str] = field(default_factory=list)
    title: str = ""


STUDIES = [
    Study("protocol-legacy", "darcy-tiny", "darcy", PROTOCOL_GRID, LEGACY,
          "Darcy, flarepp's earlier protocol"),
    Study("protocol-reference", "darcy-tiny", "darcy", PROTOCOL_GRID, [],
          "Darcy, the FLARE study's protocol"),
    Study("mixers-darcy", "darcy-tiny", "darcy", [MIXERS, "model.blocks=1,2", "seed=0,1,2"],
          [], "Darcy (200 / 100 samples, 22 x 22 grid, 20 epochs)"),
    Study("mixers-elasticity", "elasticity-tiny", "elasticity",
          [MIXERS, "model.blocks=1,2", "seed=0,1,2"], [],
          "Elasticity (200 / 50 samples, 972 points, 25 epochs)"),
]
DATA = {"darcy": ["--train", "200", "--test", "100"],
        "elasticity": ["--train", "200", "--test", "50"]}


def flarepp(*args: str) -> list[str]:
    return [sys.executable, "-m", "flarepp", *args]


def run_study(study: Study, data: Path, out: Path, jobs: int) -> None:
    cmd = flarepp("sweep", study.preset, "--data", str(data / study.dataset),
                  "--out", str(out / study.name), "--quiet", "--grid", *study.grid,
                  *[a for s in study.sets for a in ("--set", s)])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(" ".join(cmd[1:]) + f"   (x{jobs})", flush=True)
    procs = [subprocess.Popen(cmd, env=env) for _ in range(jobs)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{study.name}: sweep processes exited with {codes}")
    subprocess.run(flarepp("sweep", "report", str(out / study.name)), check=True,
                   stdout=subprocess.DEVNULL)


def _pct(mean: float, std: float) -> str:
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


def seed_table(directory: Path) -> tuple[list[dict], list[dict]]:
    """The sweep's rows, and per combination of its grid's axes other than the seed the
    mean and sample std over seeds of the test and train relative L2 (Table 11)."""
    from flarepp.experiments.reports import aggregate, collect
    study, rows = collect(directory)
    keys = [k for k in study.points[0].labels if k != "seed"]
    table = []
    for group in aggregate(rows, keys + ["sdpa_scale"]):
        test, train = group.stats("value"), group.stats("train_value")
        table.append({**group.key, "seeds": test[2], "test_mean": test[0], "test_std": test[1],
                      "train_mean": train[0], "train_std": train[1]})
    return rows, table


def protocol_section(out: Path) -> list[str]:
    tables = {}
    for name in ("protocol-legacy", "protocol-reference"):
        if not (out / name / "study.json").exists():
            return []
        tables[name] = {(t["model.mixer"], t["sdpa_scale"]): t
                        for t in seed_table(out / name)[1]}
    keys = sorted(set(tables["protocol-legacy"]) | set(tables["protocol-reference"]))
    lines = ["## The training protocol (Darcy, `darcy-tiny`)", "",
             "Test (train) relative L2 error in %, mean ± sample standard deviation over "
             "seeds 0, 1, 2, the same seeds under both protocols. *Earlier*: MSE of the "
             "normalised outputs, every input channel standardised, weight decay on every "
             "parameter, fixed beta1 = 0.9. *Reference* (the presets' default now): the FLARE "
             "study's relative L2 of de-normalised outputs plus 0.1 x that of the grid "
             "gradients, raw grid positions with a standardised coefficient, decay on weight "
             "matrices only, beta1 cycled 0.95 -> 0.85 -> 0.95.", "",
             "| mixer | SDPA scale | earlier: test | earlier: train | reference: test | "
             "reference: train | seeds |", "|---|---|---|---|---|---|---|"]
    for key in keys:
        old, new = (tables[n].get(key) for n in ("protocol-legacy", "protocol-reference"))
        cells = []
        for t in (old, new):
            cells += (["-", "-"] if t is None else [_pct(t["test_mean"], t["test_std"]),
                                                    _pct(t["train_mean"], t["train_std"])])
        seeds = "/".join(str(t["seeds"]) if t else "0" for t in (old, new))
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + f" | {seeds} |")
    lines += ["", *protocol_findings(tables), ""]
    return lines


def _change(a: float, b: float) -> str:
    return f"{100 * (b - a) / a:+.0f}%"


def protocol_findings(tables: dict) -> list[str]:
    """Sentences computed from the table: protocol effect per mixer and scale, the scale
    effect, and FLARE++'s margin over FLARE at each protocol and scale."""
    out = []
    for name, label in (("protocol-legacy", "earlier"), ("protocol-reference", "reference")):
        t = tables[name]
        flare = {s: v["test_mean"] for (m, s), v in t.items() if m == "flare"}
        pp = {s: v["test_mean"] for (m, s), v in t.items() if m == "flarepp"}
        for s_f in sorted(flare):
            for s_p in sorted(pp):
                out.append(f"- {label} protocol, FLARE at scale {s_f} vs FLARE++ at scale "
                           f"{s_p}: FLARE++'s test error is {_change(flare[s_f], pp[s_p])} "
                           "relative to FLARE's.")
    old, new = tables["protocol-legacy"], tables["protocol-reference"]
    for key in sorted(set(old) & set(new)):
        out.append(f"- {key[0]} at scale {key[1]}: the reference protocol changes the test "
                   f"error by {_change(old[key]['test_mean'], new[key]['test_mean'])}.")
    return out


def mixer_section(out: Path, study: Study, figures: Path) -> list[str]:
    if not (out / study.name / "study.json").exists():
        return []
    rows, table = seed_table(out / study.name)
    done = sum(r["status"] == "done" for r in rows)
    sets = "".join(f" --set {s}" for s in study.sets)
    lines = [f"## {study.title}: FLARE, FLARE++, simplified FLARE++", "",
             f"`flarepp sweep {study.preset}{sets} --grid {' '.join(study.grid)}` ({done} of "
             f"{len(rows)} runs done). Test (train) relative L2 in %, mean ± sample std over "
             "seeds.", "", "| blocks | mixer | SDPA scale | test | train | seeds |",
             "|---|---|---|---|---|---|"]
    for t in sorted(table, key=lambda t: (int(t["model.blocks"]), t["model.mixer"])):
        lines.append(f"| {t['model.blocks']} | {t['model.mixer']} | {t['sdpa_scale']} | "
                     f"{_pct(t['test_mean'], t['test_std'])} | "
                     f"{_pct(t['train_mean'], t['train_std'])} | {t['seeds']} |")
    by_depth: dict[str, dict[str, float]] = {}
    for t in table:
        by_depth.setdefault(t["model.blocks"], {})[t["model.mixer"]] = t["test_mean"]
    lines.append("")
    for depth in sorted(by_depth, key=int):
        errs = by_depth[depth]
        best = min(errs, key=errs.get)
        rel = (f"; FLARE++ vs FLARE {_change(errs['flare'], errs['flarepp'])}"
               if {"flare", "flarepp"} <= set(errs) else "")
        lines.append(f"- B = {depth}: lowest mean test error {best} "
                     f"({100 * errs[best]:.2f}%){rel}.")
    stuck = [r["point"] for r in rows
             if r["status"] == "done" and r["train_value"] is not None
             and float(r["train_value"]) >= 0.5]
    if stuck:
        lines.append(f"- {len(stuck)} of {done} runs ended with a training error of 50% or "
                     f"more (they did not fit the training data): "
                     f"{', '.join(stuck)}.")
    source = out / study.name / "fig4_depth_latents.png"
    if source.exists():
        figures.mkdir(parents=True, exist_ok=True)
        target = figures / f"{study.name}_depth.png"
        shutil.copyfile(source, target)
        lines += ["", f"![{study.title}: error against depth](results/{target.name})"]
    return lines + [""]


def write_page(out: Path) -> Path:
    page = ROOT / "docs" / "results.md"
    lines = ["# Results on CPU-sized data", "",
             "Produced by `OMP_NUM_THREADS=1 .venv/bin/python scripts/results.py` (see its "
             "docstring); every number below is read from the sweeps' run directories. The "
             "data are generated here (`flarepp data make`), far smaller than the public "
             "benchmarks, and the models are the `-tiny` presets (C = 64, H = 4, M = 32, "
             "20-25 epochs): these numbers test the code and the protocol, they do not "
             "reproduce Table 1.", ""]
    lines += protocol_section(out)
    for study in STUDIES[2:]:
        lines += mixer_section(out, study, ROOT / "docs" / "results")
    page.write_text("\n".join(lines) + "\n")
    return page


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data", help="data directory (one per dataset)")
    parser.add_argument("--out", default="runs/results", help="sweep directories")
    parser.add_argument("--jobs", type=int, default=2, help="processes per sweep")
    parser.add_argument("--only", nargs="+", choices=[s.name for s in STUDIES])
    parser.add_argument("--page-only", action="store_true",
                        help="write docs/results.md from the sweeps as they are")
    args = parser.parse_args()
    data, out = Path(args.data), Path(args.out)
    if not args.page_only:
        for name, sizes in DATA.items():
            if not (data / name).exists():
                subprocess.run(flarepp("data", "make", name, "--out", str(data / name),
                                       *sizes, "--quiet"), check=True)
        for study in STUDIES:
            if args.only is None or study.name in args.only:
                run_study(study, data, out, args.jobs)
    print(write_page(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
