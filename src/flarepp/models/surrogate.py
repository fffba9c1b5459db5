"""A model in physical units: the model together with the maps between physical units and
its own, as one module (neuraloperator's ``DataProcessor`` is the idea).

Shape letters: B samples, N points, I input channels, O outputs, K conditioning tokens of C
features.

A model maps normalised inputs to normalised outputs. Each map is a per-channel shift and
scale, a buffer of the module (it moves with ``.to()``, travels in ``state_dict()`` as
``input_shift``, ``input_scale``, ``output_shift``, ``output_scale``, ``condition_shift``,
``condition_scale``, and is traced into an export):

* **normalise** inputs: ``x_n = (x - shift_x) / scale_x``, zero at padding; conditioning
  tokens ``c_n = (c - shift_c) / scale_c``;
* **de-normalise** outputs: ``y = y_n scale_y + shift_y`` in at least FP32, zero at padding.

A map left out is the identity. :meth:`UnitMaps.denormalise` is the one de-normalisation of
model outputs in flarepp: the trainer's loss (a task's :class:`UnitMaps`), evaluation,
``flarepp infer``, :func:`flarepp.load` and ``flarepp export`` all go through it
(``tests/test_surrogate.py`` fails on another in ``src/``).

:class:`Surrogate` is the maps with the model: ``Surrogate(model, inputs=(mean, std),
outputs=(mean, std))(x, mask)`` takes and returns physical units and has the model's call
signature, so it is exported, streamed and token-sharded as the model is. Its state is
rebuilt from a checkpoint's stored normalisers by
:func:`flarepp.storage.checkpoint.rebuild_surrogate`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from flarepp.models.backbone import StreamingPlan

MAPS = {"inputs": "input", "outputs": "output", "conditions": "condition"}
"""The maps a :class:`UnitMaps` holds, by argument name, and their buffers' prefix."""

Pair = tuple[Any, Any]
"""``(shift, scale)``: per-channel arrays, tensors or numbers."""


def _map_buffers(pair: Pair | None, role: str) -> tuple[torch.Tensor | None, ...]:
    """``(shift, scale)`` as 1-D tensors of one length (their own float dtype), checked."""
    if pair is None:
        return None, None
    shift, scale = (torch.as_tensor(v if isinstance(v, torch.Tensor) else np.asarray(v))
                    .detach().reshape(-1) for v in pair)
    if not (shift.is_floating_point() and scale.is_floating_point()):
        shift, scale = shift.to(torch.float32), scale.to(torch.float32)
    if shift.shape != scale.shape:
        raise ValueError(f"the {role} map: shift has {shift.numel()} channel(s) and scale "
                         f"{scale.numel()}; give one of each per channel")
    if not (torch.isfinite(shift).all() and torch.isfinite(scale).all()):
        raise ValueError(f"the {role} map: shift and scale must be finite, got shift "
                         f"{shift.tolist()} and scale {scale.tolist()}")
    return shift.clone(), scale.clone()


class UnitMaps(nn.Module):
    """The maps between physical units and a model's (module docstring): ``inputs``,
    ``outputs`` and ``conditions`` each a ``(shift, scale)`` pair or None (the identity)."""

    def __init__(self, *, inputs: Pair | None = None, outputs: Pair | None = None,
                 conditions: Pair | None = None) -> None:
        super().__init__()
        for role, pair in (("inputs", inputs), ("outputs", outputs),
                           ("conditions", conditions)):
            shift, scale = _map_buffers(pair, role)
            self.register_buffer(f"{MAPS[role]}_shift", shift)
            self.register_buffer(f"{MAPS[role]}_scale", scale)

    @property
    def device(self) -> torch.device:
        """Where the maps are (the CPU for identity maps)."""
        return next(self.buffers(), torch.empty(0)).device

    def normalise(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(x - shift_x) / scale_x`` in ``x``'s dtype, zero where ``mask [B, N]`` is False."""
        if self.input_shift is not None:
            x = (x - self.input_shift.to(x.dtype)) / self.input_scale.to(x.dtype)
        return x if mask is None else x.masked_fill(~mask[..., None], 0.0)

    def normalise_conditions(self, c: torch.Tensor) -> torch.Tensor:
        """``(c - shift_c) / scale_c`` of conditioning tokens ``[B, K, C]``."""
        if self.condition_shift is None:
            return c
        return (c - self.condition_shift.to(c.dtype)) / self.condition_scale.to(c.dtype)

    def denormalise(self, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``y_n scale_y + shift_y`` in at least FP32, zero where ``mask [B, N]`` is False;
        ``y`` as it is without an output map."""
        if self.output_shift is None:
            return y
        y = y.to(torch.promote_types(y.dtype, torch.float32))
        y = y * self.output_scale.to(y.dtype) + self.output_shift.to(y.dtype)
        return y if mask is None else y.masked_fill(~mask.to(y.device)[..., None], 0.0)


class Surrogate(UnitMaps):
    """``model`` in physical units: ``forward(x [B, N, I], mask [B, N], conditioning
    [B, K, C]) = denormalise(model(normalise(x), mask, normalise_conditions(c)))``, zero at
    padding; ``inputs``, ``outputs``, ``conditions`` its maps as ``(shift, scale)`` pairs
    (None: the identity)."""

    def __init__(self, model: nn.Module, *, inputs: Pair | None = None,
                 outputs: Pair | None = None, conditions: Pair | None = None) -> None:
        super().__init__(inputs=inputs, outputs=outputs, conditions=conditions)
        self.model = model

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                conditioning: torch.Tensor | None = None) -> torch.Tensor:
        extra = ({} if conditioning is None
                 else {"conditioning": self.normalise_conditions(conditioning)})
        return self.denormalise(self.model(self.normalise(x, mask), mask=mask, **extra), mask)

    @property
    def takes_conditioning(self) -> bool:
        """Whether the model takes conditioning tokens (a conditioned model declares its
        own ``streaming_refusal()``; :func:`~flarepp.distributed.streaming_refusal`)."""
        return getattr(self.model, "takes_conditioning",
                       hasattr(self.model, "streaming_refusal"))

    def streaming_refusal(self) -> str | None:
        """The model's own reason not to stream (:func:`~flarepp.distributed.
        streaming_refusal`), None where it gives none."""
        own = getattr(self.model, "streaming_refusal", None)
        return None if own is None else own()

    def streaming_plan(self, conditioning: torch.Tensor | None = None) -> StreamingPlan:
        """The model's :class:`~flarepp.models.backbone.StreamingPlan` with the maps around
        it: normalise before its ``embed``, de-normalise after its ``head``; ``conditioning``
        tokens (physical units) normalised for a model that takes them. Both maps act on
        each token alone, so streaming the surrogate stays exact."""
        plan_of = getattr(self.model, "streaming_plan", None)
        if plan_of is None:
            raise ValueError(f"{type(self.model).__name__} declares no streaming_plan(), so "
                             "it cannot be streamed block by block; run it unchunked")
        inner = plan_of() if conditioning is None else plan_of(
            conditioning=self.normalise_conditions(conditioning))
        return dataclasses.replace(
            inner, embed=lambda x, mask: inner.embed(self.normalise(x, mask), mask),
            head=lambda h, mask: self.denormalise(inner.head(h, mask), mask))


__all__ = ["MAPS", "Surrogate", "UnitMaps"]
