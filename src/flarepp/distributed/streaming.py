"""Exact streaming inference: a mesh of any size through a single-device model in chunks.

Shape letters: B batch, N tokens, K chunk size, H heads, M latents, D head width.

A FLARE-family model is pointwise in the tokens except for its encodes, each of which
reduces all N tokens to ``Z [B, H, M, D]``. Encode ``e`` (in forward order) depends on the
tokens only through pointwise maps and the earlier encodes' latents. So the exact forward
runs in passes over chunks of K tokens:

* pass ``e``: for every chunk, run the model up to encode ``e`` using the finished latents
  ``Z_0 .. Z_{e-1}`` for the earlier encodes, compute the chunk's partial ``(Z_c, L_c)``
  with the fused kernel and merge it into a running ``(Z, L)`` by the log-sum-exp rule of
  eq. 33 (``L = logsumexp(L, L_c)``, ``Z = exp(L_old - L) Z + exp(L_c - L) Z_c``), then stop
  that chunk's forward. FLARE needs one such pass per block; FLARE++ two (its synthesis
  encode is complete over all chunks before the value-gathering encode starts);
* last pass: run every chunk through the whole model with all latents known and write
  its outputs.

Live memory is O(K C) activations plus O(B H M D) per encode and the inputs and outputs
themselves, independent of N; the price is recomputation: pass ``e`` replays the model up
to encode ``e``, about ``E/2 + 1`` full forwards for ``E`` encodes. With a process group,
each pass's merged partial is further merged across ranks (streaming within each rank's
shard, exact over the whole mesh).

The driver swaps in :class:`StreamingBackend` for the duration of the call and restores the
mixers' backends afterwards; the model code is not touched. Inference only (no autograd).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from flarepp.distributed.encoder import merge_across_ranks
from flarepp.distributed.shardable import (check_token_shardable, install_backend,
                                            restore_backends)
from flarepp.ops import AttentionBackend, encode_with_lse, merge_partials


class _EncodeReached(Exception):
    """Raised by the streaming backend to end a chunk's forward once its partial is taken."""


class StreamingBackend(AttentionBackend):
    """Serves finished latents for earlier encodes and accumulates the target encode."""

    name = "streaming"

    def __init__(self) -> None:
        self.latents: list[torch.Tensor] = []   # finished Z per encode, in forward order
        self.queries: list[torch.Tensor] = []   # the queries each Z was computed with
        self.target = 0                         # the encode being accumulated in this pass
        self.calls = 0                          # encodes seen in the current chunk's forward
        self.partial: tuple[torch.Tensor, torch.Tensor] | None = None  # running (Z, L)
        self.partial_query: torch.Tensor | None = None
        self.partial_dtype: torch.dtype | None = None  # the dtype encode() would return

    def start_chunk(self) -> None:
        self.calls = 0

    def _check_query(self, q: torch.Tensor, reference: torch.Tensor, index: int) -> None:
        # The latents of encode `index` are only valid for the queries they were computed
        # with; queries that vary between chunks mean the model is not streamable.
        if q.shape != reference.shape or not torch.allclose(q, reference, rtol=1e-5,
                                                            atol=1e-6):
            raise RuntimeError(f"streaming: encode {index} received different queries in "
                               "different chunks; its queries depend on the chunk's tokens "
                               "outside the latent encodes, so the model cannot be streamed")

    def encode(self, q, k, v, mask=None, *, scale=None):
        index = self.calls
        self.calls += 1
        if index < len(self.latents):
            self._check_query(q, self.queries[index], index)
            return self.latents[index]
        z_c, lse_c = encode_with_lse(q, k, v, mask, scale=scale)
        self.partial_dtype = z_c.dtype
        z_c = z_c.to(lse_c.dtype)  # accumulate in float32 (float64) across chunks
        if self.partial is None:
            self.partial, self.partial_query = (z_c, lse_c), q
        else:
            self._check_query(q, self.partial_query, index)
            z, lse = self.partial
            self.partial = merge_partials(torch.stack([z, z_c]), torch.stack([lse, lse_c]))
        raise _EncodeReached

    def finish_pass(self, group: dist.ProcessGroup | None) -> None:
        """Turn the running partial into encode ``target``'s latents (merged over ``group``)."""
        z, lse = self.partial
        if group is not None:
            z, lse = merge_across_ranks(z, lse, group)
        self.latents.append(z.to(self.partial_dtype))
        self.queries.append(self.partial_query)
        self.partial, self.partial_query = None, None
        self.target += 1

    def self_attention(self, q, k, v, mask=None, *, scale=None):
        raise ValueError("streaming: full self-attention cannot be computed chunk by chunk "
                         "exactly; use a FLARE-family mixer or the unchunked forward")


def _chunks(n_tokens: int, chunk_size: int) -> list[slice]:
    """Slices of at most ``chunk_size`` tokens; one empty slice when there are no tokens."""
    count = max(1, math.ceil(n_tokens / chunk_size))
    return [slice(i * chunk_size, min(n_tokens, (i + 1) * chunk_size)) for i in range(count)]


def stream_forward(model: nn.Module, x_BNI: torch.Tensor, mask_BN: torch.Tensor | None = None,
                   *, chunk_size: int, device: torch.device | str | None = None,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``model(x, mask)`` computed exactly in chunks of ``chunk_size`` tokens.

    ``x`` and ``mask`` may stay on the host; each chunk is moved to ``device`` (default: the
    model's) and the outputs are written back to ``x``'s device. With ``group``, ``x`` is
    this rank's token shard and the encodes are merged across the group as well (call it
    on every rank). Raises ``ValueError`` for a model with a mixer that cannot stream.
    """
    check_token_shardable(model, "stream_forward")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if device is None:
        device = next(model.parameters()).device
    backend = StreamingBackend()
    previous = install_backend(model, backend)
    chunks = _chunks(x_BNI.shape[1], chunk_size)
    try:
        with torch.no_grad():
            while True:
                y_BNO, reached = None, 0
                for sl in chunks:
                    backend.start_chunk()
                    x_c = x_BNI[:, sl].to(device)
                    m_c = None if mask_BN is None else mask_BN[:, sl].to(device)
                    try:
                        y_c = model(x_c, m_c)
                    except _EncodeReached:
                        reached += 1
                        continue
                    if y_BNO is None:
                        y_BNO = y_c.new_empty((y_c.shape[0], x_BNI.shape[1], *y_c.shape[2:]),
                                              device=x_BNI.device)
                    y_BNO[:, sl] = y_c
                if reached == 0:
                    return y_BNO
                if reached != len(chunks):
                    raise RuntimeError(f"streaming: encode {backend.target} was reached in "
                                       f"{reached} of {len(chunks)} chunks; the model's "
                                       "control flow depends on the chunk")
                backend.finish_pass(group)
    finally:
        restore_backends(previous)
