"""Reports of a study: one row per point, one seed aggregation, report plug-ins by name.

:func:`collect` reads a study's directory into one row per point: its labels, ``status``
(``done``, ``failed`` or ``pending``), ``error`` (why it failed, or the last error that
left it pending), the task's own metric (``metric`` = the task's ``headline``; ``value``
its test value, ``train_value`` its train value where the task evaluates one, both of the
weights named in ``weights``; ``value_raw`` and ``value_ema`` the test values of the raw
and the EMA weights where the run stored them; a run written before both were stored
reported only EMA; ``val_value``, ``val_value_raw`` and ``val_value_ema`` the same on the
validation split carved from the training data, where the run has one; ``train_constant``
the training metric of the best constant predictor where the task states it, and
``did_not_fit`` whether the run's own training metric is no better, :func:`did_not_fit`)
and the config facts every table states (mixer, depth, latents, precision, seed, SDPA
scale).

:func:`aggregate` is the one seed aggregation: mean, sample standard deviation (ddof 1;
NaN for one run) and count per group of finished runs.

:func:`flarepp.experiments.reporting.write_report` writes ``results.csv`` and ``report.md``
from the plug-ins the study names (:data:`REPORTS`): ``runs`` (every point, failed ones with their error), ``seeds``
(Table 11), ``depth`` (Figure 4), ``precision`` (Figure 7), ``cost`` (Figure 5), ``table1``
(Table 1), ``lra`` (Table 12), ``selection`` (a setting chosen on validation),
``paired`` (paired differences between mixers) and ``length`` (the metric against epochs). A plug-in that does not apply (one depth,
no 16-bit runs) writes nothing.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from flarepp.experiments.engine import Study, finite, point_state, read_events
from flarepp.experiments.studies import open_any_study
from flarepp.registry import Registry

# ---------------------------------------------------------------------------------------------
# rows and the one aggregation


def collect(out_dir: str | Path) -> tuple[Study, list[dict[str, Any]]]:
    """The study of ``out_dir`` and one row per point (module docstring)."""
    from flarepp.tasks import TASKS
    out_dir = Path(out_dir)
    study = open_any_study(out_dir)
    last_error: dict[str, str | None] = {}
    for e in read_events(out_dir):  # the newest error since the point last (re)started
        if e["event"] == "error":
            last_error[e["point"]] = e.get("error")
        elif e["event"] in ("start", "resume", "finish"):
            last_error[e["point"]] = None
    rows = []
    for point in study.points:
        config = point.config
        task = TASKS.get(config.task)
        model = config.model_kwargs()
        state = point_state(out_dir, point)
        metrics = state.metrics or {}
        weights = metrics.get("eval_weights", "ema" if metrics else None)
        test = f"test_{task.headline}"
        row: dict[str, Any] = {
            "point": point.name, "mixer": model.get("mixer", model.get("arch", "surrogate")),
            "blocks": model.get("blocks"), "latents": model.get("latents"),
            "precision": config.precision, "seed": config.seed,
            "sdpa_scale": config.sdpa_scale_text(), **point.labels,
            "status": state.status, "error": state.error or last_error.get(point.name),
            "metric": task.headline, "lower_is_better": task.lower_is_better,
            "value": metrics.get(f"test_{task.headline}"),
            "train_value": metrics.get(f"train_{task.headline}"),
            f"test_{task.headline}": metrics.get(f"test_{task.headline}"),
            "weights": weights, "value_raw": metrics.get(f"{test}_raw"),
            "value_ema": metrics.get(f"{test}_ema",
                                     metrics.get(test) if weights == "ema" else None),
            "val_value": metrics.get(f"val_{task.headline}"),
            "val_value_raw": metrics.get(f"val_{task.headline}_raw"),
            "val_value_ema": metrics.get(f"val_{task.headline}_ema"),
            "train_constant": metrics.get(f"train_constant_{task.headline}"),
            **{k: metrics.get(k) for k in ("params", "seconds", "device")},
            "epochs": metrics.get("epochs", config.epochs)}  # trained, else configured
        if state.status == "done" and not finite(row["value"]):
            row.update(status="failed", error=f"test {task.headline} is {row['value']}")
        row["did_not_fit"] = did_not_fit(row)
        rows.append(row)
    return study, rows


def did_not_fit(row: dict[str, Any]) -> bool | None:
    """Whether a finished run failed to fit its training data: its training metric
    (``train_value``) no better than the best constant predictor's (``train_constant``).
    None where either is unknown (a run still going, a task that states no constant)."""
    train, constant = row.get("train_value"), row.get("train_constant")
    if row.get("status") != "done" or not (finite(train) and finite(constant)):
        return None
    return bool(train >= constant if row["lower_is_better"] else train <= constant)


@dataclass
class Group:
    """Finished runs that share ``key``; statistics of their ``value`` field."""

    key: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)

    def stats(self, value: str = "value") -> tuple[float, float, int]:
        """``(mean, sample std, n)`` of ``value`` over the group's runs (std NaN for one)."""
        arr = np.asarray([r[value] for r in self.rows if finite(r.get(value))], float)
        if not len(arr):
            return math.nan, math.nan, 0
        return (float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else math.nan,
                len(arr))


def aggregate(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[Group]:
    """The finished rows grouped by ``keys``, in first-seen order: the one seed aggregation
    of every table and figure."""
    groups: dict[tuple, Group] = {}
    for r in rows:
        if r["status"] == "done":
            k = tuple(r.get(key) for key in keys)
            groups.setdefault(k, Group(dict(zip(keys, k)))).rows.append(r)
    return list(groups.values())


def spread(mean: float, std: float, scale: float = 1.0, digits: str = ".4g") -> str:
    """``mean ± std`` (just the mean for one run), both times ``scale``."""
    if math.isnan(mean):
        return "-"
    text = format(scale * mean, digits)
    return text if math.isnan(std) else f"{text} ± {format(scale * std, digits)}"


def markdown(header: list[str], body: list[list[Any]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in body])


def fmt(value: Any, spec: str = ".4g") -> str:
    return format(value, spec) if finite(value) else "-"


def csv_text(rows: list[list[Any]]) -> str:
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    return text.getvalue()


# ---------------------------------------------------------------------------------------------
# plug-ins

@dataclass
class Report:
    """What a plug-in sees and adds to: the study, its rows, its directory, the Markdown
    lines of ``report.md`` and the paths written."""

    study: Study
    rows: list[dict[str, Any]]
    out_dir: Path
    lines: list[str] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def done(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "done"]

    @property
    def label_keys(self) -> list[str]:
        return list(self.study.points[0].labels)

    def metric_name(self) -> str:
        metrics = sorted({r["metric"] for r in self.rows})
        return "/".join(metrics)


REPORTS: Registry[Callable[[Report], None]] = Registry("report")


@REPORTS.register("runs", doc="every point: status, the task's test (train) metric, error")
def runs_report(rep: Report) -> None:
    counts = {s: sum(r["status"] == s for r in rep.rows)
              for s in ("done", "failed", "pruned", "pending")}
    lower = {r["lower_is_better"] for r in rep.rows}
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
    both = any(finite(r.get("value_raw")) for r in rep.rows)
    body = []
    for r in rep.rows:
        value = fmt(r["value"]) + (f" ({fmt(r['train_value'])})" if finite(r["train_value"])
                                   else "")
        weights = ([r.get("weights") or "-", fmt(r.get("value_raw")), fmt(r.get("value_ema"))]
                   if both else [])
        error = (r["error"] or "")[:160].replace("|", "/").replace("\n", " ")
        body.append([r["point"], r["mixer"], *[r.get(k) for k in keys], r["sdpa_scale"],
                     r["status"], value, *weights, r.get("params") or "-", error])
    rep.lines += markdown(["point", "mixer", *keys, "sdpa_scale", "status",
                           f"test {rep.metric_name()}", *(["weights", "raw", "EMA"] if both
                                                          else []), "params", "error"], body)


@REPORTS.register("seeds", doc="Table 11: mean ± sample std over seeds of every other "
                               "combination")
def seeds_report(rep: Report) -> None:
    keys = [k for k in rep.label_keys if k != "seed"]
    groups = aggregate(rep.rows, keys + ["sdpa_scale"])
    if "seed" not in rep.label_keys or not groups:
        return
    rep.lines += ["", "## Over seeds (Table 11)", "",
                  f"Test (train) `{rep.metric_name()}`: mean ± sample standard deviation over "
                  "seeds of the finished runs.", ""]
    both = any(finite(r.get("value_raw")) for g in groups for r in g.rows)
    body = []
    for g in groups:
        test, train = g.stats("value"), g.stats("train_value")
        named = "/".join(sorted({str(r.get("weights")) for r in g.rows}))  # mixed: flagged
        weights = ([named, spread(*g.stats("value_raw")[:2]), spread(*g.stats("value_ema")[:2])]
                   if both else [])
        body.append([*[g.key[k] for k in keys], g.key["sdpa_scale"], test[2],
                     spread(*test[:2]), spread(*train[:2]), *weights])
    rep.lines += markdown(keys + ["sdpa_scale", "seeds", "test", "train",
                                  *(["weights", "test (raw)", "test (EMA)"] if both
                                    else [])], body)


def _figure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


@REPORTS.register("depth", doc="Figure 4: the metric against depth B, a line per latent "
                               "budget M, a panel per mixer")
def depth_report(rep: Report) -> None:
    done = rep.done
    depths = sorted({r["blocks"] for r in done if r["blocks"] is not None})
    if len(depths) < 2:
        return
    plt = _figure()
    panels = sorted({(r["mixer"], r["sdpa_scale"], r["precision"]) for r in done}, key=str)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4),
                             squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        mine = [r for r in done if (r["mixer"], r["sdpa_scale"], r["precision"]) == panel]
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


def precision_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


@REPORTS.register("precision", doc="Figure 7: 16-bit over FP32 metric per mixer and depth")
def precision_report(rep: Report) -> None:
    ratios = precision_ratios(rep.rows)
    if not ratios:
        return
    plt = _figure()
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


__all__ = ["Group", "REPORTS", "Report", "aggregate", "collect", "did_not_fit",
           "precision_ratios", "spread"]
