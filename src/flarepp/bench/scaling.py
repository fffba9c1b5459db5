"""Time and memory of complete models against the number of tokens N (paper D.3, Figure 6).

For each mixer and each N, one training step of ``build_model(mixer=..., dim=C, heads=H,
blocks=..., latents=M)`` on ``[B, N, in_dim]`` -- forward, a mean-square loss, backward --
is timed (median of ``repeats`` steps after ``warmup`` untimed ones), and its peak memory is
taken above the memory held once the model and its input exist:

* CPU: every point runs in a fresh interpreter (freed memory of an earlier point would
  otherwise be reused unseen); peak resident set minus the resident set after importing
  torch and building the model and input (:mod:`flarepp.bench.memory`);
* CUDA: in this process by default (``isolate=True``: a fresh one per point),
  ``torch.cuda.max_memory_allocated`` (reset before the point's
  steps) minus the memory allocated after building the model and input. Allocated, not
  reserved, bytes: memory cached by earlier points does not count, and every point starts
  from an emptied cache (also after a point that ran out of memory). Each step is timed
  between two ``torch.cuda.synchronize`` calls, so the time covers its kernels.

Each point's achieved FLOP/s is the analytic count of :mod:`flarepp.bench.flops` over the
median step time, also given as a fraction of the machine's measured dense-matmul
throughput (:func:`matmul_peak`: median of square GEMMs in the benchmark's dtype, measured
before and after the sweep; the larger of the two is used).

A point is skipped, with the reason in its ``status``, when it would not fit (estimated peak
above ``memory_fraction`` of the available memory) or take too long (estimated time of all
its steps above ``time_budget_s``). Estimates extrapolate the previous measured point of the
same mixer linearly in B*N (memory) and at its achieved FLOP/s (time); a mixer's first
point uses a prior of ``PRIOR_FLOATS_PER_TOKEN_PER_BLOCK`` saved floats of width C and
``PRIOR_PEAK_FRACTION`` of the matmul peak. A point that runs out of memory anyway is
recorded as ``skipped: out of memory ...``; one that fails otherwise (a kernel's input error,
a worker killed or timed out) as ``failed: ...``. The sweep goes on either way, and
:func:`failed_points` lists the failures, which make ``flarepp bench scaling`` exit non-zero.

``rounds`` > 1 measures every point that many times, round-robin over the mixers at each N
(a fresh interpreter each time on CPU), and pools the timed steps: on a shared machine the
load drifts over seconds to minutes, and interleaving keeps the mixers' ratios fair. Each
record keeps its per-round medians (``round_times_s``), and :func:`ratios` gives, beside the
ratio of the pooled medians, the median over rounds of the ratio within each round
(``time_ratio_rounds``): the measure of two mixers side by side that a drift of the machine's
speed between rounds does not move.

``retain_memory`` (CPU, default: on unless ``FLAREPP_RETAIN_MEMORY=0``) has each worker
keep freed host memory for reuse (:mod:`flarepp.allocator`), as CUDA's caching allocator
does; without it glibc unmaps large freed blocks and every step faults its activations in
again. Every record's ``malloc`` field says what the worker's allocator did.

``total_budget_s`` bounds the whole sweep: a point whose estimated time would end the sweep
past it is skipped, with the reason, so a sweep fits a fixed slot (``make gpu-check``).

With ``reference_repo`` (a clone of the FLARE study's code), the mixer name
``flare-study`` measures that study's own ``FLAREModel`` at the same settings
(:mod:`flarepp.bench.reference`; loaded from the clone at run time, never a dependency),
counted with FLARE's FLOPs (the same products).

FP32 runs use LayerNorm and no autocast; ``bf16`` / ``fp16`` runs use RMSNorm and autocast
to that dtype with FP32 weights, as the paper's mixed-precision runs (C.2).
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from flarepp import allocator
from flarepp.bench.flops import MIXER_FLOPS, model_flops
from flarepp.bench.memory import PeakMemory
from flarepp.bench.reference import REFERENCE_MIXER, flare_study_model
from flarepp.device import autocast, available_memory, resolve_device, synchronize
from flarepp.mixers import MIXERS
from flarepp.models import build_model
from flarepp.models.backbone import compile_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIZE_SUFFIXES = {"": 1, "k": 2 ** 10, "m": 2 ** 20}
PRIOR_FLOATS_PER_TOKEN_PER_BLOCK = 32  # measured ~16 (FLARE), ~21 (FLARE++) in FP32 on CPU
PRIOR_PEAK_FRACTION = 0.2
SAFETY = 1.3  # margin on extrapolated memory and time
RECORD_KEYS = ("mixer", "n", "batch", "dtype", "device", "compile", "threads", "malloc",
               "status", "time_s", "cpu_time_s", "times_s", "cpu_times_s", "peak_mem_bytes",
               "baseline_mem_bytes", "mem_method", "flops", "flops_forward",
               "achieved_flops_per_s", "fraction_of_peak", "peak_flops_per_s", "params",
               "estimated_time_s", "estimated_mem_bytes")
"""Fields of every record (JSON and CSV); ``time_s`` is the step's wall time, ``cpu_time_s``
this process's CPU time over it, ``flops`` the forward + backward count."""


def parse_size(text: str) -> int:
    """``"16k"`` -> 16384, ``"1M"`` -> 1048576, ``"1000"`` -> 1000 (binary k and M)."""
    t = text.strip().lower()
    suffix = t[-1] if t and t[-1] in SIZE_SUFFIXES else ""
    number = t[:-1] if suffix else t
    try:
        value = float(number) * SIZE_SUFFIXES[suffix]
    except ValueError:
        raise ValueError(f"cannot read size {text!r}: expected an integer with an optional "
                         f"k (x1024) or M (x1048576) suffix, e.g. 4k or 1M") from None
    if value <= 0 or value != int(value):
        raise ValueError(f"size {text!r} must be a positive whole number of tokens")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """``"1k,4k,16k"`` -> ``[1024, 4096, 16384]``."""
    sizes = [parse_size(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise ValueError(f"no sizes in {text!r}")
    return sizes


@dataclass(kw_only=True)
class ScalingConfig:
    """One sweep: every mixer at every N, on one device and dtype."""

    mixers: list[str] = field(default_factory=lambda: ["attention", "flare", "flarepp"])
    sizes: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    batch: int = 8
    dim: int = 128
    heads: int = 8
    blocks: int = 8
    latents: int = 64
    in_dim: int = 3
    out_dim: int = 1
    dtype: str = "fp32"
    device: str = "auto"  # auto, cpu, cuda or cuda:K (flarepp.device.resolve_device)
    repeats: int = 5
    warmup: int = 1
    time_budget_s: float = 600.0
    memory_fraction: float = 0.8
    threads: int | None = None
    compile: bool = False
    rounds: int = 1
    total_budget_s: float | None = None
    retain_memory: bool = field(default_factory=allocator.retain_memory_requested)
    isolate: bool | None = None  # a fresh interpreter per point; None: on CPU only
    peak_matmul_size: int | None = None  # side of the GEMMs of matmul_peak (None: default)
    reference_repo: str | None = None  # a clone of the FLARE study's code (bench.reference)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known dtypes: {', '.join(DTYPES)}")
        self.device = str(resolve_device(self.device))  # raises a sentence if unavailable
        if self.isolate is None:
            self.isolate = torch.device(self.device).type == "cpu"
        if self.repeats < 1 or self.warmup < 0 or self.batch < 1:
            raise ValueError(f"need repeats >= 1, warmup >= 0, batch >= 1; got {self}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.total_budget_s is not None and self.total_budget_s <= 0:
            raise ValueError(f"total_budget_s must be positive, got {self.total_budget_s}")
        if self.compile and self.warmup < 1:
            raise ValueError("compile=True needs warmup >= 1: the first step compiles")
        for name in self.mixers:
            if name == REFERENCE_MIXER:
                if not self.reference_repo:
                    raise ValueError(f"mixer {REFERENCE_MIXER!r} (the FLARE study's own "
                                     "FLAREModel) needs reference_repo, a clone of its code")
                continue
            MIXERS.entry(name)  # unknown names raise, listing the known ones

    def model_settings(self, mixer: str) -> dict[str, Any]:
        """``build_model`` keywords for ``mixer``; the norm follows the precision (C.2)."""
        return dict(mixer=mixer, in_dim=self.in_dim, out_dim=self.out_dim, dim=self.dim,
                    heads=self.heads, blocks=self.blocks, latents=self.latents,
                    norm="layernorm" if self.dtype == "fp32" else "rmsnorm")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- measuring

def matmul_peak(device: str = "cpu", dtype: str = "fp32", *, size: int | None = None,
                repeats: int = 5) -> float:
    """Dense-matmul throughput in FLOP/s: median over ``repeats`` square GEMMs ``size^3``
    (``2 size^3`` FLOPs each) after one warm-up, in this process's thread setting."""
    dev = torch.device(device)
    size = size or (8192 if dev.type == "cuda" else 2048)
    a = torch.randn(size, size, device=dev).to(DTYPES[dtype])
    b = torch.randn(size, size, device=dev).to(DTYPES[dtype])
    times = []
    for i in range(repeats + 1):
        synchronize(dev)
        start = time.perf_counter()
        torch.matmul(a, b)
        synchronize(dev)
        if i:
            times.append(time.perf_counter() - start)
    return 2.0 * size ** 3 / statistics.median(times)


def _step(model: torch.nn.Module, x: torch.Tensor, precision: str) -> None:
    model.zero_grad(set_to_none=True)
    with autocast(precision, x.device):
        y = model(x)
    y.float().square().mean().backward()


def measure_point(config: ScalingConfig, mixer: str, n: int) -> dict[str, Any]:
    """Build the model, then time and memory-probe its training steps in this process."""
    dev = torch.device(config.device)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(0)
    if mixer == REFERENCE_MIXER:
        settings = config.model_settings("flare")
        model = flare_study_model(config.reference_repo, **{
            k: settings[k] for k in ("in_dim", "out_dim", "dim", "heads", "blocks",
                                     "latents", "norm")}).to(dev)
    else:
        model = build_model(**config.model_settings(mixer)).to(dev)
    if config.compile:
        compile_model(model)
    x = torch.randn(config.batch, n, config.in_dim, device=dev)
    times, cpu_times = [], []
    with PeakMemory(dev) as mem:
        for i in range(config.warmup + config.repeats):
            synchronize(dev)
            start, cpu_start = time.perf_counter(), time.process_time()
            _step(model, x, config.dtype)
            synchronize(dev)
            if i >= config.warmup:
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu_start)
    return {"time_s": statistics.median(times), "times_s": times,
            "cpu_time_s": statistics.median(cpu_times), "cpu_times_s": cpu_times,
            "peak_mem_bytes": mem.peak, "baseline_mem_bytes": mem.baseline,
            "mem_method": mem.method, "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters())}


def worker_main() -> None:
    """Entry point of the fresh interpreter that measures one CPU point (or the peak);
    its allocator policy comes from ``FLAREPP_RETAIN_MEMORY``, set by the parent."""
    policy = allocator.apply_policy()
    job = json.loads(sys.argv[1])
    config = ScalingConfig(**job["config"])
    if job["kind"] == "peak":
        if config.threads:
            torch.set_num_threads(config.threads)
        print(json.dumps({"peak_flops_per_s": matmul_peak(config.device, config.dtype,
                                                          size=config.peak_matmul_size),
                          "threads": torch.get_num_threads()}))
    else:
        print(json.dumps({**measure_point(config, job["mixer"], job["n"]),
                          "malloc": str(policy)}))


class PointOutOfMemory(RuntimeError):
    """A point ran out of the device's memory: reported as skipped, not as a failure."""


def failed_points(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of points that failed (not those skipped, for memory or time)."""
    return [r for r in records if str(r.get("status") or "").startswith("failed")]


def _in_fresh_interpreter(config: ScalingConfig, job: dict[str, Any], timeout_s: float
                          ) -> dict[str, Any]:
    """Run ``job`` through :func:`worker_main` in a new interpreter; raise ``RuntimeError``
    with a one-line reason if it fails, is killed or runs past ``timeout_s``."""
    job = {**job, "config": {**config.to_dict(), "isolate": False}}
    code = "from flarepp.bench.scaling import worker_main; worker_main()"
    env = allocator.child_environment(config.retain_memory)
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(job)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"worker ran past its {timeout_s:.0f} s timeout") from None
    if done.returncode < 0:
        hint = " (likely out of memory)" if done.returncode == -9 else ""
        raise RuntimeError(f"worker killed by signal {-done.returncode}{hint}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no error output"])[-1]
        error = PointOutOfMemory if "OutOfMemoryError" in last else RuntimeError
        raise error(f"worker exited with status {done.returncode}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- estimating

def estimate_point(config: ScalingConfig, n: int, flops: float | None,
                   previous: dict[str, Any] | None, peak_flops: float
                   ) -> tuple[float, float | None]:
    """``(memory bytes, seconds for all steps or None)`` expected for a point.

    From ``previous`` (the last measured point of the same mixer): memory scaled by the
    token count, time at its achieved FLOP/s (or scaled by the token count when there is
    no FLOP count). Without one: the prior constants of this module.
    """
    tokens = config.batch * n
    steps = config.warmup + config.repeats
    if previous is not None:
        scale = tokens / (previous["batch"] * previous["n"])
        memory = SAFETY * scale * max(previous["peak_mem_bytes"], 0)
        rate = previous.get("achieved_flops_per_s")
        step_s = flops / rate if (flops and rate) else scale * previous["time_s"]
        return memory, steps * step_s
    memory = (SAFETY * tokens * config.blocks * PRIOR_FLOATS_PER_TOKEN_PER_BLOCK
              * config.dim * 4)
    step_s = flops / (PRIOR_PEAK_FRACTION * peak_flops) if flops else None
    return memory, None if step_s is None else steps * step_s


def skip_reason(config: ScalingConfig, est_memory: float, est_time: float | None,
                available: int) -> str | None:
    """Why a point with these estimates is skipped, or ``None`` to run it."""
    if est_memory > config.memory_fraction * available:
        return (f"skipped: estimated peak {est_memory / 2 ** 30:.1f} GiB exceeds "
                f"{config.memory_fraction:.0%} of the {available / 2 ** 30:.1f} GiB available")
    if est_time is not None and est_time > config.time_budget_s:
        return (f"skipped: estimated {est_time:.0f} s for {config.warmup + config.repeats} "
                f"steps exceeds the time budget of {config.time_budget_s:.0f} s")
    return None


# ----------------------------------------------------------------------------- the sweep

def run_scaling(config: ScalingConfig, *, log: Callable[[str], None] = print
                ) -> dict[str, Any]:
    """Measure every (mixer, N) point; returns ``{"machine", "config", "records"}``.

    Points run in order of N, all mixers at one N before the next N, so that ratios
    between mixers are measured side by side under the same machine load.
    """
    dev = torch.device(config.device)
    deadline = (None if config.total_budget_s is None
                else time.monotonic() + config.total_budget_s)
    machine = _machine(config)
    peak = machine["peak_flops_per_s"]
    log(f"dense matmul ({config.dtype}, {config.device}, {machine['threads']} threads): "
        f"{peak / 1e9:.1f} GFLOP/s (median of square GEMMs)")
    records: list[dict[str, Any]] = []
    last: dict[str, dict[str, Any]] = {}
    for n in sorted(config.sizes):
        pending = {}
        for mixer in config.mixers:
            record = _plan(config, mixer, n, last.get(mixer), peak, dev)
            if record["status"] is None:
                pending[mixer] = record
            else:
                log(format_record(record))
            records.append(record)
        results: dict[str, list[dict[str, Any]]] = {m: [] for m in pending}
        for _ in range(config.rounds):  # round-robin: mixers side by side, each round
            for mixer, record in pending.items():
                if record["status"] is not None:
                    continue
                if deadline is not None and (time.monotonic() + (record["estimated_time_s"]
                                                                 or 0.0)) > deadline:
                    if not results[mixer]:  # otherwise: finish with the rounds measured
                        record["status"] = (f"skipped: the sweep's total time budget of "
                                            f"{config.total_budget_s:.0f} s is spent")
                    continue
                try:
                    results[mixer].append(_measure(config, mixer, n, record, dev))
                except PointOutOfMemory as err:
                    record["status"] = f"skipped: {str(err).splitlines()[0]}"
                except RuntimeError as err:  # a kernel's input error, a worker killed or timed out
                    record["status"] = f"failed: {str(err).splitlines()[0]}"
        for mixer, record in pending.items():
            if record["status"] is None:
                _finish(record, results[mixer], peak)
                last[mixer] = record
            log(format_record(record))
    # The matmul throughput drifts on a shared machine: measure it again and take the larger.
    again = _machine(config)["peak_flops_per_s"]
    machine["peak_flops_per_s_measured"] = [peak, again]
    machine["peak_flops_per_s"] = peak = max(peak, again)
    log(f"dense matmul again: {again / 1e9:.1f} GFLOP/s; fractions of peak use "
        f"{peak / 1e9:.1f} GFLOP/s")
    for record in records:
        record["peak_flops_per_s"] = peak
        if record["achieved_flops_per_s"]:
            record["fraction_of_peak"] = record["achieved_flops_per_s"] / peak
            log(f"{record['mixer']:>10s} N={record['n']:>8d}  "
                f"{100 * record['fraction_of_peak']:5.1f}% of the matmul peak")
    return {"machine": machine, "config": config.to_dict(), "records": records}


def _machine(config: ScalingConfig) -> dict[str, Any]:
    dev = torch.device(config.device)
    if dev.type == "cpu" and config.isolate:
        res = _in_fresh_interpreter(config, {"kind": "peak"}, timeout_s=600)
        peak, threads = res["peak_flops_per_s"], res["threads"]
    else:
        if config.threads:
            torch.set_num_threads(config.threads)
        peak = matmul_peak(config.device, config.dtype, size=config.peak_matmul_size)
        threads = torch.get_num_threads()
    name = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
            else platform.processor() or platform.machine())
    return {"device_name": name, "threads": threads, "torch": torch.__version__,
            "peak_flops_per_s": peak, "peak_dtype": config.dtype}


def _plan(config: ScalingConfig, mixer: str, n: int, previous: dict[str, Any] | None,
          peak: float, dev: torch.device) -> dict[str, Any]:
    """A new record with its FLOP count and estimates; ``status`` is the skip reason, or
    ``None`` when the point is to be measured."""
    record: dict[str, Any] = {k: None for k in RECORD_KEYS}
    record.update(mixer=mixer, n=n, batch=config.batch, dtype=config.dtype,
                  device=config.device, compile=config.compile, peak_flops_per_s=peak)
    counted = "flare" if mixer == REFERENCE_MIXER else mixer  # the same products as ours
    if counted in MIXER_FLOPS:  # otherwise the FLOP fields stay empty and time scales with N
        counts = model_flops(config.model_settings(counted), n, config.batch)
        record.update(flops=counts["step"], flops_forward=counts["forward"])
    est_mem, est_time = estimate_point(config, n, record["flops"], previous, peak)
    record.update(estimated_mem_bytes=est_mem, estimated_time_s=est_time)
    record["status"] = skip_reason(config, est_mem, est_time, available_memory(dev))
    return record


def _measure(config: ScalingConfig, mixer: str, n: int, record: dict[str, Any],
             dev: torch.device) -> dict[str, Any]:
    """One round of one point: in a fresh interpreter if ``config.isolate`` (the default on
    CPU), else in this process (the default on CUDA: no interpreter and CUDA start-up per
    point; ``isolate=True`` also protects later points from a failing kernel).

    In this process, a point that runs out of memory raises ``RuntimeError`` only after its
    tensors, held by the out-of-memory error's traceback, are freed and the CUDA cache is
    emptied, so that the next point's free-memory estimate and its run start clean.
    """
    if config.isolate:
        timeout = 60 + 3 * max(record["estimated_time_s"] or 0.0, config.time_budget_s)
        return _in_fresh_interpreter(config, {"kind": "point", "mixer": mixer, "n": n}, timeout)
    failure = None
    try:
        return {**measure_point(config, mixer, n), "malloc": "not set (measured in-process)"}
    except torch.cuda.OutOfMemoryError as err:
        failure = f"out of memory: {str(err).splitlines()[0]}"
    finally:
        if dev.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    raise PointOutOfMemory(failure)


def _finish(record: dict[str, Any], rounds: list[dict[str, Any]], peak: float) -> None:
    """Pool the rounds: median over every timed step, the largest peak memory."""
    record.update({k: rounds[-1][k] for k in ("baseline_mem_bytes", "mem_method", "threads",
                                             "params", "malloc")})
    record["round_times_s"] = [statistics.median(r["times_s"]) for r in rounds]
    record["times_s"] = [t for r in rounds for t in r["times_s"]]
    record["cpu_times_s"] = [t for r in rounds for t in r["cpu_times_s"]]
    record["time_s"] = statistics.median(record["times_s"])
    record["cpu_time_s"] = statistics.median(record["cpu_times_s"])
    record["peak_mem_bytes"] = max(r["peak_mem_bytes"] for r in rounds)
    record["status"] = "ok"
    if record["flops"]:
        record["achieved_flops_per_s"] = record["flops"] / record["time_s"]
        record["fraction_of_peak"] = record["achieved_flops_per_s"] / peak


# ----------------------------------------------------------------------------- reporting

def format_record(r: dict[str, Any]) -> str:
    head = f"{r['mixer']:>10s} N={r['n']:>8d} B={r['batch']}"
    if r["status"] != "ok":
        return f"{head}  {r['status']}"
    rate = ""
    if r["achieved_flops_per_s"]:
        rate = f"  {r['achieved_flops_per_s'] / 1e9:7.1f} GFLOP/s"
    return (f"{head}  step {r['time_s']:8.3f} s  peak {r['peak_mem_bytes'] / 2 ** 20:9.1f} MiB"
            f"{rate}")


def format_table(records: list[dict[str, Any]]) -> str:
    """One line per N, one column per mixer: step time [s] / peak memory [MiB], or the
    first word of the status (``skipped``, ``failed``)."""
    mixers = list(dict.fromkeys(r["mixer"] for r in records))
    cell = {(r["mixer"], r["n"]): r for r in records}
    width = 22
    lines = [f"{'N':>9s}" + "".join(f"{m:>{width}s}" for m in mixers),
             f"{'':>9s}" + "".join(f"{'step s / peak MiB':>{width}s}" for _ in mixers)]
    for n in sorted({r["n"] for r in records}):
        row = f"{n:>9d}"
        for m in mixers:
            r = cell.get((m, n))
            if r is None:
                text = "-"
            elif r["status"] == "ok":
                text = f"{r['time_s']:.4g} / {r['peak_mem_bytes'] / 2 ** 20:.1f}"
            else:
                text = r["status"].split(":")[0]
            row += f"{text:>{width}s}"
        lines.append(row)
    return "\n".join(lines)


def ratios(records: list[dict[str, Any]], numerator: str = "flarepp",
           denominator: str = "flare") -> list[dict[str, Any]]:
    """Per N where both are measured: time and memory of ``numerator`` over ``denominator``;
    with several rounds also ``round_ratios`` (each round's median over the other's) and
    ``time_ratio_rounds``, their median."""
    ok = {(r["mixer"], r["n"]): r for r in records if r["status"] == "ok"}
    rows = []
    for n in sorted({r["n"] for r in records}):
        a, b = ok.get((numerator, n)), ok.get((denominator, n))
        if a and b:
            rows.append({"n": n, "time_ratio": a["time_s"] / b["time_s"],
                         "cpu_time_ratio": (a["cpu_time_s"] / b["cpu_time_s"]
                                            if a.get("cpu_time_s") and b.get("cpu_time_s")
                                            else None),
                         "mem_ratio": (a["peak_mem_bytes"] / b["peak_mem_bytes"]
                                       if b["peak_mem_bytes"] > 0 else math.nan)})
            pairs = list(zip(a.get("round_times_s", []), b.get("round_times_s", [])))
            if len(pairs) > 1 and len(a["round_times_s"]) == len(b["round_times_s"]):
                rows[-1]["round_ratios"] = [x / y for x, y in pairs]
                rows[-1]["time_ratio_rounds"] = statistics.median(rows[-1]["round_ratios"])
    return rows


def write_outputs(result: dict[str, Any], json_path: Path) -> dict[str, Path]:
    """JSON at ``json_path``, CSV and PNG beside it (same stem); returns the three paths."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    result = {**result, "flarepp_over_flare": ratios(result["records"])}
    json_path.write_text(json.dumps(result, indent=2))
    csv_path = json_path.with_suffix(".csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(RECORD_KEYS))
        writer.writeheader()
        for r in result["records"]:
            row = {k: r.get(k) for k in RECORD_KEYS}
            for key in ("times_s", "cpu_times_s"):
                if row[key] is not None:
                    row[key] = ";".join(f"{t:.6g}" for t in row[key])
            writer.writerow(row)
    png_path = json_path.with_suffix(".png")
    plot_scaling(result["records"], png_path)
    return {"json": json_path, "csv": csv_path, "png": png_path}


def plot_scaling(records: list[dict[str, Any]], path: Path) -> Path:
    """Log-log time and peak memory against N per mixer, and the FLARE++/FLARE ratios."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mixer in dict.fromkeys(r["mixer"] for r in records):
        pts = sorted((r["n"], r["time_s"], r["peak_mem_bytes"]) for r in records
                     if r["mixer"] == mixer and r["status"] == "ok")
        if pts:
            ns = [p[0] for p in pts]
            axes[0].loglog(ns, [p[1] for p in pts], "o-", label=mixer)
            axes[1].loglog(ns, [max(p[2], 1) / 2 ** 20 for p in pts], "o-", label=mixer)
    rows = ratios(records)
    if rows:
        axes[2].semilogx([r["n"] for r in rows], [r["time_ratio"] for r in rows], "o-",
                         label="step time")
        axes[2].semilogx([r["n"] for r in rows], [r["mem_ratio"] for r in rows], "s--",
                         label="peak memory")
        axes[2].axhline(1.0, color="gray", lw=0.8)
    else:
        axes[2].text(0.5, 0.5, "needs flare and flarepp", ha="center", transform=axes[2].transAxes)
    b = records[0] if records else {}
    axes[0].set(xlabel="tokens N", ylabel="forward + backward step [s]",
                title=f"step time (B={b.get('batch')}, {b.get('dtype')}, {b.get('device')})")
    axes[1].set(xlabel="tokens N", ylabel="peak memory above model + input [MiB]",
                title="peak memory")
    axes[2].set(xlabel="tokens N", ylabel="FLARE++ / FLARE", title="FLARE++ / FLARE")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
