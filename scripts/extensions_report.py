"""Tables and figures of docs/extensions.md from the runs of the extension scripts.

Reads ``runs/extensions/{lm,rollout,bench,rank}`` (written by ``scripts/lm_tiny_runs.sh``,
``scripts/rollout_runs.sh``, ``flarepp bench generate --json runs/extensions/bench/
generate.json`` and ``scripts/rank_growth_darcy.py``), prints Markdown tables and writes
``docs/figures/rollout_error_by_step.png`` and ``docs/figures/rank_growth.png``.

    .venv/bin/python scripts/extensions_report.py [--runs runs/extensions] [--figures docs/figures]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

LM = {"lm-tiny": "flare-causal", "lm-tiny-flarepp": "flarepp-causal",
      "lm-tiny-attention": "attention-causal"}
ROLLOUT = {"rollout-tiny": "Cross FLARE", "rollout-tiny-concat": "concat inputs",
           "rollout-tiny-adaln": "AdaLN-Zero"}


def _runs(folder: Path, preset: str) -> list[Path]:
    return sorted(p for p in folder.glob(f"{preset}-s*") if (p / "metrics.json").is_file())


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


def rank_table(folder: Path, figures: Path) -> str:
    path = folder / "summary.json"
    if not path.is_file():
        return "(no rank-growth results)"
    summary = json.loads(path.read_text())
    if (folder / "rank_growth.png").is_file():
        figures.mkdir(parents=True, exist_ok=True)
        shutil.copy(folder / "rank_growth.png", figures / "rank_growth.png")
    targets = sorted({round(s["final_test_rel_l2"] * 1.05, 4) for s in summary.values()})
    rows = ["| run | final test rel. L2 | training s | "
            + " | ".join(f"epoch (s) to reach {t:.4f}" for t in targets) + " |",
            "|---|---|---|" + "---|" * len(targets)]
    for name, s in summary.items():
        cells = []
        for t in targets:
            hit = [i for i, e in enumerate(s["test_rel_l2"]) if e <= t]
            cells.append(f"{hit[0] + 1} ({s['seconds'][hit[0]]:.0f})" if hit else "-")
        rows.append(f"| {name} | {s['final_test_rel_l2']:.4f} | {s['total_seconds']:.0f} | "
                    + " | ".join(cells) + " |")
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
