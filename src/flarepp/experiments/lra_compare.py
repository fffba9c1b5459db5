"""Long Range Arena accuracy of several mixers over seeds, tabulated like Table 12 (Sec. D.5).

``run_lra_comparison(tasks, mixers, out_dir, seeds=3, size="tiny")`` trains one run of the
:class:`~flarepp.train.Trainer` per (seed, task, mixer) -- seed-major, so that a complete
one-seed table exists early -- each in ``out_dir/runs/<task>/<mixer>/seed<k>`` with the
task table's settings for that mixer (:func:`flarepp.train.presets.lra_run_config`); a
run's ``seed`` drives its initialisation and batch order. Every task's data is read once
and shared by its runs.

Resumable and shareable: a finished run (``metrics.json``) with the same config is reused,
one with another config is an error (never a stale table entry), a half-finished one
resumes from its newest checkpoint, a run whose loss diverged is recorded in its
``failed.json`` and left out of the table (its cell counts the seeds that finished), and
a run another process is training (its run
directory is locked) is skipped, so several ``flarepp lra compare`` processes with the same
arguments can share one ``out_dir``; each writes the table of every run finished so far.

Outputs in ``out_dir``: ``results.csv`` (one line per finished run), ``table.md`` and
``table.csv`` (mixers x tasks, test accuracy in %, mean and sample standard deviation over
seeds, the average over tasks; the chance level 1/K and the test split's majority-class
share per task), ``comparison.png`` (bars with seed spread).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from flarepp.io import atomic_write_json, atomic_write_text

FAILED = "failed.json"  # a run whose loss diverged: kept out of the table, not retried

RESULT_FIELDS = ["task", "mixer", "seed", "test_accuracy", "val_accuracy", "chance",
                 "majority", "params", "seconds", "epochs", "steps", "train_samples",
                 "test_samples", "run_dir"]


@dataclass(frozen=True)
class GridRun:
    """One run of the comparison."""

    task: str
    mixer: str
    seed: int

    def directory(self, out_dir: Path) -> Path:
        return Path(out_dir) / "runs" / self.task / self.mixer / f"seed{self.seed}"


def grid(tasks: list[str], mixers: list[str], seeds: int) -> list[GridRun]:
    """Seed-major order: every (task, mixer) of seed 0 before any of seed 1."""
    return [GridRun(t, m, s) for s in range(seeds) for t in tasks for m in mixers]


def check_names(tasks: list[str], mixers: list[str], seeds: int) -> None:
    """Unknown tasks or mixers, or no seeds, fail before any data is read."""
    from flarepp.data.lra import LRA_TASKS
    from flarepp.mixers import MIXERS
    for task in tasks:
        LRA_TASKS.entry(task)
    for mixer in mixers:
        MIXERS.entry(mixer)
    if seeds <= 0:
        raise ValueError(f"seeds must be positive, got {seeds}")
    if not tasks or not mixers:
        raise ValueError("give at least one task and one mixer")


def run_config(run: GridRun, size: str, *, steps: int | None = None,
               split_limits: dict[str, int] | None = None, train_samples: int | None = None,
               data_root: str | None = None, overrides: list[str] | None = None):
    """The run's config: the task table's settings, then ``overrides``, then its seed.

    The steps are counted in batches of the final ``batch_size`` (an overridden one too);
    an ``epochs`` override wins over the steps."""
    from flarepp.train.config import apply_overrides
    from flarepp.train.presets import lra_run_config
    options = dict(steps=steps, split_limits=split_limits, train_samples=train_samples,
                   data_root=data_root)
    overrides = [*(overrides or []), f"seed={run.seed}"]
    probe = apply_overrides(lra_run_config(run.task, size, run.mixer, **options), overrides)
    config = lra_run_config(run.task, size, run.mixer, batch_size=probe.batch_size, **options)
    return apply_overrides(config, overrides)


def _finished(directory: Path, config) -> bool:
    """Whether ``directory`` holds a finished run of ``config`` (another config: an error)."""
    from flarepp.train.config import RunConfig
    if not (directory / "metrics.json").exists():
        return False
    stored = RunConfig.from_dict(json.loads((directory / "config.json").read_text()))
    if stored.identity() != config.identity():
        changed = sorted(k for k, v in config.identity().items()
                         if stored.identity().get(k) != v)
        raise ValueError(f"{str(directory)!r} holds a finished run with another config "
                         f"(differs in {changed}); choose another --out")
    return True


def chance_levels(data) -> dict[str, float]:
    """``chance`` = 1/K and ``majority`` = the test split's most frequent label's share."""
    labels = data.splits["test"].labels
    shares = np.bincount(labels, minlength=data.num_classes) / len(labels)
    return {"chance": 1.0 / data.num_classes, "majority": float(shares.max())}


def run_lra_comparison(tasks: list[str], mixers: list[str], out_dir: str | Path, *,
                       seeds: int = 3, size: str = "tiny",
                       data_roots: dict[str, str] | None = None, steps: int | None = None,
                       split_limits: dict[str, int] | None = None,
                       overrides: list[str] | None = None, device: str | None = None,
                       log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Train the unfinished runs of ``tasks x mixers x seeds``; return every finished run's
    result (this process's and any other's) and write the outputs (module docstring).

    ``data_roots`` maps a task to its data folder (default: the config's ``data_root``);
    ``steps``, ``split_limits`` and ``overrides`` (``--set`` items) apply to every run;
    ``device`` is where this process trains (a runtime choice: finished runs are reused
    whatever device made them).
    """
    from flarepp.tasks import build_task
    from flarepp.tasks.sequence import load_sequence_data
    from flarepp.train import Trainer, latest_checkpoint
    from flarepp.train.rundir import RunLock, RunLocked
    check_names(tasks, mixers, seeds)
    out_dir = Path(out_dir)
    roots = dict(data_roots or {})
    unknown = sorted(set(roots) - set(tasks))
    if unknown:
        raise ValueError(f"--data names task(s) {unknown} that are not compared "
                         f"({', '.join(tasks)})")
    runtime = [f"device={device}"] if device else []
    data: dict[str, Any] = {}
    results, skipped = [], []
    runs = grid(tasks, mixers, seeds)
    for i, run in enumerate(runs):
        if run.task not in data:
            nominal = run_config(run, size, steps=steps, split_limits=split_limits,
                                 data_root=roots.get(run.task), overrides=overrides)
            data[run.task] = (load_sequence_data(nominal, nominal.data_root),
                              nominal.data_root)
        dataset, root = data[run.task]
        config = run_config(run, size, steps=steps, split_limits=split_limits,
                            train_samples=len(dataset.splits["train"]), data_root=root,
                            overrides=[*(overrides or []), *runtime])
        directory = run.directory(out_dir)
        where = f"[{i + 1}/{len(runs)}] {run.task} {run.mixer} seed {run.seed}"
        if (directory / FAILED).exists():
            log(f"{where}: failed before ({directory / FAILED}); not retried")
            continue
        if _finished(directory, config):
            results.append(_result(run, directory, dataset))
            continue
        claim = RunLock(out_dir / "claims" / run.task / run.mixer / f"seed{run.seed}")
        try:
            claim.acquire()
        except RunLocked:
            skipped.append(run)
            log(f"{where}: another process is training it; skipped")
            continue
        try:
            if not _finished(directory, config):  # not finished since the first look
                resume = latest_checkpoint(directory) is not None
                log(f"{where}: {'resuming' if resume else 'training'} {config.epochs} "
                    f"epoch(s) into {directory}")
                trainer = Trainer(config, directory, resume=resume, progress=False,
                                  task=build_task(config, root, data=dataset))
                try:
                    metrics = trainer.fit()
                except FloatingPointError as err:  # diverged: recorded, the grid goes on
                    atomic_write_json(directory / FAILED, {"error": str(err)})
                    log(f"{where}: failed: {err}")
                    continue
                log(f"{where}: test accuracy {100 * metrics['test_accuracy']:.2f}% "
                    f"({metrics['seconds']:.0f} s)")
            results.append(_result(run, directory, dataset))
        finally:
            claim.release()
    for run in skipped:  # finished meanwhile by the process that held it?
        if (run.directory(out_dir) / "metrics.json").exists():
            results.append(_result(run, run.directory(out_dir), data[run.task][0]))
    order = {run: k for k, run in enumerate(runs)}
    results.sort(key=lambda r: order[GridRun(r["task"], r["mixer"], r["seed"])])
    if results:
        write_outputs(results, out_dir, tasks=tasks, mixers=mixers)
    return results


def _result(run: GridRun, directory: Path, data) -> dict[str, Any]:
    metrics = json.loads((directory / "metrics.json").read_text())
    config = json.loads((directory / "config.json").read_text())
    n_train = len(data.splits["train"])
    return {"task": run.task, "mixer": run.mixer, "seed": run.seed,
            "test_accuracy": metrics["test_accuracy"], "val_accuracy": metrics["val_accuracy"],
            **chance_levels(data), "params": metrics["params"], "seconds": metrics["seconds"],
            "epochs": metrics["epochs"],
            "steps": metrics["epochs"] * math.ceil(n_train / config["batch_size"]),
            "train_samples": n_train, "test_samples": len(data.splits["test"]),
            "run_dir": str(directory)}


# -- the table ---------------------------------------------------------------------------------

def summarize(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """``{(mixer, task): {"mean", "std", "n", "params"}}`` of the test accuracy in %;
    ``std`` the sample standard deviation over seeds (NaN for one seed)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["mixer"], r["task"]), []).append(r)
    out = {}
    for key, runs in groups.items():
        acc = np.array([100 * r["test_accuracy"] for r in runs], dtype=float)
        out[key] = {"mean": float(acc.mean()),
                    "std": float(acc.std(ddof=1)) if len(acc) > 1 else math.nan,
                    "n": len(acc), "params": float(runs[0]["params"])}
    return out


def _cell(stats: dict[str, float] | None, seeds: int) -> str:
    if stats is None:
        return "-"
    text = f"{stats['mean']:.2f}" if math.isnan(stats["std"]) else \
        f"{stats['mean']:.2f} ± {stats['std']:.2f}"
    return text if stats["n"] == seeds else f"{text} ({stats['n']}/{seeds} seeds)"


def averages(summary, mixers: list[str], tasks: list[str]) -> dict[str, float]:
    """Mean over tasks of each mixer's mean accuracy (only mixers with every task)."""
    return {m: float(np.mean([summary[(m, t)]["mean"] for t in tasks])) for m in mixers
            if all((m, t) in summary for t in tasks)}


def markdown_table(results: list[dict[str, Any]], *, tasks: list[str] | None = None,
                   mixers: list[str] | None = None) -> str:
    """Table 12's layout: one row per mixer, one column per task and the average; bold and
    underline mark the best and second-best mean (higher accuracy is better)."""
    tasks = tasks or list(dict.fromkeys(r["task"] for r in results))
    mixers = mixers or list(dict.fromkeys(r["mixer"] for r in results))
    summary = summarize(results)
    seeds = max(s["n"] for s in summary.values())
    avg = averages(summary, mixers, tasks)
    columns = {t: {m: summary[(m, t)]["mean"] for m in mixers if (m, t) in summary}
               for t in tasks}
    columns["Avg"] = avg
    rank = {(m, c): i for c, means in columns.items()
            for i, m in enumerate(sorted(means, key=means.get, reverse=True)[:2])}

    def marked(text: str, key: tuple[str, str]) -> str:
        return {0: f"**{text}**", 1: f"<u>{text}</u>"}.get(rank.get(key), text)

    head = ["Mixer", *tasks, "Avg"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for m in mixers:
        cells = [marked(_cell(summary.get((m, t)), seeds), (m, t)) for t in tasks]
        cells.append(marked(f"{avg[m]:.2f}", (m, "Avg")) if m in avg else "-")
        lines.append("| " + " | ".join([m, *cells]) + " |")
    first = {t: next(r for r in results if r["task"] == t) for t in tasks
             if any(r["task"] == t for r in results)}
    for label, key in (("chance (1/K)", "chance"), ("majority class (test)", "majority")):
        cells = [f"{100 * first[t][key]:.2f}" if t in first else "-" for t in tasks]
        lines.append("| " + " | ".join([f"*{label}*", *cells, ""]) + " |")
    lines.append("")
    spread = "one seed" if seeds == 1 else f"mean ± sample std over {seeds} seeds"
    lines.append(f"Test accuracy in %, {spread}; bold / underline: best / second-best mean "
                 "per column. Avg: mean over the tasks of a mixer with all of them.")
    for t, r in first.items():
        lines.append(f"- {t}: {r['train_samples']} training samples, {r['epochs']} epochs = "
                     f"{r['steps']} steps, {r['test_samples']} test samples.")
    return "\n".join(lines) + "\n"


def write_outputs(results: list[dict[str, Any]], out_dir: str | Path, *,
                  tasks: list[str] | None = None, mixers: list[str] | None = None
                  ) -> dict[str, Path]:
    """``results.csv``, ``table.md``, ``table.csv`` and ``comparison.png`` in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = tasks or list(dict.fromkeys(r["task"] for r in results))
    mixers = mixers or list(dict.fromkeys(r["mixer"] for r in results))
    paths = {"results": out_dir / "results.csv", "markdown": out_dir / "table.md",
             "table": out_dir / "table.csv", "chart": out_dir / "comparison.png"}
    atomic_write_text(paths["results"], _csv_text(
        [RESULT_FIELDS] + [[r[k] for k in RESULT_FIELDS] for r in results]))
    atomic_write_text(paths["markdown"], markdown_table(results, tasks=tasks, mixers=mixers))
    summary = summarize(results)
    rows = [["mixer"] + [f"{t}_{k}" for t in tasks for k in ("mean_pct", "std_pct", "seeds")]]
    for m in mixers:
        row: list[Any] = [m]
        for t in tasks:
            s = summary.get((m, t))
            row += ["", "", 0] if s is None else [f"{s['mean']:.6g}", f"{s['std']:.6g}",
                                                  s["n"]]
        rows.append(row)
    atomic_write_text(paths["table"], _csv_text(rows))
    plot_comparison(results, paths["chart"], tasks=tasks, mixers=mixers)
    return paths


def _csv_text(rows: list[list[Any]]) -> str:
    import io
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    return text.getvalue()


def plot_comparison(results: list[dict[str, Any]], path: Path, *, tasks: list[str],
                    mixers: list[str]) -> Path:
    """One panel per task: mean test accuracy per mixer, seed spread as error bars, the
    chance level and majority share as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summary = summarize(results)
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks), 0.4 * len(mixers) + 1.6),
                             squeeze=False)
    for ax, t in zip(axes[0], tasks):
        rows = [m for m in mixers if (m, t) in summary][::-1]
        means = [summary[(m, t)]["mean"] for m in rows]
        spread = [0.0 if math.isnan(summary[(m, t)]["std"]) else summary[(m, t)]["std"]
                  for m in rows]
        colors = ["tab:red" if m == "flarepp" else "tab:gray" if m == "attention"
                  else "tab:blue" for m in rows]
        ax.barh(range(len(rows)), means, xerr=spread, color=colors, capsize=3)
        ax.set_yticks(range(len(rows)), rows)
        mine = [r for r in results if r["task"] == t]
        if mine:
            ax.axvline(100 * mine[0]["chance"], color="k", ls="--", lw=1, label="chance")
            ax.axvline(100 * mine[0]["majority"], color="k", ls=":", lw=1, label="majority")
        ax.set_xlabel("test accuracy (%)"), ax.set_title(t), ax.grid(axis="x", alpha=0.3)
    axes[0][0].legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["GridRun", "RESULT_FIELDS", "chance_levels", "grid", "markdown_table",
           "run_config", "run_lra_comparison", "summarize", "write_outputs"]
