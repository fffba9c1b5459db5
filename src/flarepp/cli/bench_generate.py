"""``flarepp bench generate``: time and state memory per generated token at long contexts.

Adds ``generate`` under the shared ``flarepp bench`` command (:mod:`flarepp.cli.bench`).
Causal FLARE's decoding state is ``B H M (D + 2)`` numbers per block at any context length;
causal attention's KV cache grows as ``2 B H L D``
(:mod:`flarepp.models.decoding`).
"""

from __future__ import annotations

import argparse

import torch

from flarepp.cli.bench import add_model_arguments, bench_subparsers, sizes, write_figures
from flarepp.device import DEVICE_HELP, resolve_device
from flarepp.models import build_model
from flarepp.models.decoding import format_points, measure_decoding, points_as_dicts
from flarepp.storage.checkpoint import load_causal_lm


def _bench_generate(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.checkpoint:
        models = [load_causal_lm(path, device=device) for path in args.checkpoint]
    else:
        torch.manual_seed(args.seed)
        models = [build_model("causal-lm", mixer=m.strip(), dim=args.dim, heads=args.heads,
                              blocks=args.blocks, latents=args.latents).to(device).eval()
                  for m in args.mixers.split(",") if m.strip()]
    points = []
    for model in models:
        c = model.config
        print(f"{c.mixer}: C={c.dim} H={c.heads} blocks={c.blocks} M={c.latents} on {device}",
              flush=True)
        points += measure_decoding(model, args.contexts, steps=args.steps, batch=args.batch,
                                   prefill_limit=args.prefill_limit, seed=args.seed)
    print("\n" + format_points(points))
    write_figures(args.json, {"device": str(device), "batch": args.batch,
                              "points": points_as_dicts(points)})
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_subparsers(sub).add_parser(
        "generate", help="time and state bytes per generated token against context length "
                         "(causal FLARE vs causal attention with a KV cache)")
    p.add_argument("--mixers", default="flare-causal,attention-causal",
                   help="comma-separated causal mixers (default flare-causal,attention-causal)")
    p.add_argument("--checkpoint", action="append",
                   help="measure a trained causal-lm instead (repeatable; overrides --mixers)")
    p.add_argument("--contexts", type=sizes, default=sizes("1k,8k,32k,64k"),
                   help="context lengths before the timed steps, k = 1024 (default "
                        "1k,8k,32k,64k)")
    p.add_argument("--steps", type=int, default=32, help="timed one-token steps per point")
    p.add_argument("--batch", type=int, default=1)
    add_model_arguments(p, dim=64, heads=4, latents=32, blocks=2)  # lm-tiny's
    p.add_argument("--prefill-limit", type=int, default=4096,
                   help="longest context whose KV cache is built by the quadratic parallel "
                        "form; longer ones get a cache of random keys/values of that length "
                        "(default 4096)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default torch's)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT.json", help="also write the points here")
    p.set_defaults(func=_bench_generate)
