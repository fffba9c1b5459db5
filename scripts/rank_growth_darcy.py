"""Rank-adaptive FLARE on darcy-tiny: M grown 16 -> 32 -> 64 against fixed M = 16 and 64.

Runs the one trainer (``flarepp.train.Trainer``) one epoch at a time, resuming from the
run's own checkpoint, so that every optimizer step's loss (``Trainer.step_losses``) is kept
in ``steps.jsonl`` beside the run's ``log.jsonl``: the loss around each growth step is then
visible step by step. The model and optimizer state follow the trainer's
``latent_schedule`` (``flarepp.rank_growth``). Then writes ``summary.json`` and
``rank_growth.png`` (test error against epoch and against training seconds; per-step loss
around the growth epochs).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/rank_growth_darcy.py --data /work/data/darcy \
        --out runs/extensions/rank [--seeds 0 1 2]

Run directories are ``OUT/<variant>-s<seed>``; ``summary.json`` and the figure cover every
finished one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VARIANTS = {
    "grow-16-32-64": ["latent_schedule=16,32@5,64@10"],
    "fixed-M64": ["model.latents=64"],
    "fixed-M16": ["model.latents=16"],
}
COMMON = ["model.mixer=flare", "device=cpu"]


def run(name: str, overrides: list[str], data: Path, out: Path, seed: int) -> None:
    from flarepp.train import Trainer, get_preset
    config = get_preset("darcy-tiny", COMMON + overrides + [f"seed={seed}"])
    name = f"{name}-s{seed}"
    run_dir = out / name
    steps = run_dir / "steps.jsonl"
    while True:
        resume = (run_dir / "checkpoints").is_dir()
        trainer = Trainer(config, run_dir, data_root=data, resume=resume, progress=False)
        if trainer.epoch >= config.epochs:
            trainer.close()
            return
        epoch = trainer.epoch + 1
        trainer.fit(stop_after=1)
        latents = trainer.model.config.latents
        with open(steps, "a") as f:
            f.writelines(json.dumps({"epoch": epoch, "step": i, "loss": loss,
                                    "latents": latents}) + "\n" for i, loss in enumerate(trainer.step_losses))
        print(f"{name}: epoch {epoch} M={latents} {trainer.history[-1]}", flush=True)


def summarize(out: Path) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summary = {}
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    colours = dict(zip(VARIANTS, ("C0", "C1", "C2")))
    names = sorted(p.name for p in out.iterdir() if (p / "metrics.json").is_file())
    for name in names:
        log = out / name / "log.jsonl"
        variant = name.rsplit("-s", 1)[0]
        style = dict(color=colours.get(variant, "k"), label=name)
        records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        steps = [json.loads(x) for x in (out / name / "steps.jsonl").read_text().splitlines()]
        seconds, elapsed = [], 0.0
        for r in records:
            elapsed += r["seconds"]
            seconds.append(elapsed)
        errors = [r["test_rel_l2"] for r in records]
        summary[name] = {"test_rel_l2": errors, "seconds": seconds,
                         "train_loss": [r["train_loss"] for r in records],
                         "final_test_rel_l2": errors[-1], "total_seconds": seconds[-1]}
        epochs = [r["epoch"] for r in records]
        a.semilogy(epochs, errors, marker="o", ms=2, lw=0.8, **style)
        b.semilogy(seconds, errors, marker="o", ms=2, lw=0.8, **style)
        losses = [s["loss"] for s in steps]
        c.semilogy(range(1, len(losses) + 1), losses, lw=0.5, **style)
    per_epoch = len([s for s in steps if s["epoch"] == 1]) if summary else 0
    for growth in (5, 10):
        c.axvline(growth * per_epoch + 0.5, color="k", lw=0.6, ls=":")
    for ax, xl in ((a, "epoch"), (b, "training seconds (shared CPU)"), (c, "optimizer step")):
        ax.set_xlabel(xl), ax.grid(alpha=.3), ax.legend(fontsize=8)
    a.set_ylabel("test relative L2 (EMA)"), c.set_ylabel("training loss per step")
    fig.savefig(out / "rank_growth.png", dpi=110)
    plt.close(fig)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="darcy data directory")
    parser.add_argument("--out", type=Path, default=Path("runs/extensions/rank"))
    parser.add_argument("--only", choices=sorted(VARIANTS), action="append")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args()
    if not args.summary_only:
        for seed in args.seeds:
            for name in args.only or VARIANTS:
                run(name, VARIANTS[name], args.data, args.out, seed)
    for name, s in summarize(args.out).items():
        print(f"{name:14s} final test rel L2 {s['final_test_rel_l2']:.4f} after "
              f"{s['total_seconds']:.0f} s of training")


if __name__ == "__main__":
    main()
