"""docs/results.md: FLARE, FLARE++ and simplified FLARE++ compared fairly at CPU sizes.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/results.py [--data DIR] [--out DIR]
        [--jobs 2] [--only STUDY ...] [--page-only]

Each study below is one ``flarepp sweep`` run by ``--jobs`` processes sharing its directory
(an interrupted call continues where it stopped), on data generated here (``flarepp data
make DATASET --seed S``: one directory per data draw, ``DIR/<dataset>-draw<S>``). The page
quotes each study's own report plug-ins (:func:`flarepp.experiments.reports.
report_sections`: ``selection``, ``paired``, ``length``), so every number on it is computed
once, by the plug-in, from the run directories. A study not run yet is listed as such.

Studies (``-tiny`` presets; 2 CPU cores):

* ``presets-<dataset>``: the ``-tiny`` setting chosen on a validation split (20% of the
  training samples): peak learning rate x warm-up share x input normalisation, for FLARE,
  FLARE++ and simplified FLARE++, 3 seeds x 2 data draws; the setting with the best mean over
  the mixers of each mixer's mean validation error (no per-mixer tuning). Darcy took 3.2
  CPU-hours of training (2.7 hours on 2 cores); Elasticity's runs are about twice as long.
* ``mixers-<dataset>``: the chosen presets, the three mixers, 5 seeds x 2 fresh draws (not
  the ones the setting was chosen on), all training samples: mean ± std per mixer and the
  paired differences with 95% intervals. About 1 CPU-hour on Darcy, 2 on Elasticity.
* ``length-<dataset>``: FLARE, FLARE++ and Transolver at 10, 20 and 40 epochs (each a whole
  one-cycle schedule; Darcy also at 80), 400 training samples, 3 seeds: the metric against
  training length. Darcy took 2.1 CPU-hours (1.1 of them the 80-epoch runs, added by
  growing the 10-40 study), Elasticity 1.7 for 10-40; its epochs are about twice as long, so
  its 80-epoch point (about 2 more CPU-hours) did not fit the session that ran these.

The measurements made before this page (EMA weights, 3 seeds of one draw, copied settings)
are frozen in ``docs/results/earlier.md`` and appended.
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
MIXERS = "model.mixer=flare,flarepp,flarepp-simple"
PRESET_GRID = ["lr=1e-3,3e-3", "pct_start=0.1,0.3", "input_norm=reference,standard", MIXERS,
               "seed=0,1,2"]
SIZES = {"darcy": {"train": 200, "test": 100}, "elasticity": {"train": 200, "test": 50}}


@dataclass
class Study:
    name: str
    preset: str
    dataset: str
    grid: list[str]
    draws: tuple[int, ...]
    sections: tuple[str, ...]
    title: str
    sets: list[str] = field(default_factory=list)
    train: int | None = None  # training samples of its data draws (default SIZES)
    caveat: str = ""  # what a reader must know to compare its mixers, printed under it

    def data_dirs(self, data: Path) -> list[Path]:
        suffix = "" if self.train is None else f"-train{self.train}"
        return [data / f"{self.dataset}{suffix}-draw{seed}" for seed in self.draws]

    def command(self, data: Path, out: Path) -> list[str]:
        draws = ",".join(str(d) for d in self.data_dirs(data))
        return ["sweep", self.preset, "--out", str(out / self.name), "--quiet", "--grid",
                *self.grid, f"data_root={draws}", *[a for s in self.sets for a in ("--set", s)]]


BASELINE_CAVEAT = ("Transolver runs here at the `-tiny` preset's optimiser settings, chosen "
                   "for the FLARE family, not at its own paper's (it was not tuned "
                   "separately), with as many slices as the FLARE models have latents "
                   "(M = 32).")

STUDIES = [
    Study("presets-darcy", "darcy-tiny", "darcy", PRESET_GRID, (0, 1), ("selection",),
          "Darcy: the `darcy-tiny` setting chosen on validation", ["val_fraction=0.2"]),
    Study("presets-elasticity", "elasticity-tiny", "elasticity", PRESET_GRID, (0, 1),
          ("selection",), "Elasticity: the `elasticity-tiny` setting chosen on validation",
          ["val_fraction=0.2"]),
    Study("mixers-darcy", "darcy-tiny", "darcy", [MIXERS, "seed=0,1,2,3,4"], (2, 3),
          ("paired",), "Darcy (200 / 100 samples, 22 x 22 grid, 20 epochs): the mixers, "
                       "5 seeds x 2 draws"),
    Study("mixers-elasticity", "elasticity-tiny", "elasticity", [MIXERS, "seed=0,1,2,3,4"],
          (2, 3), ("paired",), "Elasticity (200 / 50 samples, 972 points, 25 epochs): the "
                               "mixers, 5 seeds x 2 draws"),
    Study("length-darcy", "darcy-tiny", "darcy",
          ["epochs=10,20,40,80", "model.mixer=flare,flarepp,transolver", "seed=0,1,2"], (4,),
          ("length", "paired"),
          "Darcy (400 / 100 samples, 22 x 22 grid): error against training length",
          ["dataset_options.n_train=400"], train=400, caveat=BASELINE_CAVEAT),
    Study("length-elasticity", "elasticity-tiny", "elasticity",
          ["epochs=10,20,40", "model.mixer=flare,flarepp,transolver", "seed=0,1,2"], (4,),
          ("length", "paired"),
          "Elasticity (400 / 50 samples, 972 points): error against training length",
          ["dataset_options.n_train=400"], train=400, caveat=BASELINE_CAVEAT),
]


def flarepp(*args: str) -> list[str]:
    return [sys.executable, "-m", "flarepp", *args]


def make_data(study: Study, data: Path) -> None:
    sizes = dict(SIZES[study.dataset], **({"train": study.train} if study.train else {}))
    for seed, path in zip(study.draws, study.data_dirs(data)):
        if not path.exists():
            subprocess.run(flarepp("data", "make", study.dataset, "--out", str(path),
                                   "--train", str(sizes["train"]), "--test",
                                   str(sizes["test"]), "--seed", str(seed), "--quiet"),
                           check=True)


def run_study(study: Study, data: Path, out: Path, jobs: int) -> None:
    make_data(study, data)
    cmd = flarepp(*study.command(data, out))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(" ".join(cmd[1:]) + f"   (x{jobs})", flush=True)
    procs = [subprocess.Popen(cmd, env=env) for _ in range(jobs)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{study.name}: sweep processes exited with {codes}")


def study_section(study: Study, data: Path, out: Path, figures: Path) -> list[str]:
    """The study's heading, its command and its plug-ins' report lines; images copied to
    ``figures`` and linked from the page."""
    from flarepp.experiments.reports import report_sections, status_counts, training_hours
    directory = out / study.name
    lines = [f"## {study.title}", ""]
    command = "flarepp " + " ".join(study.command(Path("DATA"), Path("STUDIES")))
    if not (directory / "study.json").exists():
        return lines + [f"Not measured yet: `{command}` (`scripts/results.py --only "
                        f"{study.name}`).", ""]
    rep = report_sections(directory, study.sections)
    counts = status_counts(rep.rows)
    lines += [f"`{command}`: {counts['done']} of {len(rep.rows)} runs done, {counts['failed']} "
              f"failed, {counts['pending']} pending; {training_hours(rep.rows):.1f} CPU-hours of "
              "training (one thread per run).", ""]
    if study.caveat:
        lines += [f"*{study.caveat}*", ""]
    section, paths = list(rep.lines), rep.paths
    while section and not section[0]:
        section = section[1:]
    figures.mkdir(parents=True, exist_ok=True)
    for key, path in paths.items():
        if path.suffix == ".png":
            target = figures / f"{study.name}_{path.name}"
            shutil.copyfile(path, target)
            section = [line.replace(f"]({path.name})", f"](results/{target.name})")
                       for line in section]
    # The plug-ins' own headings sit one level below the study's.
    return lines + [("#" + line) if line.startswith("## ") else line for line in section] + [""]


def write_page(data: Path, out: Path) -> Path:
    page = ROOT / "docs" / "results.md"
    lines = ["# Results on CPU-sized data", "",
             "Produced by `OMP_NUM_THREADS=1 .venv/bin/python scripts/results.py` (see its "
             "docstring); every number below is computed by the sweeps' report plug-ins from "
             "their run directories (`flarepp sweep report DIR` prints the same). The data are "
             "generated here (`flarepp data make`), far smaller than the public benchmarks, "
             "and the models are the `-tiny` presets (C = 64, H = 4, M = 32): these numbers "
             "test the code and the protocol at CPU sizes, they do not reproduce Table 1.", "",
             "**Which weights, and how sure.** Errors are those of the weights each run names "
             "(`eval_weights`: the raw weights, as the FLARE study reports; the EMA weights' "
             "are stored beside them). A setting is chosen on a validation split carved from "
             "the training data, by the mean over the mixers, never on test. Comparisons pair "
             "runs that share a seed and a data draw and state a 95% interval; where it holds "
             "0 the page says the difference is not significant. Runs that did not fit their "
             "training data (training error no better than the best constant predictor's) are "
             "counted and kept. Every mixer runs at its reference SDPA scale (FLARE 1, the "
             "others 1/sqrt(D)).", ""]
    for study in STUDIES:
        lines += study_section(study, data, out, ROOT / "docs" / "results")
    lines += [(ROOT / "docs" / "results" / "earlier.md").read_text().rstrip(), ""]
    page.write_text("\n".join(lines) + "\n")
    return page


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data", help="data draws, one directory each")
    parser.add_argument("--out", default="runs/results", help="the studies' directories")
    parser.add_argument("--jobs", type=int, default=2, help="processes per sweep")
    parser.add_argument("--only", nargs="+", choices=[s.name for s in STUDIES])
    parser.add_argument("--page-only", action="store_true",
                        help="write docs/results.md from the studies as they are")
    args = parser.parse_args()
    data, out = Path(args.data), Path(args.out)
    if not args.page_only:
        for study in STUDIES:
            if args.only is None or study.name in args.only:
                run_study(study, data, out, args.jobs)
    print(write_page(data, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
