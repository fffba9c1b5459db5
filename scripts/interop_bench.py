"""PhysicsNeMo's FLARE against the same weights imported into flarepp: time and memory.

    PYTHONPATH=SCRATCH/site:src python scripts/interop_bench.py [--n 4096,16384] [--rounds 5]
                                                             [--write-model FILE.mdlus]

Run in the scratch environment of ``scripts/make_import_fixtures.py`` (PhysicsNeMo 2.2.2
importable, its torchvision stand-in applied here), one process, one thread, CPU. It builds
release 2.2's ``FLARE`` at its default width (C=256, H=8, M=32, 4 blocks, MLP ratio 4) with
3 embedding and 3 functional inputs and 4 outputs, saves it with ``Module.save``, imports the
``.mdlus`` with ``flarepp.interop`` (float32), checks both compute the same outputs, and
times forward + backward (loss ``mean(y^2)``, gradients of every parameter and the input)
for each N in interleaved rounds (the order alternates), reporting medians. Memory per
step: the bytes autograd saves for the backward (unique storages, deterministic) and the
resident-set high-water mark above the step's start (freed heap returned to the system
with ``malloc_trim`` first). ``--write-model`` keeps the ``.mdlus`` (for ``flarepp import``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ARGS = dict(functional_dim=3, out_dim=4, embedding_dim=3, n_layers=4, n_hidden=256, n_head=8,
            slice_num=32, mlp_ratio=4, use_te=False)


def their_model(path: Path):
    sys.modules["torchvision._meta_registrations"] = types.ModuleType(
        "torchvision._meta_registrations")
    from physicsnemo.models.flare import FLARE
    torch.manual_seed(0)
    model = FLARE(**ARGS)
    model.save(str(path))
    return model


def saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves for the backward during ``step()``."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def measure(forward, x: torch.Tensor, model) -> dict:
    from flarepp.bench.memory import peak_rss_since, reset_peak_rss
    libc = ctypes.CDLL("libc.so.6")

    def step():
        model.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        forward(xi).square().mean().backward()
    libc.malloc_trim(0)
    base = reset_peak_rss()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rss": peak_rss_since(base)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="4096,16384")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write-model", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from flarepp.interop import import_mdlus
    with tempfile.TemporaryDirectory() as tmp:
        path = args.write_model or Path(tmp) / "flare.mdlus"
        theirs = their_model(path).train()
        ours = import_mdlus(path).model().float().train()
    E = ARGS["embedding_dim"]
    impls = {"physicsnemo": (theirs, lambda x: theirs(x[..., E:], embedding=x[..., :E])),
             "flarepp": (ours, lambda x: ours(x))}
    rows = []
    for n in (int(v) for v in args.n.split(",")):
        x = torch.randn(1, n, E + ARGS["functional_dim"], generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            a, b = (f(x) for _, f in impls.values())
        diff = float((a - b).abs().max() / a.abs().max())
        result = {name: {"seconds": [], "rss": []} for name in impls}
        saved = {name: saved_bytes(lambda: f(x.requires_grad_(True)).square().mean())
                 for name, (_, f) in impls.items()}
        for r in range(args.rounds):
            order = list(impls) if r % 2 == 0 else list(reversed(impls))
            for name in order:
                model, f = impls[name]
                m = measure(f, x, model)
                result[name]["seconds"].append(m["seconds"])
                result[name]["rss"].append(m["rss"])
        for name in impls:
            rows.append({"n": n, "impl": name,
                         "median_s": statistics.median(result[name]["seconds"]),
                         "rounds_s": result[name]["seconds"],
                         "saved_for_backward_mib": saved[name] / 2**20,
                         "median_peak_rss_mib": statistics.median(result[name]["rss"]) / 2**20,
                         "max_rel_diff_vs_physicsnemo": diff})
        x.requires_grad_(False)
    print(json.dumps(rows, indent=1))
    print("| N | implementation | fwd+bwd median s | saved for backward MiB | peak RSS MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['impl']} | {r['median_s']:.3f} | "
              f"{r['saved_for_backward_mib']:.1f} | {r['median_peak_rss_mib']:.1f} |")


if __name__ == "__main__":
    main()
