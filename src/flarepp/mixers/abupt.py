"""AB-UPT anchor attention as a token mixer (Alkin et al., 2025; paper Table 9).

Shape letters: B batch, N tokens, A anchors, H heads, D head width, C channels.

AB-UPT splits the points into A *anchor* tokens and the rest; anchors self-attend and every
other token cross-attends to the anchors only, so the mixer costs O(N A):

    ``[Q | K | V] = X W_QKV``,  ``Y_h = softmax_A(s Q_h K_h[anchors]^T) V_h[anchors]``,
    output ``Y W_O``

-- one attention in which all N tokens (anchors included) are queries and only the anchors
are keys and values. Projections are those of full self-attention (``W_QKV`` without bias,
``W_O`` with bias), so the parameter count equals the attention mixer's (Table 10).
The anchor budget is fixed at ``anchors = 512`` on every dataset (Table 9) and does not
follow the backbone's ``latents``; with ``N <= anchors`` every real token is an anchor and
the mixer is exactly full self-attention.

How anchors are drawn (only real tokens are ever anchors):

* training mode: a fresh uniform subset of ``anchors`` real tokens per sample and per
  call, without replacement, from the global torch generator (AB-UPT trains on random
  anchor subsets). Each block draws its own subset.
* eval mode: a deterministic subset -- the first ``anchors`` entries of
  ``randperm(n_real)`` from a CPU generator seeded with ``anchor_seed``, taken among the
  real tokens in their input order. It depends only on ``(anchor_seed, n_real)``, so every
  block uses the same anchors, repeated calls agree, padding does not change it, and a
  padded batch equals its samples run one at a time.

Because the anchors are picked by position, permuting the tokens changes which tokens are
anchors once ``N > anchors``: the mixer is not permutation-equivariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flarepp.mixers.base import Mixer, MixerConfig, check_tokens
from flarepp.mixers.registry import MIXERS


@dataclass(kw_only=True)
class AnchorAttentionConfig(MixerConfig):
    """``anchors``: the anchor budget A (512 throughout the paper); ``anchor_seed``: the
    seed of the deterministic eval-mode anchor set."""

    anchors: int = 512
    anchor_seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.anchors <= 0:
            raise ValueError(f"anchors must be positive, got {self.anchors}")


def eval_anchor_order(n_real: int, seed: int) -> torch.Tensor:
    """The deterministic ranking of ``n_real`` real tokens for eval-mode anchors (CPU)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(n_real, generator=generator)


@MIXERS.register("abupt", doc="AB-UPT anchor attention: every token attends to 512 anchors")
class AnchorAttention(Mixer):
    """All tokens attend to A anchor tokens sampled from the real input points."""

    config_cls = AnchorAttentionConfig
    permutation_equivariant = False  # anchors are chosen by position once N > anchors
    stochastic_in_training = True    # random anchor subsets in training mode

    def __init__(self, config: AnchorAttentionConfig) -> None:
        super().__init__(config)
        self.qkv_proj = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out_proj = nn.Linear(config.dim, config.dim)

    def anchor_indices(self, mask: torch.Tensor | None, batch: int, n_tokens: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(index [B, A], valid [B, A])`` of the anchors, or ``None`` when every real
        token is an anchor. Samples with fewer than A real tokens pad with invalid slots."""
        n_real = (torch.full((batch,), n_tokens, device=device) if mask is None
                  else mask.sum(dim=1))
        A = self.config.anchors
        if int(n_real.max()) <= A:
            return None
        real = (torch.ones(batch, n_tokens, dtype=torch.bool, device=device)
                if mask is None else mask)
        if self.training:
            # A uniform random subset: the A smallest of i.i.d. uniform keys over real tokens.
            keys = torch.rand(batch, n_tokens, device=device).masked_fill(~real, 2.0)
            index = keys.topk(A, dim=1, largest=False).indices
        else:
            # Rank real tokens by a permutation that depends only on (seed, n_real).
            rank = torch.full((batch, n_tokens), n_tokens, dtype=torch.long, device=device)
            positions = torch.cumsum(real.long(), dim=1) - 1        # k for the k-th real
            for count in torch.unique(n_real).tolist():
                order = eval_anchor_order(int(count), self.config.anchor_seed).to(device)
                rank_of_kth = torch.empty_like(order)
                rank_of_kth[order] = torch.arange(int(count), device=device)
                rows = n_real == count
                k = positions[rows].clamp(min=0, max=int(count) - 1)
                rank[rows] = torch.where(real[rows], rank_of_kth[k], rank[rows])
            index = rank.topk(A, dim=1, largest=False).indices
        valid = torch.gather(real, 1, index)
        return index, valid

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        q, k, v = self.split_projections(self.qkv_proj(x), 3)                # [B,H,N,D]
        B, N = x.shape[:2]
        anchors = self.anchor_indices(mask, B, N, x.device)
        anchor_mask = mask
        if anchors is not None:
            index, anchor_mask = anchors
            gather = index[:, None, :, None].expand(-1, self.heads, -1, self.head_dim)
            k, v = torch.gather(k, 2, gather), torch.gather(v, 2, gather)    # [B,H,A,D]
        # All N tokens query the anchors (an encode with N queries and A keys).
        y = self.backend.encode(q, k, v, anchor_mask, scale=self.config.attn_scale)
        y = self.out_proj(self.merge_heads(y))
        return y if mask is None else y.masked_fill(~mask[..., None], 0.0)
