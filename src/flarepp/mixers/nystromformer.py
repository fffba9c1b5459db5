"""Nystromformer: Nystrom-approximated softmax attention (Xiong et al., 2021, Sec. 3).

Shape letters: B batch, N tokens, M landmarks (the config's ``latents``), H heads, D head
width, C channels.

Per head, with ``[Q | K | V] = X W_QKV`` and ``s`` the softmax scale (``1/sqrt(D)``):

* landmarks ``Q~ [M, D]``, ``K~ [M, D]``: segment means of Q and K over M contiguous
  segments of the token sequence;
* ``F~ = softmax(s Q K~^T) [N, M]``, ``A~ = softmax(s Q~ K~^T) [M, M]``,
  ``B~ = softmax(s Q~ K^T) [M, N]``;
* ``Y = F~ A~^+ (B~ V)``, ``A~^+`` the Moore-Penrose pseudo-inverse by the iterative method
  the paper adopts: ``Z_0 = A~^T / (||A~||_1 ||A~||_inf)``,
  ``Z_{j+1} = Z_j (13 I - A~ Z_j (15 I - A~ Z_j (7 I - A~ Z_j))) / 4``, 6 iterations;
* output ``Y W_O``.

``B~ V`` is an encode (M landmark queries gather the N tokens) and ``F~ (.)`` a decode
(each token reads the M landmarks), so both run through ``self.backend`` on fused SDPA; only
the small ``A~`` is formed explicitly, and the pseudo-inverse runs in at least float32.
Cost O(N M D + M^3).

Choices where the paper leaves room:

* Segments: token ranks ``[floor(j n / M), ceil((j + 1) n / M))`` for landmark ``j`` and
  ``n`` real tokens -- exactly the paper's segment means when M divides n, otherwise the
  windows of adaptive average pooling (neighbouring segments share a boundary token; with
  ``n < M`` landmarks repeat, which the pseudo-inverse absorbs). No padding to a multiple
  of M is needed, so any N works.
* ``||.||_1, ||.||_inf`` are taken per sample and head, as in the paper's formula (the
  release takes one maximum over the whole batch, which would couple samples).
* Masks: landmarks are segment means of the real tokens only, numbered by their rank among
  the real tokens of their sample; ``B~`` excludes padding keys; padding outputs are zero.
  A padded sample therefore gives the same outputs as the sample alone.
* The depthwise-convolution skip of the release's LRA runs (``Y += conv(V)`` along the
  sequence, one length-k filter per head, 35 in its LRA configs) is optional:
  ``conv_kernel = 0`` (the default, the paper's approximation alone) or an odd k. It runs
  over the real tokens in order (padding removed), with zero padding at the ends.

Segment means and the convolution follow token order, so the mixer is not
permutation-equivariant. Parameters as full attention: ``4C^2 + C`` (``W_QKV`` without
bias, ``W_O`` with bias), plus ``H k`` convolution weights when ``conv_kernel = k > 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flarepp.mixers.base import Mixer, MixerConfig, check_tokens, zero_masked
from flarepp.mixers.linear_attention import kernel_precision
from flarepp.mixers.registry import MIXERS
from flarepp.mixers.transolver import at_least_float32
from flarepp.ops.attention import default_scale


@dataclass(kw_only=True)
class NystromformerConfig(MixerConfig):
    """``latents``: the number of landmarks M; ``pinv_iterations``: steps of the iterative
    pseudo-inverse (6 in the paper); ``conv_kernel``: length of the depthwise-convolution
    skip on V (0 = none; odd otherwise)."""

    pinv_iterations: int = 6
    conv_kernel: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pinv_iterations <= 0:
            raise ValueError(f"pinv_iterations must be positive, got {self.pinv_iterations}")
        if self.conv_kernel < 0 or (self.conv_kernel and self.conv_kernel % 2 == 0):
            raise ValueError(f"conv_kernel must be 0 (no convolution) or odd, got "
                             f"{self.conv_kernel}")


def real_tokens_first(mask_BN: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, N]`` indices listing each sample's real tokens in input order, then its
    padding; ``None`` without a mask (every token is real, already in order)."""
    if mask_BN is None:
        return None
    return torch.argsort((~mask_BN).to(torch.int8), dim=1, stable=True)


def gather_tokens(x_BHND: torch.Tensor, order_BN: torch.Tensor | None) -> torch.Tensor:
    """``x`` with its tokens in the order ``order_BN`` (the identity for ``None``)."""
    if order_BN is None:
        return x_BHND
    B, H, N, D = x_BHND.shape
    return x_BHND.gather(2, order_BN[:, None, :, None].expand(B, H, N, D))


def scatter_tokens(x_BHND: torch.Tensor, order_BN: torch.Tensor | None) -> torch.Tensor:
    """The inverse of :func:`gather_tokens`."""
    if order_BN is None:
        return x_BHND
    B, H, N, D = x_BHND.shape
    return torch.zeros_like(x_BHND).scatter(2, order_BN[:, None, :, None].expand(B, H, N, D),
                                            x_BHND)


def segment_bounds(real_B: torch.Tensor, segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end) [B, M]``: segment ``j`` covers ranks ``[floor(j n / M),
    ceil((j + 1) n / M))`` of a sample's ``n`` real tokens."""
    j = torch.arange(segments, device=real_B.device)
    n = real_B[:, None]
    return (j * n) // segments, ((j + 1) * n + segments - 1) // segments


def segment_means(x_BHND: torch.Tensor, real_B: torch.Tensor, segments: int) -> torch.Tensor:
    """Means of ``x`` over the segments of :func:`segment_bounds`, ``[B, H, M, D]``.

    ``x`` holds each sample's real tokens first, in order; sums come from differences of a
    prefix sum, so no ``[M, N]`` pooling matrix is formed. A sample without real tokens
    gets zero landmarks.
    """
    B, H, _, D = x_BHND.shape
    prefix = F.pad(x_BHND.cumsum(dim=2), (0, 0, 1, 0))                      # [B,H,N+1,D]
    start, end = segment_bounds(real_B, segments)                           # [B, M]

    def at(index_BM: torch.Tensor) -> torch.Tensor:
        return prefix.gather(2, index_BM[:, None, :, None].expand(B, H, segments, D))

    count = (end - start).clamp_min(1).to(x_BHND.dtype)[:, None, :, None]
    return (at(end) - at(start)) / count


def iterative_pinv(matrix_BHMM: torch.Tensor, iterations: int) -> torch.Tensor:
    """Moore-Penrose pseudo-inverse by the iteration of Nystromformer Sec. 3, per matrix:
    ``Z_0 = A^T / (||A||_1 ||A||_inf)``, ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4``.
    """
    identity = torch.eye(matrix_BHMM.shape[-1], dtype=matrix_BHMM.dtype,
                         device=matrix_BHMM.device)
    magnitude = matrix_BHMM.abs()
    norm_1 = magnitude.sum(dim=-2).amax(dim=-1)                             # max column sum
    norm_inf = magnitude.sum(dim=-1).amax(dim=-1)                           # max row sum
    z = matrix_BHMM.transpose(-1, -2) / (norm_1 * norm_inf)[..., None, None]
    for _ in range(iterations):
        az = matrix_BHMM @ z
        z = 0.25 * z @ (13 * identity - az @ (15 * identity - az @ (7 * identity - az)))
    return z


@MIXERS.register("nystromformer", doc="Nystromformer (Xiong et al., 2021): M segment-mean "
                 "landmarks, iterative pseudo-inverse")
class Nystromformer(Mixer):
    """Nystrom approximation of softmax attention with M landmarks (module docstring)."""

    config_cls = NystromformerConfig
    permutation_equivariant = False  # segment means (and the convolution) follow token order

    def __init__(self, config: NystromformerConfig) -> None:
        super().__init__(config)
        self.qkv_proj = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out_proj = nn.Linear(config.dim, config.dim)
        if config.conv_kernel:
            bound = 1.0 / math.sqrt(config.conv_kernel)  # nn.Conv2d's default init
            self.value_conv = nn.Parameter(
                torch.empty(config.heads, config.conv_kernel).uniform_(-bound, bound))
        else:
            self.value_conv = None

    def depthwise_conv(self, values_BHND: torch.Tensor, order_BN: torch.Tensor | None
                       ) -> torch.Tensor:
        """``sum_t w_h,t v_(i + t - k//2)`` over the real tokens in order, zero beyond."""
        H, k = self.value_conv.shape
        ordered = gather_tokens(values_BHND, order_BN)
        weight = self.value_conv.to(ordered.dtype).view(H, 1, k, 1)
        conv = F.conv2d(ordered, weight, padding=(k // 2, 0), groups=H)
        return scatter_tokens(conv, order_BN)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        B, N, _ = x.shape
        c = self.config
        q, k, v = self.split_projections(self.qkv_proj(x), 3)                   # [B,H,N,D]
        if mask is not None:
            v = v.masked_fill(~mask[:, None, :, None], 0.0)
        order = real_tokens_first(mask)
        real = (torch.full((B,), N, device=x.device) if mask is None
                else mask.sum(dim=1))
        with kernel_precision(x.device.type):
            landmark_queries = segment_means(at_least_float32(gather_tokens(q, order)),
                                             real, c.latents)                   # Q~ [B,H,M,D]
            landmark_keys = segment_means(at_least_float32(gather_tokens(k, order)),
                                          real, c.latents)                      # K~ [B,H,M,D]
            scale = default_scale(self.head_dim, c.attn_scale)
            kernel = torch.softmax(scale * landmark_queries @ landmark_keys.transpose(-1, -2),
                                   dim=-1)                                      # A~ [B,H,M,M]
            kernel_pinv = iterative_pinv(kernel, c.pinv_iterations)
        gathered = self.backend.encode(landmark_queries, k, v, mask, scale=c.attn_scale)
        with kernel_precision(x.device.type):
            landmark_values = kernel_pinv @ at_least_float32(gathered)          # A~^+ B~ V
        y = self.backend.decode(q, landmark_keys, landmark_values, mask, scale=c.attn_scale)
        y = y.to(v.dtype)
        if self.value_conv is not None:
            y = y + self.depthwise_conv(v, order)
        return zero_masked(self.out_proj(self.merge_heads(y)), mask)


__all__ = ["Nystromformer", "NystromformerConfig", "iterative_pinv", "segment_bounds",
           "segment_means"]
