"""Where a training step's time goes, FLARE against FLARE++ (or any two mixers), by op.

One training step of the Table 7 surrogate (C = 128, H = 8, M = 64, 8 blocks) on N random
points, after a warm-up step, under ``torch.profiler``; prints each op's self CPU time and
call count for both mixers and their difference, largest first.

Usage: python scripts/profile_mixers.py N [MIXER_A MIXER_B] [--threads T]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import flarepp


def op_times(mixer: str, n: int) -> dict[str, tuple[float, int]]:
    """``{op: (self CPU seconds, calls)}`` of one training step of the surrogate."""
    torch.manual_seed(0)
    model = flarepp.build_model("surrogate", in_dim=3, out_dim=1, mixer=mixer, dim=128,
                                heads=8, latents=64, blocks=8)
    x = torch.randn(1, n, 3)

    def step() -> None:
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int)
    parser.add_argument("mixers", nargs="*", default=["flare", "flarepp"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    a, b = (args.mixers + ["flare", "flarepp"])[:2]
    ta, tb = op_times(a, args.n), op_times(b, args.n)
    total_a, total_b = (sum(t for t, _ in d.values()) for d in (ta, tb))
    print(f"N={args.n}, {args.threads} threads, self CPU time of one step: {a} {total_a:.2f} s,"
          f" {b} {total_b:.2f} s, ratio {total_b / total_a:.3f}")
    for key in sorted(ta.keys() | tb.keys(), key=lambda k: -tb.get(k, (0, 0))[0])[:args.top]:
        (sa, ca), (sb, cb) = ta.get(key, (0.0, 0)), tb.get(key, (0.0, 0))
        print(f"{key[:55]:55s} {a} {sa:6.2f} s ({ca:4d})  {b} {sb:6.2f} s ({cb:4d})  "
              f"diff {sb - sa:+6.2f}")


if __name__ == "__main__":
    main()
