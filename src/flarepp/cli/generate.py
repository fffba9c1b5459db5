"""``flarepp generate CHECKPOINT --prompt TEXT``: sample bytes from a trained causal LM.

The prompt runs once through the parallel form; every new byte is one recurrent step
(for causal FLARE an ``O(H M D)`` state per block, whatever the length;
:func:`flarepp.models.causal_lm.generate`). The text goes to stdout, the timing and the
decoding state's size to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from flarepp.cli import CLIError
from flarepp.device import DEVICE_HELP


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
        return value
    return parse


def _generate(args: argparse.Namespace) -> int:
    import torch

    from flarepp.device import resolve_device
    from flarepp.models.causal_lm import generate
    from flarepp.models.decoding import state_bytes
    from flarepp.storage.checkpoint import load_causal_lm
    prompt = args.prompt.encode("utf-8")
    if not prompt:
        raise CLIError("--prompt must hold at least one character")
    if args.top_k is not None and args.top_k < 1:
        raise CLIError(f"--top-k must be >= 1, got {args.top_k}")
    device = resolve_device(args.device)
    model = load_causal_lm(args.checkpoint, device=device, ema=not args.live_weights)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    start = time.perf_counter()
    out = generate(model, ids, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, generator=generator)
    seconds = time.perf_counter() - start
    sys.stdout.write(bytes(out[0].tolist()).decode("utf-8", errors="replace") + "\n")
    with torch.no_grad():
        _, states = model.prefill(out[:, :-1])
    used, _ = state_bytes(states)
    print(f"[{model.config.mixer}: {args.max_new_tokens} bytes in {seconds:.2f} s, "
          f"{args.max_new_tokens / max(seconds, 1e-9):.0f} bytes/s on {device}; decoding "
          f"state after {out.shape[1] - 1} bytes: {used / 1024:.1f} KiB]", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a trained causal LM checkpoint "
                                        "(e.g. of the lm-tiny preset)")
    p.add_argument("checkpoint", help="a run's checkpoint, e.g. runs/lm-tiny/checkpoints/"
                                      "epoch_0008.pt")
    p.add_argument("--prompt", default="def ", help="text to continue (UTF-8 bytes)")
    p.add_argument("--max-new-tokens", type=_non_negative(int), default=200,
                   help="bytes to generate (default 200)")
    p.add_argument("--temperature", type=_non_negative(float), default=0.8,
                   help="softmax temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely bytes (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--live-weights", action="store_true",
                   help="use the trained weights instead of their EMA (the default)")
    p.set_defaults(func=_generate)
