"""The golden ``darcy-tiny`` loss curves: seconds-long seeded runs whose per-epoch numbers
``tests/test_protocol.py`` compares against ``tests/golden/darcy_tiny.json``.

Each run is the ``darcy-tiny`` preset (its training protocol unchanged) shrunk to seconds:
16 / 8 generated Darcy samples on a 22 x 22 grid (``make_darcy`` seed 0), C = 16, H = 2,
B = 2, M = 8, batch 4, 6 epochs, FP32 on the CPU, one thread; once with FLARE++ and once
with FLARE (whose SDPA scale differs from FLARE++'s under ``attn_scale="reference"``).
Weight decay is raised to 0.5 so that the weight-decay groups move the curve measurably.

Measured on this project's CPU: a rerun is bitwise identical; two intra-op threads instead
of one (another summation order) move the numbers by at most 2e-8 relative; the smallest
protocol change (``weight_decay_groups=reference`` instead of ``weights``) moves them by
1.4e-4, the others by 3e-4 (``all``) to 0.27 (``loss=rel_l2`` instead of ``rel_l2_grad``).
The test's relative tolerance, 1e-5, sits between the two.

Besides the training losses the file holds the test error per epoch and the final test and
train errors of both weights the run evaluates (``_raw``: the trained weights, the
headline; ``_ema``: their moving average, flarepp's headline before ``eval_weights``).

Regenerate (after an intended change of the protocol, and say why in the commit):

    OMP_NUM_THREADS=1 .venv/bin/python scripts/golden_darcy_tiny.py --write
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "darcy_tiny.json"
OVERRIDES = ["dataset_options.n_train=16", "dataset_options.n_test=8",
             "dataset_options.resolution=22", "model.dim=16", "model.heads=2",
             "model.blocks=2", "model.latents=8", "batch_size=4", "epochs=6",
             "checkpoint_every=6", "device=cpu", "precision=fp32", "weight_decay=0.5"]
CURVES = {"flarepp": ["model.mixer=flarepp"], "flare": ["model.mixer=flare"]}


def golden_run(workdir: str | Path, extra: list[str] | None = None, *,
               run_name: str = "run") -> dict:
    """Train the golden run in ``workdir``; returns its per-epoch curve and final metrics."""
    import torch

    from flarepp.data.generators.darcy import make_darcy
    from flarepp.train import Trainer, get_preset
    torch.set_num_threads(1)
    workdir = Path(workdir)
    data = workdir / "darcy"
    if not data.exists():
        make_darcy(data, n_train=16, n_test=8, resolution=22, seed=0, progress=False)
    config = get_preset("darcy-tiny", OVERRIDES + list(extra or []))
    metrics = Trainer(config, workdir / run_name, data_root=data, progress=False).fit()
    history = metrics_history(workdir / run_name)
    curve = {"overrides": OVERRIDES + list(extra or []),
             "train_loss": [r["train_loss"] for r in history]}
    for weights in ("ema", "raw"):
        curve[f"test_rel_l2_{weights}_per_epoch"] = [r[f"test_rel_l2_{weights}"]
                                                     for r in history]
        for split in ("test", "train"):
            key = f"{split}_rel_l2_{weights}"
            curve[key] = metrics[key]
    return curve


def metrics_history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {GOLDEN}")
    args = parser.parse_args()
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in CURVES.items():
            curves[name] = golden_run(Path(tmp), extra, run_name=name)
    text = json.dumps(curves, indent=1) + "\n"
    if args.write:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
        print(f"wrote {GOLDEN}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
