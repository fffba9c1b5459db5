"""The learning rate of a fine-tune (``flarepp train --init-from``): the test error per epoch
of darcy-tiny fine-tuned from a run on other Darcy data, at the preset's lr and lower ones.

    OMP_NUM_THREADS=1 python scripts/fine_tune_lr.py /tmp/fine-tune 3e-3 1e-3 3e-4 1e-4

A source run (12 epochs, 64 training samples at 22 x 22, generator seed 1) is fine-tuned for
6 epochs on data of another seed (7): its weights' error on the new test split is printed
first, then each lr's error after every epoch. The one-cycle schedule warms up to ``lr`` in
its first 10% of steps, so the preset's lr, chosen to train from scratch, first moves the
weights far from where the source left them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from flarepp.data.generators.darcy import make_darcy
from flarepp.storage.rundir import RunDir
from flarepp.train import evaluate_checkpoint, get_preset, latest_checkpoint, train

DATA = "dataset_options={'resolution': 22, 'n_train': 64, 'n_test': 32}"


def main(root: Path, rates: list[str]) -> None:
    if not (root / "b").exists():
        make_darcy(root / "a", n_train=64, n_test=32, resolution=22, seed=1, progress=False)
        make_darcy(root / "b", n_train=64, n_test=32, resolution=22, seed=7, progress=False)
    if not RunDir(root / "source").has_metrics():
        train(get_preset("darcy-tiny", [DATA, "epochs=12"]), root / "source",
              data_root=root / "a", progress=False)
    start = evaluate_checkpoint(latest_checkpoint(root / "source"), data_root=root / "b",
                                device="cpu")["test_rel_l2"]
    print(f"the source's weights on the new data: test_rel_l2 {start:.4f}", flush=True)
    for lr in rates:
        out = root / f"tuned-lr-{lr}"
        train(get_preset("darcy-tiny", [DATA, "epochs=6", f"lr={lr}"]), out,
              data_root=root / "b", progress=False, init_from=root / "source")
        errors = [f"{r['test_rel_l2']:.4f}" for r in RunDir(out).read_log()]
        print(f"lr={lr}: test_rel_l2 after each epoch {', '.join(errors)}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or ["3e-3", "1e-3", "3e-4"])
