"""Higher-order linear attention: multilinear attention and triple attention.

Shape letters: B batch, H heads, N tokens, D head width, C = H*D channels, L order.

The talk ("FLARE + high order attention ideas", "Notes on high-order attention") starts
from 2-simplicial attention, whose trilinear scores ``A_ijk = sum_d Q_id K1_jd K2_kd``
weigh pairs of tokens, and removes the softmax so that associativity applies:

* **Multilinear attention** ("Proposal 1"). ``Y_id = sum_{j,k} A_ijk V1_jd V2_kd`` factors
  as ``Y = Q (S_1 ⊙ S_2)`` with ``S_l = K_l^T V_l [D, D]``; order L generalises it to
  ``Y = Q (S_1 ⊙ ... ⊙ S_L)``, the L-simplicial sum over L-tuples of tokens. ``O(L N D^2)``.
* **Triple attention** ("Proposal 2", higher-order memory). A ``D x D x D`` state
  ``S_ijk = sum_n K1_ni V_nj K2_nk`` and ``Y_nj = sum_{i,k} Q1_ni S_ijk Q2_nk``. Equivalently
  ``Y_n = sum_m (q1_n . k1_m)(q2_n . k2_m) v_m``: linear attention with the tensor-product
  feature map ``phi(q1, q2) = q1 ⊗ q2`` of width D^2 (the talk's "kernel-based
  interpretation"); that is how it is computed, ``O(N D^3)`` work, ``O(N D^2)`` memory.

Choices, per head (the talk leaves them open):

* **Scaling by 1/N** with N the number of real tokens, for every token sum: ``S_l =
  K_l^T V_l / N`` and ``S = (1/N) sum_n ...``. It is the talk's scaling for triple attention;
  for multilinear attention it keeps the output's size independent of N (the L-fold token
  sum grows like N^L otherwise, and overflows 16-bit formats at a few thousand tokens).
* **No feature map and no row normalisation**: the talk's linearisation of 2-simplicial
  attention uses the raw multilinear forms; the feature map ``phi`` and ``rownorm`` it
  shows belong to its review of linear attention. Queries, keys and values are plain
  projections ``X W``.
* Projections: one stacked bias-free GEMM for all queries, keys and values, and an output
  projection with bias, as in the ``attention`` mixer; initialised near the identity
  (paper A.5, as the FLARE mixers), since the products of several ``N(0, 0.02^2)``
  projections would start the mixer at a vanishing output.

Masks: masked tokens are left out of every state and of N; their outputs are zero. No
attention backend is involved (there is no softmax for one to replace); the tests check
both mixers against the token-tuple forms above, written out explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flarepp.mixers.base import (Mixer, MixerConfig, check_tokens, near_identity_linear,
                                 zero_masked)
from flarepp.mixers.registry import MIXERS


def _real_count(t_BHND: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``N`` per sample as ``[B, 1, 1, 1]`` (at least 1: an all-masked sample gives 0)."""
    if mask is None:
        return t_BHND.new_full((t_BHND.shape[0], 1, 1, 1), float(t_BHND.shape[2]))
    return mask.sum(dim=1).clamp_min(1).to(t_BHND.dtype).view(-1, 1, 1, 1)


def _keep_real(t_BHND: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return t_BHND if mask is None else t_BHND * mask[:, None, :, None].to(t_BHND.dtype)


@dataclass(kw_only=True)
class MultilinearConfig(MixerConfig):
    """``order``: L, the number of ``(K_l, V_l)`` pairs (1 is linear attention without a
    feature map). ``latents`` is accepted and unused."""

    order: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.order < 1:
            raise ValueError(f"order must be >= 1, got {self.order}")


@MIXERS.register("multilinear",
                 doc="multilinear attention Y = Q (S_1 ⊙ ... ⊙ S_L), S_l = K_l^T V_l / N (talk)")
class MultilinearAttention(Mixer):
    """``Y_h = Q_h (S_1,h ⊙ ... ⊙ S_L,h)``, ``S_l,h = K_l,h^T V_l,h / N`` per head."""

    config_cls = MultilinearConfig

    def __init__(self, config: MultilinearConfig) -> None:
        super().__init__(config)
        # [W_Q | W_K1 | W_V1 | ... | W_KL | W_VL]
        self.qkv_proj = near_identity_linear(config.dim, 1 + 2 * config.order, bias=False)
        self.out_proj = near_identity_linear(config.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        q, *kv = self.split_projections(self.qkv_proj(x), 1 + 2 * self.config.order)
        n = _real_count(q, mask)
        state = None                                                       # [B, H, D, D]
        for keys, values in zip(kv[0::2], kv[1::2]):
            s_l = (_keep_real(keys, mask) / n).transpose(-1, -2) @ values  # 1/N first: fp16
            state = s_l if state is None else state * s_l
        return zero_masked(self.out_proj(self.merge_heads(q @ state)), mask)


@MIXERS.register("triple",
                 doc="triple attention: D x D x D state S_ijk = sum_n K1 V K2 / N (talk)")
class TripleAttention(Mixer):
    """``Y_h,nj = sum_{ik} Q1_ni S_ijk Q2_nk``, ``S_ijk = (1/N) sum_n K1_ni V_nj K2_nk``.
    ``latents`` is accepted and unused."""

    def __init__(self, config: MixerConfig) -> None:
        super().__init__(config)
        self.qkv_proj = near_identity_linear(config.dim, 5, bias=False)  # [Q1|Q2|K1|K2|V]
        self.out_proj = near_identity_linear(config.dim)

    @staticmethod
    def features(a_BHND: torch.Tensor, b_BHND: torch.Tensor) -> torch.Tensor:
        """``a ⊗ b`` per token, flattened ``(i, k) -> i * D + k``: ``[B, H, N, D^2]``."""
        B, H, N, D = a_BHND.shape
        return (a_BHND.unsqueeze(-1) * b_BHND.unsqueeze(-2)).reshape(B, H, N, D * D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        q1, q2, k1, k2, v = self.split_projections(self.qkv_proj(x), 5)
        # S[(i, k), j] = (1/N) sum_n K1_ni K2_nk V_nj, the D x D x D state as [D^2, D]
        features = self.features(_keep_real(k1, mask), k2) / _real_count(v, mask)
        state = features.transpose(-1, -2) @ v                            # [B, H, D^2, D]
        y = self.features(q1, q2) @ state                                  # [B, H, N, D]
        return zero_masked(self.out_proj(self.merge_heads(y)), mask)
