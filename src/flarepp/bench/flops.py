"""Analytic FLOP count of one training step of the surrogate backbone (paper D.3).

Shape letters: B batch, N tokens, C channels, H heads, D = C/H head width, M latents
(slices, packed tokens), A anchors, r the FFN ratio, L the hidden layers of each
input/output MLP (``io_layers``).

How the count is made (per sample; multiply by B):

* every matrix product is counted, ``2 m n k`` for ``[m, k] @ [k, n]`` -- a linear map on N
  tokens costs ``2 N C_in C_out``; biases are not counted;
* a fused SDPA call with ``n_q`` queries and ``n_k`` keys costs ``4 n_q n_k D`` per head
  (``2 n_q n_k D`` for ``Q K^T`` and as much for ``P V``), i.e. ``4 n_q n_k C`` over the H
  heads; the softmax itself (max, exp, sum) is not counted;
* norms, activations, residual adds, masking, softmaxes, temperatures and gates are not
  counted;
* backward = 2 x forward (the input-gradient and weight-gradient products of every
  matmul); the score recomputation inside the fused attention backward is not counted, so
  FLOP/s computed from this count are "model FLOP/s".

This is the rule ``torch.utils.flop_counter.FlopCounterMode`` applies to ``mm``, ``addmm``,
``bmm`` and ``einsum``, and to SDPA where it has a formula for the kernel: the CUDA flash,
memory-efficient and cuDNN kernels, counted as the two products above. On CPU, SDPA runs
``_scaled_dot_product_flash_attention_for_cpu``, for which FlopCounterMode (torch 2.13)
has no formula: it counts those calls as 0. The tests therefore cross-check this count
against FlopCounterMode with the attention calls computed by explicit matmuls.

Mixer forward FLOPs per sample (``MIXER_FLOPS``):

* ``attention``: ``[Q|K|V]`` ``6NC^2``, output ``2NC^2``, one SDPA over N x N ``4N^2C``;
* ``flare``: ``[K|V]`` ``4NC^2``, output ``2NC^2``, encode + decode ``2 x 4NMC``;
* ``flarepp``: ``[K~|K|V]`` ``6NC^2``, output ``2NC^2``, synthesis encode + encode + decode
  ``3 x 4NMC``;
* ``flarepp-simple`` and ``flarepp-v1``: ``[K~|V~|K|V]`` ``8NC^2``, output ``2NC^2``,
  ``3 x 4NMC``;
* ``abupt``: ``[Q|K|V]`` ``6NC^2``, output ``2NC^2``, N queries on ``A' = min(N, A)``
  anchors ``4NA'C``;
* ``luna``: token projections ``[K|V]``, ``W_q``, ``W_o`` ``8NC^2``; packed projections
  ``W_pq``, ``[W_k|W_v]`` on the M packed tokens ``6MC^2``; pack + unpack ``2 x 4NMC``;
* ``transolver``: ``[W_f|W_x]`` ``4NC^2``, output ``2NC^2``, slice logits, slice states and
  deslice ``3 x 2NMC``, slice-token ``[W_q|W_k|W_v]`` ``6MCD`` and attention ``4M^2C``;
* ``transolver++``: ``W_x`` ``2NC^2``, output ``2NC^2``, temperature MLP ``2NMC + 2NMH``,
  slice logits, states and deslice ``3 x 2NMC``, ``6MCD + 4M^2C`` on the slice tokens;
* ``transolver3``: logits from the contracted ``[H, M, C]`` weight, states ``(w~^T X)``
  and deslice ``3 x 2NHMC``; ``W_f`` and ``W_o`` on the M states ``4MC^2``;
  ``6MCD + 4M^2C`` on the slice tokens; and once per call, independent of B, the
  contraction of ``W_s`` with ``W_x`` ``2MC^2 + 2MC``.

Mixers without a formula (see :func:`mixers_without_formula`) are refused by name.

Backbone forward FLOPs per sample: input MLP ``2N in C + 2L NC^2 + 2NC^2``; per block the
mixer plus the FFN ``4rNC^2``; output MLP ``2NC^2 + 2L NC^2 + 2NC out``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from flarepp.mixers import MixerConfig, list_mixers, mixer_config
from flarepp.models.backbone import SurrogateConfig
from flarepp.registry import Registry

BACKWARD_FACTOR = 2.0
"""Backward FLOPs as a multiple of forward FLOPs."""


class MixerCost(NamedTuple):
    """Forward FLOPs of one mixer call: ``per_sample`` (times B) plus ``per_call`` (work on
    the weights alone, done once per call whatever B)."""

    per_sample: float
    per_call: float = 0.0


MixerFlops = Callable[[int, MixerConfig], MixerCost]
"""``(n_tokens, mixer config) -> MixerCost`` of one mixer call."""

MIXER_FLOPS: Registry = Registry("mixer FLOP formula")


def linear_flops(n_tokens: int, in_features: int, out_features: int) -> float:
    """``2 N C_in C_out``: one linear map applied to N tokens."""
    return 2.0 * n_tokens * in_features * out_features


def sdpa_flops(n_queries: int, n_keys: int, dim: int) -> float:
    """``4 n_q n_k C``: ``Q K^T`` and ``P V`` of one SDPA call over all H heads (C = H D)."""
    return 4.0 * n_queries * n_keys * dim


def _register(name: str, doc: str) -> Callable[[MixerFlops], MixerFlops]:
    return MIXER_FLOPS.register(name, doc=doc)


@_register("attention", "8NC^2 + 4N^2C")
def _attention(n: int, c: MixerConfig) -> MixerCost:
    C = c.dim
    return MixerCost(linear_flops(n, C, 3 * C) + linear_flops(n, C, C) + sdpa_flops(n, n, C))


@_register("flare", "6NC^2 + 8NMC")
def _flare(n: int, c: MixerConfig) -> MixerCost:
    C, M = c.dim, c.latents
    return MixerCost(linear_flops(n, C, 2 * C) + linear_flops(n, C, C)
                     + 2 * sdpa_flops(M, n, C))


@_register("flarepp", "8NC^2 + 12NMC")
def _flarepp(n: int, c: MixerConfig) -> MixerCost:
    C, M = c.dim, c.latents
    return MixerCost(linear_flops(n, C, 3 * C) + linear_flops(n, C, C)
                     + 3 * sdpa_flops(M, n, C))


def _synthesized_query(n: int, c: MixerConfig) -> MixerCost:
    C, M = c.dim, c.latents
    return MixerCost(linear_flops(n, C, 4 * C) + linear_flops(n, C, C)
                     + 3 * sdpa_flops(M, n, C))


MIXER_FLOPS.add("flarepp-simple", _synthesized_query, doc="10NC^2 + 12NMC")
MIXER_FLOPS.add("flarepp-v1", _synthesized_query, doc="10NC^2 + 12NMC")


@_register("abupt", "8NC^2 + 4N min(N, A) C")
def _abupt(n: int, c: MixerConfig) -> MixerCost:
    C, keys = c.dim, min(n, c.anchors)
    return MixerCost(linear_flops(n, C, 3 * C) + linear_flops(n, C, C)
                     + sdpa_flops(n, keys, C))


@_register("luna", "8NC^2 + 6MC^2 + 8NMC")
def _luna(n: int, c: MixerConfig) -> MixerCost:
    C, M = c.dim, c.latents
    tokens = linear_flops(n, C, 2 * C) + 2 * linear_flops(n, C, C)    # [W_pk|W_pv], W_q, W_o
    packed = linear_flops(M, C, C) + linear_flops(M, C, 2 * C)        # W_pq, [W_k|W_v]
    return MixerCost(tokens + packed + sdpa_flops(M, n, C) + sdpa_flops(n, M, C))


def _slice_token_attention(c: MixerConfig) -> float:
    """``[W_q|W_k|W_v]`` (D x 3D, per head) and SDPA among the M slice tokens."""
    M, D = c.latents, c.head_dim
    return c.heads * linear_flops(M, D, 3 * D) + sdpa_flops(M, M, c.dim)


def _einsum_flops(*contracted_sizes: int) -> float:
    """``2 prod(sizes)``: an einsum whose output and contracted indices span these sizes."""
    total = 2.0
    for size in contracted_sizes:
        total *= size
    return total


@_register("transolver", "6NC^2 + 6NMC + 6MCD + 4M^2C")
def _transolver(n: int, c: MixerConfig) -> MixerCost:
    C, M, H, D = c.dim, c.latents, c.heads, c.head_dim
    logits = H * linear_flops(n, D, M)                         # W_s per head
    states_and_deslice = 2 * _einsum_flops(H, n, M, D)
    return MixerCost(linear_flops(n, C, 2 * C) + logits + states_and_deslice
                     + _slice_token_attention(c) + linear_flops(n, C, C))


@_register("transolver++", "4NC^2 + 8NMC + 2NMH + 6MCD + 4M^2C")
def _transolver_pp(n: int, c: MixerConfig) -> MixerCost:
    C, M, H, D = c.dim, c.latents, c.heads, c.head_dim
    temperature = H * (linear_flops(n, D, M) + linear_flops(n, M, 1))
    logits = H * linear_flops(n, D, M)
    states_and_deslice = 2 * _einsum_flops(H, n, M, D)
    return MixerCost(2 * linear_flops(n, C, C) + temperature + logits + states_and_deslice
                     + _slice_token_attention(c))


@_register("transolver3", "6NHMC + 4MC^2 + 6MCD + 4M^2C, plus 2MC^2 + 2MC per call")
def _transolver3(n: int, c: MixerConfig) -> MixerCost:
    C, M, H, D = c.dim, c.latents, c.heads, c.head_dim
    token_side = 3 * _einsum_flops(H, n, M, C)           # logits, w~^T X, deslice
    state_side = 2 * _einsum_flops(H, M, C, D)           # W_f and W_o on the M states
    per_call = _einsum_flops(H, M, D, C) + _einsum_flops(H, D, M)   # W_s (W_x, b_x)
    return MixerCost(token_side + state_side + _slice_token_attention(c), per_call)


def mixers_without_formula() -> list[str]:
    """Registered mixers that :func:`model_flops` refuses (no formula written yet)."""
    return [name for name in list_mixers() if name not in MIXER_FLOPS]


def model_flops(settings: dict[str, Any], n_tokens: int, batch: int) -> dict[str, float]:
    """Forward, backward and step FLOPs of ``build_model(**settings)`` on ``[batch, N, in]``.

    ``settings`` are the surrogate backbone's keyword settings (``mixer``, ``in_dim``,
    ``out_dim``, ``dim``, ``heads``, ``blocks``, ``latents``, ``ffn_ratio``, ``io_layers``,
    ``mixer_options``; unset ones take the backbone's defaults); ``arch`` may be
    ``"surrogate"`` or ``"luna"`` (the backbone with Luna's carried packed stream, the same
    products). Raises ``ValueError`` for another architecture or a mixer without a formula.
    """

    arch = settings.get("arch", "surrogate")
    if arch not in ("surrogate", "luna"):
        raise ValueError(f"FLOP count is defined for the 'surrogate' and 'luna' backbones "
                         f"only, got arch {arch!r}")
    fields = {k: v for k, v in settings.items() if k != "arch"}
    if arch == "luna":
        fields.setdefault("mixer", "luna")
    cfg = SurrogateConfig(**fields)
    if cfg.mixer not in MIXER_FLOPS:
        raise ValueError(f"no FLOP formula for mixer {cfg.mixer!r}; formulas exist for "
                         f"{', '.join(MIXER_FLOPS.names())}")
    mixer_cfg = mixer_config(cfg.mixer, dim=cfg.dim, heads=cfg.heads, latents=cfg.latents,
                             norm=cfg.norm, attn_scale=cfg.attn_scale, **cfg.mixer_options)
    mixer = MIXER_FLOPS.get(cfg.mixer)(n_tokens, mixer_cfg)
    n, c, hidden_layers = n_tokens, cfg.dim, cfg.io_layers
    io = (linear_flops(n, cfg.in_dim, c) + hidden_layers * linear_flops(n, c, c)
          + linear_flops(n, c, c)                                     # input MLP
          + linear_flops(n, c, c) + hidden_layers * linear_flops(n, c, c)
          + linear_flops(n, c, cfg.out_dim))                          # output MLP
    hidden = int(c * cfg.ffn_ratio)
    ffn = linear_flops(n, c, hidden) + linear_flops(n, hidden, c)
    forward = (batch * (io + cfg.blocks * (mixer.per_sample + ffn))
               + cfg.blocks * mixer.per_call)
    backward = BACKWARD_FACTOR * forward
    return {"forward": forward, "backward": backward, "step": forward + backward}
