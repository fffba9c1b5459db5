"""Linformer: softmax attention over a fixed-length projection of the sequence
(Wang et al., 2020, Sec. 4, eq. 7).

Shape letters: B batch, N tokens, M projected length (the config's ``latents``, Linformer's
k), L ``max_tokens``, H heads, D head width, C channels.

Per head i, with ``[Q | K | V] = X W_QKV`` and learned ``E_i, F_i [M, L]``:

    ``head_i = softmax(s Q_i (E_i K_i)^T) (F_i V_i)``,  output ``[head_1 .. head_H] W_O``

-- every token attends to M projected keys, a decode onto M latents formed by mixing the
sequence with fixed weights, so it runs through ``self.backend.decode`` (fused SDPA) at
cost O(N M D). The paper's parameter sharing options (Sec. 4) are a config value:

* ``sharing="headwise"`` (registered as ``linformer``): ``E_i = E``, ``F_i = F`` for every
  head (``2 M L`` weights);
* ``sharing="key-value"`` (registered as ``linformer-kv``): ``E_i = F_i = E`` (``M L``);
* ``sharing="none"``: separate ``E_i, F_i`` per head, eq. 7 as written (``2 H M L``).

Layerwise sharing (one E for all layers) is not offered: each mixer owns its projections.

A fixed-length projection needs a maximum length: ``max_tokens = L``. A sequence of
``N <= L`` tokens uses the first N columns of E and F (position n of the input always
meets column n), so a sample padded at its end gives the same outputs as the sample alone;
``N > L`` is refused. Padding: masked tokens' keys and values are zeroed before the
projection (they add nothing to ``E K`` and ``F V``) and their outputs are zero. Because
column n belongs to position n the mixer is not permutation-equivariant, and padding
placed between real tokens shifts nothing: real tokens keep their input positions.

E and F start as in the Linformer release (fairseq): Xavier-uniform with gain
``1/sqrt(2)`` on the ``[M, L]`` matrix. Parameters: ``4C^2 + C`` as full attention
(``W_QKV`` without bias, ``W_O`` with bias) plus the projections above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from flarepp.mixers.base import Mixer, MixerConfig, check_tokens, zero_masked
from flarepp.mixers.registry import MIXERS

SHARING = ("headwise", "key-value", "none")


@dataclass(kw_only=True)
class LinformerConfig(MixerConfig):
    """``latents``: the projected length M (Linformer's k); ``max_tokens``: the longest
    sequence L the projections cover; ``sharing``: one of ``headwise``, ``key-value``,
    ``none`` (Linformer Sec. 4)."""

    max_tokens: int = 4096
    sharing: str = "headwise"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.sharing not in SHARING:
            raise ValueError(f"unknown Linformer sharing {self.sharing!r}; known: "
                             f"{', '.join(SHARING)}")


def sequence_projection(copies: int, projected: int, max_tokens: int) -> nn.Parameter:
    """``[copies, M, L]`` projections, Xavier-uniform with gain ``1/sqrt(2)`` per ``[M, L]``."""
    bound = math.sqrt(6.0 / (projected + max_tokens)) / math.sqrt(2.0)
    return nn.Parameter(torch.empty(copies, projected, max_tokens).uniform_(-bound, bound))


@MIXERS.register("linformer", doc="Linformer (Wang et al., 2020): keys/values projected to "
                 "length M, headwise-shared E, F")
class Linformer(Mixer):
    """Linformer attention; see the module docstring for E, F, masks and variable N."""

    config_cls = LinformerConfig
    permutation_equivariant = False  # column n of E, F belongs to input position n

    def __init__(self, config: LinformerConfig) -> None:
        super().__init__(config)
        c = config
        self.qkv_proj = nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.out_proj = nn.Linear(c.dim, c.dim)
        copies = c.heads if c.sharing == "none" else 1
        self.key_projection = sequence_projection(copies, c.latents, c.max_tokens)    # E
        self.value_projection = (None if c.sharing == "key-value"                     # F
                                 else sequence_projection(copies, c.latents, c.max_tokens))

    def project_sequence(self, x_BHND: torch.Tensor, projection_PML: torch.Tensor
                         ) -> torch.Tensor:
        """``E x``: the first N columns of E mix the N tokens, ``[B, H, M, D]``."""
        N = x_BHND.shape[2]
        e = projection_PML[:, :, :N].to(x_BHND.dtype)
        if e.shape[0] == 1:                                    # shared by the heads
            return torch.einsum("mn,bhnd->bhmd", e[0], x_BHND)
        return torch.einsum("hmn,bhnd->bhmd", e, x_BHND)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        N = x.shape[1]
        if N > self.config.max_tokens:
            raise ValueError(f"linformer: x has N={N} tokens but the projections E, F cover "
                             f"max_tokens={self.config.max_tokens}; build the mixer with "
                             f"max_tokens >= {N}")
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        q, k, v = self.split_projections(self.qkv_proj(x), 3)                   # [B,H,N,D]
        if mask is not None:
            padding = ~mask[:, None, :, None]
            k, v = k.masked_fill(padding, 0.0), v.masked_fill(padding, 0.0)
        value_projection = (self.key_projection if self.value_projection is None
                            else self.value_projection)
        projected_keys = self.project_sequence(k, self.key_projection)          # E K [B,H,M,D]
        projected_values = self.project_sequence(v, value_projection)           # F V
        y = self.backend.decode(q, projected_keys, projected_values, mask,
                                scale=self.config.attn_scale)
        return zero_masked(self.out_proj(self.merge_heads(y)), mask)


MIXERS.add("linformer-kv", Linformer, defaults={"sharing": "key-value"},
           doc="Linformer with key-value sharing: E = F, shared by the heads")

__all__ = ["SHARING", "Linformer", "LinformerConfig"]
