"""Exported-model inference on the CPU: onnxruntime against PyTorch eager, same weights.

One process, interleaved rounds: every round times one forward of each engine at every N
(the order of the two engines alternating between rounds), after one warm-up forward each,
so a load change on a shared machine hits both alike; the ratio is taken per round and its
median reported. Both run the same function: the model with its normalisers inside
(a :class:`~flarepp.models.surrogate.Surrogate`), FP32, exported once with a dynamic
point count (:func:`~flarepp.inference.export.export_onnx`), and their outputs are compared
at every N (``max_abs_diff``).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flarepp.inference.export import example_inputs, export_onnx, exported_surrogate
from flarepp.inference.predictor import load_predictor
from flarepp.models import Surrogate, build_model

DEFAULT_MODEL = dict(mixer="flarepp", in_dim=3, out_dim=1, dim=64, heads=4, blocks=3,
                     latents=32)
"""darcy-tiny's FLARE++ (random weights) when no run is given."""


def benchmark_module(run: str | Path | None, model: dict[str, Any] | None = None
                     ) -> Surrogate:
    """The run's exported function (FP32, CPU), or a :data:`DEFAULT_MODEL`-like FLARE++ with
    identity maps (zero shift, unit scale)."""
    if run is not None:
        return exported_surrogate(load_predictor(run, device="cpu", precision="fp32"))
    settings = {**DEFAULT_MODEL, **(model or {})}
    torch.manual_seed(0)
    identity = {role: (np.zeros(n, np.float32), np.ones(n, np.float32)) for role, n in
                (("inputs", settings["in_dim"]), ("outputs", settings["out_dim"]))}
    return Surrogate(build_model(**settings), **identity).eval()


def bench_export(sizes: list[int], *, rounds: int = 3, batch: int = 1,
                 run: str | Path | None = None, model: dict[str, Any] | None = None
                 ) -> list[dict[str, Any]]:
    """Per N: the median seconds of one forward under PyTorch eager and onnxruntime (CPU,
    as many intra-op threads as torch uses), the median of the per-round ratios eager /
    onnxruntime, and the largest output difference."""
    import onnxruntime
    module = benchmark_module(run, model)
    channels = int(module.input_shift.numel())
    with tempfile.TemporaryDirectory(prefix="flarepp-bench-export-") as tmp:
        export_onnx(module, Path(tmp) / "model.onnx")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        session = onnxruntime.InferenceSession(str(Path(tmp) / "model.onnx"), options,
                                               providers=["CPUExecutionProvider"])
    inputs = {n: example_inputs(channels, batch, n, padded=False) for n in sizes}
    engines = {
        "eager": lambda x, m: module(x, m).numpy(),
        "onnxruntime": lambda x, m: session.run(["y"], {"x": x.numpy(), "mask": m.numpy()})[0],
    }
    times: dict[tuple[str, int], list[float]] = {(e, n): [] for e in engines for n in sizes}
    diff = {}
    with torch.no_grad():
        for n in sizes:                       # warm-up, and the outputs compared
            outs = {e: f(*inputs[n]) for e, f in engines.items()}
            diff[n] = float(np.abs(outs["eager"] - outs["onnxruntime"]).max())
        for r in range(rounds):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for n in sizes:
                for e in order:
                    start = time.perf_counter()
                    engines[e](*inputs[n])
                    times[(e, n)].append(time.perf_counter() - start)
    return [{"n": n, "batch": batch, "rounds": rounds,
             "eager_s": statistics.median(times[("eager", n)]),
             "onnxruntime_s": statistics.median(times[("onnxruntime", n)]),
             "ratio": statistics.median(a / b for a, b in zip(times[("eager", n)],
                                                              times[("onnxruntime", n)])),
             "round_ratios": [a / b for a, b in zip(times[("eager", n)],
                                                    times[("onnxruntime", n)])],
             "max_abs_diff": diff[n], "threads": torch.get_num_threads()} for n in sizes]


__all__ = ["DEFAULT_MODEL", "bench_export", "benchmark_module"]
