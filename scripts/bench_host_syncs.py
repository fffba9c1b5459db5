"""Step time of the trainer as before issue 19 (the step loss read every step,
HOST_SYNC_EVERY = 1, and torch's AveragedModel as the EMA, which reads its counter on the
host in every update) and now (every 16 steps, flarepp's WeightAverage), on darcy-tiny at
its preset model size, CPU, one process; interleaved rounds, one trainer, median per
setting. Usage: python scripts/bench_host_syncs.py ROUNDS"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flarepp.data.generators.darcy import make_darcy
from flarepp.train import Trainer, get_preset
from flarepp.train import loop
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

torch.set_num_threads(1)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
tmp = Path(tempfile.mkdtemp())
make_darcy(tmp / "d", n_train=64, n_test=4, resolution=22, seed=3, progress=False)
config = get_preset("darcy-tiny", ["epochs=50", "device=cpu", "batch_size=4",
                                   "dataset_options={'resolution': 22, 'n_train': 64, 'n_test': 4}"])
trainer = Trainer(config, tmp / "run", data_root=tmp / "d", progress=False)
trainer.train_epoch()  # warm-up
emas = {16: trainer.ema,
        1: AveragedModel(trainer.model, multi_avg_fn=get_ema_multi_avg_fn(config.ema_decay),
                         use_buffers=True)}
wall = {1: [], 16: []}
cpu = {1: [], 16: []}
for r in range(rounds):
    for every in (1, 16) if r % 2 == 0 else (16, 1):
        loop.HOST_SYNC_EVERY, trainer.ema = every, emas[every]
        t, c = time.perf_counter(), time.process_time()
        trainer.train_epoch()
        steps = len(trainer.step_losses)
        wall[every].append((time.perf_counter() - t) / steps)
        cpu[every].append((time.process_time() - c) / steps)
trainer.close()
for name, times in (("wall", wall), ("CPU", cpu)):
    for every, ts in times.items():
        label = "before (read every step, torch EMA)" if every == 1 else "now (every 16, WeightAverage)"
        print(f"{name:4s} {label}: median step {1e3 * statistics.median(ts):.2f} ms")
    ratios = [b / a for a, b in zip(times[1], times[16])]
    print(f"{name:4s} per-round ratio now / before: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds")
