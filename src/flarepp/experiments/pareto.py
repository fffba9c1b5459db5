"""Test error against training cost on the full-surface task (paper Figure 5, Sec. 4.2, D.4).

``flarepp drivaerml pareto PRESET --out DIR`` trains, with the one
:class:`~flarepp.train.Trainer`, FLARE and FLARE++ at every depth B and latent budget M of
the grid (default the paper's, B in 2, 4, 8 and M in 64, 128, 256) and AB-UPT at every depth
with its anchor budget fixed at 512 (Table 9: its latent budget does not follow M), each
point in ``DIR/runs/<point>``. Like ``flarepp sweep`` (:mod:`flarepp.experiments.sweep`,
whose points and claims it uses) it is safe to interrupt and to share: a finished point is
never redone, a half-finished one resumes, and several processes may work on one ``DIR``
(a point is claimed by an exclusive lock on ``DIR/claims/<point>/.lock``).

Training cost (D.4): the paper's GPU hours are 500 x the wall time of one steady-state epoch
(data loading included; compilation and full-mesh evaluation excluded) measured in separate
timing runs on one H100. Here each point gets its own timing run before it trains
(:func:`time_epoch`: two training epochs from scratch in a temporary directory, the second
one measured; ``cost.json``), and its cost is ``epochs x`` that epoch in hours of the device
it ran on: GPU hours (wall time) on a GPU; on a CPU the process's CPU time, since the wall
time of a shared machine measures the other processes' load as much as the run. The wall
time the run's own training epochs took (``log.jsonl``) is reported beside it.

The Pareto front: the configurations (means over seeds) that no other configuration beats
on both counts, i.e. none is at most as costly and at most as wrong with one of the two
strictly smaller. ``flarepp drivaerml report DIR`` (:func:`write_report`) writes
``results.csv``, ``report.md`` (every run; FLARE++ over FLARE per matched (B, M) in error and
cost; the front) and ``fig5_cost_error.png``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from flarepp.experiments.sweep import (Point, claimed_points, point_done, record_event,
                                       run_dir, train_point)
from flarepp.io import atomic_write_json, atomic_write_text
from flarepp.train.config import RunConfig, apply_overrides

SPEC_NAME = "pareto.json"
COST_NAME = "cost.json"
ANCHOR_MIXER = "abupt"
MIXER_LABELS = {"flare": "FLARE", "flarepp": "FLARE++", "abupt": "AB-UPT"}
MIXER_COLOURS = {"flare": "tab:blue", "flarepp": "tab:red", "abupt": "tab:green"}
DEPTH_MARKERS = "os^Dvp*h"


# ---------------------------------------------------------------------------------------------
# the grid

def pareto_points(mixers: Sequence[str], blocks: Sequence[int], latents: Sequence[int],
                  seeds: Sequence[int], anchors: int) -> list[Point]:
    """Every point: each mixer at each depth, each latent budget (AB-UPT: ``anchors``
    anchors instead) and each seed."""
    points = []
    for mixer in mixers:
        for b in blocks:
            budgets = [None] if mixer == ANCHOR_MIXER else list(latents)
            for m in budgets:
                for seed in seeds:
                    values = [("model.mixer", mixer), ("model.blocks", str(b))]
                    if m is None:
                        values.append(("model.mixer_options.anchors", str(anchors)))
                        budget = f"A-{anchors}"
                    else:
                        values.append(("model.latents", str(m)))
                        budget = f"M-{m}"
                    values.append(("seed", str(seed)))
                    points.append(Point(f"{mixer}_B-{b}_{budget}_seed-{seed}", tuple(values)))
    return points


@dataclass
class ParetoSpec:
    """What a Pareto directory holds: the base config, its points and the data."""

    base: RunConfig
    points: list[Point]
    data_root: str

    def config(self, point: Point) -> RunConfig:
        return apply_overrides(self.base, point.overrides)

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base.to_dict(), "data_root": self.data_root,
                "points": [[p.name, [list(v) for v in p.values]] for p in self.points]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ParetoSpec":
        return cls(RunConfig.from_dict(d["base"]),
                   [Point(name, tuple(tuple(v) for v in values)) for name, values in d["points"]],
                   d["data_root"])


def open_pareto(out_dir: str | Path, spec: ParetoSpec | None) -> ParetoSpec:
    """The study of ``out_dir``: ``spec`` written there if new (every point's config checked
    first), the stored one if ``spec`` is None; a different ``spec`` is an error."""
    path = Path(out_dir) / SPEC_NAME
    stored = json.loads(path.read_text()) if path.exists() else None
    if spec is None:
        if stored is None:
            raise FileNotFoundError(f"{str(path)!r} does not exist: start the study with a "
                                    "preset")
        return ParetoSpec.from_dict(stored)
    for point in spec.points:
        spec.config(point)
    mine = json.loads(json.dumps(spec.to_dict()))
    if stored is not None and stored != mine:
        raise ValueError(f"{str(out_dir)!r} holds another study (other preset, grid or data); "
                         f"continue it with `flarepp drivaerml pareto --out {out_dir}` or "
                         "choose another --out")
    if stored is None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, mine)
    return spec


# ---------------------------------------------------------------------------------------------
# running

def time_epoch(config: RunConfig, data_root: str, splits: Any, *, epochs: int = 2
               ) -> dict[str, Any]:
    """A separate timing run (D.4): ``epochs`` training epochs of ``config`` from scratch in a
    temporary directory; the last one's wall time (data loading included) and this
    process's CPU time over it. Nothing is evaluated or kept."""
    import tempfile

    import torch

    from flarepp.train import Trainer
    with tempfile.TemporaryDirectory(prefix="flarepp-timing-") as tmp:
        # the schedule must last the timing epochs (a run of fewer epochs is timed too)
        timed = dataclasses.replace(config, epochs=max(config.epochs, epochs))
        trainer = Trainer(timed, Path(tmp) / "run", data_root=data_root, progress=False,
                          splits=splits)
        try:
            for _ in range(epochs):
                wall, cpu = time.perf_counter(), time.process_time()
                trainer.train_epoch()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            trainer.close()
    return {"epoch_seconds": wall, "epoch_cpu_seconds": cpu, "timing_epochs": epochs,
            "device": str(trainer.device), "threads": torch.get_num_threads()}


def run_pareto(spec: ParetoSpec, out_dir: str | Path, *, timing_epochs: int = 2,
               log: Callable[[str], None] = print) -> dict[str, list[str]]:
    """Time and train every unclaimed point that lacks its ``cost.json`` or its result
    (:func:`time_epoch` first, then the run); returns this process's ``{"finished",
    "failed", "skipped"}`` point names."""
    from flarepp.data import load_dataset
    from flarepp.tasks import TASKS
    out_dir = Path(out_dir)
    loaded: dict[str, Any] = {}
    done: dict[str, list[str]] = {"finished": [], "failed": [], "skipped": []}

    def complete(point: Point) -> bool:
        return point_done(out_dir, point) and (run_dir(out_dir, point) / COST_NAME).exists()

    for i, point in claimed_points(out_dir, spec.points, complete, done["skipped"]):
        config = spec.config(point)
        key = json.dumps([config.dataset, config.dataset_options])
        if key not in loaded:  # one reader (and one statistics pass) for every point
            loaded[key] = load_dataset(config.dataset, spec.data_root,
                                       **config.dataset_options)
        directory = run_dir(out_dir, point)
        tag = f"[{i + 1}/{len(spec.points)}] {point.name}"
        if not (directory / COST_NAME).exists():
            cost = time_epoch(config, spec.data_root, loaded[key], epochs=timing_epochs)
            atomic_write_json(directory / COST_NAME, cost)
            log(f"{tag}: an epoch takes {cost['epoch_seconds']:.3g} s "
                f"({cost['epoch_cpu_seconds']:.3g} s CPU)")
        if point_done(out_dir, point):
            continue
        metrics = train_point(config, out_dir, point, spec.data_root, loaded[key], tag, done,
                              log)
        if metrics is None:
            continue
        headline = f"test_{TASKS.get(config.task).headline}"
        record_event(out_dir, point, "finish", **{headline: metrics[headline]})
        done["finished"].append(point.name)
        log(f"{tag}: {headline} {metrics[headline]:.4g}")
    return done


# ---------------------------------------------------------------------------------------------
# cost, results and the front

def training_cost(directory: Path, epochs: int) -> dict[str, Any] | None:
    """A run's cost: ``epochs x`` its timing run's steady-state epoch (``cost.json``, from
    :func:`time_epoch`) in hours: wall time on a GPU, the process's CPU time on a CPU (a
    shared CPU's wall time measures the other processes' load as much as the run); and
    ``measured_hours``, the sum of the training epochs' wall times in ``log.jsonl``. A run
    without ``cost.json`` is costed from its log (``epochs x`` the median epoch wall time
    after the first), ``estimate`` says which. None before anything was measured."""
    out: dict[str, Any] = {}
    log = directory / "log.jsonl"
    seconds = ([json.loads(line)["seconds"] for line in log.read_text().splitlines()
                if line.strip()] if log.is_file() else [])
    if seconds:
        out["measured_hours"] = float(sum(seconds)) / 3600.0
    cost = directory / COST_NAME
    if cost.is_file():
        timing = json.loads(cost.read_text())
        gpu = device_kind(timing["device"]) == "GPU"
        epoch = timing["epoch_seconds"] if gpu else timing["epoch_cpu_seconds"]
        out.update(epoch_seconds=timing["epoch_seconds"],
                   epoch_cpu_seconds=timing["epoch_cpu_seconds"],
                   hours=epochs * epoch / 3600.0,
                   estimate="timing run, " + ("wall" if gpu else "CPU") + " time")
    elif seconds:
        epoch = float(np.median(seconds[1:] if len(seconds) > 1 else seconds))
        out.update(epoch_seconds=epoch, hours=epochs * epoch / 3600.0,
                   estimate="training log, wall time")
    return out or None


def device_kind(device: str | None) -> str:
    """``"GPU"`` for a CUDA device, else ``"CPU"`` (what the hours are hours of)."""
    return "GPU" if device and device.startswith("cuda") else "CPU"


def collect_results(out_dir: str | Path) -> tuple[ParetoSpec, list[dict[str, Any]]]:
    """One row per point: mixer, depth, latent (or anchor) budget, seed, status, the test
    metric, its channels, parameters and cost."""
    from flarepp.tasks import TASKS
    out_dir = Path(out_dir)
    spec = open_pareto(out_dir, None)
    rows = []
    for point in spec.points:
        config = spec.config(point)
        model = config.model_kwargs()
        mixer = model.get("mixer")
        anchors = (model.get("mixer_options") or {}).get("anchors")
        row: dict[str, Any] = {
            "point": point.name, "mixer": mixer, "blocks": model.get("blocks"),
            "budget": (f"{anchors} anchors" if mixer == ANCHOR_MIXER
                       else f"M={model.get('latents')}"),
            "latents": anchors if mixer == ANCHOR_MIXER else model.get("latents"),
            "seed": config.seed, "precision": config.precision, "epochs": config.epochs,
            "status": "pending"}
        directory = run_dir(out_dir, point)
        headline = TASKS.get(config.task).headline
        if (directory / "metrics.json").exists():
            metrics = json.loads((directory / "metrics.json").read_text())
            row.update(status="done", error=metrics[f"test_{headline}"],
                       params=metrics.get("params"), device=metrics.get("device"))
            row.update(training_cost(directory, config.epochs) or {})
            errors = directory / "surface_errors.json"
            if errors.is_file():
                cases = json.loads(errors.read_text())["cases"]
                for channel in cases[0]["nmse_channels"] if cases else ():
                    row[f"error_{channel}"] = float(np.mean([c["nmse_channels"][channel]
                                                             for c in cases]))
        elif (directory / "failed.json").exists():
            row["status"] = "failed"
        row["metric"] = headline
        rows.append(row)
    return spec, rows


def configurations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Finished runs grouped by (mixer, blocks, budget): mean and spread over seeds of the
    error, mean cost."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == "done" and "hours" in r:
            groups.setdefault((r["mixer"], r["blocks"], r["latents"]), []).append(r)
    out = []
    for (mixer, blocks, latents), runs in groups.items():
        errors = np.array([r["error"] for r in runs], float)
        out.append({"mixer": mixer, "blocks": blocks, "latents": latents,
                    "budget": runs[0]["budget"], "seeds": len(runs),
                    "error": float(errors.mean()),
                    "error_std": float(errors.std(ddof=1)) if len(runs) > 1 else math.nan,
                    "hours": float(np.mean([r["hours"] for r in runs])),
                    "params": runs[0].get("params"), "device": runs[0].get("device")})
    return sorted(out, key=lambda c: (c["mixer"], c["blocks"], c["latents"]))


def pareto_front(costs: Sequence[float], errors: Sequence[float]) -> list[int]:
    """Indices of the non-dominated points, by increasing cost: a point is dominated when
    another is at most as costly and at most as wrong, one of them strictly."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i], errors[i]))
    front, best = [], math.inf
    for i in order:
        if errors[i] < best:
            front.append(i)
            best = errors[i]
    return front


def matched_ratios(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """FLARE++ over FLARE at every (B, M) both ran: error and cost ratios."""
    by_key = {(c["mixer"], c["blocks"], c["latents"]): c for c in configs}
    out = []
    for (mixer, blocks, latents), plus in sorted(by_key.items(), key=str):
        base = by_key.get(("flare", blocks, latents))
        if mixer != "flarepp" or base is None:
            continue
        out.append({"blocks": blocks, "latents": latents,
                    "error_ratio": plus["error"] / base["error"],
                    "cost_ratio": plus["hours"] / base["hours"],
                    "flare_error": base["error"], "flarepp_error": plus["error"]})
    return out


def cost_error_figure(configs: list[dict[str, Any]], front: list[int], path: Path,
                      unit: str) -> Path:
    """Figure 5: test error against training cost, one colour per mixer, one marker per
    depth, the Pareto front as a dashed staircase through its (ringed) points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.4), constrained_layout=True)
    depths = sorted({c["blocks"] for c in configs})
    for mixer in sorted({c["mixer"] for c in configs}):
        for depth in depths:
            mine = [c for c in configs if c["mixer"] == mixer and c["blocks"] == depth]
            if not mine:
                continue
            marker = DEPTH_MARKERS[depths.index(depth) % len(DEPTH_MARKERS)]
            ax.errorbar([c["hours"] for c in mine], [c["error"] for c in mine],
                        yerr=[0.0 if math.isnan(c["error_std"]) else c["error_std"]
                              for c in mine], fmt=marker, ms=6, capsize=2,
                        color=MIXER_COLOURS.get(mixer, "0.3"),
                        label=f"{MIXER_LABELS.get(mixer, mixer)}, B={depth}")
            for c in mine:
                ax.annotate(c["budget"].replace(" anchors", "A"), (c["hours"], c["error"]),
                            fontsize=6, xytext=(3, 3), textcoords="offset points")
    points = [configs[i] for i in front]
    xs = [p["hours"] for p in points]
    ys = [p["error"] for p in points]
    ax.step(xs + [max(c["hours"] for c in configs) * 1.05], ys + ys[-1:], where="post",
            ls="--", color="k", lw=1, label="Pareto front")
    ax.scatter(xs, ys, s=110, facecolors="none", edgecolors="k", lw=1)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel(f"training cost [{unit} hours] (epochs x steady-state epoch time)")
    ax.set_ylabel("test normalised MSE x 100 [%] (every cell)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _markdown(header: list[str], body: list[list[Any]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in body])


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def write_report(out_dir: str | Path) -> dict[str, Path]:
    """``results.csv``, ``report.md`` and ``fig5_cost_error.png`` of the study in
    ``out_dir`` (the figure once a run has finished)."""
    from flarepp.paper import FIGURE5_CLAIMS
    out_dir = Path(out_dir)
    spec, rows = collect_results(out_dir)
    configs = configurations(rows)
    unit = device_kind(configs[0]["device"]) if configs else "CPU"
    paths = {"csv": out_dir / "results.csv", "markdown": out_dir / "report.md"}
    fields = ["point", "mixer", "blocks", "budget", "seed", "precision", "epochs", "status",
              "error", "error_p_s", "error_tau_x", "error_tau_y", "error_tau_z", "params",
              "epoch_seconds", "epoch_cpu_seconds", "hours", "estimate", "measured_hours",
              "device"]
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "pending")}
    summary = (f"Preset `{spec.base.name}` on `{spec.data_root}`; {len(rows)} runs "
               f"({counts['done']} done, {counts['failed']} failed, {counts['pending']} "
               "pending). Error: test normalised MSE x 100 of the 4 standardised channels on "
               f"every cell of every test surface, in %. Cost: {unit} hours, epochs x one "
               "steady-state training epoch of a separate timing run (paper Sec. D.4's "
               "estimator; on a CPU the process's CPU time, on a GPU wall time); `trained h` "
               "is the wall time the run's training epochs took.")
    lines = [f"# Error against training cost: {out_dir.name}", "", summary, "",
             "## Every run", ""]
    lines += _markdown(
        ["point", "status", "error %", "p_s", "tau_x", "tau_y", "tau_z", "params",
         "epoch s", "epoch CPU s", f"{unit} h", "trained h"],
        [[r["point"], r["status"], _fmt(r.get("error")), _fmt(r.get("error_p_s")),
          _fmt(r.get("error_tau_x")), _fmt(r.get("error_tau_y")), _fmt(r.get("error_tau_z")),
          r.get("params") or "-", _fmt(r.get("epoch_seconds"), ".3g"),
          _fmt(r.get("epoch_cpu_seconds"), ".3g"), _fmt(r.get("hours"), ".3g"),
          _fmt(r.get("measured_hours"), ".3g")] for r in rows])
    estimates = sorted({r["estimate"] for r in rows if r.get("estimate")})
    if len(estimates) > 1:
        lines += ["", f"Costs mix estimates ({'; '.join(estimates)}): compare with care."]
    if configs:
        front = pareto_front([c["hours"] for c in configs], [c["error"] for c in configs])
        lines += ["", "## Configurations (mean over seeds) and the Pareto front", ""]
        lines += _markdown(
            ["mixer", "B", "budget", "seeds", "error %", f"{unit} h", "params", "on front"],
            [[MIXER_LABELS.get(c["mixer"], c["mixer"]), c["blocks"], c["budget"], c["seeds"],
              (_fmt(c["error"]) if math.isnan(c["error_std"])
               else f"{c['error']:.4g} ± {c['error_std']:.2g}"),
              _fmt(c["hours"], ".3g"), c["params"] or "-", "yes" if i in front else ""]
             for i, c in enumerate(configs)])
        ratios = matched_ratios(configs)
        if ratios:
            better = sum(r["error_ratio"] < 1 for r in ratios)
            lines += ["", "## FLARE++ over FLARE at matched (B, M)", "",
                      f"FLARE++ is lower in {better} of {len(ratios)} matched configurations. "
                      "The paper (Sec. 4.2) reports lower error in all 18, by "
                      + ", ".join(f"{100 * v:.0f}% at B={b}" for b, v in
                                  FIGURE5_CLAIMS["flarepp_over_flare_gain_by_blocks"].items())
                      + " (means over latent budgets), at "
                      + "-".join(map(str, FIGURE5_CLAIMS["flarepp_over_flare_cost"]))
                      + "x FLARE's cost.", ""]
            lines += _markdown(["B", "M", "FLARE %", "FLARE++ %", "error ratio", "cost ratio"],
                               [[r["blocks"], r["latents"], _fmt(r["flare_error"]),
                                 _fmt(r["flarepp_error"]), f"{r['error_ratio']:.3f}",
                                 f"{r['cost_ratio']:.3f}"] for r in ratios])
        paths["figure5"] = cost_error_figure(configs, front, out_dir / "fig5_cost_error.png",
                                             unit)
        lines += ["", f"![Figure 5]({paths['figure5'].name})"]
    atomic_write_text(paths["markdown"], "\n".join(lines) + "\n")
    return paths


__all__ = ["ParetoSpec", "collect_results", "configurations", "matched_ratios",
           "open_pareto", "pareto_front", "pareto_points", "run_pareto", "training_cost",
           "write_report"]
