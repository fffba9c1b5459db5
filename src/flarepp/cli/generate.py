"""``flarepp generate CHECKPOINT --prompt TEXT``: sample bytes from a trained causal LM.

The prompt runs once through the parallel form; every new byte is one recurrent step
(for causal FLARE an ``O(H M D)`` state per block, whatever the length;
:func:`flarepp.models.causal_lm.generate_stream`). The text goes to stdout byte by byte as
it is sampled, flushed each time, so a long request shows its output at once and Ctrl-C or
SIGTERM stops it with everything generated so far written (exit 130 / 143); the timing and
the decoding state's size go to stderr. The bytes are written as sampled, not decoded: a
byte model's output need not be UTF-8. A request whose KV cache (causal attention) would
not fit what the device may still allocate (on the host: free memory, the address-space
and cgroup limits) is refused before any work.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from flarepp.allocator import is_allocation_failure
from flarepp.cli import CLIError, Terminated, at_least
import flarepp.device
from flarepp.device import DEVICE_HELP, resolve_device
from flarepp.models.causal_lm import generate_stream
from flarepp.models.decoding import state_bytes
from flarepp.storage.checkpoint import load_causal_lm
from flarepp.storage.rundir import RunDir


def _finite_non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _check_memory(model, prompt_tokens: int, new_tokens: int, device) -> None:
    """Refuse a request whose decoding state cannot fit what ``device`` may still allocate
    (free memory, and on the host the process's address-space, data and cgroup limits,
    :func:`flarepp.device.memory_bounds`; the tightest is named).

    Causal attention's KV cache grows by ``2 H D`` numbers per block and token and is
    reserved for the prompt and every new token up front; causal FLARE's state has a fixed
    size, so only time bounds its request (and the output is streamed)."""
    per_token = (state_bytes(model.initial_state(1, capacity=2))[1]
                 - state_bytes(model.initial_state(1, capacity=1))[1])
    if per_token <= 0:
        return
    # looked up when called: a test (or an embedding program) may bound it otherwise
    bound, free = min(flarepp.device.memory_bounds(device).items(), key=lambda item: item[1])
    need = per_token * (prompt_tokens + new_tokens)
    if need > free:
        fits = max(free // per_token - prompt_tokens, 0)
        raise CLIError(f"--max-new-tokens {new_tokens}: {model.config.mixer}'s KV cache for "
                       f"{prompt_tokens + new_tokens} tokens needs {need / 2**30:.1f} GiB, "
                       f"more than the {free / 2**30:.1f} GiB {bound} leaves on {device}; "
                       f"at most {fits} new tokens fit")


def _generate(args: argparse.Namespace) -> int:
    prompt = args.prompt.encode("utf-8")
    if not prompt:
        raise CLIError("--prompt must hold at least one character")
    device = resolve_device(args.device)
    model = load_causal_lm(args.checkpoint, device=device, ema=not args.live_weights)
    _check_memory(model, len(prompt), args.max_new_tokens, device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    # The sampled bytes themselves, not a decoding of them: a byte model's output need not
    # be UTF-8 (and stdout's encoding need not hold every character).
    sys.stdout.flush()
    out = sys.stdout.buffer
    produced, states, stopped = 0, None, None
    start = time.perf_counter()
    out.write(prompt)
    out.flush()
    try:
        for token, states in generate_stream(model, ids, args.max_new_tokens,
                                             temperature=args.temperature, top_k=args.top_k,
                                             generator=generator):
            out.write(bytes([int(token[0])]))  # each byte as it is sampled
            out.flush()
            produced += 1
    except (KeyboardInterrupt, Terminated) as err:
        stopped = err
    except BrokenPipeError:   # the reader went away (`| head`): stop, as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        stopped = "the reader closed the output"
    except RuntimeError as err:   # the allocator, past what _check_memory could foresee
        if not is_allocation_failure(err):
            raise
        raise MemoryError(f"the decoding state for {len(prompt) + args.max_new_tokens} "
                          f"tokens could not be allocated on {device} "
                          f"({str(err).splitlines()[0]})") from None
    seconds = time.perf_counter() - start
    if not isinstance(stopped, str):
        out.write(b"\n")
        out.flush()
    used = state_bytes(states)[0] if states is not None else 0
    names = {KeyboardInterrupt: "SIGINT", Terminated: "SIGTERM"}
    how = ("" if stopped is None else
           f"stopped ({stopped}) " if isinstance(stopped, str) else
           f"stopped by {names[type(stopped)]} ")
    if stopped is not None:
        how += f"after {produced} of {args.max_new_tokens} bytes, all written; "
    print(f"[{model.config.mixer}: {how}{produced} bytes in {seconds:.2f} s, "
          f"{produced / max(seconds, 1e-9):.0f} bytes/s on {device}; decoding state after "
          f"{len(prompt) + max(produced - 1, 0)} bytes: {used / 1024:.1f} KiB]",
          file=sys.stderr)
    if isinstance(stopped, BaseException):
        raise stopped
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a trained causal LM checkpoint "
                                        "(e.g. of the lm-tiny preset)")
    p.add_argument("checkpoint", help=f"a run's checkpoint, e.g. "
                                      f"runs/lm-tiny/{RunDir.CHECKPOINTS}/epoch_0008.pt")
    p.add_argument("--prompt", default="def ", help="text to continue (UTF-8 bytes)")
    p.add_argument("--max-new-tokens", type=at_least(0), default=200,
                   help="bytes to generate (default 200), written as they are sampled")
    p.add_argument("--temperature", type=_finite_non_negative, default=0.8,
                   help="softmax temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=at_least(1), default=None,
                   help="sample among the k most likely bytes (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--live-weights", action="store_true",
                   help="use the trained weights instead of their EMA (the default)")
    p.set_defaults(func=_generate)
