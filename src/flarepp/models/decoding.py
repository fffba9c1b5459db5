"""Decoding with a trained causal LM: loading it from a checkpoint, and the per-token cost of
generation at long contexts (state bytes and step time), FLARE against a KV cache.

Shape letters: B batch, L context length (tokens already seen), H heads, M latents,
D head width.

Per block, the decoding state after L tokens is ``B H M (D + 2)`` numbers for causal FLARE
(running maximum, denominator and weighted value sum per latent,
:class:`~flarepp.ops.causal.LatentState`; twice that for causal FLARE++) whatever L,
and ``2 B H L D`` numbers (keys and values) plus L validity flags for causal attention's
KV cache (:class:`~flarepp.mixers.causal.KVCache`). A FLARE step costs ``O(H M D)``, an
attention step ``O(H L D)``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from flarepp.mixers.causal import KVCache
from flarepp.models.causal_lm import CausalLM


def state_bytes(states: list[Any]) -> tuple[int, int]:
    """``(in use, allocated)`` bytes of a decoder's per-block states: a KV cache counts its
    first ``length`` slots as in use and its whole capacity as allocated."""
    used = sum(t.numel() * t.element_size() for s in states for t in s.tensors())
    allocated = 0
    for s in states:
        tensors = [s.keys, s.values, s.valid] if isinstance(s, KVCache) else s.tensors()
        allocated += sum(t.numel() * t.element_size() for t in tensors)
    return used, allocated


def synthetic_kv_states(model: CausalLM, batch: int, length: int, capacity: int,
                        generator: torch.Generator) -> list[KVCache]:
    """KV caches holding ``length`` random keys and values per block (standard normal):
    what a step costs depends on the cache length, not on its content, so beyond the
    context a quadratic prefill can afford these stand in for the prompt's caches."""
    states = model.initial_state(batch, capacity=capacity)
    for cache in states:
        for t in (cache.keys, cache.values):
            t[:, :, :length] = torch.randn(t[:, :, :length].shape, generator=generator,
                                           dtype=t.dtype).to(t.device)
        cache.valid[:, :length] = True
        cache.length = length
    return states


@dataclass
class DecodePoint:
    """One measurement: ``context`` tokens seen, then ``steps`` timed one-token steps."""

    mixer: str
    context: int
    prefill: str                # "parallel form" or "synthetic cache"
    step_ms_median: float
    step_ms_min: float
    state_bytes: int            # in use after the context
    state_bytes_allocated: int
    steps: int


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_decoding(model: CausalLM, contexts: list[int], *, steps: int = 32,
                     batch: int = 1, prefill_limit: int = 4096, seed: int = 0
                     ) -> list[DecodePoint]:
    """Step time and state size of ``model`` after each context length (module doc).

    The state after L tokens comes from the parallel form over L random tokens
    (:meth:`CausalLM.prefill`), except for KV caches beyond ``prefill_limit`` tokens, whose
    quadratic prefill is skipped: :func:`synthetic_kv_states` builds caches of the same
    length. Then ``steps`` tokens are appended one at a time and each step is timed.
    """
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    mixer = model.config.mixer
    quadratic = isinstance(model.initial_state(1, capacity=1)[0], KVCache)
    points = []
    for length in contexts:
        capacity = length + steps + 1
        if quadratic and length > prefill_limit:
            states = synthetic_kv_states(model, batch, length, capacity, generator)
            how = "synthetic cache"
        else:
            ids = torch.randint(0, model.config.vocab_size, (batch, length),
                                generator=generator).to(device)
            _, states = model.prefill(ids, capacity=capacity)
            how = "parallel form"
        used, allocated = state_bytes(states)
        token = torch.randint(0, model.config.vocab_size, (batch,), generator=generator)
        token = token.to(device)
        times = []
        for _ in range(steps):
            _synchronize(device)
            start = time.perf_counter()
            logits, states = model.step(token, states)
            _synchronize(device)
            times.append(time.perf_counter() - start)
            token = logits.argmax(-1)
        points.append(DecodePoint(mixer, length, how, 1e3 * statistics.median(times),
                                  1e3 * min(times), used, allocated, steps))
        del states
    return points


def format_points(points: list[DecodePoint]) -> str:
    """A fixed-width table of :func:`measure_decoding` results."""
    lines = [f"{'mixer':18s} {'context':>8s} {'ms/token':>9s} {'min ms':>8s} "
             f"{'state KiB':>10s} {'alloc KiB':>10s}  state built by"]
    for p in points:
        lines.append(f"{p.mixer:18s} {p.context:8d} {p.step_ms_median:9.3f} "
                     f"{p.step_ms_min:8.3f} {p.state_bytes / 1024:10.1f} "
                     f"{p.state_bytes_allocated / 1024:10.1f}  {p.prefill}")
    return "\n".join(lines)


def points_as_dicts(points: list[DecodePoint]) -> list[dict[str, Any]]:
    return [asdict(p) for p in points]


__all__ = ["DecodePoint", "format_points", "measure_decoding",
           "points_as_dicts", "state_bytes", "synthetic_kv_states"]
