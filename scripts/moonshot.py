"""A mesh too large for memory, inferred exactly by ``flarepp infer`` with the hidden state on disk.

    python scripts/moonshot.py CKPT --n 100M --chunk-size 65536 --precision bf16 \\
        --work DIR [--exact-n 1M] [--threads 2]

1. Random inputs ``x [1, N, in]`` (uniform in [0, 1), seed 0) for the checkpoint's model,
   written to ``DIR/x_<N>.npz``, and the first ``--exact-n`` of them to ``DIR/x_<n>.npz``.
2. Exactness on the small mesh, in FP32: ``flarepp infer`` unchunked against ``flarepp infer
   --chunk-size K --hidden-on memmap``: the largest difference of the predictions and the
   largest prediction (block-wise streaming computes the same function, Appendix B's
   log-sum-exp merge; only the order of the floating-point sums differs). A 16-bit
   ``--precision``'s own error is measured on trained checkpoints (``flarepp eval
   --precision``), not here.
3. The large mesh: ``flarepp infer --chunk-size K --precision P --hidden-on memmap
   --memmap-dir DIR`` in a child process, sampled every ``--every`` seconds: its resident
   memory (``VmRSS``, split into anonymous memory, ``RssAnon``, and pages of mapped files,
   ``RssFile``, which the kernel may drop), the disk the memory-mapped hidden state holds
   (its file is deleted once mapped, with its space reserved whole: the size of its mapping
   in ``/proc/PID/maps``), and the host's ``MemAvailable``. Peaks and the wall time go to ``DIR/moonshot.json``.

Every number is measured in this run; nothing is estimated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


def parse_count(text: str) -> int:
    scale = {"k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def infer_cmd(ckpt: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flarepp", "infer", ckpt, "--data", str(data), "--out",
            str(out), *extra]


def infer(ckpt: str, data: Path, out: Path, *extra: str, env: dict) -> None:
    subprocess.run(infer_cmd(ckpt, data, out, *extra), check=True, env=env)


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile``, ``VmHWM`` of ``pid`` in bytes ({} once gone)."""
    keys = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(line.split()[1]) * 1024 for line in f for k in keys
                    if line.startswith(k + ":")}
    except OSError:
        return {}


def mapped_bytes(pid: int, directory: Path) -> int:
    """Bytes of the files under ``directory`` that process ``pid`` maps (0 once it is gone):
    the hidden state, whose file is deleted once mapped and whose blocks are all reserved."""
    prefix = os.path.realpath(directory) + os.sep
    total = 0
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(prefix):
                    start, end = (int(v, 16) for v in fields[0].split("-"))
                    total += end - start
    except OSError:
        return 0
    return total


def disk_bytes(directory: Path) -> int:
    """Bytes of disk the files under ``directory`` occupy (allocated blocks): what a run
    left there."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def watched(cmd: list[str], memmap_dir: Path, every: float, env: dict, log: Path) -> dict:
    """Run ``cmd``; sample its memory and the memmap directory's disk use until it ends."""
    peaks = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "VmHWM": 0, "disk": 0}
    low_available = mem_available()
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        done = threading.Event()

        def sample() -> None:
            nonlocal low_available
            while not done.wait(every):
                for k, v in proc_status(proc.pid).items():
                    peaks[k] = max(peaks[k], v)
                peaks["disk"] = max(peaks["disk"], mapped_bytes(proc.pid, memmap_dir))
                low_available = min(low_available, mem_available())

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        code = proc.wait()
        done.set()
        thread.join()
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {code}; see {log}")
    return {"wall_s": time.perf_counter() - start, "peak_bytes": peaks,
            "min_mem_available_bytes": low_available,
            "disk_left_bytes": disk_bytes(memmap_dir)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--n", type=parse_count, default=100_000_000)
    parser.add_argument("--exact-n", type=parse_count, default=1_000_000)
    parser.add_argument("--chunk-size", type=int, default=65536)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--work", required=True, help="inputs, predictions, memmap, report")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--skip-exact", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    from flarepp.train import load_trained_model
    config = load_trained_model(args.checkpoint).model.config
    report: dict = {"checkpoint": args.checkpoint, "n": args.n, "chunk_size": args.chunk_size,
                    "precision": args.precision, "threads": args.threads,
                    "model": {k: getattr(config, k, None) for k in
                              ("mixer", "in_dim", "out_dim", "dim", "heads", "latents",
                               "blocks")}}
    print("model:", report["model"], flush=True)

    big, small = work / f"x_{args.n}.npz", work / f"x_{args.exact_n}.npz"
    if not big.exists():
        x = np.random.default_rng(0).random((1, args.n, config.in_dim), dtype=np.float32)
        np.savez(small, x=x[:, :args.exact_n])
        np.savez(big, x=x)
        del x
    chunk = ["--chunk-size", str(args.chunk_size)]
    if not args.skip_exact:
        full, streamed = work / "exact_full.npz", work / "exact_streamed.npz"
        infer(args.checkpoint, small, full, "--precision", "fp32", env=env)
        infer(args.checkpoint, small, streamed, *chunk, "--precision", "fp32", "--hidden-on",
              "memmap", "--memmap-dir", str(work), env=env)
        a, b = np.load(full)["pred"], np.load(streamed)["pred"]
        report["exact"] = {"n": args.exact_n, "max_abs_diff": float(np.abs(a - b).max()),
                           "max_abs_pred": float(np.abs(a).max())}
        print("exactness:", report["exact"], flush=True)

    memmap_dir = work / "hidden"
    memmap_dir.mkdir(exist_ok=True)
    cmd = infer_cmd(args.checkpoint, big, work / "pred.npz", *chunk, "--precision",
                    args.precision, "--hidden-on", "memmap", "--memmap-dir", str(memmap_dir))
    print(" ".join(cmd[2:]), flush=True)
    report["large"] = watched(cmd, memmap_dir, args.every, env, work / "infer.log")
    report["large"]["input_bytes"] = big.stat().st_size
    report["large"]["output_bytes"] = (work / "pred.npz").stat().st_size
    (work / "moonshot.json").write_text(json.dumps(report, indent=1))
    gib = 2 ** 30
    peaks = report["large"]["peak_bytes"]
    print(f"{args.n:,} points in {report['large']['wall_s']:.0f} s; peak resident "
          f"{peaks['VmRSS'] / gib:.2f} GiB (anonymous {peaks['RssAnon'] / gib:.2f}, mapped "
          f"files {peaks['RssFile'] / gib:.2f}); hidden state on disk up to "
          f"{peaks['disk'] / gib:.2f} GiB; lowest MemAvailable "
          f"{report['large']['min_mem_available_bytes'] / gib:.2f} GiB; "
          f"report {work / 'moonshot.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
