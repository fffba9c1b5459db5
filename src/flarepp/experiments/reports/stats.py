"""The plug-ins that say how sure a study is: ``selection``, ``paired`` and ``length``.

Both read a grid whose labels name a mixer (the config's), a ``seed`` and a data draw (the
``data_root`` axis: data generated with another seed); every other label is a *setting*
(``lr``, ``pct_start``, ``input_norm``, ...).

``selection`` chooses one setting for every mixer, on validation alone: per setting and
mixer the mean validation metric (``val_value``, the split carved from the training data by
``val_fraction``) over seeds and draws, then per setting the mean of those mixer means (no
mixer gets its own setting). The best such mean wins, among the settings every run of which
finished. The test metric is shown beside it and never enters the choice; without a
validation metric there is no choice, and the report says why.

``paired`` compares the values of one axis on equal terms -- the mixers by default, or any
label (``flarepp sweep report DIR --pair preset``, ``--pair model`` for wirings given as
whole models, ``--pair KEY=A,B`` for two values with A the reference, ``--against OTHER``
for the runs of two studies, labelled ``study``): per setting (the other labels, and the
mixer where it varies within a value of the compared axis), each value's mean ± sample std
of the test metric, then for each value B against A (FLARE by default for mixers, FLARE++
first; else the first value) the differences ``value(B) - value(A)`` of the runs that share
a seed and a draw, their mean, sample std, count and the 95% interval ``mean ± t(0.975, n -
1) std / sqrt(n)``. An interval that holds 0 is written out as "not significant at 95%".

``length`` shows the trend with training length where the grid has an ``epochs`` axis: per
setting (every other one), each mixer's test metric against epochs, mean ± sample std over
seeds and draws, raw and EMA weights where the runs stored both (figure ``length.png``).

A run that finished without fitting its training data (:func:`.reports.did_not_fit`) is
counted and kept in every mean; a run that failed (a non-finite loss) has no value, is
counted, and leaves its pair out.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from flarepp.experiments.engine import finite
from flarepp.experiments.reports.common import Report, figure_module, fmt, markdown, spread
from flarepp.experiments.reports.rows import Row, aggregate, csv_text
from flarepp.io import atomic_write_text

NOT_SETTINGS = ("mixer", "model.mixer", "model", "seed", "data_root")
"""Labels that are not settings: the mixer (``mixer`` is the config's; a ``model`` axis,
whole models as values, names the mixer or architecture too), the seed and the data draw."""

MIXER_ORDER = ("flare", "flarepp", "flarepp-simple")
"""Mixers in this order first: ``flare`` is the default reference A, ``flarepp`` the
first B."""


def settings_of(rep: Report) -> list[str]:
    """The study's setting labels: every label but the mixer, the seed and the draw."""
    return [k for k in rep.label_keys if k not in NOT_SETTINGS]


def mixers_in(rows: Sequence[Row], key: str = "mixer") -> list[Any]:
    """The rows' values of ``key`` (their mixers by default, :data:`MIXER_ORDER` first),
    then as first seen."""
    seen = list(dict.fromkeys(r.get(key) for r in rows))
    first = MIXER_ORDER if key == "mixer" else ()
    return [m for m in first if m in seen] + [m for m in seen if m not in first]


def _setting(row: Row, settings: Sequence[str]) -> tuple:
    return tuple(row.get(k) for k in settings)


def _stats(rows: Sequence[Row], value: str) -> tuple[float, float, int]:
    """``(mean, sample std, n)`` of ``value`` over the finished ``rows`` (one group)."""
    groups = aggregate(rows, [])
    return groups[0].stats(value) if groups else (math.nan, math.nan, 0)


def _count(rows: Sequence[Row], setting: tuple, settings: Sequence[str],
           mixer: Any = None, key: str = "mixer") -> dict[str, int]:
    """Runs of ``setting`` (and of ``mixer``, the value of ``key``): all, finished, failed,
    not fitted."""
    mine = [r for r in rows if _setting(r, settings) == setting
            and (mixer is None or r.get(key) == mixer)]
    return {"runs": len(mine), "done": sum(r.status == "done" for r in mine),
            "failed": sum(r.status == "failed" for r in mine),
            "did_not_fit": sum(r.did_not_fit is True for r in mine)}


# ---------------------------------------------------------------------------------------------
# selection


def choose_setting(rows: Sequence[Row], settings: Sequence[str],
                   value: str = "val_value") -> dict[str, Any]:
    """The setting with the best mean over mixers of each mixer's mean ``value`` (over seeds
    and draws), among the settings whose every run finished with a finite ``value`` for
    every mixer. ``{"chosen": setting or None, "scores": {setting: mean over mixers or
    NaN}, "cells": {(setting, mixer): (mean, std, n)}, "why_not": {setting: reason}}``."""
    mixers = mixers_in(rows)
    lower = all(r.lower_is_better for r in rows)
    cells = {(tuple(g.key[k] for k in settings), g.key["mixer"]): g.stats(value)
             for g in aggregate(rows, [*settings, "mixer"])}
    scores, why_not = {}, {}
    for setting in dict.fromkeys(_setting(r, settings) for r in rows):
        count = _count(rows, setting, settings)
        means = [cells.get((setting, m), (math.nan, math.nan, 0)) for m in mixers]
        scores[setting] = (float(np.mean([c[0] for c in means]))
                           if all(c[2] for c in means) else math.nan)
        have = sum(c[2] for c in means)
        missing = [m for m, c in zip(mixers, means) if not c[2]]
        if count["failed"]:
            why_not[setting] = f"{count['failed']} of its {count['runs']} runs failed"
        elif have < count["runs"]:
            why_not[setting] = f"{count['runs'] - have} of its {count['runs']} runs have no value"
        elif missing:
            why_not[setting] = f"no run of {', '.join(missing)}"
    eligible = {s: v for s, v in scores.items() if s not in why_not and math.isfinite(v)}
    best = (min if lower else max)(eligible, key=eligible.get) if eligible else None
    # A study still running chooses nothing: a setting not yet trained could win.
    pending = sum(1 for r in rows if r.status == "pending")
    return {"chosen": None if pending else best, "best_so_far": best, "pending": pending,
            "scores": scores, "cells": cells, "why_not": why_not, "mixers": mixers}


def _describe(setting: tuple, settings: Sequence[str]) -> str:
    return ", ".join(f"`{k}` = {v}" for k, v in zip(settings, setting)) or "the one setting"


def selection_report(rep: Report) -> None:
    """A setting chosen on the validation split (module docstring)."""
    settings = settings_of(rep)
    rows = rep.rows
    if not settings or len({_setting(r, settings) for r in rows}) < 2:
        return
    metric = rep.metric_name()
    rep.lines += ["", "## A setting chosen on validation", ""]
    if not any(r.status == "done" for r in rows):
        rep.lines += [f"No choice yet: none of the {len(rows)} runs has finished."]
        return
    if not any(finite(r.val_value) for r in rows):
        rep.lines += [f"No choice: no run has a validation metric (`val_{metric}`), and the "
                      "test metric is never used to choose. Sweep with `--set val_fraction=F` "
                      "to hold a share F of the training data out for validation."]
        return
    result = choose_setting(rows, settings)
    mixers, chosen = result["mixers"], result["chosen"]
    body, table = [], [[*settings, "mixer", "val_mean", "val_std", "runs_with_val",
                        "test_mean", "test_std", "did_not_fit", "failed", "chosen"]]
    for setting in result["scores"]:
        for mixer in mixers:
            val = result["cells"].get((setting, mixer), (math.nan, math.nan, 0))
            test = _stats([r for r in rows if r.get("mixer") == mixer
                           and _setting(r, settings) == setting], "value")
            count = _count(rows, setting, settings, mixer)
            mark = "**chosen**" if setting == chosen else ""
            body.append([*setting, mixer, f"{spread(*val[:2])} ({val[2]})",
                         spread(*test[:2]), count["did_not_fit"], count["failed"], mark])
            table.append([*setting, mixer, val[0], val[1], val[2], test[0], test[1],
                          count["did_not_fit"], count["failed"], int(setting == chosen)])
    rep.lines += [f"Validation `val_{metric}` (the share `val_fraction` of the training data "
                  "held out; the same samples in every run on a draw) of the weights each run "
                  "names: mean ± sample std over seeds and data draws (runs). The test "
                  f"`{metric}` is shown and never used to choose. Runs that did not fit their "
                  "training data (training metric no better than the best constant "
                  "predictor's) are counted and kept in the means; failed runs have no "
                  "value.", ""]
    rep.lines += markdown([*settings, "mixer", "val (runs)", "test", "did not fit",
                           "failed", ""], body)
    rep.lines += ["", f"Mean over the {len(mixers)} mixers ({', '.join(mixers)}) of each "
                      "mixer's mean validation metric:", ""]
    rep.lines += markdown([*settings, "mean over mixers", "eligible"], [
        [*s, fmt(v), "chosen" if s == chosen else result["why_not"].get(s, "yes")]
        for s, v in result["scores"].items()])
    if chosen is None and result["pending"]:
        so_far = result["best_so_far"]
        rep.lines += ["", f"No choice yet: {result['pending']} run(s) of the study are still "
                          "pending, and a setting not yet trained could win"
                      + (f" (the best complete setting so far: {_describe(so_far, settings)})."
                         if so_far is not None else ".")]
    elif chosen is None:
        rep.lines += ["", "No choice: no setting has every run finished with a validation "
                          "metric for every mixer."]
    else:
        rep.lines += ["", f"Chosen: {_describe(chosen, settings)} (mean validation "
                          f"{fmt(result['scores'][chosen])} over the mixers)."]
    rep.paths["selection"] = rep.out_dir / "selection.csv"
    atomic_write_text(rep.paths["selection"], csv_text(table))


# ---------------------------------------------------------------------------------------------
# paired differences


def paired_differences(rows: Sequence[Row], a: Any, b: Any, value: str = "value",
                       key: str = "mixer") -> np.ndarray:
    """``value(b) - value(a)`` of the finished runs whose ``key`` (the mixer by default, any
    label: a preset, a wiring, a study) is ``b`` and ``a`` and that share a seed and a data
    draw, in the order of ``b``'s runs."""
    def by_pair(arm: Any) -> dict[tuple, float]:
        return {(r.get("seed"), r.get("data_root")): r.get(value) for r in rows
                if r.get(key) == arm and r.status == "done" and finite(r.get(value))}
    first, second = by_pair(a), by_pair(b)
    return np.asarray([v - first[k] for k, v in second.items() if k in first], float)


def interval(diffs: np.ndarray, level: float = 0.95) -> dict[str, float]:
    """Mean, sample std, count and the two-sided t interval of the mean at ``level``:
    ``mean ± t((1 + level) / 2, n - 1) std / sqrt(n)`` (NaN ends for fewer than 2)."""
    from scipy import stats
    n = len(diffs)
    mean = float(diffs.mean()) if n else math.nan
    std = float(diffs.std(ddof=1)) if n > 1 else math.nan
    half = (float(stats.t.ppf((1 + level) / 2, n - 1)) * std / math.sqrt(n) if n > 1
            else math.nan)
    return {"mean": mean, "std": std, "n": n, "low": mean - half, "high": mean + half}


def verdict(stats: dict[str, float], a: str, b: str, lower_is_better: bool = True) -> str:
    """A plain sentence on whether ``b - a`` differs from 0 at 95%."""
    if stats["n"] < 2:
        return "too few pairs for an interval"
    if stats["low"] <= 0.0 <= stats["high"]:
        return "not significant at 95%"
    better = (stats["mean"] < 0) == lower_is_better
    return f"{b} {'better' if better else 'worse'} than {a} at 95%"


PAIR = "pair"
"""The report option (:attr:`Report.options`) naming the axis ``paired`` compares:
``(key, values or None)``; without it, the mixers."""


def _pairing(rep: Report) -> tuple[str, list[str], dict[tuple, list[Row]], list[tuple]]:
    """The compared key, the setting keys (every other label, and the mixer where it varies
    within a value of another compared key: not where a preset chooses it), the rows per
    setting, and ``(setting, A, B)`` per comparison."""
    key, chosen = rep.options.get(PAIR) or ("mixer", None)
    mixers: dict[Any, set] = {}
    for r in rep.rows:
        mixers.setdefault(r.get(key), set()).add(r.get("mixer"))
    by_mixer = key != "mixer" and any(len(m) > 1 for m in mixers.values())
    settings = [k for k in ["mixer"] * by_mixer + settings_of(rep) if k != key]
    groups: dict[tuple, list[Row]] = {}
    for r in rep.rows:
        if chosen is None or str(r.get(key)) in chosen:
            groups.setdefault(_setting(r, settings), []).append(r)
    comparisons = []
    for setting, mine in groups.items():
        arms = mixers_in(mine, key)
        if chosen is not None:
            arms = sorted(arms, key=lambda arm: chosen.index(str(arm)))
        if len(arms) < 2:
            continue
        a = "flare" if key == "mixer" and chosen is None and "flare" in arms else arms[0]
        comparisons += [(setting, a, b) for b in arms if b != a]
    return key, settings, groups, comparisons


def paired_report(rep: Report) -> None:
    """Per value mean ± std; paired differences of the compared axis (module docstring)."""
    key, settings, groups, comparisons = _pairing(rep)
    if not comparisons:
        return
    rows = [r for mine in groups.values() for r in mine]
    draws = len({r.get("data_root") for r in rows})
    seeds = len({r.get("seed") for r in rows})
    title = "Mixers" if key == "mixer" else f"Values of `{key}`"
    rep.lines += ["", f"## {title} compared, paired by seed and data draw", "",
                  f"Test `{rep.metric_name()}` of the weights each run names, over {seeds} "
                  f"seed(s) x {draws} data draw(s): mean ± sample std of the finished runs. "
                  "Runs that did not fit their training data (training metric no better than "
                  "the best constant predictor's) are counted and kept in the means; failed "
                  "runs (non-finite loss) are counted and have no value.", ""]
    _paired_means(rep, groups, settings, key)
    _paired_differences(rep, comparisons, groups, settings, key)


def _paired_means(rep: Report, groups: dict[tuple, list[Row]], settings: list[str],
                  key: str) -> None:
    """Each value's test and train mean ± std per setting; the runs not fitted or failed."""
    body = []
    for setting, mine in groups.items():
        for arm in mixers_in(mine, key):
            runs = [r for r in mine if r.get(key) == arm]
            test, train = _stats(runs, "value"), _stats(runs, "train_value")
            count = _count(mine, setting, settings, arm, key)
            body.append([*setting, arm, f"{count['done']}/{count['runs']}",
                         spread(*test[:2]), spread(*train[:2]), count["did_not_fit"],
                         count["failed"]])
    rep.lines += markdown([*settings, key, "finished", "test", "train", "did not fit",
                           "failed"], body)
    rows = [r for mine in groups.values() for r in mine]
    for what, names in (("did not fit their training data", [
            r.point for r in rows if r.did_not_fit is True]),
                        ("failed", [r.point for r in rows if r.status == "failed"])):
        if names:
            rep.lines += ["", f"{len(names)} of {len(rows)} runs {what}: {', '.join(names)}."]


def _paired_differences(rep: Report, comparisons: list[tuple], groups: dict[tuple, list[Row]],
                        settings: list[str], key: str) -> None:
    """The table of ``B - A`` per comparison with its interval and verdict, its CSV, and a
    sentence for each difference not significant at 95%."""
    metric = rep.metric_name()
    lower = all(r.lower_is_better for mine in groups.values() for r in mine)
    rep.lines += ["", f"Paired differences `{metric}`(B) - `{metric}`(A) over the (seed, "
                      "draw) pairs where both finished; 95% interval "
                      "mean ± t(0.975, n - 1) std / sqrt(n).", ""]
    body, table, sentences = [], [[*settings, "A", "B", "pairs", "mean", "std", "low",
                                    "high", "verdict"]], []
    for setting, a, b in comparisons:
        stats = interval(paired_differences(groups[setting], a, b, key=key))
        said = verdict(stats, a, b, lower)
        body.append([*setting, f"{b} - {a}", stats["n"], fmt(stats["mean"]),
                     fmt(stats["std"]), f"[{fmt(stats['low'])}, {fmt(stats['high'])}]",
                     said])
        table.append([*setting, a, b, stats["n"], stats["mean"], stats["std"], stats["low"],
                      stats["high"], said])
        where = f" ({_describe(setting, settings)})" if settings else ""
        if said == "not significant at 95%":
            sentences.append(f"- {b} - {a}{where}: the difference is not significant at 95% "
                             f"(interval [{fmt(stats['low'])}, {fmt(stats['high'])}] holds 0, "
                             f"{stats['n']} pairs).")
    rep.lines += markdown([*settings, "B - A", "pairs", "mean", "std", "95% interval",
                           "verdict"], body)
    if sentences:
        rep.lines += [""] + sentences
    rep.paths["paired"] = rep.out_dir / rep.options.get("paired_file", "paired.csv")
    atomic_write_text(rep.paths["paired"], csv_text(table))


# ---------------------------------------------------------------------------------------------
# training length


LENGTH = "epochs"
"""The grid axis the ``length`` plug-in plots against."""


def length_report(rep: Report) -> None:
    """The metric against training length (module docstring)."""
    if LENGTH not in rep.label_keys:
        return
    done = rep.done
    lengths = sorted({int(r.get(LENGTH)) for r in done if finite(r.get(LENGTH))})
    if len(lengths) < 2:
        return
    panel_keys = [k for k in settings_of(rep) if k != LENGTH]
    panels: dict[tuple, list[Row]] = {}
    for r in rep.rows:
        panels.setdefault(_setting(r, panel_keys), []).append(r)
    body, table = _length_figure(rep, panels, panel_keys, lengths)
    metric = rep.metric_name()
    rep.paths["length_csv"] = rep.out_dir / "length.csv"
    atomic_write_text(rep.paths["length_csv"], csv_text(table))
    rep.lines += ["", "## The metric against training length", "",
                  f"Test `{metric}`: mean ± sample std over seeds and data draws of the finished "
                  "runs at each length (each a whole one-cycle schedule of that many epochs; "
                  "the headline of the weights each run names, then the raw and the EMA "
                  "weights where stored). Runs that did not fit their training data are counted "
                  "and kept.", ""]
    rep.lines += markdown([*panel_keys, "mixer", LENGTH, "finished", "test", "raw", "EMA",
                           "did not fit", "failed"], body)
    rep.lines += ["", f"![test {metric} against epochs]({rep.paths['length'].name})"]


def _length_figure(rep: Report, panels: dict[tuple, list[Row]], panel_keys: list[str],
                   lengths: list[int]) -> tuple[list[list[Any]], list[list[Any]]]:
    """``length.png``, a panel per setting of the other labels: each mixer's test metric
    against epochs, raw and EMA where the runs stored both; returns the Markdown and CSV
    rows of every (panel, mixer, length)."""
    both = any(finite(r.value_raw) and finite(r.value_ema) for r in rep.done)
    curves = [("value_raw", "raw", "-"), ("value_ema", "EMA", "--")] if both else \
        [("value", "", "-")]
    body, table = [], [[*panel_keys, "mixer", LENGTH, "runs", "finished", "test_mean",
                        "test_std", "raw_mean", "raw_std", "ema_mean", "ema_std",
                        "did_not_fit", "failed"]]
    plt = figure_module()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False,
                             sharey=True)
    for ax, (panel, mine) in zip(axes[0], panels.items()):
        names = mixers_in(mine)
        for i, mixer in enumerate(names):
            runs = [r for r in mine if r.get("mixer") == mixer]
            nudge = 2 ** (0.04 * (i - (len(names) - 1) / 2))  # error bars side by side
            for field_, what, style in curves:
                pts = [(n, *_stats([r for r in runs if r.get(LENGTH) == n], field_))
                       for n in lengths]
                pts = [p for p in pts if p[3]]
                if pts:
                    n, mean, std, _ = zip(*pts)
                    ax.errorbar([x * nudge for x in n], mean,
                                yerr=[0.0 if math.isnan(s) else s for s in std],
                                color=f"C{i}", linestyle=style, marker="o", capsize=3,
                                label=f"{mixer} {what}".strip())
            _length_rows(runs, panel, mixer, lengths, body, table)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("epochs")
        ax.set_title(_describe(panel, panel_keys).replace("`", "") if panel_keys else "",
                     fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"test {rep.metric_name()}")
    fig.tight_layout()
    rep.paths["length"] = rep.out_dir / "length.png"
    fig.savefig(rep.paths["length"], dpi=120)
    plt.close(fig)
    return body, table


def _length_rows(runs: list[Row], panel: tuple, mixer: str, lengths: list[int],
                 body: list[list[Any]], table: list[list[Any]]) -> None:
    """A Markdown and a CSV row per length of one mixer's ``runs``."""
    for n in lengths:
        at = [r for r in runs if r.get(LENGTH) == n]
        test, raw, ema = (_stats(at, f) for f in ("value", "value_raw", "value_ema"))
        failed = sum(r.status == "failed" for r in at)
        unfit = sum(r.did_not_fit is True for r in at)
        body.append([*panel, mixer, n, f"{test[2]}/{len(at)}", spread(*test[:2]),
                     spread(*raw[:2]), spread(*ema[:2]), unfit, failed])
        table.append([*panel, mixer, n, len(at), test[2], test[0], test[1], raw[0],
                      raw[1], ema[0], ema[1], unfit, failed])


__all__ = ["LENGTH", "NOT_SETTINGS", "PAIR", "choose_setting", "interval", "paired_differences",
           "length_report", "paired_report", "selection_report", "settings_of", "verdict"]
