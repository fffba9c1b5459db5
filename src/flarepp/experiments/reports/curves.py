"""Plug-ins that read curves from the run directories: ``rollout`` (the error against
rollout step) and ``growth`` (rank growth against fixed latent budgets).

``rollout`` applies where the finished runs stored ``test_rollout.npz`` (the ``rollout``
task: each test trajectory's relative L2 at each step): per group of runs that differ only
in their seed, the mean over the test trajectories at each step, then the mean over seeds,
drawn with a band from the lowest to the highest seed (``rollout_steps.png``); the table
has the headline (the mean over the horizon) as mean ± sample std over seeds and the mean
error at the first, the middle and the last step.

``growth`` applies where the grid has a ``latent_schedule`` axis and at least one schedule
grows M (:class:`flarepp.rank_growth.LatentSchedule`): every run's logged test metric
against epoch and against its training seconds, and every optimiser step's loss with the
growths marked (``growth.png``, from ``log.jsonl``); per group, the headline over seeds and
the epochs (and seconds) each run took to come within :data:`GROWTH_THRESHOLDS` times the
best group's mean headline; and for each growth the mean loss of the 10 steps before and
after it and the first step after, beside the run of the same seed that keeps the initial M
throughout (the two are the same model up to the first growth, so the growth's own effect
shows as the difference).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flarepp.experiments.engine import run_dir
from flarepp.experiments.reports.common import Report, figure_module, fmt, markdown, spread
from flarepp.experiments.reports.rows import Row, aggregate, csv_text
from flarepp.io import atomic_write_text
from flarepp.storage.rundir import RunDir

def _rollout_file(rep: Report, point: str) -> Path:
    """The rollout task's per-trajectory, per-step test errors in a point's run directory."""
    return RunDir(run_dir(rep.out_dir, point)).file(RunDir.ROLLOUT, split="test")


def _groups(rep: Report, rows: list[Row]):
    keys = [k for k in rep.label_keys if k != "seed"]
    return keys, aggregate(rows, keys)


def _name(key: dict) -> str:
    return ", ".join(str(v) for v in key.values()) or "all runs"


def rollout_report(rep: Report) -> None:
    """The error against rollout step (module docstring)."""
    done = [r for r in rep.done if _rollout_file(rep, r.point).is_file()]
    if not done:
        return
    keys, groups = _groups(rep, done)
    plt = figure_module()
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    body, table = [], [[*keys, "seeds", "step", "mean", "low", "high"]]
    horizon = None
    for g in groups:
        per_run = []
        for r in g.rows:
            with np.load(_rollout_file(rep, r.point)) as f:
                per_run.append(f["rel_l2"].mean(0))                    # [steps]
        steps = min(len(c) for c in per_run)
        curves = np.array([c[:steps] for c in per_run])                 # [seeds, steps]
        mean = curves.mean(0)
        horizon = steps if horizon is None else min(horizon, steps)
        x = np.arange(1, steps + 1)
        ax.plot(x, mean, marker="o", ms=3, label=f"{_name(g.key)} ({len(g.rows)} seeds)")
        if len(g.rows) > 1:
            ax.fill_between(x, curves.min(0), curves.max(0), alpha=0.2)
        middle = max(0, steps // 2 - 1)
        body.append([*g.key.values(), len(g.rows), g.rows[0].params or "-",
                     spread(*g.stats()[:2]), fmt(mean[0]), fmt(mean[middle]), fmt(mean[-1])])
        table += [[*g.key.values(), len(g.rows), s + 1, mean[s], curves[:, s].min(),
                   curves[:, s].max()] for s in range(steps)]
    ax.set_xlabel("rollout step"), ax.set_ylabel("relative L2 (test mean)")
    ax.set_yscale("log"), ax.grid(alpha=.3), ax.legend(fontsize=8)
    rep.paths["rollout"] = rep.out_dir / "rollout_steps.png"
    fig.savefig(rep.paths["rollout"], dpi=110)
    plt.close(fig)
    rep.paths["rollout_csv"] = rep.out_dir / "rollout_steps.csv"
    atomic_write_text(rep.paths["rollout_csv"], csv_text(table))
    middle = max(0, horizon // 2 - 1)
    rep.lines += ["", "## The error against rollout step", "",
                  f"Test `{rep.metric_name()}` (the mean over the horizon): mean ± sample std "
                  "over seeds; then the mean over test trajectories and seeds of the relative "
                  "L2 at a step (the figure's band: lowest to highest seed).", ""]
    rep.lines += markdown([*keys, "seeds", "params", f"test {rep.metric_name()}", "step 1",
                           f"step {middle + 1}", f"step {horizon}"], body)
    rep.lines += ["", f"![error against rollout step]({rep.paths['rollout'].name})"]


# ---------------------------------------------------------------------------------------------
# rank growth

GROWTH_AXIS = "latent_schedule"
GROWTH_THRESHOLDS = (1.5, 1.2, 1.1)
"""The ``growth`` table's targets: these multiples of the best group's mean headline."""
AROUND = 10
"""Optimiser steps averaged before and after a growth."""


def _log(directory: Path, metric: str) -> dict:
    """A run's logged test metric per epoch, its cumulative training seconds, and every
    step's loss with its (1-based) epoch."""
    records = RunDir(directory).read_log()
    seconds = np.cumsum([r["seconds"] for r in records])
    tested = [(r, float(t)) for r, t in zip(records, seconds) if f"test_{metric}" in r]
    return {"epochs": [r["epoch"] for r, _ in tested],
            "error": [r[f"test_{metric}"] for r, _ in tested],
            "seconds": [t for _, t in tested],
            "steps": [(r["epoch"], loss) for r in records for loss in r.get("step_losses", [])]}


def _around(steps: list[tuple[int, float]], epoch: int) -> str:
    """Mean loss of the last steps of epoch ``epoch - 1`` / the first of ``epoch``, and the
    first step of ``epoch``."""
    before = [loss for e, loss in steps if e == epoch - 1][-AROUND:]
    after = [loss for e, loss in steps if e == epoch][:AROUND]
    if not before or not after:
        return "-"
    return f"{np.mean(before):.4f} / {np.mean(after):.4f}, {after[0]:.4f}"


def growth_report(rep: Report) -> None:
    """Rank growth against fixed latent budgets (module docstring)."""
    if GROWTH_AXIS not in rep.label_keys:
        return
    configs = {p.name: p.config for p in rep.study.points}
    milestones = {r.point: configs[r.point].schedule().milestones for r in rep.done
                  if configs[r.point].latent_schedule is not None}
    if not any(len(m) > 1 for m in milestones.values()):
        return
    done = [r for r in rep.done if r.point in milestones]
    logs = {r.point: _log(run_dir(rep.out_dir, r.point), r.metric) for r in done}
    keys, groups = _groups(rep, done)
    _growth_figure(rep, groups, logs, milestones)
    _growth_targets(rep, keys, groups, logs)
    _growth_losses(rep, done, logs, milestones)
    rep.lines += ["", f"![rank growth]({rep.paths['growth'].name})"]


def _growth_figure(rep: Report, groups: list, logs: dict, milestones: dict) -> None:
    """``growth.png``: each run's logged test metric against epochs and training seconds,
    and its loss per step with the growths marked."""
    plt = figure_module()
    fig, (by_epoch, by_time, losses) = plt.subplots(1, 3, figsize=(15, 4),
                                                    constrained_layout=True)
    for i, g in enumerate(groups):
        for r in g.rows:
            style = dict(color=f"C{i}", lw=0.8, label=f"{_name(g.key)}, seed {r.seed}")
            log = logs[r.point]
            by_epoch.semilogy(log["epochs"], log["error"], marker="o", ms=2, **style)
            by_time.semilogy(log["seconds"], log["error"], marker="o", ms=2, **style)
            losses.semilogy(range(1, len(log["steps"]) + 1), [x for _, x in log["steps"]],
                            **{**style, "lw": 0.5})
            per_epoch = sum(e == 1 for e, _ in log["steps"])
            for epoch, _ in milestones[r.point][1:]:
                losses.axvline(epoch * per_epoch + 0.5, color="k", lw=0.6, ls=":")
    for ax, label in ((by_epoch, "epoch"), (by_time, "training seconds"),
                      (losses, "optimizer step")):
        ax.set_xlabel(label), ax.grid(alpha=.3), ax.legend(fontsize=7)
    by_epoch.set_ylabel(f"test {rep.metric_name()} (logged)")
    losses.set_ylabel("training loss per step")
    rep.paths["growth"] = rep.out_dir / "growth.png"
    fig.savefig(rep.paths["growth"], dpi=110)
    plt.close(fig)


def _growth_targets(rep: Report, keys: list[str], groups: list, logs: dict) -> None:
    """The table of epochs (seconds) each run took to come within each target of the best
    group's mean."""
    lower = all(r.lower_is_better for g in groups for r in g.rows)
    means = [g.stats()[0] for g in groups]
    best = min(means) if lower else max(means)

    def reached(r: Row, target: float) -> str:
        log = logs[r.point]
        hits = [i for i, e in enumerate(log["error"]) if (e <= target if lower else e >= target)]
        return f"{log['epochs'][hits[0]]} ({log['seconds'][hits[0]]:.0f})" if hits else "-"

    body = [[*g.key.values(), len(g.rows), spread(*g.stats()[:2]),
             *[", ".join(reached(r, t * best) for r in g.rows) for t in GROWTH_THRESHOLDS]]
            for g in groups]
    metric = rep.metric_name()
    rep.lines += ["", "## Rank growth against fixed latent budgets", "",
                  f"Test `{metric}`: mean ± sample std over seeds. Epochs (training seconds) "
                  "each run, seed by seed, took until its logged test metric came within "
                  f"x{', x'.join(str(t) for t in GROWTH_THRESHOLDS)} of the best mean "
                  f"({fmt(best)}); `-`: not within the run.", ""]
    rep.lines += markdown([*keys, "seeds", f"test {metric}",
                           *[f"epochs (s) to x{t}" for t in GROWTH_THRESHOLDS]], body)


def _growth_losses(rep: Report, done: list[Row], logs: dict, milestones: dict) -> None:
    """The training loss around each growth, beside the run of the same seed that keeps the
    initial M."""
    body = []
    for r in done:
        start = milestones[r.point][0][1]
        fixed = next((f for f in done if f.seed == r.seed
                      and milestones[f.point] == ((0, start),)), None)
        for epoch, latents in milestones[r.point][1:]:
            before = dict(milestones[r.point])
            was = max(m for e, m in before.items() if e < epoch)
            body.append([r.get(GROWTH_AXIS), r.seed, f"{was} -> {latents} (epoch {epoch + 1})",
                         _around(logs[r.point]["steps"], epoch + 1),
                         _around(logs[fixed.point]["steps"], epoch + 1) if fixed else "-"])
    rep.lines += ["", f"Training loss around each growth: the mean of the {AROUND} steps "
                      "before / after it, and the first step after; beside it the run of the "
                      "same seed that keeps the initial M (the same model until the growth).",
                  ""]
    rep.lines += markdown([GROWTH_AXIS, "seed", "growth", "grown run", "fixed initial M"],
                          body)


__all__ = ["GROWTH_THRESHOLDS", "growth_report", "rollout_report"]
