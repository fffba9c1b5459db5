"""Cross FLARE: mixing and conditioning in one encode (talk, Aim 1(b), "Cross FLARE").

Shape letters: B batch, N mesh tokens, K conditioning tokens, M latents, H heads, D head
width, C = H D channels.

The talk proposes to handle token mixing and conditioning "in one unified block" at cost
``O(2MN + MC)``: the latents gather from the mesh tokens *and* from a set of conditioning
tokens ``c`` (time, summaries of the previous states, parameters), and only the mesh tokens
read the latents back. Per head, with the same projections for both token sets,

    K = [X; c] W_K,   V = [X; c] W_V                          ([N + K, D])
    Z = softmax_{N+K}(s Q K^T) V                              (encode, [M, D])
    Y = softmax_M(s K_X Q^T) Z,   K_X = X W_K                  (decode, mesh tokens only)

so each latent is a convex combination of mesh and conditioning values: how much a latent
listens to the conditioning is learned through the same routing scores. The encode costs
``O(M (N + K) D)``, the decode ``O(N M D)``.

* ``flare-cross``: FLARE's fixed queries ``Q = Q_f`` (parameters ``3C^2 + MC``).
* ``flarepp-cross``: FLARE++'s synthesized queries (paper v2, Table 2), whose synthesis
  encode also reads ``[X; c]``: ``Q = N_0(Q_f) + sigmoid(gamma) SDPA(N_a(Q~), K~, K~)``
  with ``K~ = N_0([X; c] W~_K)``; parameters ``4C^2 + 2MC + H``.

The conditioning tokens come in already embedded to width C (the model owns that
embedding, :mod:`flarepp.models.conditioned`); they share the mixer's projections, so the
mixer has exactly the parameters of FLARE / FLARE++ and, called without conditioning
tokens, *is* FLARE / FLARE++. Masks: ``mask [B, N]`` for mesh tokens and
``conditioning_mask [B, K]`` for conditioning tokens (True = real) remove tokens from every
encode; masked mesh tokens' outputs are zero.
"""

from __future__ import annotations

import torch

from flarepp.mixers.base import check_tokens, zero_masked
from flarepp.mixers.flare import FLARE, FLAREPP, LowRankRouting
from flarepp.mixers.registry import MIXERS


def joint_tokens(x_BNC: torch.Tensor, mask_BN: torch.Tensor | None,
                 conditioning_BKC: torch.Tensor, conditioning_mask_BK: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[X; c]`` ``[B, N + K, C]`` and its mask (``None`` when both parts are all real)."""
    joint = torch.cat([x_BNC, conditioning_BKC.to(x_BNC.dtype)], dim=1)
    if mask_BN is None and conditioning_mask_BK is None:
        return joint, None
    B, N, K = x_BNC.shape[0], x_BNC.shape[1], conditioning_BKC.shape[1]
    def real(mask: torch.Tensor | None, n: int) -> torch.Tensor:
        return torch.ones(B, n, dtype=torch.bool, device=x_BNC.device) if mask is None \
            else mask

    return joint, torch.cat([real(mask_BN, N), real(conditioning_mask_BK, K)], dim=1)


class CrossRouting(LowRankRouting):
    """A FLARE-family mixer whose encodes also read conditioning tokens (module doc).

    ``forward(x [B, N, C], mask=None, *, conditioning=None [B, K, C],
    conditioning_mask=None [B, K])``. The routing (queries, keys, values) is the parent
    mixer's :meth:`route` applied to the joint token set; the decode uses the mesh tokens'
    keys only.
    """

    takes_conditioning = True
    # Conditioning tokens are replicated on every rank, so a sharded encode would count
    # them once per rank: not token-shardable as it stands.
    token_shardable = False

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                conditioning: torch.Tensor | None = None,
                conditioning_mask: torch.Tensor | None = None) -> torch.Tensor:
        if conditioning is None:
            if conditioning_mask is not None:
                raise ValueError("conditioning_mask given without conditioning tokens")
            return super().forward(x, mask)
        check_tokens(x, mask, self.config.dim)
        check_tokens(conditioning, conditioning_mask, self.config.dim, what="conditioning")
        if conditioning.shape[0] != x.shape[0]:
            raise ValueError(f"conditioning must have the batch size of x ({x.shape[0]}), "
                             f"got shape {list(conditioning.shape)}")
        N = x.shape[1]
        joint, joint_mask = joint_tokens(x, mask, conditioning, conditioning_mask)
        if joint_mask is not None:
            joint = joint.masked_fill(~joint_mask[..., None], 0.0)
        queries, keys, latents = self.route(joint, joint_mask)                  # Z [B,H,M,D]
        y = self.decode_tokens(keys[:, :, :N], queries, latents, mask)           # [B,H,N,D]
        return zero_masked(self.out_proj(self.merge_heads(y)), mask)


@MIXERS.register("flare-cross",
                 doc="Cross FLARE: FLARE whose encode also gathers from conditioning tokens")
class CrossFLARE(CrossRouting, FLARE):
    """FLARE (fixed queries) with conditioning tokens in its encode."""


@MIXERS.register("flarepp-cross",
                 doc="Cross FLARE++: FLARE++ whose encodes also gather from conditioning tokens")
class CrossFLAREPP(CrossRouting, FLAREPP):
    """FLARE++ (synthesized queries) with conditioning tokens in both of its encodes."""


__all__ = ["CrossFLARE", "CrossFLAREPP", "CrossRouting", "joint_tokens"]
