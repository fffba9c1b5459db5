"""The weight algebra between other FLARE implementations and flarepp's mixers.

Shape letters: C channels, H heads, D = C / H head width, M latents.

**Shared head maps.** NVIDIA PhysicsNeMo's FLARE layer projects the tokens once,
``x_h = W_in,h x + b_in,h`` (``W_in,h`` the rows ``hD .. (h+1)D - 1`` of one ``C x C`` map),
then applies one ``D x D`` key map and one ``D x D`` value map shared by every head:
``k_h = W_k x_h + b_k``, ``v_h = W_v x_h + b_v``. Composed, that is flarepp's per-head
projection (paper Table 2, FLARE column)::

    W_K,h = W_k W_in,h,        b_K,h = W_k b_in,h + b_k      (and W_V,h, b_V,h alike)

so every such layer maps exactly onto flarepp's ``flare`` mixer (:func:`compose_shared`). The
way back (:func:`factor_shared`) exists only where flarepp's maps have that structure: with
``W_in,h = W_K,h`` (``W_k = I``, ``b_k = 0``) the value maps must be
``[W_V,h | b_V,h] = W_v [W_K,h | b_K,h] + [0 | b_v]`` for one ``(W_v, b_v)`` over all heads,
which is solved by least squares and accepted only when it holds to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class InteropError(ValueError):
    """A checkpoint flarepp cannot read, or weights with no exact counterpart in the other
    implementation; one sentence naming the file, argument or key."""


class MapError(InteropError):
    """Weights that have no exact counterpart in the other implementation."""


class SourceWeights:
    """Another implementation's state dict, read key by key in float64: a missing key is an
    :class:`InteropError` naming it and ``where`` (the file), and :meth:`check_all_used`
    refuses a state dict holding weights no map read (a layer flarepp's model lacks)."""

    def __init__(self, state: dict[str, torch.Tensor], where: str) -> None:
        self.state, self.where, self.used = state, where, set()

    def __contains__(self, key: str) -> bool:
        return key in self.state

    def __call__(self, key: str) -> torch.Tensor:
        if key not in self.state:
            raise InteropError(f"{self.where}: the state dict lacks {key!r}, which the model "
                               "its arguments describe has")
        self.used.add(key)
        value = self.state[key]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            what = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise InteropError(f"{self.where}: {key!r} is a {what}, not a real floating-point "
                               "tensor")
        if not torch.isfinite(value).all():
            raise InteropError(f"{self.where}: {key!r} holds NaN or infinite weights")
        return value.detach().double()

    def affine(self, prefix: str) -> "Affine":
        return Affine(self(f"{prefix}.weight"), self(f"{prefix}.bias"))

    def check_all_used(self) -> None:
        left = sorted(set(self.state) - self.used)
        if left:
            more = f" and {len(left) - 3} more" if len(left) > 3 else ""
            raise InteropError(f"{self.where}: the state dict holds {left[:3]}{more}, which "
                               "no part of flarepp's model takes (a layer it lacks)")


@dataclass(frozen=True)
class Affine:
    """A linear map with bias: ``y = weight x + bias`` (``weight [out, in]``, ``bias [out]``)."""

    weight: torch.Tensor
    bias: torch.Tensor

    def double(self) -> "Affine":
        return Affine(self.weight.double(), self.bias.double())


def compose_shared(inner: Affine, shared: Affine, heads: int) -> Affine:
    """``W_h = W_s W_in,h``, ``b_h = W_s b_in,h + b_s`` for every head, stacked ``[C, C]``.

    ``inner``: the ``C x C`` projection ``x -> x_h`` (rows grouped by head); ``shared``: the
    ``D x D`` map every head applies. Computed in float64."""
    inner, shared = inner.double(), shared.double()
    C, D = inner.weight.shape[0], shared.weight.shape[0]
    if C != heads * D or shared.weight.shape != (D, D):
        raise MapError(f"a shared head map of shape {list(shared.weight.shape)} does not fit "
                       f"{heads} heads of a {C}-wide projection")
    w_in = inner.weight.reshape(heads, D, -1)                               # [H, D, C]
    b_in = inner.bias.reshape(heads, D)                                     # [H, D]
    weight = torch.einsum("de,hec->hdc", shared.weight, w_in).reshape(C, -1)
    bias = (b_in @ shared.weight.T + shared.bias).reshape(C)
    return Affine(weight, bias)


def residual_linear(layer: Affine) -> Affine:
    """``x + W x + b`` as one map: ``(I + W) x + b`` (the FLARE study's one-layer residual
    key and value projections)."""
    layer = layer.double()
    return Affine(layer.weight + torch.eye(layer.weight.shape[0], dtype=torch.float64),
                  layer.bias)


@dataclass(frozen=True)
class SharedFactors:
    """``inner`` (``C x C``), ``key`` and ``value`` (``D x D``) with
    ``compose_shared(inner, key) = K`` and ``compose_shared(inner, value) = V``; ``residual``
    the relative least-squares residual of the value map."""

    inner: Affine
    key: Affine
    value: Affine
    residual: float


def factor_shared(keys: Affine, values: Affine, heads: int, *, rtol: float = 1e-9
                  ) -> SharedFactors:
    """The inverse of :func:`compose_shared` for a pair of per-head projections, or a
    :class:`MapError` saying why none exists (module docstring)."""
    keys, values = keys.double(), values.double()
    C = keys.weight.shape[0]
    D = C // heads
    # [W_K,h | b_K,h] and [W_V,h | b_V,h] side by side over the heads: [D, H (C + 1)]
    k_cols = torch.cat([keys.weight.reshape(heads, D, -1),
                        keys.bias.reshape(heads, D, 1)], dim=2).permute(1, 0, 2).reshape(D, -1)
    v_cols = torch.cat([values.weight.reshape(heads, D, -1),
                        values.bias.reshape(heads, D, 1)], dim=2).permute(1, 0, 2).reshape(D, -1)
    ones = torch.zeros(heads, 1, keys.weight.shape[1] + 1, dtype=torch.float64)
    ones[..., -1] = 1.0                                   # b_v adds to the bias columns only
    design = torch.cat([k_cols, ones.reshape(1, -1)], dim=0)              # [D + 1, H (C+1)]
    solution = torch.linalg.lstsq(design.T, v_cols.T).solution.T          # [D, D + 1]
    scale = max(float(v_cols.abs().max()), 1e-300)
    residual = float((solution @ design - v_cols).abs().max()) / scale
    if not residual <= rtol:
        raise MapError(f"its value maps are not one D x D map applied to its key maps "
                       f"(relative residual {residual:.2g}): PhysicsNeMo's FLARE shares one "
                       f"key and one value map of rank D = {D} between the heads, while "
                       "flarepp's per-head maps are independent")
    identity = Affine(torch.eye(D, dtype=torch.float64), torch.zeros(D, dtype=torch.float64))
    return SharedFactors(keys, identity, Affine(solution[:, :D], solution[:, D]), residual)


__all__ = ["Affine", "InteropError", "MapError", "SharedFactors", "SourceWeights", "compose_shared", "factor_shared",
           "residual_linear"]
