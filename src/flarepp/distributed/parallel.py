"""Token-sharded context parallelism applied from outside a single-device model (App. B).

Shape letters: B batch, N tokens (N_r on rank r), C channels.

``cp = context_parallel(model, group)`` checks that every rank holds the same model,
copies group rank 0's parameters to the others, and routes every mixer's ``encode`` through
the exact distributed encoder (:mod:`flarepp.distributed.encoder`): FLARE then runs one
distributed encode per block, FLARE++ two (query synthesis, then value gathering), while
decodes, projections, norms and FFNs stay local to each rank's tokens. The model code is
untouched; ``cp.close()`` (or leaving ``with context_parallel(...)``) restores it.

A training step on rank r::

    x_r, y_r = cp.shard(x_BNI), cp.shard(y_BNO)       # contiguous token shards
    loss_r = loss_fn(model(x_r), y_r)                   # sum_r loss_r = the global loss
    loss_r.backward()
    cp.all_reduce_gradients()                           # every rank: the unsharded gradient
    optimizer.step()

Each rank's backward gives the partial gradient of every replicated parameter; the sum over
the group is exact (see the gradient convention in :mod:`flarepp.distributed.encoder`), and
:meth:`ContextParallel.all_reduce_gradients` forms it. A loss that needs global token sums
(relative L2) uses :func:`flarepp.distributed.global_sum` and back-propagates
``loss / world_size``. Failures never hang silently: mismatched model configs raise at wrap
time, mismatched latent shapes raise at the encode, and a dead rank surfaces as the
collective's error or the process group's timeout (set by
:func:`flarepp.distributed.mesh.launch`).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flarepp.distributed.encoder import distributed_encode_with_lse
from flarepp.distributed.shardable import (check_token_shardable, install_backend,
                                            restore_backends)
from flarepp.ops import AttentionBackend


class ContextParallelBackend(AttentionBackend):
    """Distributed ``encode`` over ``group``; ``decode`` local; full attention refused."""

    name = "context-parallel"

    def __init__(self, group: dist.ProcessGroup, *, check_shapes: bool | None = None) -> None:
        self.group = group
        self.check_shapes = check_shapes

    def encode(self, q, k, v, mask=None, *, scale=None):
        z, _ = distributed_encode_with_lse(q, k, v, mask, group=self.group, scale=scale,
                                           check_shapes=self.check_shapes)
        return z

    def self_attention(self, q, k, v, mask=None, *, scale=None):
        raise ValueError("context parallel: full self-attention cannot be split over token "
                         "shards exactly (each query needs every key); use a FLARE-family "
                         "mixer or run unsharded")


def shard_sizes(n_tokens: int, world_size: int) -> list[int]:
    """Contiguous near-even shard sizes: the first ``N mod R`` ranks get one token more."""
    base, extra = divmod(int(n_tokens), int(world_size))
    return [base + (r < extra) for r in range(world_size)]


def shard_slice(n_tokens: int, rank: int, world_size: int,
                sizes: list[int] | None = None) -> slice:
    """The token range of ``rank``; ``sizes`` (summing to N, zeros allowed) overrides the
    even split."""
    sizes = shard_sizes(n_tokens, world_size) if sizes is None else [int(s) for s in sizes]
    if len(sizes) != world_size or sum(sizes) != n_tokens or min(sizes) < 0:
        raise ValueError(f"shard sizes {sizes} must be {world_size} non-negative counts "
                         f"summing to N={n_tokens}")
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _flat_apply(tensors: list[torch.Tensor], collective) -> None:
    """Run ``collective`` on one flat buffer per (device, dtype) and copy the result back."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    for group_tensors in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        collective(flat)
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum every parameter's gradient over ``group`` (the unsharded model's gradient).

    A parameter that requires grad but received none on this rank contributes zeros, so
    every rank issues the same collectives.
    """
    grads = []
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    _flat_apply(grads, lambda flat: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group))


def _replica_description(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    return {
        "class": type(model).__qualname__,
        "config": json.loads(json.dumps(config.to_dict(), default=str))
        if hasattr(config, "to_dict") else None,
        "tensors": [[name, list(t.shape), str(t.dtype)]
                    for name, t in [*model.named_parameters(), *model.named_buffers()]],
    }


def check_replicas(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Raise on every rank unless all ranks hold the same model class, config and tensors."""
    mine = _replica_description(model)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    bad = [r for r, d in enumerate(everyone) if d != reference]
    if not bad:
        return
    lines = []
    for r in bad:
        other = everyone[r]
        for key in ("class", "config", "tensors"):
            a, b = reference[key], other[key]
            if key == "config" and isinstance(a, dict) and isinstance(b, dict):
                diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
                lines += [f"rank {r} config {k}={b.get(k)!r} vs rank 0 {a.get(k)!r}"
                          for k in diff]
            elif a != b:
                lines.append(f"rank {r} {key} differs from rank 0's")
    raise ValueError("context_parallel: the ranks hold different models; "
                     + "; ".join(lines or [f"ranks {bad} differ from rank 0"]))


def broadcast_parameters(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Copy group rank 0's parameters and buffers to every rank."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        tensors = [t.data for t in [*model.parameters(), *model.buffers()]]
        _flat_apply(tensors, lambda flat: dist.broadcast(flat, src=src, group=group))


class ContextParallel:
    """Handle returned by :func:`context_parallel`: sharding, reduction and gathering helpers."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup,
                 previous: list[tuple[nn.Module, AttentionBackend]]) -> None:
        self.model = model
        self.group = group
        self._previous = previous

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def shard(self, x: torch.Tensor | None, *, sizes: list[int] | None = None,
              dim: int = 1) -> torch.Tensor | None:
        """This rank's contiguous token shard of ``x`` (``[B, N, ...]`` or a ``[B, N]``
        mask) along ``dim``; ``None`` passes through."""
        if x is None:
            return None
        return x[(slice(None),) * dim + (shard_slice(x.shape[dim], self.rank,
                                                     self.world_size, sizes),)]

    def gather(self, x_r: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
        """Concatenate every rank's shard along ``dim`` in rank order (on every rank)."""
        return gather_tokens(x_r, self.group, dim=dim)

    def all_reduce_gradients(self) -> None:
        all_reduce_gradients(self.model, self.group)

    def close(self) -> None:
        """Give every mixer back the backend it had before :func:`context_parallel`."""
        restore_backends(self._previous)
        self._previous = []

    def __enter__(self) -> "ContextParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def context_parallel(model: nn.Module, group: dist.ProcessGroup, *,
                     sync_parameters: bool = True, check_shapes: bool | None = None
                     ) -> ContextParallel:
    """Shard ``model``'s tokens over ``group`` (paper App. B); returns a handle.

    Collective: every rank of ``group`` must call it. Raises ``ValueError`` if the model
    holds a mixer that cannot be token-sharded exactly or if the ranks' models differ;
    ``sync_parameters`` then copies group rank 0's weights to all ranks. ``check_shapes``
    (default: on under ``FLAREPP_DEBUG_CHECKS=1`` only, as it costs an all-reduce and a
    host sync per encode) makes ranks that disagree on the batch fail with an error.
    """
    check_token_shardable(model, "context_parallel")
    check_replicas(model, group)
    if sync_parameters:
        broadcast_parameters(model, group)
    previous = install_backend(model, ContextParallelBackend(group, check_shapes=check_shapes))
    return ContextParallel(model, group, previous)


def gather_tokens(x_r: torch.Tensor, group: dist.ProcessGroup, *, dim: int = 1
                  ) -> torch.Tensor:
    """All-gather uneven token shards ``[B, N_r, ...]`` into ``[B, N, ...]`` on every rank."""
    world = dist.get_world_size(group)
    size = torch.tensor([x_r.shape[dim]], dtype=torch.int64, device=x_r.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes_int = [int(s.item()) for s in sizes]
    longest = max(sizes_int)
    pad_shape = list(x_r.shape)
    pad_shape[dim] = longest - x_r.shape[dim]
    padded = torch.cat([x_r, x_r.new_zeros(pad_shape)], dim=dim).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes_int)], dim=dim)
