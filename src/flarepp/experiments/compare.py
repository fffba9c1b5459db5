"""Train every Table 1 model under one protocol and tabulate test relative L2 (Table 1).

For each dataset, one preset (``darcy-tiny`` for ``scale="tiny"``, ``darcy`` for the paper
run) fixes the data, the optimiser, the schedule, the epochs and the backbone settings;
each model's keywords come from :mod:`flarepp.experiments.comparison`, and each seed is one
run of the trainer (``seed`` drives the initialisation and the batch order). The data are
loaded once per dataset and shared by all runs. A finished run (``metrics.json``) with the
same config is reused and one with checkpoints but no metrics is resumed, so an
interrupted comparison continues where it stopped; a finished run with another config is
an error, never a stale table entry.

Outputs in ``out_dir``: ``results.csv`` (one line per run), ``table.md`` and ``table.csv``
(Table 1's shape: models x datasets, test relative L2 in %, mean and sample standard
deviation over seeds), ``comparison.png`` (a bar chart), ``runs/<dataset>/<model>/seed<k>``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from flarepp.experiments.comparison import (COMPARISON_MODELS, TABLE1_ORDER,
                                            comparison_model_kwargs)
from flarepp.mixers.abupt import AnchorAttentionConfig

RESULT_FIELDS = ["model", "label", "dataset", "seed", "sdpa_scale", "test_rel_l2",
                 "train_rel_l2", "params", "seconds", "epochs", "n_points"]


def preset_name(dataset: str, scale: str) -> str:
    if scale not in ("tiny", "paper"):
        raise ValueError(f"scale must be 'tiny' or 'paper', got {scale!r}")
    return f"{dataset}-tiny" if scale == "tiny" else dataset


def _one_run(config, splits, run_dir: Path) -> dict[str, Any]:
    from flarepp.train import Trainer, latest_checkpoint
    metrics_path, config_path = run_dir / "metrics.json", run_dir / "config.json"
    if metrics_path.exists():
        stored = json.loads(config_path.read_text()) if config_path.exists() else None
        if stored != json.loads(json.dumps(config.to_dict())):
            raise ValueError(f"{str(run_dir)!r} holds a finished run with a different config "
                             "(epochs, seed, model or data options); choose another --out")
        return json.loads(metrics_path.read_text())
    resume = latest_checkpoint(run_dir) is not None
    trainer = Trainer(config, run_dir, splits=splits, resume=resume, progress=False)
    return trainer.fit()


def run_comparison(models: list[str], datasets: list[str], out_dir: str | Path, *,
                   epochs: int | None = None, seeds: int = 1, scale: str = "tiny",
                   data_root: str | Path | None = None, overrides: list[str] | None = None,
                   log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Train ``models`` x ``datasets`` x ``seeds`` runs; returns one result dict per run.

    ``data_root`` holds one directory per dataset (default: each preset's ``data_root``);
    ``overrides`` are ``--set`` items applied to every preset (``epochs`` wins over them).
    """
    from flarepp.data import load_dataset
    from flarepp.train import get_preset
    for name in models:
        COMPARISON_MODELS.entry(name)  # unknown names fail before any training
    if seeds <= 0:
        raise ValueError(f"seeds must be positive, got {seeds}")
    out_dir = Path(out_dir)
    results = []
    for dataset in datasets:
        base = get_preset(preset_name(dataset, scale), overrides)
        root = Path(data_root) / dataset if data_root is not None else Path(base.data_root)
        if not root.exists():
            raise FileNotFoundError(
                f"data for {dataset!r} not found at {str(root)!r}; make it with "
                f"`flarepp data make {dataset} --out {root}` or pass --data-root")
        splits = load_dataset(base.dataset, root, **base.dataset_options)
        settings = {k: base.model[k] for k in ("dim", "heads", "blocks", "latents")}
        for name in models:
            model = comparison_model_kwargs(name, dataset, settings)
            for seed in range(seeds):
                config = dataclasses.replace(
                    base, name=f"{base.name}-{name}", model=model, seed=seed,
                    epochs=epochs or base.epochs, data_root=str(root))
                run_dir = out_dir / "runs" / dataset / name / f"seed{seed}"
                metrics = _one_run(config, splits, run_dir)
                result = {"model": name, "label": COMPARISON_MODELS.get(name).label,
                          "dataset": dataset, "seed": seed,
                          "sdpa_scale": config.sdpa_scale_text(),
                          "test_rel_l2": metrics["test_rel_l2"],
                          "train_rel_l2": metrics["train_rel_l2"],
                          "params": metrics["params"], "seconds": metrics["seconds"],
                          "epochs": metrics["epochs"], "n_points": splits.train.n_points}
                results.append(result)
                log(f"{dataset:>14s}  {result['label']:<20s} seed {seed}  test rel L2 "
                    f"{100 * result['test_rel_l2']:.3f}%  ({result['params']:,} params, "
                    f"{result['seconds']:.0f} s)")
    return results


def summarize(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """``{(model, dataset): {"mean", "std", "n", "params"}}`` of the test error in %;
    ``std`` is the sample standard deviation (NaN for a single seed)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["model"], r["dataset"]), []).append(r)
    summary = {}
    for key, runs in groups.items():
        errs = np.array([100 * r["test_rel_l2"] for r in runs], dtype=float)
        summary[key] = {"mean": float(errs.mean()),
                        "std": float(errs.std(ddof=1)) if len(errs) > 1 else math.nan,
                        "n": len(errs), "params": float(runs[0]["params"])}
    return summary


def _ordered(items: set[str], order: list[str]) -> list[str]:
    return [m for m in order if m in items] + sorted(items - set(order))


def _cell(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "-"
    if math.isnan(stats["std"]):
        return f"{stats['mean']:.2f}"
    return f"{stats['mean']:.2f} ± {stats['std']:.2f}"


def table_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[str], dict]:
    summary = summarize(results)
    models = _ordered({m for m, _ in summary}, TABLE1_ORDER)
    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    return models, datasets, summary


def markdown_table(results: list[dict[str, Any]]) -> str:
    """Table 1's layout; bold / underline mark the best / second-best efficient model."""
    models, datasets, summary = table_rows(results)
    points = {r["dataset"]: r["n_points"] for r in results}
    seeds = {r["dataset"]: len({x["seed"] for x in results if x["dataset"] == r["dataset"]})
             for r in results}
    head = ["Model"] + [f"{d} ({points[d]} points)" for d in datasets]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    rank: dict[tuple[str, str], int] = {}
    for d in datasets:
        efficient = [m for m in models if (m, d) in summary
                     and (m not in COMPARISON_MODELS or COMPARISON_MODELS.get(m).efficient)]
        for i, m in enumerate(sorted(efficient, key=lambda m: summary[(m, d)]["mean"])[:2]):
            rank[(m, d)] = i
    for m in models:
        label = COMPARISON_MODELS.get(m).label if m in COMPARISON_MODELS else m
        cells = []
        for d in datasets:
            text = _cell(summary.get((m, d)))
            if rank.get((m, d)) == 0:
                text = f"**{text}**"
            elif rank.get((m, d)) == 1:
                text = f"<u>{text}</u>"
            cells.append(text)
        lines.append("| " + " | ".join([label] + cells) + " |")
    n = sorted(set(seeds.values()))
    spread = ("a single seed" if n == [1] else
              f"mean ± sample std over {'/'.join(map(str, n))} seeds")
    lines.append("")
    lines.append(f"Test relative L2 error in %, {spread}; bold and underline: best and "
                 "second-best efficient model.")
    scales = {r["model"]: r.get("sdpa_scale", "-") for r in results}
    lines.append("SDPA scale each model ran with (sdpa_scale; config attn_scale): " + ", ".join(
        f"{COMPARISON_MODELS.get(m).label if m in COMPARISON_MODELS else m} {scales[m]}"
        for m in models) + ".")
    anchors = AnchorAttentionConfig.anchors
    small = [d for d in datasets if points[d] <= anchors]
    if "abupt" in models and small:
        lines.append(f"AB-UPT keeps its {anchors} anchors (Table 9): on {', '.join(small)} "
                     "every point is an anchor, so it computes full self-attention there.")
    lines.append("")
    lines.append("| Model | " + " | ".join(f"{d} params (M)" for d in datasets) + " |")
    lines.append("| --- | " + " | ".join("---" for _ in datasets) + " |")
    for m in models:
        label = COMPARISON_MODELS.get(m).label if m in COMPARISON_MODELS else m
        vals = [f"{summary[(m, d)]['params'] / 1e6:.3f}" if (m, d) in summary else "-"
                for d in datasets]
        lines.append("| " + " | ".join([label] + vals) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(results: list[dict[str, Any]], out_dir: str | Path) -> dict[str, Path]:
    """``results.csv``, ``table.md``, ``table.csv`` and ``comparison.png`` in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"results": out_dir / "results.csv", "markdown": out_dir / "table.md",
             "table": out_dir / "table.csv", "chart": out_dir / "comparison.png"}
    with open(paths["results"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_FIELDS)
        writer.writeheader()
        writer.writerows({k: r[k] for k in RESULT_FIELDS} for r in results)
    paths["markdown"].write_text(markdown_table(results))
    models, datasets, summary = table_rows(results)
    with open(paths["table"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "label"] + [f"{d}_{k}" for d in datasets
                                              for k in ("mean_pct", "std_pct", "seeds")])
        for m in models:
            row = [m, COMPARISON_MODELS.get(m).label if m in COMPARISON_MODELS else m]
            for d in datasets:
                s = summary.get((m, d))
                row += ["", "", 0] if s is None else [f"{s['mean']:.6g}", f"{s['std']:.6g}",
                                                      s["n"]]
            writer.writerow(row)
    plot_comparison(results, paths["chart"])
    return paths


def plot_comparison(results: list[dict[str, Any]], path: Path) -> Path:
    """One panel per dataset: horizontal bars of the mean test error, seed spread as error
    bars, FLARE++ highlighted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models, datasets, summary = table_rows(results)
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 0.45 * len(models)
                                                        + 1.2), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        rows = [m for m in models if (m, d) in summary][::-1]
        means = [summary[(m, d)]["mean"] for m in rows]
        spread = [0.0 if math.isnan(summary[(m, d)]["std"]) else summary[(m, d)]["std"]
                  for m in rows]
        colors = ["tab:red" if m == "flarepp" else "tab:gray" if m == "attention"
                  else "tab:blue" for m in rows]
        ax.barh(range(len(rows)), means, xerr=spread, color=colors, capsize=3)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([COMPARISON_MODELS.get(m).label if m in COMPARISON_MODELS else m
                            for m in rows])
        ax.set_xlabel("test relative L2 error (%)")
        ax.set_title(d)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
