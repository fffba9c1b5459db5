"""Tables and figures of docs/extensions.md from the runs of the extension scripts.

Reads ``runs/extensions/{lm,rollout,bench,rank}`` (the studies of ``flarepp sweep lm-tiny
--grid preset=lm-tiny,lm-tiny-attention,lm-tiny-flarepp seed=0,1,2 --out
runs/extensions/lm`` and ``flarepp sweep rollout-tiny --grid preset=rollout-tiny,
rollout-tiny-concat,rollout-tiny-adaln seed=0,1,2 --out runs/extensions/rollout``, then
``flarepp bench generate --json runs/extensions/bench/generate.json`` and
``flarepp sweep darcy-tiny --data DATA --set model.mixer=flare --grid
latent_schedule="'16','64','16,32@5,64@10'" seed=0,1,2 --out runs/extensions/rank``),
prints Markdown tables and writes
``docs/figures/rollout_error_by_step.png`` and ``docs/figures/rank_growth.png``.

    .venv/bin/python scripts/extensions_report.py [--runs runs/extensions] [--figures docs/figures]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

LM = {"lm-tiny": "flare-causal", "lm-tiny-flarepp": "flarepp-causal",
      "lm-tiny-attention": "attention-causal"}
ROLLOUT = {"rollout-tiny": "Cross FLARE", "rollout-tiny-concat": "concat inputs",
           "rollout-tiny-adaln": "AdaLN-Zero"}


def _runs(folder: Path, preset: str | None) -> list[Path]:
    """The finished runs of ``preset`` in the study of ``folder`` (seed order)."""
    from flarepp.experiments.engine import run_dir
    from flarepp.experiments.reports import collect
    if not (folder / "study.json").is_file():
        return []
    _, rows = collect(folder)
    return [run_dir(folder, r["point"]) for r in rows
            if r["status"] == "done" and preset in (None, r.get("preset"))]


def _mean_std(values: list[float], digits: int = 3) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (1 seed)"
    return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def lm_table(folder: Path) -> str:
    rows = ["| mixer | params | held-out bits/byte, per seed | mean ± std | train bits/byte "
            "| training s/run |", "|---|---|---|---|---|---|"]
    for preset, mixer in LM.items():
        metrics = [json.loads((r / "metrics.json").read_text()) for r in _runs(folder, preset)]
        if not metrics:
            continue
        test = [m["test_bits_per_byte"] for m in metrics]
        rows.append(f"| `{mixer}` | {metrics[0]['params']:,} | "
                    f"{', '.join(f'{v:.3f}' for v in test)} | {_mean_std(test)} | "
                    f"{np.mean([m['train_bits_per_byte'] for m in metrics]):.3f} | "
                    f"{np.mean([m['seconds'] for m in metrics]):.0f} |")
    return "\n".join(rows)


def rollout_table(folder: Path, figures: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = ["| conditioning | params | mean rel. L2 over 20 steps, per seed | mean ± std "
            "| step 1 | step 10 | step 20 |", "|---|---|---|---|---|---|---|"]
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for preset, label in ROLLOUT.items():
        runs = _runs(folder, preset)
        if not runs:
            continue
        metrics = [json.loads((r / "metrics.json").read_text()) for r in runs]
        curves = []
        for r in runs:
            with np.load(r / "test_rollout.npz") as f:
                curves.append(f["rel_l2"].mean(0))
        curves = np.array(curves)                                   # [seeds, steps]
        mean = curves.mean(0)
        steps = np.arange(1, curves.shape[1] + 1)
        ax.plot(steps, mean, marker="o", ms=3, label=f"{label} ({len(runs)} seeds)")
        if len(runs) > 1:
            ax.fill_between(steps, curves.min(0), curves.max(0), alpha=0.2)
        head = [m["test_rollout_rel_l2"] for m in metrics]
        rows.append(f"| {label} | {metrics[0]['params']:,} | "
                    f"{', '.join(f'{v:.3f}' for v in head)} | {_mean_std(head)} | "
                    f"{mean[0]:.3f} | {mean[min(9, len(mean) - 1)]:.3f} | {mean[-1]:.3f} |")
    ax.set_xlabel("rollout step (dt = 0.05)"), ax.set_ylabel("relative L2 (test mean)")
    ax.set_yscale("log"), ax.grid(alpha=.3), ax.legend()
    figures.mkdir(parents=True, exist_ok=True)
    fig.savefig(figures / "rollout_error_by_step.png", dpi=110)
    plt.close(fig)
    return "\n".join(rows)


def bench_table(folder: Path) -> str:
    path = folder / "generate.json"
    if not path.is_file():
        return "(no bench results)"
    points = json.loads(path.read_text())["points"]
    rows = ["| mixer | context | ms / token (median) | decoding state | state built by |",
            "|---|---|---|---|---|"]
    for p in points:
        size = p["state_bytes"]
        text = f"{size / 2 ** 20:.1f} MiB" if size >= 2 ** 20 else f"{size / 1024:.1f} KiB"
        rows.append(f"| `{p['mixer']}` | {p['context']:,} | {p['step_ms_median']:.2f} | "
                    f"{text} | {p['prefill']} |")
    return "\n".join(rows)


RANK_THRESHOLDS = (0.15, 0.10, 0.09)


VARIANTS = {"16": "fixed-M16", "64": "fixed-M64", "16,32@5,64@10": "grow-16-32-64"}


def rank_summary(folder: Path, figures: Path) -> dict:
    """Per finished run of the rank-growth sweep (``variant-s<seed>``): test error and
    training seconds per epoch, every optimizer step's loss; writes ``rank_growth.png``
    (test error against epoch and against seconds; per-step loss around the growths)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summary = {}
    for run in _runs(folder, None):
        config = json.loads((run / "config.json").read_text())
        variant = VARIANTS.get(config["latent_schedule"], config["latent_schedule"])
        records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
        errors = [r["test_rel_l2"] for r in records]
        summary[f"{variant}-s{config['seed']}"] = {
            "test_rel_l2": errors, "seconds": np.cumsum([r["seconds"] for r in records]).tolist(),
            "final_test_rel_l2": errors[-1],
            "steps": [{"epoch": r["epoch"], "loss": loss} for r in records
                      for loss in r["step_losses"]]}
    if not summary:
        return summary
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    colours = dict(zip(VARIANTS.values(), ("C2", "C1", "C0")))
    for name, run in sorted(summary.items()):
        style = dict(color=colours.get(name.rsplit("-s", 1)[0], "k"), label=name, lw=0.8)
        epochs = range(1, len(run["test_rel_l2"]) + 1)
        a.semilogy(epochs, run["test_rel_l2"], marker="o", ms=2, **style)
        b.semilogy(run["seconds"], run["test_rel_l2"], marker="o", ms=2, **style)
        losses = [x["loss"] for x in run["steps"]]
        c.semilogy(range(1, len(losses) + 1), losses, **{**style, "lw": 0.5})
    per_epoch = sum(x["epoch"] == 1 for x in next(iter(summary.values()))["steps"])
    for growth in (5, 10):
        c.axvline(growth * per_epoch + 0.5, color="k", lw=0.6, ls=":")
    for ax, xl in ((a, "epoch"), (b, "training seconds (shared CPU)"), (c, "optimizer step")):
        ax.set_xlabel(xl), ax.grid(alpha=.3), ax.legend(fontsize=8)
    a.set_ylabel("test relative L2 (EMA)"), c.set_ylabel("training loss per step")
    figures.mkdir(parents=True, exist_ok=True)
    fig.savefig(figures / "rank_growth.png", dpi=110)
    plt.close(fig)
    return summary


def rank_table(folder: Path, figures: Path) -> str:
    """Per variant over seeds: final error, epochs (and seconds) to reach fixed errors, and
    the per-step loss just before and after each growth, next to fixed M = 16 on the same
    seed (the same batches; the two runs are the same model until the first growth)."""
    summary = rank_summary(folder, figures)
    if not summary:
        return "(no rank-growth results)"
    variants: dict[str, list[str]] = {}
    for name in summary:
        variants.setdefault(name.rsplit("-s", 1)[0], []).append(name)
    rows = ["| run | seeds | final test rel. L2, per seed | mean | "
            + " | ".join(f"epochs (s) to {t}" for t in RANK_THRESHOLDS) + " |",
            "|---|---|---|---|" + "---|" * len(RANK_THRESHOLDS)]
    for variant, names in variants.items():
        finals = [summary[n]["final_test_rel_l2"] for n in names]
        cells = []
        for t in RANK_THRESHOLDS:
            hits = []
            for n in names:
                reached = [i for i, e in enumerate(summary[n]["test_rel_l2"]) if e <= t]
                hits.append(f"{reached[0] + 1} ({summary[n]['seconds'][reached[0]]:.0f})"
                            if reached else "-")
            cells.append(", ".join(hits))
        rows.append(f"| {variant} | {len(names)} | {', '.join(f'{v:.4f}' for v in finals)} | "
                    f"{np.mean(finals):.4f} | " + " | ".join(cells) + " |")
    rows += ["", "| seed | growth | grown run: mean loss of the 10 steps before / after, "
             "first step after | fixed M = 16: the same |", "|---|---|---|---|"]
    for name in sorted(n for n in summary if n.startswith("grow")):
        seed = name.rsplit("-s", 1)[1]
        if f"fixed-M16-s{seed}" not in summary:
            continue
        steps = [summary[n]["steps"] for n in (name, f"fixed-M16-s{seed}")]
        for epoch, what in ((6, "16 -> 32"), (11, "32 -> 64")):
            cells = []
            for run in steps:
                before = [x["loss"] for x in run if x["epoch"] == epoch - 1][-10:]
                after = [x["loss"] for x in run if x["epoch"] == epoch][:10]
                cells.append(f"{np.mean(before):.4f} / {np.mean(after):.4f}, {after[0]:.4f}")
            rows.append(f"| {seed} | {what} (epoch {epoch}) | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("runs/extensions"))
    parser.add_argument("--figures", type=Path, default=Path("docs/figures"))
    args = parser.parse_args()
    print("## lm\n\n" + lm_table(args.runs / "lm"))
    print("\n## rollout\n\n" + rollout_table(args.runs / "rollout", args.figures))
    print("\n## bench generate\n\n" + bench_table(args.runs / "bench"))
    print("\n## rank growth\n\n" + rank_table(args.runs / "rank", args.figures))


if __name__ == "__main__":
    main()
