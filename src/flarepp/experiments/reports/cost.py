"""Figure 5's report plug-in (``cost``): test error against training cost, and the front.

Training cost (paper Sec. D.4): the paper's GPU hours are 500 x the wall time of one
steady-state epoch (data loading included; compilation and full-mesh evaluation excluded)
measured in separate timing runs. Here the engine gives each point of a ``pareto`` study its
own timing run before it trains (:func:`flarepp.experiments.engine.time_epoch`,
``cost.json``), and its cost is ``epochs x`` that epoch in hours of the device it ran on:
GPU hours (wall time) on a GPU; on a CPU the process's CPU time, since the wall time of a
shared machine measures the other processes' load as much as the run. The wall time the
run's own training epochs took (``log.jsonl``) is reported beside it.

The Pareto front: the configurations (means over seeds) that no other configuration beats
on both counts, i.e. none is at most as costly and at most as wrong with one of the two
strictly smaller.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from flarepp.experiments.engine import run_dir
from flarepp.experiments.reports.common import Report, figure_module, fmt, markdown
from flarepp.experiments.reports.rows import aggregate
from flarepp.paper import FIGURE5_CLAIMS
from flarepp.storage.rundir import RunDir

MIXER_LABELS = {"flare": "FLARE", "flarepp": "FLARE++", "abupt": "AB-UPT"}
MIXER_COLOURS = {"flare": "tab:blue", "flarepp": "tab:red", "abupt": "tab:green"}
DEPTH_MARKERS = "os^Dvp*h"

def training_cost(directory: Path, epochs: int) -> dict[str, Any] | None:
    """A run's cost (paper Sec. D.4): ``epochs x`` its timing run's steady-state epoch
    (``cost.json``) in hours: wall time on a GPU, the process's CPU time on a CPU (a shared
    CPU's wall time measures the other processes' load as much as the run); and
    ``measured_hours``, the sum of the training epochs' wall times in ``log.jsonl``. A run
    without ``cost.json`` is costed from its log (``epochs x`` the median epoch wall time
    after the first), ``estimate`` says which. None before anything was measured."""
    out: dict[str, Any] = {}
    run = RunDir(directory)
    seconds = [r["seconds"] for r in run.read_log()] if run.has_log() else []
    if seconds:
        out["measured_hours"] = float(sum(seconds)) / 3600.0
    timing = run.read_cost()
    if timing is not None:
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


def configurations(rep: Report) -> list[dict[str, Any]]:
    """Finished, costed runs grouped by (mixer, blocks, budget): mean and spread over seeds
    of the error, mean cost."""
    for r in rep.rows:
        point = next(p for p in rep.study.points if p.name == r.point)
        r.extra.update(training_cost(run_dir(rep.out_dir, point), point.config.epochs) or {})
        cases = RunDir(run_dir(rep.out_dir, point)).file(RunDir.SURFACE_ERRORS)
        if r.status == "done" and cases.is_file():
            cases = json.loads(cases.read_text())["cases"]
            for channel in cases[0]["nmse_channels"] if cases else ():
                r.extra[f"error_{channel}"] = float(np.mean([c["nmse_channels"][channel]
                                                       for c in cases]))
    out = []
    for g in aggregate([r for r in rep.rows if "hours" in r.extra], ["mixer", "blocks", "budget"]):
        mean, std, n = g.stats()
        out.append({**g.key, "seeds": n, "error": mean, "error_std": std,
                    "hours": float(np.mean([r.extra["hours"] for r in g.rows])),
                    "params": g.rows[0].params, "device": g.rows[0].device,
                    "latents": g.rows[0].latents if g.key["mixer"] != "abupt" else None})
    return sorted(out, key=lambda c: (c["mixer"], c["blocks"], str(c["budget"])))


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
    by_key = {(c["mixer"], c["blocks"], c["budget"]): c for c in configs}
    out = []
    for (mixer, blocks, budget), plus in sorted(by_key.items(), key=str):
        base = by_key.get(("flare", blocks, budget))
        if mixer != "flarepp" or base is None:
            continue
        out.append({"blocks": blocks, "latents": plus["latents"],
                    "error_ratio": plus["error"] / base["error"],
                    "cost_ratio": plus["hours"] / base["hours"],
                    "flare_error": base["error"], "flarepp_error": plus["error"]})
    return out


def cost_error_figure(configs: list[dict[str, Any]], front: list[int], path: Path,
                      unit: str, metric: str) -> Path:
    """Figure 5: the metric against training cost, one colour per mixer, one marker per
    depth, the Pareto front as a dashed staircase through its (ringed) points."""
    plt = figure_module()
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
    ax.set_ylabel(f"test {metric}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def cost_report(rep: Report) -> None:
    """Figure 5: the metric against training cost, the Pareto front, FLARE++ over FLARE at
    matched (B, M)."""
    configs = configurations(rep)
    unit = device_kind(configs[0]["device"]) if configs else "CPU"
    metric = rep.metric_name()
    rep.lines += ["", "## Training cost", "",
                  f"Cost: {unit} hours, epochs x one steady-state training epoch of a separate "
                  "timing run (paper Sec. D.4's estimator; on a CPU the process's CPU time, on a "
                  "GPU wall time); `trained h` is the wall time the run's training epochs took. "
                  f"Error: test `{metric}`.", ""]
    rep.lines += markdown(
        ["point", "status", "error", "p_s", "tau_x", "tau_y", "tau_z", "epoch s",
         "epoch CPU s", f"{unit} h", "trained h"],
        [[r.point, r.status, fmt(r.value), fmt(r.get("error_p_s")),
          fmt(r.get("error_tau_x")), fmt(r.get("error_tau_y")), fmt(r.get("error_tau_z")),
          fmt(r.get("epoch_seconds"), ".3g"), fmt(r.get("epoch_cpu_seconds"), ".3g"),
          fmt(r.get("hours"), ".3g"), fmt(r.get("measured_hours"), ".3g")] for r in rep.rows])
    estimates = sorted({r.extra["estimate"] for r in rep.rows if r.get("estimate")})
    if len(estimates) > 1:
        rep.lines += ["", f"Costs mix estimates ({'; '.join(estimates)}): compare with care."]
    if not configs:
        return
    front = pareto_front([c["hours"] for c in configs], [c["error"] for c in configs])
    rep.lines += ["", "## Configurations (mean over seeds) and the Pareto front", ""]
    rep.lines += markdown(
        ["mixer", "B", "budget", "seeds", "error", f"{unit} h", "params", "on front"],
        [[MIXER_LABELS.get(c["mixer"], c["mixer"]), c["blocks"], c["budget"], c["seeds"],
          (fmt(c["error"]) if math.isnan(c["error_std"])
           else f"{c['error']:.4g} ± {c['error_std']:.2g}"),
          fmt(c["hours"], ".3g"), c["params"] or "-", "yes" if i in front else ""]
         for i, c in enumerate(configs)])
    ratios = matched_ratios(configs)
    if ratios:
        better = sum(r["error_ratio"] < 1 for r in ratios)
        rep.lines += ["", "## FLARE++ over FLARE at matched (B, M)", "",
                      f"FLARE++ is lower in {better} of {len(ratios)} matched configurations. "
                      "The paper (Sec. 4.2) reports lower error in all 18, by "
                      + ", ".join(f"{100 * v:.0f}% at B={b}" for b, v in
                                  FIGURE5_CLAIMS["flarepp_over_flare_gain_by_blocks"].items())
                      + " (means over latent budgets), at "
                      + "-".join(map(str, FIGURE5_CLAIMS["flarepp_over_flare_cost"]))
                      + "x FLARE's cost.", ""]
        rep.lines += markdown(["B", "M", "FLARE", "FLARE++", "error ratio", "cost ratio"],
                              [[r["blocks"], r["latents"], fmt(r["flare_error"]),
                                fmt(r["flarepp_error"]), f"{r['error_ratio']:.3f}",
                                f"{r['cost_ratio']:.3f}"] for r in ratios])
    path = cost_error_figure(configs, front, rep.out_dir / "fig5_cost_error.png", unit, metric)
    rep.paths["figure5"] = path
    rep.lines += ["", f"![Figure 5]({path.name})"]


__all__ = ["configurations", "cost_error_figure", "device_kind", "matched_ratios",
           "pareto_front", "training_cost"]
