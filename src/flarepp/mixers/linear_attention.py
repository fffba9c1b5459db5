"""Kernelised linear attention: linear attention, Performer (FAVOR+) and cosFormer.

Shape letters: B batch, N tokens, H heads, D head width, R feature width, C channels.

All three replace the softmax similarity ``exp(q.k)`` by a product of feature maps,
``sim(q_i, k_j) = phi(q_i) . phi(k_j)``, and compute per head the normalised form of
Katharopoulos et al. (2020, Sec. 3.2, "linearized attention")

    ``y_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / max(phi(q_i)^T sum_j phi(k_j), eps)``

in O(N R D) by associativity: the ``[R, D]`` state ``phi(K)^T V`` and the ``[R]`` sum
``phi(K)^T 1`` are formed once and read by every query; the N x N matrix never exists.
Bidirectional (non-causal) forms only. The floor ``eps`` only matters when a query's
features are orthogonal to every key's (possible with ReLU features) or a sample has no
real token; ``eps`` is 1e-6 as in the linear-attention and cosFormer releases, and 1e-30
for Performer, whose stabilised sums (below) are rescaled and must not meet a larger floor.

Members differ only in ``phi``:

* ``linear-attention`` (Katharopoulos et al., 2020, Sec. 3.2.1): ``phi(x) = elu(x) + 1``
  applied to ``q`` and ``k`` as they are (no scale).
* ``performer`` (Choromanski et al., 2021, FAVOR+, Sec. 2.3-2.4): positive random
  features ``phi(x) = exp(W x - |x|^2 / 2) / sqrt(R)`` of ``x = s^(1/2) q`` (``s`` the
  softmax scale, ``1/sqrt(D)`` by default), whose expected product is ``exp(s q.k)``
  (their Lemma 1); ``W [R, D]`` are orthogonal random features: blocks of D orthonormal
  rows from the QR of a Gaussian matrix, each row rescaled by the norm of an independent
  ``N(0, I_D)`` vector so that rows are marginally Gaussian (Sec. 2.4).
* ``cosformer`` (Qin et al., 2022, Sec. 3.2-3.4): ``sim = relu(q_i).relu(k_j)
  cos(pi/2 (i - j)/M)``, decomposed by ``cos(a - b) = cos a cos b + sin a sin b`` into
  ``phi(x_i) = [relu(x_i) cos(pi i / 2M), relu(x_i) sin(pi i / 2M)]`` (R = 2D), with
  ``i = 1..N`` the token position and ``M = N`` as in the cosFormer release.

Padding masks (``[B, N]`` bool, True = real token): masked keys' features and values are
zeroed before the sums, so masked tokens do not influence real ones; masked outputs are
zero. cosFormer's positions count real tokens only: ``i`` is a real token's rank among the
real tokens of its sample (1-based) and ``M`` their number, so a padded sample gives the
same outputs as the sample alone, wherever its padding sits.

Projections are those of the ``attention`` mixer: ``[Q | K | V] = X W_QKV`` without bias
and an output projection with bias, so each mixer has ``4C^2`` weights plus ``C`` biases
(Performer's ``W`` is a fixed buffer, not a parameter). None of them makes a softmax
attention call, so they hold no attention backend (``backend = None``): the explicit
backend has nothing to replace, and each is checked against its own float64 definition in
``tests/test_linear_mixers.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flarepp.mixers.base import Mixer, MixerConfig, check_tokens, zero_masked
from flarepp.mixers.registry import MIXERS
from flarepp.mixers.transolver import at_least_float32


def kernel_precision(device_type: str):
    """Autocast off: the feature maps and the sums over N run in at least float32."""
    return torch.autocast(device_type, enabled=False)


def normalised_kernel_attention(features_q_BHNR: torch.Tensor, features_k_BHNR: torch.Tensor,
                                values_BHND: torch.Tensor, mask_BN: torch.Tensor | None,
                                eps: float) -> torch.Tensor:
    """``y_i = phi_q,i^T (Phi_k^T V) / max(phi_q,i^T Phi_k^T 1, eps)`` over real keys,
    ``[B, H, N, D]``; rows of masked queries are left for the caller to zero."""
    if mask_BN is not None:
        padding = ~mask_BN[:, None, :, None]
        features_k_BHNR = features_k_BHNR.masked_fill(padding, 0.0)
        values_BHND = values_BHND.masked_fill(padding, 0.0)
    state_BHRD = features_k_BHNR.transpose(-1, -2) @ values_BHND
    key_sum_BHR1 = features_k_BHNR.sum(dim=2).unsqueeze(-1)
    numerator = features_q_BHNR @ state_BHRD
    denominator = (features_q_BHNR @ key_sum_BHR1).clamp_min(eps)
    return numerator / denominator


class KernelAttention(Mixer):
    """Shared parts: projections as in full attention, the normalised kernel attention.

    Subclasses define :meth:`feature_maps`. Parameters: ``4C^2 + C`` (``W_QKV``, ``W_O``
    and its bias).
    """

    eps = 1e-6

    def __init__(self, config: MixerConfig) -> None:
        super().__init__(config)
        self.qkv_proj = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out_proj = nn.Linear(config.dim, config.dim)
        self.backend = None  # no softmax attention call for a backend to execute

    def feature_maps(self, q_BHND: torch.Tensor, k_BHND: torch.Tensor,
                     mask_BN: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(phi(Q), phi(K))``, each ``[B, H, N, R]``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        q, k, v = self.split_projections(self.qkv_proj(x), 3)                  # [B,H,N,D]
        with kernel_precision(x.device.type):
            q, k, values = at_least_float32(q), at_least_float32(k), at_least_float32(v)
            features_q, features_k = self.feature_maps(q, k, mask)
            y = normalised_kernel_attention(features_q, features_k, values, mask, self.eps)
        return zero_masked(self.out_proj(self.merge_heads(y.to(v.dtype))), mask)


@MIXERS.register("linear-attention", doc="linear attention (Katharopoulos et al., 2020): "
                 "phi = elu + 1, O(N D^2)")
class LinearAttention(KernelAttention):
    """``phi(x) = elu(x) + 1`` (Katharopoulos et al., 2020, Sec. 3.2.1); ``attn_scale``
    and ``latents`` are accepted and unused."""

    def feature_maps(self, q_BHND, k_BHND, mask_BN):
        return F.elu(q_BHND) + 1.0, F.elu(k_BHND) + 1.0


@dataclass(kw_only=True)
class PerformerConfig(MixerConfig):
    """``features``: R, the number of random features per head (256 as in the FLARE
    study's LRA Performer runs and the Performer paper's LRA settings)."""

    features: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.features <= 0:
            raise ValueError(f"features must be positive, got {self.features}")


def orthogonal_gaussian_projection(rows: int, dim: int, *,
                                   generator: torch.Generator | None = None) -> torch.Tensor:
    """``[rows, dim]`` orthogonal random features (Choromanski et al., 2021, Sec. 2.4).

    Stacked blocks of ``dim`` orthonormal rows (the Q of a Gaussian matrix's QR, its
    columns' signs fixed by R's diagonal so that Q is uniform on the orthogonal group), each
    row scaled by the norm of an independent ``N(0, I_dim)`` draw, so every row is
    marginally ``N(0, I_dim)`` and rows within a block are exactly orthogonal.
    """
    blocks = []
    for _ in range(math.ceil(rows / dim)):
        gaussian = torch.randn(dim, dim, generator=generator)
        orthonormal, triangular = torch.linalg.qr(gaussian)
        # Signs of R's diagonal make Q Haar-distributed (Mezzadri, 2007); without them
        # Householder QR biases the directions, and the estimate of exp(q.k) with them.
        signs = torch.sign(torch.diagonal(triangular))
        blocks.append((orthonormal * torch.where(signs == 0, 1.0, signs)).T)
    directions = torch.cat(blocks)[:rows]
    norms = torch.randn(rows, dim, generator=generator).norm(dim=1, keepdim=True)
    return directions * norms


@MIXERS.register("performer", doc="Performer FAVOR+ (Choromanski et al., 2021): positive "
                 "orthogonal random features")
class Performer(KernelAttention):
    """FAVOR+ with positive orthogonal random features, ``R = features`` per head.

    The projection ``W [H, R, D]`` is drawn once, at construction, from the global torch
    generator (like any initial weight) and kept as a persistent buffer: it is saved in
    checkpoints, moves with the module and is never redrawn, so the forward is a fixed,
    deterministic function in training and eval mode alike. The Performer paper redraws
    features during training; the FLARE study's LRA reruns did not (redraw interval 0),
    and neither does this mixer.

    Stabilisers: each query's features are divided by their maximum over R and the keys'
    by their maximum over the real keys and R (per sample and head). Both factors cancel
    between numerator and denominator, so the output is that of the unstabilised features;
    they are treated as constants in the backward pass, which is then also exact.
    Parameters ``4C^2 + C``; the buffer holds ``H R D`` numbers.
    """

    config_cls = PerformerConfig
    eps = 1e-30  # positive features: the floor only turns 0/0 (no real key) into 0

    def __init__(self, config: PerformerConfig) -> None:
        super().__init__(config)
        projection = torch.stack([orthogonal_gaussian_projection(config.features,
                                                                 config.head_dim)
                                  for _ in range(config.heads)])
        self.register_buffer("random_features", projection)                    # [H, R, D]

    def softmax_scale(self) -> float:
        s = self.config.attn_scale
        return 1.0 / math.sqrt(self.head_dim) if s is None else float(s)

    def log_features(self, x_BHND: torch.Tensor) -> torch.Tensor:
        """``W x - |x|^2 / 2`` with ``x`` scaled by ``s^(1/2)``, ``[B, H, N, R]``."""
        x = x_BHND * math.sqrt(self.softmax_scale())
        projection = self.random_features.to(x.dtype)
        projected = torch.einsum("bhnd,hrd->bhnr", x, projection)
        return projected - 0.5 * x.square().sum(dim=-1, keepdim=True)

    def feature_maps(self, q_BHND, k_BHND, mask_BN):
        norm = 1.0 / math.sqrt(self.config.features)
        log_q = self.log_features(q_BHND)
        log_k = self.log_features(k_BHND)
        query_max = log_q.amax(dim=-1, keepdim=True).detach()
        if mask_BN is not None:  # padding keys must not set the keys' stabiliser
            log_k = log_k.masked_fill(~mask_BN[:, None, :, None], float("-inf"))
        key_max = log_k.amax(dim=(-2, -1), keepdim=True).detach()
        key_max = torch.where(torch.isfinite(key_max), key_max, torch.zeros_like(key_max))
        return norm * torch.exp(log_q - query_max), norm * torch.exp(log_k - key_max)


@MIXERS.register("cosformer", doc="cosFormer (Qin et al., 2022): ReLU features with cos "
                 "re-weighting by position i/M")
class CosFormer(KernelAttention):
    """``phi(x_i) = [relu(x_i) cos(pi i / 2M), relu(x_i) sin(pi i / 2M)]``, positions
    counted over the real tokens (see the module docstring). Order-dependent: token ``i``'s
    weight to token ``j`` depends on ``i - j``. ``attn_scale`` and ``latents`` are unused."""

    permutation_equivariant = False

    @staticmethod
    def position_angles(mask_BN: torch.Tensor | None, batch: int, tokens: int,
                        device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``pi i / (2 M)`` per token, ``[B, 1, N, 1]``; ``i`` the 1-based rank among real
        tokens, ``M`` their number (padding gets an unused angle)."""
        if mask_BN is None:
            position = torch.arange(1, tokens + 1, device=device, dtype=dtype).expand(batch, -1)
            length = torch.full((batch, 1), float(tokens), device=device, dtype=dtype)
        else:
            position = mask_BN.cumsum(dim=1).to(dtype)
            length = mask_BN.sum(dim=1, keepdim=True).clamp_min(1).to(dtype)
        return (0.5 * math.pi * position / length)[:, None, :, None]

    def feature_maps(self, q_BHND, k_BHND, mask_BN):
        B, _, N, _ = q_BHND.shape
        angle = self.position_angles(mask_BN, B, N, q_BHND.device, q_BHND.dtype)
        cos, sin = torch.cos(angle), torch.sin(angle)
        q, k = F.relu(q_BHND), F.relu(k_BHND)
        return torch.cat([q * cos, q * sin], dim=-1), torch.cat([k * cos, k * sin], dim=-1)


__all__ = ["CosFormer", "KernelAttention", "LinearAttention", "Performer", "PerformerConfig",
           "normalised_kernel_attention", "orthogonal_gaussian_projection"]
