"""Step time against the CPU's intra-op thread count, and the count a run would choose.

Each case is one training step (forward, mean-square loss, backward, AdamW step) of a
model at the size a run trains it: ``darcy-tiny``'s model (its preset: C = 64, H = 4,
B = 3, M = 32, FLARE++) on a batch of 4 Darcy grids of ``R x R`` points, and the Table 7
surrogate (C = 128, H = 8, M = 64, 8 blocks, :class:`~flarepp.bench.scaling.ScalingConfig`)
on one sample of N points. In one process, for each case: ``rounds`` interleaved rounds
over the counts of :func:`~flarepp.threads.candidates` (one untimed warm-up step each
first), the median step time per count; then the count that
:func:`~flarepp.threads.measure_threads` chooses on the same step, as a run would.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from flarepp.bench.scaling import ScalingConfig
from flarepp.models import build_model
from flarepp.threads import apply_threads, candidates, measure_threads, thread_budget
from flarepp.train import get_preset

DARCY_BATCH = 4
DARCY_IN, DARCY_OUT = 3, 1  # grid coordinates and the coefficient in; the solution out


def darcy_case(resolution: int) -> tuple[str, Callable[[], tuple[torch.nn.Module, Any]]]:
    def build():
        config = get_preset("darcy-tiny", [f"dataset_options.resolution={resolution}"])
        model = build_model(in_dim=DARCY_IN, out_dim=DARCY_OUT, **config.model_kwargs())
        return model, torch.randn(DARCY_BATCH, resolution * resolution, DARCY_IN)
    return f"darcy-tiny {resolution}x{resolution} (batch {DARCY_BATCH})", build


def surrogate_case(n: int) -> tuple[str, Callable[[], tuple[torch.nn.Module, Any]]]:
    def build():
        config = ScalingConfig(device="cpu")
        return (build_model(**config.model_settings("flarepp")),
                torch.randn(1, n, config.in_dim))
    return f"Table 7 surrogate N={n} (batch 1)", build


def training_step(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()
    return step


def time_counts(step: Callable[[], None], counts: list[int], rounds: int) -> dict[int, float]:
    """Median seconds of ``step`` at each count, ``rounds`` interleaved rounds."""
    times: dict[int, list[float]] = {n: [] for n in counts}
    for n in counts:  # warm-up at each count
        apply_threads(n)
        step()
    for _ in range(rounds):
        for n in counts:
            apply_threads(n)
            start = time.perf_counter()
            step()
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def run_threads_bench(resolutions: list[int], surrogate_n: list[int], *, rounds: int = 3,
                      log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per case: ``case``, ``step_s`` (count -> median seconds), ``fastest``,
    ``chosen`` (and how), ``chosen_over_fastest``."""
    counts = candidates(thread_budget())
    before = torch.get_num_threads()
    rows = []
    try:
        for name, build in [*map(darcy_case, resolutions), *map(surrogate_case, surrogate_n)]:
            torch.manual_seed(0)
            model, x = build()
            step = training_step(model, x)
            times = time_counts(step, counts, rounds)
            apply_threads(before)
            choice = measure_threads(step)
            fastest = min(times, key=times.get)
            rows.append({"case": name, "step_s": times, "fastest": fastest,
                         "chosen": choice.threads, "how": choice.how,
                         "chosen_over_fastest": times[choice.threads] / times[fastest]
                         if choice.threads in times else None})
            log(format_row(rows[-1], counts))
    finally:
        apply_threads(before)
    return rows


def format_header(counts: list[int]) -> str:
    return f"{'case':42s}" + "".join(f"{f'{n} thr':>11s}" for n in counts) + \
        "   fastest  chosen  chosen/fastest"


def format_row(row: dict[str, Any], counts: list[int]) -> str:
    ratio = row["chosen_over_fastest"]
    return (f"{row['case']:42s}" + "".join(f"{row['step_s'][n] * 1e3:9.1f}ms" for n in counts)
            + f"   {row['fastest']:7d}  {row['chosen']:6d}  "
            + (f"{ratio:14.3f}" if ratio is not None else f"{'-':>14s}")
            + f"  ({row['how']})")


__all__ = ["darcy_case", "format_header", "format_row", "run_threads_bench", "surrogate_case",
           "time_counts", "training_step"]
