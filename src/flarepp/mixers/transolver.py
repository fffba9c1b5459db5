"""The Transolver family as token mixers, without convolutions (paper Table 9, Sec. C.3).

Shape letters: B batch, N tokens, M slices (the latent budget), H heads, D = C/H head width.

Every member is *physics attention* (Wu et al., 2024, Sec. 3.1), per head h:

* slice weights ``w_i = softmax_M(logits_i / tau)`` -- each token's soft assignment to M slices;
* slice tokens (physical states) ``s_j = sum_i w_ij f_i / (sum_i w_ij + eps)``, a weighted mean;
* ``s' = SDPA(s W_q, s W_k, s W_v)`` among the M slice tokens (``W_q, W_k, W_v`` are
  ``D x D``, shared by the heads, no bias);
* deslice ``y_i = sum_j w_ij s'_j``, then the output projection.

Members differ in where the logits and features come from:

* ``transolver`` (Wu et al., 2024): ``f = X W_f``, ``logits = (X W_x) W_s`` with a separate
  projection ``W_x``; ``tau`` a learned per-head temperature clamped to [0.1, 5]. The
  release's irregular-mesh attention (``Physics_Attention_1D``) initialises ``W_s``
  orthogonally but does not clamp ``tau``; its structured-mesh attentions clamp, and so does
  the FLARE study's Transolver (``pdebench/models/transolver.py``), the code behind Table
  1's Transolver comparison, which flarepp follows in both.
* ``transolver++`` (Luo et al., 2025, Sec. 3.2): *eidetic states* -- one projection
  ``X~ = X W_x`` serves both the logits and the states; a per-token adaptive temperature
  ``tau_i = tau_0 + MLP(x~_i)`` (Ada-Temp); Gumbel-softmax slicing
  ``w_i = softmax((logits_i + g_i) / tau_i)``, ``g = -log(-log u)``, ``u ~ U(0, 1)``
  (Rep-Slice) -- drawn in every forward, evaluation included, as in the Transolver++
  release and the FLARE study's copy of it (the noise is part of the model: the mean of the
  outputs over draws is not the noise-free output). In eval mode the draw is seeded, so an
  evaluation is reproducible (see :class:`TransolverPP`); ``eval_noise=False`` evaluates
  with ``g = 0`` instead, a deterministic variant of flarepp's own, not the release's.
* ``transolver3`` (Zhou et al., 2026, arXiv 2602.04940, Sec. 3.1): the same operator as
  Transolver computed in the associative order of its "faster slice and deslice":
  ``s = Linear_f((w d^-1)^T X)`` (project the M states, not the N tokens) and
  ``y = w (s' W_o) + b_o`` (project the M states before deslicing); the logit projection
  ``(X W_x + b_x) W_s + b_s`` is contracted into one ``[H, M, C]`` weight, so no
  ``[B, N, C]`` intermediate is formed. Its geometry tiling, amortized subset training and
  state caching are left out (Table 9: "variants without convolution"; no tiling).

Masked tokens get zero slice weight (they join no slice) and zero output. The M x M
attention among slice tokens goes through ``self.backend.self_attention``.
Parameters per block (C=128, H=8, M=64): Transolver and Transolver-3 51,400,
Transolver++ 36,041 -- the settings of the FLARE study's implementation (Table 10).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flarepp.mixers.base import Mixer, MixerConfig, check_tokens
from flarepp.mixers.registry import MIXERS

SLICE_EPS = 1e-5  # added to the slice mass sum_i w_ij, as in the Transolver papers
NOISE_STREAM_STRIDE = 1_000_003  # eval-noise seeds of blocks: seed + stride * block index


def masked_slice_weights(weights_BHNM: torch.Tensor, mask_BN: torch.Tensor | None
                         ) -> torch.Tensor:
    """Zero the weights of padding tokens so they join no slice."""
    if mask_BN is None:
        return weights_BHNM
    return weights_BHNM * mask_BN[:, None, :, None].to(weights_BHNM.dtype)


def slice_tokens(weights_BHNM: torch.Tensor, features_BHND: torch.Tensor) -> torch.Tensor:
    """``s_j = sum_i w_ij f_i / (sum_i w_ij + eps)``, ``[B, H, M, D]``."""
    mass_BHM = weights_BHNM.sum(dim=2)
    states = torch.einsum("bhnm,bhnd->bhmd", weights_BHNM, features_BHND)
    return states / (mass_BHM + SLICE_EPS).unsqueeze(-1)


def deslice(weights_BHNM: torch.Tensor, states_BHMD: torch.Tensor) -> torch.Tensor:
    """``y_i = sum_j w_ij s'_j``, ``[B, H, N, D]``."""
    return torch.einsum("bhnm,bhmd->bhnd", weights_BHNM, states_BHMD)


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """Upcast 16-bit tensors for a softmax; float32 and float64 pass unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def gumbel_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """``g = -log(-log u)`` with ``u`` kept away from 0 and 1."""
    info = torch.finfo(u.dtype)
    return -torch.log(-torch.log(u.clamp(min=info.tiny, max=1.0 - info.eps)))


def gumbel_noise(like: torch.Tensor) -> torch.Tensor:
    """``g = -log(-log u)``, ``u ~ U(0, 1)`` from the global generator (at least float32)."""
    dtype = at_least_float32(like).dtype
    return gumbel_from_uniform(torch.rand(like.shape, device=like.device, dtype=dtype))


def seeded_gumbel_noise(like_BHNM: torch.Tensor, seed: int) -> torch.Tensor:
    """Gumbel noise ``[1, H, N, M]`` from a CPU generator seeded with ``seed``, drawn token
    by token (``[N, H, M]`` in order), so token n's noise does not depend on how many tokens
    follow it (padding appended to a sample leaves its real tokens' noise unchanged); the
    same for every sample of the batch."""
    _, H, N, M = like_BHNM.shape
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand((N, H, M), generator=generator, dtype=at_least_float32(like_BHNM).dtype)
    return gumbel_from_uniform(u).permute(1, 0, 2).unsqueeze(0).to(like_BHNM.device)


class PhysicsAttention(Mixer):
    """Shared parts: the per-head slice projection ``W_s`` (``D -> M``, orthogonal init as
    in Transolver), the slice-token attention and the output projection."""

    def __init__(self, config: MixerConfig) -> None:
        super().__init__(config)
        c = config
        self.slice_proj = nn.Linear(c.head_dim, c.latents)          # W_s, shared by heads
        nn.init.orthogonal_(self.slice_proj.weight)
        nn.init.zeros_(self.slice_proj.bias)
        self.slice_proj._flarepp_custom_init = True
        self.state_qkv_proj = nn.Linear(c.head_dim, 3 * c.head_dim, bias=False)  # W_q|W_k|W_v
        self.out_proj = nn.Linear(c.dim, c.dim)

    def attend_states(self, states_BHMD: torch.Tensor) -> torch.Tensor:
        """Self-attention among the M slice tokens (no padding among slices)."""
        q, k, v = self.state_qkv_proj(states_BHMD).chunk(3, dim=-1)
        return self.backend.self_attention(q, k, v, None, scale=self.config.attn_scale)

    @staticmethod
    def softmax_over_slices(logits_BHNM: torch.Tensor, temperature: torch.Tensor
                            ) -> torch.Tensor:
        """``softmax_M(logits / tau)`` in at least float32, returned in the logits' dtype."""
        w = torch.softmax(at_least_float32(logits_BHNM) / at_least_float32(temperature), dim=-1)
        return w.to(logits_BHNM.dtype)

    @staticmethod
    def zero_padding(y_BNC: torch.Tensor, mask_BN: torch.Tensor | None) -> torch.Tensor:
        return y_BNC if mask_BN is None else y_BNC.masked_fill(~mask_BN[..., None], 0.0)


@MIXERS.register("transolver", doc="Transolver physics attention (Wu et al., 2024), no conv")
class Transolver(PhysicsAttention):
    """Physics attention with separate feature and slice projections and a learned
    per-head temperature ``tau_h`` (initialised at 0.5, clamped to [0.1, 5])."""

    def __init__(self, config: MixerConfig) -> None:
        super().__init__(config)
        self.in_proj = nn.Linear(config.dim, 2 * config.dim)      # [W_f | W_x]
        self.temperature = nn.Parameter(torch.full((config.heads,), 0.5))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        features, slice_inputs = self.split_projections(self.in_proj(x), 2)  # [B,H,N,D]
        tau = self.temperature.clamp(0.1, 5.0).view(1, -1, 1, 1)
        weights = self.softmax_over_slices(self.slice_proj(slice_inputs), tau)
        weights = masked_slice_weights(weights, mask)                        # [B,H,N,M]
        states = self.attend_states(slice_tokens(weights, features))         # [B,H,M,D]
        y = self.out_proj(self.merge_heads(deslice(weights, states)))
        return self.zero_padding(y, mask)


@dataclass(kw_only=True)
class TransolverPPConfig(MixerConfig):
    """``eval_noise``: draw the Gumbel noise in eval mode too (the release's model);
    ``eval_noise_seed``: the seed of that draw."""

    eval_noise: bool = True
    eval_noise_seed: int = 0


@MIXERS.register("transolver++", doc="Transolver++ (Luo et al., 2025): eidetic states, "
                 "Gumbel-softmax slicing with per-token temperature")
class TransolverPP(PhysicsAttention):
    """Eidetic states with Ada-Temp and Rep-Slice (see the module docstring).

    ``tau_i = max(tau_0,h + GELU(GELU(x~_i A_1 + a_1) A_2 + a_2), 0.01)`` with
    ``A_1: D -> M``, ``A_2: M -> 1`` (the temperature network of the Transolver++ release),
    ``tau_0,h`` initialised at 0.5. Training-mode forwards draw Gumbel noise from the
    global torch generator. Eval-mode forwards draw it too, as the release does, but from a
    generator seeded with ``eval_noise_seed + NOISE_STREAM_STRIDE * noise_stream``
    (:func:`seeded_gumbel_noise`; ``noise_stream`` is the block index, set by the model, so
    blocks draw independent noise): an evaluation is reproducible and a sample's output
    does not depend on the padding or the other samples of its batch. It depends on token
    order (the noise is drawn per position), so with ``eval_noise`` on the mixer is not
    permutation-equivariant in eval mode; ``eval_noise=False`` (``g = 0``) is.
    """

    config_cls = TransolverPPConfig
    stochastic_in_training = True
    noise_stream = 0

    def __init__(self, config: TransolverPPConfig) -> None:
        super().__init__(config)
        c = config
        self.in_proj = nn.Linear(c.dim, c.dim)                        # W_x (eidetic)
        self.temperature_net = nn.Sequential(
            nn.Linear(c.head_dim, c.latents), nn.GELU(),
            nn.Linear(c.latents, 1), nn.GELU())
        self.base_temperature = nn.Parameter(torch.full((c.heads,), 0.5))   # tau_0

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        tokens = self.split_heads(self.in_proj(x))                          # x~ [B,H,N,D]
        tau = self.temperature_net(tokens) + self.base_temperature.view(1, -1, 1, 1)
        tau = tau.clamp(min=0.01)                                           # [B,H,N,1]
        logits = self.slice_proj(tokens)
        if self.training:
            logits = at_least_float32(logits) + gumbel_noise(logits)
        elif self.config.eval_noise:
            seed = self.config.eval_noise_seed + NOISE_STREAM_STRIDE * self.noise_stream
            logits = at_least_float32(logits) + seeded_gumbel_noise(logits, seed)
        weights = masked_slice_weights(self.softmax_over_slices(logits, tau), mask)
        weights = weights.to(tokens.dtype)
        states = self.attend_states(slice_tokens(weights, tokens))
        y = self.out_proj(self.merge_heads(deslice(weights, states)))
        return self.zero_padding(y, mask)


@MIXERS.register("transolver3", doc="Transolver-3 (arXiv 2602.04940) physics attention in "
                 "its faster slice/deslice order, without tiling")
class Transolver3(PhysicsAttention):
    """Transolver's operator computed state-side (Transolver-3, "faster slice and deslice").

    With ``w~ = w d^-1`` the mass-normalised weights: ``s = (w~^T X) W_f^T + b_f`` and
    ``y = w (s' W_o,h) + b_o``; the temperature ``tau_h`` (init 0.5) is not clamped.
    Equal to :class:`Transolver` with the same weights up to where ``eps`` enters.
    """

    def __init__(self, config: MixerConfig) -> None:
        super().__init__(config)
        self.in_proj = nn.Linear(config.dim, 2 * config.dim)      # [W_f | W_x]
        self.temperature = nn.Parameter(torch.full((config.heads,), 0.5))

    def slice_logit_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_s`` contracted with the head-split ``W_x``: ``[H, M, C]`` and ``[H, M]``."""
        H, D, C = self.heads, self.head_dim, self.config.dim
        w_x = self.in_proj.weight[C:].view(H, D, C)
        b_x = self.in_proj.bias[C:].view(H, D)
        weight = torch.matmul(self.slice_proj.weight, w_x)                     # [H, M, C]
        bias = b_x @ self.slice_proj.weight.T + self.slice_proj.bias           # [H, M]
        return weight, bias

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        H, D, C = self.heads, self.head_dim, self.config.dim
        logit_w, logit_b = self.slice_logit_weight()
        logits = torch.einsum("bnc,hmc->bhnm", x, logit_w.to(x.dtype)) + logit_b[:, None]
        weights = self.softmax_over_slices(logits, self.temperature.view(1, -1, 1, 1))
        weights = masked_slice_weights(weights.to(x.dtype), mask)              # [B,H,N,M]
        mass = weights.sum(dim=2) + SLICE_EPS                                  # [B,H,M]
        raw_states = torch.einsum("bhnm,bnc->bhmc", weights, x) / mass.unsqueeze(-1)
        w_f = self.in_proj.weight[:C].view(H, D, C)
        states = torch.einsum("bhmc,hdc->bhmd", raw_states, w_f.to(x.dtype))
        states = states + self.in_proj.bias[:C].view(1, H, 1, D)               # Linear_f
        states = self.attend_states(states)                                    # [B,H,M,D]
        w_o = self.out_proj.weight.view(C, H, D).permute(1, 2, 0)              # [H, D, C]
        projected = torch.einsum("bhmd,hdc->bhmc", states, w_o.to(states.dtype))
        y = torch.einsum("bhnm,bhmc->bnc", weights, projected) + self.out_proj.bias
        return self.zero_padding(y, mask)
