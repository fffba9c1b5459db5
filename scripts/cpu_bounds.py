"""Two bounds on what a hand-made CPU kernel could save FLARE++ (docs/cpu.md).

    python scripts/cpu_bounds.py N [--threads 2] [--rounds 7]

* ``norms``: one block's routing preparation at N tokens, forward + backward: the stacked
  projection ``[W~_K | W_K | W_V]`` alone; with FLARE++'s two per-head norms as the mixer
  runs them (``layer_norm`` copies the strided view of the projection); and with the norms
  fused by ``torch.compile`` (one generated loop over the strided view, forward and
  backward), i.e. what a fused per-head norm kernel would give.
* ``attention``: an encode (M queries over N keys) and a decode (N queries over M keys)
  through PyTorch's fused SDPA kernel against the same products materialised
  (``softmax(Q K^T) V`` as two GEMMs and a softmax).

Medians of interleaved rounds, in milliseconds, forward and backward apart; the Table 7
sizes (C = 128, H = 8, M = 64, D = 16), batch 1.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

C, H, M = 128, 8, 64
D = C // H


Case = tuple[Callable[[], tuple], Callable[..., tuple], Callable[[tuple], None]]
"""``(inputs, forward, backward)``: fresh leaf inputs (not timed), the forward on them, and
the backward through its outputs."""


def timed(case: Case) -> tuple[float, float]:
    """(forward, backward) seconds of one call of ``case`` on fresh inputs."""
    make_inputs, forward, backward = case
    inputs = make_inputs()
    start = time.perf_counter()
    out = forward(*inputs)
    middle = time.perf_counter()
    backward(out)
    return middle - start, time.perf_counter() - middle


def norm_variants(n: int) -> dict[str, Case]:
    x, weight = torch.randn(1, n, C), torch.randn(3 * C, C) / C ** 0.5
    scale, shift = torch.ones(D, requires_grad=True), torch.zeros(D, requires_grad=True)

    def split(p):
        return p.view(1, n, 3, H, D).unbind(2)

    def normed(p):
        synthesis, keys, values = split(p)
        return (F.layer_norm(synthesis, (D,)), F.layer_norm(keys, (D,), scale, shift), values)

    fused = torch.compile(normed, dynamic=False)

    def case(prepare) -> Case:
        return (lambda: (x.clone().requires_grad_(),),
                lambda leaf: prepare(F.linear(leaf, weight)),
                lambda outs: sum((t * (i + 1.1)).sum() for i, t in enumerate(outs)).backward())

    return {"projection alone": case(split), "with the norms": case(normed),
            "norms fused (torch.compile)": case(fused)}


def attention_variants(n: int) -> dict[str, Case]:
    def explicit(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=1.0)

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    def case(kind, fn) -> Case:
        if kind == "encode":   # M latent queries over N token keys and values
            make = lambda: (leaf(1, H, M, D), leaf(1, H, n, D), leaf(1, H, n, D))  # noqa: E731
        else:                  # N token queries over M latent keys and values
            make = lambda: (leaf(1, H, n, D), leaf(1, H, M, D), leaf(1, H, M, D))  # noqa: E731
        return make, fn, lambda out: out.sum().backward()

    return {f"{kind} {name}": case(kind, fn) for kind in ("encode", "decode")
            for name, fn in (("SDPA", sdpa), ("materialised", explicit))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for title, variants in (("norms", norm_variants(args.n)),
                            ("attention", attention_variants(args.n))):
        for case in variants.values():
            timed(case)  # warm-up (and compile)
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, case in variants.items():
                times[name].append(timed(case))
        print(f"{title}, N = {args.n}, {args.threads} threads, medians of {args.rounds}:")
        for name, values in times.items():
            fwd = statistics.median(v[0] for v in values)
            bwd = statistics.median(v[1] for v in values)
            print(f"  {name:32s} forward {1e3 * fwd:8.1f} ms   backward {1e3 * bwd:8.1f} ms")


if __name__ == "__main__":
    main()
