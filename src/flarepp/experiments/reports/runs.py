"""The plug-ins every sweep runs: ``runs`` (every point), ``seeds`` (Table 11), ``depth``
(Figure 4) and ``precision`` (Figure 7). A plug-in that does not apply (one depth, no 16-bit
runs) writes nothing."""

from __future__ import annotations

import math
from typing import Any

from flarepp.experiments.engine import finite
from flarepp.experiments.reports.common import Report, figure_module, fmt, markdown, spread
from flarepp.experiments.reports.rows import Row, aggregate, status_counts


def runs_report(rep: Report) -> None:
    """Every point: status, the task's test (train) metric, raw and EMA, error."""
    counts = status_counts(rep.rows)
    lower = {r.lower_is_better for r in rep.rows}
    sense = ("lower is better" if lower == {True} else "higher is better" if lower == {False}
             else "")
    pruned = f"{counts['pruned']} pruned, " if counts["pruned"] else ""
    rep.lines += [f"Points: {len(rep.rows)} ({counts['done']} done, {counts['failed']} failed, "
                  f"{pruned}{counts['pending']} pending). Metric: the task's own, test "
                  f"`{rep.metric_name()}` ({sense}; train in brackets where evaluated) of the "
                  "weights each run names (`weights`, config `eval_weights`; raw and EMA "
                  "beside it where stored); "
                  "`sdpa_scale` is the SDPA scale each run's mixer used (config `attn_scale`).",
                  "", "## Every run", ""]
    keys = [k for k in rep.label_keys if k not in ("mixer",)]
    both = any(finite(r.value_raw) for r in rep.rows)
    body = []
    for r in rep.rows:
        value = fmt(r.value) + (f" ({fmt(r.train_value)})" if finite(r.train_value) else "")
        weights = [r.weights or "-", fmt(r.value_raw), fmt(r.value_ema)] if both else []
        error = (r.error or "")[:160].replace("|", "/").replace("\n", " ")
        body.append([r.point, r.get("mixer"), *[r.get(k) for k in keys], r.get("sdpa_scale"),
                     r.status, value, *weights, r.params or "-", error])
    rep.lines += markdown(["point", "mixer", *keys, "sdpa_scale", "status",
                           f"test {rep.metric_name()}", *(["weights", "raw", "EMA"] if both
                                                          else []), "params", "error"], body)


def seeds_report(rep: Report) -> None:
    """Table 11: mean ± sample std over seeds of every other combination."""
    keys = [k for k in rep.label_keys if k != "seed"]
    groups = aggregate(rep.rows, keys + ["sdpa_scale"])
    if "seed" not in rep.label_keys or not groups:
        return
    rep.lines += ["", "## Over seeds (Table 11)", "",
                  f"Test (train) `{rep.metric_name()}`: mean ± sample standard deviation over "
                  "seeds of the finished runs.", ""]
    both = any(finite(r.value_raw) for g in groups for r in g.rows)
    body = []
    for g in groups:
        test, train = g.stats("value"), g.stats("train_value")
        named = "/".join(sorted({str(r.weights) for r in g.rows}))  # mixed: flagged
        weights = ([named, spread(*g.stats("value_raw")[:2]), spread(*g.stats("value_ema")[:2])]
                   if both else [])
        body.append([*[g.key[k] for k in keys], g.key["sdpa_scale"], test[2],
                     spread(*test[:2]), spread(*train[:2]), *weights])
    rep.lines += markdown(keys + ["sdpa_scale", "seeds", "test", "train",
                                  *(["weights", "test (raw)", "test (EMA)"] if both
                                    else [])], body)


def _panel(r: Row) -> tuple:
    return r.get("mixer"), r.get("sdpa_scale"), r.get("precision")


def depth_report(rep: Report) -> None:
    """Figure 4: the metric against depth B, a line per latent budget M, a panel per
    mixer."""
    done = rep.done
    depths = sorted({r.get("blocks") for r in done if r.get("blocks") is not None})
    if len(depths) < 2:
        return
    plt = figure_module()
    panels = sorted({_panel(r) for r in done}, key=str)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4),
                             squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        mine = [r for r in done if _panel(r) == panel]
        by_budget: dict[Any, list[tuple]] = {}
        for g in aggregate(mine, ["latents", "blocks"]):
            mean, std, _ = g.stats()
            by_budget.setdefault(g.key["latents"], []).append(
                (g.key["blocks"], mean, 0.0 if math.isnan(std) else std))
        for latents, pts in sorted(by_budget.items(), key=str):
            b, m, s = zip(*sorted(pts))
            ax.errorbar(b, m, yerr=s, marker="o", capsize=3, label=f"M = {latents}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths, [str(b) for b in depths])
        ax.set_xlabel("blocks B")
        ax.set_title(f"{panel[0]} (scale {panel[1]}, {panel[2]})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(f"test {rep.metric_name()}")
    fig.tight_layout()
    path = rep.out_dir / "fig4_depth_latents.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    rep.paths["figure4"] = path
    rep.lines += ["", "## The metric against depth per latent budget (Figure 4)", "",
                  f"![Figure 4]({path.name})"]


def precision_ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """Figure 7's numbers: per mixer, scale, depth and latents, the mean 16-bit metric over
    the mean FP32 metric (means over seeds)."""
    means = {tuple(g.key.values()): g.stats()[0] for g in aggregate(
        rows, ["mixer", "sdpa_scale", "blocks", "latents", "precision"])}
    out = []
    for (mixer, scale, blocks, latents, precision), mean in sorted(means.items(), key=str):
        fp32 = means.get((mixer, scale, blocks, latents, "fp32"))
        if precision != "fp32" and fp32:
            out.append({"mixer": mixer, "sdpa_scale": scale, "blocks": blocks,
                        "latents": latents, "precision": precision, "ratio": mean / fp32})
    return out


def precision_report(rep: Report) -> None:
    """Figure 7: 16-bit over FP32 metric per mixer and depth."""
    ratios = precision_ratios(rep.rows)
    if not ratios:
        return
    plt = figure_module()
    fig, ax = plt.subplots(figsize=(5.0, 3.4))
    lines = sorted({(r["mixer"], r["sdpa_scale"], r["latents"], r["precision"])
                    for r in ratios}, key=str)
    for line in lines:
        pts = sorted((r["blocks"], r["ratio"]) for r in ratios
                     if (r["mixer"], r["sdpa_scale"], r["latents"], r["precision"]) == line)
        b, v = zip(*pts)
        ax.plot(b, v, marker="o", label=f"{line[0]} M={line[2]} {line[3]} (scale {line[1]})")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("blocks B")
    ax.set_ylabel(f"16-bit / FP32 test {rep.metric_name()}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = rep.out_dir / "fig7_precision_ratio.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    rep.paths["figure7"] = path
    rep.lines += ["", "## 16-bit over FP32 (Figure 7)", ""]
    rep.lines += markdown(["mixer", "sdpa_scale", "blocks", "latents", "precision", "ratio"],
                          [[r["mixer"], r["sdpa_scale"], r["blocks"], r["latents"],
                            r["precision"], f"{r['ratio']:.3f}"] for r in ratios])
    rep.lines += ["", f"![Figure 7]({path.name})"]


__all__ = ["depth_report", "precision_ratios", "precision_report", "runs_report", "seeds_report"]
