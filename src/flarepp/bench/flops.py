"""Analytic FLOP count of one training step of the surrogate backbone (paper D.3).

Shape letters: B batch, N tokens, C channels, H heads, D = C/H head width, M latents,
r the FFN ratio, L the hidden layers of each input/output MLP (``io_layers``).

How the count is made (per sample; multiply by B):

* a linear map applied to N tokens costs ``2 N C_in C_out`` (one multiply and one add per
  weight and token); biases are not counted;
* a fused SDPA call with ``n_q`` queries and ``n_k`` keys costs ``4 n_q n_k D`` per head
  (``2 n_q n_k D`` for ``Q K^T`` and as much for ``P V``), i.e. ``4 n_q n_k C`` over the H
  heads; the softmax itself (max, exp, sum) is not counted;
* norms, activations, residual adds, masking and the work on the M latents alone
  (normalising the seeds, the FP32 gated sum) are not counted;
* backward = 2 x forward (the input-gradient and weight-gradient products of every
  matmul); the score recomputation inside the fused attention backward is not counted, so
  FLOP/s computed from this count are "model FLOP/s".

Mixer forward FLOPs per sample (``MIXER_FLOPS``):

* ``attention``: ``[Q|K|V]`` ``6NC^2``, output ``2NC^2``, one SDPA over N x N ``4N^2C``;
* ``flare``: ``[K|V]`` ``4NC^2``, output ``2NC^2``, encode + decode ``2 x 4NMC``;
* ``flarepp``: ``[K~|K|V]`` ``6NC^2``, output ``2NC^2``, synthesis encode + encode + decode
  ``3 x 4NMC``;
* ``flarepp-simple`` and ``flarepp-v1``: ``[K~|V~|K|V]`` ``8NC^2``, output ``2NC^2``,
  ``3 x 4NMC``.

Backbone forward FLOPs per sample: input MLP ``2N in C + 2L NC^2 + 2NC^2``; per block the
mixer plus the FFN ``4rNC^2``; output MLP ``2NC^2 + 2L NC^2 + 2NC out``.
"""

from __future__ import annotations

from typing import Any, Callable

from flarepp.registry import Registry

BACKWARD_FACTOR = 2.0
"""Backward FLOPs as a multiple of forward FLOPs."""

MixerFlops = Callable[[int, int, int], float]
"""``(n_tokens, dim, latents) -> forward FLOPs of one mixer call on one sample``."""

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
def _attention(n: int, c: int, m: int) -> float:
    return linear_flops(n, c, 3 * c) + linear_flops(n, c, c) + sdpa_flops(n, n, c)


@_register("flare", "6NC^2 + 8NMC")
def _flare(n: int, c: int, m: int) -> float:
    return linear_flops(n, c, 2 * c) + linear_flops(n, c, c) + 2 * sdpa_flops(m, n, c)


@_register("flarepp", "8NC^2 + 12NMC")
def _flarepp(n: int, c: int, m: int) -> float:
    return linear_flops(n, c, 3 * c) + linear_flops(n, c, c) + 3 * sdpa_flops(m, n, c)


def _synthesized_query(n: int, c: int, m: int) -> float:
    return linear_flops(n, c, 4 * c) + linear_flops(n, c, c) + 3 * sdpa_flops(m, n, c)


MIXER_FLOPS.add("flarepp-simple", _synthesized_query, doc="10NC^2 + 12NMC")
MIXER_FLOPS.add("flarepp-v1", _synthesized_query, doc="10NC^2 + 12NMC")


def model_flops(settings: dict[str, Any], n_tokens: int, batch: int) -> dict[str, float]:
    """Forward, backward and step FLOPs of ``build_model(**settings)`` on ``[batch, N, in]``.

    ``settings`` are the surrogate backbone's keyword settings (``mixer``, ``in_dim``,
    ``out_dim``, ``dim``, ``blocks``, ``latents``, ``ffn_ratio``, ``io_layers``; the last
    four default to the backbone's defaults). Raises ``ValueError`` for a mixer without a
    registered formula.
    """
    from flarepp.models.backbone import SurrogateConfig

    arch = settings.get("arch", "surrogate")
    if arch != "surrogate":
        raise ValueError(f"FLOP count is defined for the 'surrogate' backbone only, got {arch!r}")
    fields = {k: v for k, v in settings.items() if k != "arch"}
    cfg = SurrogateConfig(**fields)
    mixer = MIXER_FLOPS.get(cfg.mixer)
    n, c, hidden_layers = n_tokens, cfg.dim, cfg.io_layers
    io = (linear_flops(n, cfg.in_dim, c) + hidden_layers * linear_flops(n, c, c)
          + linear_flops(n, c, c)                                     # input MLP
          + linear_flops(n, c, c) + hidden_layers * linear_flops(n, c, c)
          + linear_flops(n, c, cfg.out_dim))                          # output MLP
    hidden = int(c * cfg.ffn_ratio)
    ffn = linear_flops(n, c, hidden) + linear_flops(n, hidden, c)
    forward = batch * (io + cfg.blocks * (mixer(n, c, cfg.latents) + ffn))
    backward = BACKWARD_FACTOR * forward
    return {"forward": forward, "backward": backward, "step": forward + backward}
