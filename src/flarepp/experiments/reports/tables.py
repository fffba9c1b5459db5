"""The comparison tables' report plug-ins: ``table1`` (Table 1) and ``lra`` (Table 12).

Each writes ``table.md`` and ``table.csv`` (one row per model or mixer, one column per
dataset or task: the task's test metric in %, mean and sample standard deviation over
seeds) and ``comparison.png`` (bars with the seed spread), and adds the table to
``report.md``. Failed and unfinished runs are left out of the cells (a cell states how many
seeds it has when not all finished); the ``runs`` plug-in lists them with their errors.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from flarepp.experiments.comparison import COMPARISON_MODELS, TABLE1_ORDER
from flarepp.experiments.reports.common import Report, figure_module
from flarepp.experiments.reports.rows import aggregate, csv_text
from flarepp.io import atomic_write_text
from flarepp.mixers.abupt import AnchorAttentionConfig


def _summary(rep: Report, row_key: str, col_key: str) -> dict[tuple[Any, Any], dict[str, float]]:
    """``{(row, column): {"mean", "std", "n", "params"}}`` of the test metric in %."""
    out = {}
    for g in aggregate(rep.rows, [row_key, col_key]):
        mean, std, n = g.stats()
        out[(g.key[row_key], g.key[col_key])] = {"mean": 100 * mean, "std": 100 * std, "n": n,
                                                 "params": float(g.rows[0].params or 0)}
    return out


def _cell(stats: dict[str, float] | None, seeds: int) -> str:
    if stats is None:
        return "-"
    text = (f"{stats['mean']:.2f}" if math.isnan(stats["std"])
            else f"{stats['mean']:.2f} ± {stats['std']:.2f}")
    return text if stats["n"] == seeds else f"{text} ({stats['n']}/{seeds} seeds)"


def _ranks(summary, rows: list[str], columns: list[str], higher: bool,
           eligible=lambda r: True) -> dict[tuple[str, str], int]:
    """0 / 1 for the best / second-best mean of each column."""
    rank = {}
    for c in columns:
        have = [r for r in rows if (r, c) in summary and eligible(r)]
        ordered = sorted(have, key=lambda r: summary[(r, c)]["mean"], reverse=higher)
        rank.update({(r, c): i for i, r in enumerate(ordered[:2])})
    return rank


def _marked(text: str, rank: int | None) -> str:
    return {0: f"**{text}**", 1: f"<u>{text}</u>"}.get(rank, text)


def _outputs(rep: Report, table: str, wide: list[list[Any]], summary, rows: list[str],
             columns: list[str], label, unit: str, guides: dict[str, list[float]]) -> None:
    """``table.md``, ``table.csv`` and ``comparison.png``; the table into ``report.md``."""
    out = rep.out_dir
    rep.paths.update(markdown_table=out / "table.md", table=out / "table.csv",
                     chart=out / "comparison.png")
    atomic_write_text(rep.paths["markdown_table"], table)
    atomic_write_text(rep.paths["table"], csv_text(wide))
    plt = figure_module()
    fig, axes = plt.subplots(1, len(columns), figsize=(4.0 * len(columns),
                                                       0.45 * len(rows) + 1.4), squeeze=False)
    for ax, c in zip(axes[0], columns):
        mine = [r for r in rows if (r, c) in summary][::-1]
        ax.barh(range(len(mine)), [summary[(r, c)]["mean"] for r in mine],
                xerr=[0.0 if math.isnan(summary[(r, c)]["std"]) else summary[(r, c)]["std"]
                      for r in mine],
                color=["tab:red" if r == "flarepp" else "tab:gray" if r == "attention"
                       else "tab:blue" for r in mine], capsize=3)
        ax.set_yticks(range(len(mine)), [label(r) for r in mine])
        for value, style in zip(guides.get(c, []), ("--", ":")):
            ax.axvline(value, color="k", ls=style, lw=1)
        ax.set_xlabel(unit), ax.set_title(c), ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(rep.paths["chart"], dpi=120)
    plt.close(fig)
    rep.lines += ["", "## The table", "", table]


def _wide(summary, rows: list[str], columns: list[str], first: list[str], label
          ) -> list[list[Any]]:
    wide = [first + [f"{c}_{k}" for c in columns for k in ("mean_pct", "std_pct", "seeds")]]
    for r in rows:
        line: list[Any] = [r] + ([label(r)] if len(first) > 1 else [])
        for c in columns:
            s = summary.get((r, c))
            line += ["", "", 0] if s is None else [f"{s['mean']:.6g}", f"{s['std']:.6g}", s["n"]]
        wide.append(line)
    return wide


def table1_report(rep: Report) -> None:
    """Table 1: models x datasets, test relative L2 in %."""
    summary = _summary(rep, "model", "dataset")
    if not summary:
        return
    names = {r.get("model") for r in rep.rows}
    models = [m for m in TABLE1_ORDER if m in names] + sorted(names - set(TABLE1_ORDER))
    datasets = list(dict.fromkeys(r.get("dataset") for r in rep.rows))

    def label(m: str) -> str:
        return COMPARISON_MODELS.get(m).label if m in COMPARISON_MODELS else m

    seeds = len({r.get("seed") for r in rep.rows})
    points = rep.study.info.get("n_points", {})
    rank = _ranks(summary, models, datasets, higher=False, eligible=lambda m: (
        m not in COMPARISON_MODELS or COMPARISON_MODELS.get(m).efficient))
    head = ["Model"] + [f"{d} ({points.get(d, '?')} points)" for d in datasets]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for m in models:
        cells = [_marked(_cell(summary.get((m, d)), seeds), rank.get((m, d))) for d in datasets]
        lines.append("| " + " | ".join([label(m)] + cells) + " |")
    spread = "a single seed" if seeds == 1 else f"mean ± sample std over {seeds} seeds"
    scales = {r.get("model"): r.get("sdpa_scale") for r in rep.rows}
    lines += ["", f"Test relative L2 error in %, {spread}; bold and underline: best and "
                  "second-best efficient model.",
              "SDPA scale each model ran with (sdpa_scale; config attn_scale): " + ", ".join(
                  f"{label(m)} {scales[m]}" for m in models) + "."]
    anchors = AnchorAttentionConfig.anchors
    small = [d for d in datasets if points.get(d, anchors + 1) <= anchors]
    if "abupt" in models and small:
        lines.append(f"AB-UPT keeps its {anchors} anchors (Table 9): on {', '.join(small)} "
                     "every point is an anchor, so it computes full self-attention there.")
    lines += ["", "| Model | " + " | ".join(f"{d} params (M)" for d in datasets) + " |",
              "| --- | " + " | ".join("---" for _ in datasets) + " |"]
    for m in models:
        vals = [f"{summary[(m, d)]['params'] / 1e6:.3f}" if (m, d) in summary else "-"
                for d in datasets]
        lines.append("| " + " | ".join([label(m)] + vals) + " |")
    _outputs(rep, "\n".join(lines) + "\n",
             _wide(summary, models, datasets, ["model", "label"], label), summary, models,
             datasets, label, "test relative L2 error (%)", {})


def lra_report(rep: Report) -> None:
    """Table 12: mixers x LRA tasks, test accuracy in %, the average."""
    summary = _summary(rep, "mixer", "task")
    if not summary:
        return
    tasks = list(dict.fromkeys(r.get("task") for r in rep.rows))
    mixers = list(dict.fromkeys(r.get("mixer") for r in rep.rows))
    facts = rep.study.info.get("tasks", {})
    seeds = len({r.get("seed") for r in rep.rows})
    avg = {m: float(np.mean([summary[(m, t)]["mean"] for t in tasks])) for m in mixers
           if all((m, t) in summary for t in tasks)}
    summary.update({(m, "Avg"): {"mean": v, "std": math.nan, "n": seeds}
                    for m, v in avg.items()})
    rank = _ranks(summary, mixers, tasks + ["Avg"], higher=True)
    head = ["Mixer", *tasks, "Avg"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for m in mixers:
        cells = [_marked(_cell(summary.get((m, t)), seeds), rank.get((m, t))) for t in tasks]
        cells.append(_marked(f"{avg[m]:.2f}", rank.get((m, "Avg"))) if m in avg else "-")
        lines.append("| " + " | ".join([m, *cells]) + " |")
    for text, key in (("chance (1/K)", "chance"), ("majority class (test)", "majority")):
        cells = [f"{100 * facts[t][key]:.2f}" if t in facts else "-" for t in tasks]
        lines.append("| " + " | ".join([f"*{text}*", *cells, ""]) + " |")
    spread = "one seed" if seeds == 1 else f"mean ± sample std over {seeds} seeds"
    lines += ["", f"Test accuracy in %, {spread}; bold / underline: best / second-best mean "
                  "per column. Avg: mean over the tasks of a mixer with all of them."]
    for t in tasks:
        point = next(p for p in rep.study.points if p.labels["task"] == t)
        train = facts.get(t, {}).get("train_samples")
        if train:
            steps = point.config.epochs * math.ceil(train / point.config.batch_size)
            lines.append(f"- {t}: {train} training samples, {point.config.epochs} epochs = "
                         f"{steps} steps, {facts[t]['test_samples']} test samples.")
    for (m, c) in [k for k in summary if k[1] == "Avg"]:
        del summary[(m, c)]
    _outputs(rep, "\n".join(lines) + "\n", _wide(summary, mixers, tasks, ["mixer"], str),
             summary, mixers, tasks, str, "test accuracy (%)",
             {t: [100 * facts[t]["chance"], 100 * facts[t]["majority"]] for t in facts})


__all__ = ["lra_report", "table1_report"]
