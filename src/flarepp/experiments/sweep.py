"""Grids of runs over any config keys, and the paper's studies drawn from them.

``flarepp sweep PRESET --grid model.mixer=flare,flarepp model.blocks=2,4,8 seed=0,1,2
--out DIR`` trains one run of the :class:`~flarepp.train.Trainer` per point of the grid
(the Cartesian product of the axes, each value given as a ``--set`` value), each in its own
directory ``DIR/runs/<point>``. The sweep is safe to interrupt and to share:

* a finished point (``metrics.json``, or ``failed.json`` for a run that diverged) is never
  redone; a half-finished one resumes from its newest checkpoint;
* several processes may work on one ``DIR`` (``flarepp sweep --out DIR`` joins a sweep
  already described there): a process claims a point by an exclusive lock on
  ``DIR/claims/<point>/.lock`` (:class:`flarepp.train.rundir.RunLock`, released by the
  kernel however the process ends), so no point is trained by two processes, and a killed
  process's point is taken over by the next one that reaches it;
* ``DIR/events.jsonl`` records who started, resumed, finished or failed which point.

``flarepp sweep report DIR`` (:func:`write_report`) writes ``results.csv`` (one line per
point), ``report.md`` and, where the grid has the axes for them, the paper's studies:

* Figure 4: test error against depth B, one line per latent budget M, a panel per mixer
  (``fig4_depth_latents.png``);
* Figure 7 (Sec. D.2): FP16 (or BF16) over FP32 test error per mixer and depth
  (``fig7_precision_ratio.png``);
* Table 11 (Sec. D.1): mean and sample standard deviation over seeds of the train and test
  errors of every other combination.

Every table states the SDPA scale each run's mixer used (``sdpa_scale``; the config key
``attn_scale`` may say ``reference``).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from flarepp.io import atomic_write_json, atomic_write_text
from flarepp.train.config import RunConfig, apply_overrides

SPEC_NAME = "sweep.json"
EVENTS_NAME = "events.jsonl"


# ---------------------------------------------------------------------------------------------
# the grid

def split_values(text: str) -> list[str]:
    """``"flare,flarepp"`` -> ``["flare", "flarepp"]``; commas inside brackets or quotes
    belong to one value (``"[none,standard],standard"`` is two values)."""
    values, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(text[start:i].strip())
            start = i + 1
    values.append(text[start:].strip())
    if any(not v for v in values):
        raise ValueError(f"--grid: empty value in {text!r}")
    return values


def parse_axes(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["seed=0,1", "model.blocks=2,4"]`` -> ``[("seed", ["0", "1"]), ...]``."""
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        if "=" not in item:
            raise ValueError(f"--grid expects KEY=V1,V2,..., got {item!r}")
        key, text = item.split("=", 1)
        key = key.strip()
        if key in (k for k, _ in axes):
            raise ValueError(f"--grid: key {key!r} given twice")
        values = split_values(text)
        if len(set(values)) != len(values):
            raise ValueError(f"--grid {key}: repeated value in {values}")
        axes.append((key, values))
    return axes


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", ".", text).strip(".") or "_"


@dataclass(frozen=True)
class Point:
    """One grid point: its ``--set`` items and its directory name."""

    name: str
    values: tuple[tuple[str, str], ...]

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values]


def grid_points(axes: list[tuple[str, list[str]]]) -> list[Point]:
    """Every point of the Cartesian product of ``axes``, first axis slowest."""
    short = [k.rsplit(".", 1)[-1] for k, _ in axes]
    labels = [s if short.count(s) == 1 else k.replace(".", "-")
              for s, (k, _) in zip(short, axes)]
    points = []
    for combo in itertools.product(*(values for _, values in axes)):
        name = "_".join(f"{label}-{_slug(v)}" for label, v in zip(labels, combo)) or "base"
        points.append(Point(name, tuple(zip((k for k, _ in axes), combo))))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        points = [Point(f"{i:04d}_{p.name}", p.values) for i, p in enumerate(points)]
    return points


@dataclass
class SweepSpec:
    """What a sweep directory holds: the base config, the axes and the data."""

    base: RunConfig
    axes: list[tuple[str, list[str]]]
    data_root: str

    def points(self) -> list[Point]:
        return grid_points(self.axes)

    def config(self, point: Point) -> RunConfig:
        return apply_overrides(self.base, point.overrides)

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base.to_dict(), "axes": [[k, list(v)] for k, v in self.axes],
                "data_root": self.data_root}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SweepSpec":
        return cls(RunConfig.from_dict(d["base"]), [(k, list(v)) for k, v in d["axes"]],
                   d["data_root"])

    def check(self) -> None:
        """Every point's config is valid (before anything is trained)."""
        for point in self.points():
            self.config(point)


def open_sweep(out_dir: str | Path, spec: SweepSpec | None) -> SweepSpec:
    """The sweep of ``out_dir``: ``spec`` written there if new, the stored one if ``spec``
    is None; a ``spec`` that differs from the stored one is an error."""
    path = Path(out_dir) / SPEC_NAME
    stored = json.loads(path.read_text()) if path.exists() else None
    if spec is None:
        if stored is None:
            raise FileNotFoundError(f"{str(path)!r} does not exist: start the sweep with a "
                                    "preset and --grid")
        return SweepSpec.from_dict(stored)
    spec.check()
    mine = json.loads(json.dumps(spec.to_dict()))
    if stored is not None:  # as this version reads it (a field added since takes its default)
        stored = json.loads(json.dumps(SweepSpec.from_dict(stored).to_dict()))
    if stored is not None and stored != mine:
        changed = sorted(k for k in mine if mine[k] != stored.get(k))
        raise ValueError(f"{str(out_dir)!r} holds another sweep (its {', '.join(changed)} "
                         f"differ); continue it with `flarepp sweep --out {out_dir}` or "
                         "choose another --out")
    if stored is None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, mine)
    return spec


# ---------------------------------------------------------------------------------------------
# running

def run_dir(out_dir: Path, point: Point) -> Path:
    return out_dir / "runs" / point.name


def point_done(out_dir: Path, point: Point) -> bool:
    d = run_dir(out_dir, point)
    return (d / "metrics.json").exists() or (d / "failed.json").exists()


def record_event(out_dir: Path, point: Point, event: str, **extra: Any) -> None:
    record = {"point": point.name, "event": event, "pid": os.getpid(),
              "host": socket.gethostname(), "time": time.time(), **extra}
    fd = os.open(out_dir / EVENTS_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def claimed_points(out_dir: Path, points: list[Point], complete: Callable[[Point], bool],
                   skipped: list[str]) -> Iterator[tuple[int, Point]]:
    """``(i, point)`` for each point not ``complete`` whose claim this process takes.

    The claim (a :class:`~flarepp.train.rundir.RunLock` under ``out_dir/claims``) is held
    while the caller works on the point and released when the caller asks for the next
    one; a point held by another process is appended to ``skipped``. ``complete`` is
    checked again once claimed: another process may have finished the point in between."""
    from flarepp.train.rundir import RunLock, RunLocked
    for i, point in enumerate(points):
        if complete(point):
            continue
        claim = RunLock(out_dir / "claims" / point.name)
        try:
            claim.acquire()
        except RunLocked:
            skipped.append(point.name)
            continue
        try:
            if not complete(point):
                yield i, point
        finally:
            claim.release()


def train_point(config: Any, out_dir: Path, point: Point, data_root: Any, splits: Any,
                tag: str, done: dict[str, list[str]],
                log: Callable[[str], None]) -> dict[str, Any] | None:
    """Train (or resume) one claimed point into its run directory; a run that fails
    numerically gets ``failed.json`` and an event, and None is returned."""
    from flarepp.train import Trainer, latest_checkpoint
    directory = run_dir(out_dir, point)
    resume = latest_checkpoint(directory) is not None
    record_event(out_dir, point, "resume" if resume else "start")
    log(f"{tag}: {'resuming' if resume else 'training'} into {directory}")
    try:
        return Trainer(config, directory, data_root=data_root, resume=resume,
                       progress=False, splits=splits).fit()
    except (FloatingPointError, RuntimeError, ValueError) as err:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_json(directory / "failed.json", {"error": str(err),
                                                      "type": type(err).__name__})
        record_event(out_dir, point, "fail", error=str(err))
        done["failed"].append(point.name)
        log(f"{tag}: failed: {err}")
        return None


def run_sweep(spec: SweepSpec, out_dir: str | Path, *,
              log: Callable[[str], None] = print) -> dict[str, list[str]]:
    """Train every unclaimed, unfinished point of ``spec`` into ``out_dir``.

    Returns ``{"finished", "failed", "skipped"}`` point names of this process (``skipped``:
    held by another process when this one reached them)."""
    from flarepp.data import load_dataset
    out_dir = Path(out_dir)
    points = spec.points()
    splits_cache: dict[str, Any] = {}
    done: dict[str, list[str]] = {"finished": [], "failed": [], "skipped": []}
    for i, point in claimed_points(out_dir, points, lambda p: point_done(out_dir, p),
                                   done["skipped"]):
        config = spec.config(point)
        key = json.dumps([config.dataset, config.dataset_options, spec.data_root])
        if key not in splits_cache:
            splits_cache[key] = load_dataset(config.dataset, spec.data_root,
                                             **config.dataset_options)
        tag = f"[{i + 1}/{len(points)}] {point.name}"
        metrics = train_point(config, out_dir, point, spec.data_root, splits_cache[key], tag,
                              done, log)
        if metrics is None:
            continue
        record_event(out_dir, point, "finish", test_rel_l2=metrics.get("test_rel_l2"))
        done["finished"].append(point.name)
        log(f"{tag}: test rel L2 {100 * metrics['test_rel_l2']:.3f}%")
    return done


# ---------------------------------------------------------------------------------------------
# the report

RESULT_FIELDS = ["point", "status", "mixer", "blocks", "latents", "precision", "seed",
                 "sdpa_scale", "test_rel_l2", "train_rel_l2", "params", "seconds", "epochs"]


def collect_results(out_dir: str | Path) -> tuple[SweepSpec, list[dict[str, Any]]]:
    """One row per grid point: its axis values, effective settings and metrics (``status``
    ``done``, ``failed`` or ``pending``)."""
    out_dir = Path(out_dir)
    spec = open_sweep(out_dir, None)
    rows = []
    for point in spec.points():
        config = spec.config(point)
        model = config.model_kwargs()
        row: dict[str, Any] = {
            "point": point.name, **dict(point.values),
            "mixer": model.get("mixer", model.get("arch", "surrogate")),
            "blocks": model.get("blocks"), "latents": model.get("latents"),
            "precision": config.precision, "seed": config.seed,
            "sdpa_scale": config.sdpa_scale_text()}
        directory = run_dir(out_dir, point)
        if (directory / "metrics.json").exists():
            metrics = json.loads((directory / "metrics.json").read_text())
            row.update(status="done", **{k: metrics.get(k) for k in (
                "test_rel_l2", "train_rel_l2", "params", "seconds", "epochs")})
        elif (directory / "failed.json").exists():
            row["status"] = "failed"
        else:
            row["status"] = "pending"
        rows.append(row)
    return spec, rows


def _mean_std(values: list[float]) -> tuple[float, float]:
    arr = np.asarray(values, float)
    return float(arr.mean()), (float(arr.std(ddof=1)) if len(arr) > 1 else math.nan)


def _pct(mean: float, std: float) -> str:
    return f"{100 * mean:.2f}" if math.isnan(std) else f"{100 * mean:.2f} ± {100 * std:.2f}"


def seed_table(rows: list[dict[str, Any]], axes: list[str]) -> list[dict[str, Any]]:
    """Table 11: per combination of the axes other than ``seed``, the mean and sample
    standard deviation over seeds of the train and test errors."""
    keys = [k for k in axes if k != "seed"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == "done":
            groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    table = []
    for combo, runs in groups.items():
        test, train = (_mean_std([r[m] for r in runs]) for m in ("test_rel_l2", "train_rel_l2"))
        table.append({**dict(zip(keys, combo)), "mixer": runs[0]["mixer"],
                      "sdpa_scale": runs[0]["sdpa_scale"], "seeds": len(runs),
                      "test_mean": test[0], "test_std": test[1],
                      "train_mean": train[0], "train_std": train[1]})
    return table


def _varying(rows: list[dict[str, Any]], key: str) -> list:
    return sorted({r[key] for r in rows if r.get(key) is not None}, key=str)


def depth_figure(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Figure 4: mean test error (over seeds and other axes) against depth B, one line per
    latent budget M, a panel per mixer (and SDPA scale); ``None`` without two depths."""
    done = [r for r in rows if r["status"] == "done"]
    if len(_varying(done, "blocks")) < 2:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["mixer"], r["sdpa_scale"], r["precision"]) for r in done}, key=str)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False,
                             sharey=True)
    for ax, (mixer, scale, precision) in zip(axes[0], panels):
        mine = [r for r in done if (r["mixer"], r["sdpa_scale"], r["precision"])
                == (mixer, scale, precision)]
        for latents in _varying(mine, "latents"):
            pts = []
            for blocks in sorted(_varying(mine, "blocks")):
                errs = [r["test_rel_l2"] for r in mine
                        if r["blocks"] == blocks and r["latents"] == latents]
                if errs:
                    mean, std = _mean_std(errs)
                    pts.append((blocks, 100 * mean, 0.0 if math.isnan(std) else 100 * std))
            if pts:
                b, m, s = zip(*pts)
                ax.errorbar(b, m, yerr=s, marker="o", capsize=3, label=f"M = {latents}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(_varying(mine, "blocks")))
        ax.set_xticklabels([str(b) for b in sorted(_varying(mine, "blocks"))])
        ax.set_xlabel("blocks B")
        ax.set_title(f"{mixer} (scale {scale}, {precision})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("test relative L2 error (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def precision_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Figure 7's numbers: per mixer, depth, latents and scale, mean 16-bit test error over
    mean FP32 test error (means over seeds)."""
    done = [r for r in rows if r["status"] == "done"]
    groups: dict[tuple, dict[str, list[float]]] = {}
    for r in done:
        key = (r["mixer"], r["sdpa_scale"], r["blocks"], r["latents"])
        groups.setdefault(key, {}).setdefault(r["precision"], []).append(r["test_rel_l2"])
    out = []
    for (mixer, scale, blocks, latents), by_precision in sorted(groups.items(), key=str):
        if "fp32" not in by_precision:
            continue
        fp32 = float(np.mean(by_precision["fp32"]))
        for precision in ("fp16", "bf16"):
            if precision in by_precision:
                out.append({"mixer": mixer, "sdpa_scale": scale, "blocks": blocks,
                            "latents": latents, "precision": precision,
                            "ratio": float(np.mean(by_precision[precision])) / fp32})
    return out


def precision_figure(ratios: list[dict[str, Any]], path: Path) -> Path | None:
    """Figure 7: the 16-bit / FP32 test-error ratio against depth, one line per mixer."""
    if not ratios:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.0, 3.4))
    lines = sorted({(r["mixer"], r["sdpa_scale"], r["latents"], r["precision"])
                    for r in ratios}, key=str)
    for mixer, scale, latents, precision in lines:
        pts = sorted((r["blocks"], r["ratio"]) for r in ratios
                     if (r["mixer"], r["sdpa_scale"], r["latents"], r["precision"])
                     == (mixer, scale, latents, precision))
        b, v = zip(*pts)
        ax.plot(b, v, marker="o", label=f"{mixer} M={latents} {precision} (scale {scale})")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("blocks B")
    ax.set_ylabel("16-bit / FP32 test error")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _markdown(header: list[str], body: list[list[Any]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in body])


def write_report(out_dir: str | Path) -> dict[str, Path]:
    """``results.csv``, ``report.md`` and the figures of the sweep in ``out_dir``."""
    out_dir = Path(out_dir)
    spec, rows = collect_results(out_dir)
    axes = [k for k, _ in spec.axes]
    paths = {"csv": out_dir / "results.csv", "markdown": out_dir / "report.md"}
    fields = ["point"] + [k for k in axes if k not in RESULT_FIELDS] + RESULT_FIELDS[1:]
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "pending")}
    lines = [f"# Sweep {out_dir.name}", "",
             f"Preset `{spec.base.name}` on `{spec.data_root}`; grid: "
             + ", ".join(f"`{k}` = {', '.join(v)}" for k, v in spec.axes) + ".",
             f"Points: {len(rows)} ({counts['done']} done, {counts['failed']} failed, "
             f"{counts['pending']} pending). Errors are test (train) relative L2 in %; "
             "`sdpa_scale` is the SDPA scale each run's mixer used (config `attn_scale`).", "",
             "## Every run", ""]
    body = [[r["point"], r["mixer"], r["sdpa_scale"], r["status"],
             "-" if r.get("test_rel_l2") is None else f"{100 * r['test_rel_l2']:.3f}",
             "-" if r.get("train_rel_l2") is None else f"{100 * r['train_rel_l2']:.3f}",
             r.get("params") or "-"] for r in rows]
    lines += _markdown(["point", "mixer", "sdpa_scale", "status", "test %", "train %",
                        "params"], body)
    if "seed" in axes:
        table = seed_table(rows, axes)
        keys = [k for k in axes if k != "seed"]
        lines += ["", "## Over seeds (Table 11)", "",
                  "Mean ± sample standard deviation over seeds.", ""]
        lines += _markdown(keys + ["sdpa_scale", "seeds", "test %", "train %"],
                           [[t[k] for k in keys] + [t["sdpa_scale"], t["seeds"],
                                                    _pct(t["test_mean"], t["test_std"]),
                                                    _pct(t["train_mean"], t["train_std"])]
                            for t in table])
    figure = depth_figure(rows, out_dir / "fig4_depth_latents.png")
    if figure is not None:
        paths["figure4"] = figure
        lines += ["", "## Error against depth per latent budget (Figure 4)", "",
                  f"![Figure 4]({figure.name})"]
    ratios = precision_ratios(rows)
    figure = precision_figure(ratios, out_dir / "fig7_precision_ratio.png")
    if figure is not None:
        paths["figure7"] = figure
        lines += ["", "## 16-bit over FP32 test error (Figure 7)", ""]
        lines += _markdown(["mixer", "sdpa_scale", "blocks", "latents", "precision", "ratio"],
                           [[r["mixer"], r["sdpa_scale"], r["blocks"], r["latents"],
                             r["precision"], f"{r['ratio']:.3f}"] for r in ratios])
        lines += ["", f"![Figure 7]({figure.name})"]
    atomic_write_text(paths["markdown"], "\n".join(lines) + "\n")
    return paths


__all__ = ["Point", "SweepSpec", "collect_results", "grid_points", "open_sweep",
           "parse_axes", "precision_ratios", "run_sweep", "seed_table", "split_values",
           "write_report"]
