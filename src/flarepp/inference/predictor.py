"""A trained run as one object: its model in physical units, how it runs, and what it takes.

Shape letters: B samples, N points, I input channels (G coordinates, then F features), O
outputs, K conditioning tokens of C features.

:class:`Predictor` pairs a :class:`~flarepp.models.surrogate.Surrogate` (the model with the
maps a run stored: ``x`` inputs, ``y`` outputs, ``conditions`` for a model conditioned on
per-sample tokens; physical units in and out) with an
:class:`~flarepp.inference.execution.Execution` (device, precision, plain / streamed /
token-sharded) and the run's :class:`InputLayout` and config. :func:`flarepp.load` returns
one (:func:`load_predictor`) and ``flarepp infer`` and ``flarepp export`` start from one;
:meth:`Predictor.predict` checks physical arrays against the layout, each mistake a sentence
(:class:`PredictorError`), and runs them through :func:`~flarepp.inference.execution.
predict_tokens`. ``dataclasses.replace(predictor, execution=...)`` runs the same surrogate
another way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from flarepp.data import DataError
from flarepp.data.layout import ChannelLayout
from flarepp.data.store import MeshStore
from flarepp.device import resolve_device
from flarepp.inference.evaluate import run_data
from flarepp.inference.execution import STREAM_ABOVE, Execution, predict_tokens
from flarepp.models.surrogate import Surrogate
from flarepp.storage.checkpoint import read_checkpoint, rebuild_surrogate
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import run_checkpoint


class PredictorError(ValueError):
    """Inputs that do not fit the run's model (channels, shapes, conditions)."""


@dataclass(frozen=True)
class InputLayout:
    """What a run's model takes, from what the run stored (``describe_data()`` in its
    checkpoint): ``channels`` inputs per point of which the first ``coordinates`` are point
    positions (None: the run did not say, so every channel counts as one), their ``names``,
    ``conditions`` ``(K, C)`` conditioning tokens for a conditioned model (None: it takes
    none) named ``condition_names`` in the order the model takes them, the outputs'
    ``field_names`` and ``units``, and ``data_layout``: the run's channel layout
    (:class:`~flarepp.data.ChannelLayout`, for a run on a converted store: every input,
    target and condition channel with its source array or geometry, unit scale and units,
    point or cell rows; None where the run stored none), from which a new mesh's inputs are
    built and against which other data is checked."""

    channels: int
    outputs: int
    coordinates: int | None = None
    names: tuple[str, ...] | None = None
    conditions: tuple[int, int] | None = None
    field_names: tuple[str, ...] = ()
    units: str = ""
    condition_names: tuple[str, ...] = ()
    data_layout: ChannelLayout | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> "InputLayout":
        model, data = state["model_config"], state.get("data", {})
        inputs = data.get("inputs", {})
        conditions = None
        if "cond_dim" in model:
            conditions = (int(model["cond_tokens"]), int(model["cond_dim"]))
        names = inputs.get("names")
        taken = tuple(data.get("conditions", ()))
        channels = None
        if isinstance(data.get("layout"), dict):   # the model's conditions only, its order
            channels = ChannelLayout.from_dict(data["layout"]).with_conditions(list(taken))
        return cls(int(model["in_dim"]), int(model["out_dim"]), inputs.get("coordinates"),
                   None if names is None else tuple(names), conditions,
                   tuple(data.get("field_names", ())), str(data.get("units", "")),
                   taken, channels)

    @property
    def features(self) -> int:
        return self.channels - (self.channels if self.coordinates is None else self.coordinates)

    def describe(self) -> str:
        """``"2 coordinate channels (x, y) and 1 feature channel (a)"``, and for a
        conditioned model ``"; and per sample 1 token of 2 conditions (load, speed), in
        that order"``."""
        if self.coordinates is None:
            text = (f"{self.channels} input channels (the run did not say which are "
                    "coordinates: pass them all as points)")
        else:
            names = self.names or ()
            parts = [(self.coordinates, "coordinate", names[:self.coordinates]),
                     (self.features, "feature", names[self.coordinates:])]
            text = " and ".join(f"{n} {what} channel{'s' * (n != 1)}"
                                + (f" ({', '.join(named)})" if named else "")
                                for n, what, named in parts if n or what == "coordinate")
        if self.conditions is None:
            return text
        tokens, width = self.conditions
        named = (f" ({', '.join(self.condition_names)}), in that order"
                 if self.condition_names else "")
        return (f"{text}; and per sample {tokens} token{'s' * (tokens != 1)} of {width} "
                f"condition{'s' * (width != 1)}{named}")


@dataclass(frozen=True)
class Predictor:
    """A trained model in physical units (``surrogate``: a :class:`~flarepp.models.surrogate.
    Surrogate`) and how it runs (``execution``: an :class:`~flarepp.inference.execution.
    Execution`), with what its inputs are (``layout``: an :class:`InputLayout`; None: all
    of the model's channels, as points) and the run's ``config`` (its
    :class:`~flarepp.storage.config.RunConfig` when loaded from a run)."""

    surrogate: Surrogate = field(repr=False)
    execution: Execution = field(default_factory=Execution)
    layout: InputLayout | None = None
    config: Any = field(default=None, repr=False)

    @property
    def model(self) -> nn.Module:
        """The model inside the surrogate (its own units)."""
        return self.surrogate.model

    def with_execution(self, **changes: Any) -> "Predictor":
        """The same surrogate run with some execution settings changed
        (``dataclasses.replace`` of :attr:`execution`)."""
        return dataclasses.replace(self, execution=dataclasses.replace(self.execution,
                                                                       **changes))

    @torch.no_grad()
    def predict_arrays(self, x_SNI: np.ndarray, mask_SN: np.ndarray | None = None,
                       conditions_SKC: np.ndarray | None = None, *,
                       batch_size: int = 1) -> np.ndarray:
        """Physical predictions ``[S, N, O]`` (float32, zero at padding) for physical host
        arrays, ``batch_size`` samples per forward; inputs stay on the host and only the
        chunk (or shard) being computed moves to the device. Under a context-parallel
        plan every rank returns all of them."""
        self.surrogate.eval()
        outputs = []
        for start in range(0, x_SNI.shape[0], batch_size):
            part = slice(start, start + batch_size)
            batch = {"x": torch.from_numpy(np.ascontiguousarray(x_SNI[part], np.float32))}
            if mask_SN is not None:
                batch["mask"] = torch.from_numpy(np.asarray(mask_SN[part], dtype=bool))
            if conditions_SKC is not None:
                batch["conditioning"] = torch.from_numpy(
                    np.ascontiguousarray(conditions_SKC[part], np.float32))
            y = predict_tokens(self.surrogate, batch, self.execution)
            outputs.append(y.float().cpu().numpy())
        return np.concatenate(outputs, axis=0)

    # -- the Python API --------------------------------------------------------------------
    def predict(self, points: Any, features: Any = None, *, conditions: Any = None,
                mask: Any = None, chunk_size: int | None = None, batch_size: int = 1,
                as_torch: bool = False) -> np.ndarray | torch.Tensor:
        """Fields in physical units at ``points``: ``[N, O]`` for one mesh ``[N, G]``, or
        ``[B, N, O]`` for a batch ``[B, N, G]`` (NumPy arrays or tensors).

        ``features`` ``[(B,) N, F]``: the input channels after the coordinates (the run's
        layout says how many: :attr:`layout`); ``conditions`` ``[(B,) K, C]``: per-sample
        conditioning tokens of a conditioned model, in physical units (as the run's store
        holds them, its unit scales applied), their C channels in the order of
        ``layout.condition_names`` (``layout.describe()`` says it); ``[(B,) C]`` for one
        token; or by name, ``{name: value or [B] values}``, every name of the run once
        (one token); finite, or refused; ``mask`` ``[(B,) N]`` bool, True at
        real points (padded points get zeros); ``chunk_size`` streams K points at a time
        (exact); ``batch_size`` samples per forward; ``as_torch`` returns a CPU tensor."""
        x, mask_arr, cond, single = self._inputs(points, features, conditions, mask)
        predictor = self if chunk_size is None else self.with_execution(chunk_size=chunk_size)
        out = predictor.predict_arrays(x, mask_arr, cond, batch_size=batch_size)
        out = out[0] if single else out
        return torch.from_numpy(out) if as_torch else out

    def _inputs(self, points, features, conditions, mask):
        """``(x [B, N, I], mask, conditions, single)`` from the API's arguments, each shape
        checked against the layout in a sentence."""
        layout = self.layout or InputLayout(self.model.config.in_dim, self.model.config.out_dim)
        points = _host_array(points, "points")
        single = points.ndim == 2
        if points.ndim not in (2, 3):
            raise PredictorError(f"points must be [N, {_want(layout)}] for one mesh or "
                                 f"[B, N, {_want(layout)}] for a batch, got shape "
                                 f"{list(points.shape)}")
        points = points[None] if single else points
        if points.shape[0] == 0:
            raise PredictorError("points: a batch of 0 meshes [0, N, G]; give at least one")
        coordinates = layout.channels if layout.coordinates is None else layout.coordinates
        if points.shape[-1] != coordinates:
            raise PredictorError(f"points have {points.shape[-1]} channels, but this run's "
                                 f"model takes {layout.describe()}")
        parts = [points]
        if features is not None:
            features = _host_array(features, "features")
            features = features[None] if single and features.ndim == 2 else features
            if features.shape[:2] != points.shape[:2]:
                raise PredictorError(f"features {list(features.shape)} and points "
                                     f"{list(points.shape)} disagree on samples or points")
            if features.shape[-1] != layout.features:
                raise PredictorError(f"features have {features.shape[-1]} channels, but this "
                                     f"run's model takes {layout.describe()}")
            parts.append(features)
        elif layout.features:
            raise PredictorError(f"this run's model takes {layout.describe()}: give the "
                                 f"{layout.features} feature channel(s) as features=")
        x = np.concatenate(parts, axis=-1).astype(np.float32)
        if mask is not None:
            mask = _host_array(mask, "mask").astype(bool)
            mask = mask[None] if single and mask.ndim == 1 else mask
            if mask.shape != x.shape[:2]:
                raise PredictorError(f"mask must be [B, N] = {list(x.shape[:2])} (True at "
                                     f"real points), got {list(mask.shape)}")
        real = np.ones(x.shape[:2], bool) if mask is None else mask
        if not np.isfinite(x[real]).all():
            raise PredictorError("the inputs hold NaN or inf at real points; their "
                                 "predictions would be NaN")
        return x, mask, self._conditions(conditions, x.shape[0], single, layout), single

    def _conditions(self, conditions, samples: int, single: bool, layout: InputLayout):
        if layout.conditions is None:
            if conditions is not None:
                raise PredictorError("this run's model takes no conditions (it is not a "
                                     "conditioned architecture); leave conditions= out")
            return None
        tokens, width = layout.conditions
        if conditions is None:
            raise PredictorError(f"this run's model is conditioned on {tokens} token(s) of "
                                 f"{width} features per sample: give conditions= "
                                 f"[{'' if single else 'B, '}{tokens}, {width}]")
        if isinstance(conditions, dict):
            conditions = _named_conditions(conditions, layout)
        c = _host_array(conditions, "conditions")
        if tokens == 1 and c.ndim == (1 if single else 2):  # one token: [C] or [B, C]
            c = c[..., None, :]
        c = c[None] if single and c.ndim == 2 else c
        if list(c.shape) != [samples, tokens, width]:
            raise PredictorError(f"conditions must be [B, K, C] = [{samples}, {tokens}, "
                                 f"{width}], got {list(c.shape)}")
        if not np.isfinite(c).all():
            sample = int(np.argwhere(~np.isfinite(c))[0][0])
            raise PredictorError(f"conditions hold NaN or inf (first in sample {sample}); "
                                 "every prediction of that sample would be NaN")
        return c


def _named_conditions(conditions: dict[str, Any], layout: InputLayout) -> np.ndarray:
    """``{name: value or [B] values}`` as the ``[(B,) C]`` array of the run's condition
    channels, in their stored order (every name given once, none unknown)."""
    names = layout.condition_names
    if not names:
        raise PredictorError("this run did not store the names of its conditions: give "
                             "conditions= as an array")
    unknown = sorted(set(conditions) - set(names))
    missing = [n for n in names if n not in conditions]
    if unknown or missing:
        raise PredictorError(f"conditions= names {', '.join(names)} (the run's): "
                             + (f"unknown {unknown}" if unknown else f"missing {missing}"))
    return np.stack([np.asarray(conditions[n], np.float32) for n in names], axis=-1)


def _want(layout: InputLayout) -> str:
    return str(layout.channels if layout.coordinates is None else layout.coordinates)


def _host_array(value: Any, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if np.iscomplexobj(value):  # float32 would drop the imaginary parts, only warning
        raise PredictorError(f"{what}: complex numbers; give real ones")
    try:
        return np.asarray(value, dtype=np.float32 if what != "mask" else None)
    except (TypeError, ValueError) as err:
        raise PredictorError(f"{what}: expected an array of numbers ({err})") from None


# ---------------------------------------------------------------------------------------------
# loading a run

def load_predictor(path: str | Path, *, device: str | torch.device = "auto",
                   precision: str | None = None, weights: str | None = None,
                   chunk_size: int | None = None) -> Predictor:
    """The predictor of a run directory or a checkpoint file: the model rebuilt from the
    checkpoint alone (the one ``metrics.json`` names for a finished run, else the newest)
    with the weights the run reports (``weights``: ``raw`` or ``ema`` to choose) and its
    stored normalisers as a :class:`~flarepp.models.surrogate.Surrogate`
    (:func:`~flarepp.storage.checkpoint.rebuild_surrogate`), its input layout, run on
    ``device`` in its own precision (or ``precision``), streamed by ``chunk_size`` (unset: a
    mesh of more than :data:`~flarepp.inference.execution.STREAM_ABOVE` points streamed in
    chunks of that many, exactly; a smaller one whole).

    Raises one sentence for a path that is no run and no checkpoint, and for a run whose
    task does not map mesh points to fields (no stored normalisers)."""
    path = run_checkpoint(path)
    if weights not in (None, "raw", "ema"):
        raise ValueError(f"weights must be 'raw' or 'ema' (default: those the run reports), "
                         f"got {weights!r}")
    state = read_checkpoint(path)
    surrogate = rebuild_surrogate(state, path, ema=None if weights is None
                                  else weights == "ema")
    config = RunConfig.from_stored(state["config"])
    device = resolve_device(device)
    layout = InputLayout.from_checkpoint(state)
    if layout.data_layout is None and config.dataset == "store":
        layout = dataclasses.replace(layout, data_layout=_store_layout(state, config, layout))
    return Predictor(surrogate.to(device).eval(),
                     Execution(device, precision or config.precision, chunk_size=chunk_size,
                               stream_above=STREAM_ABOVE),
                     layout, config)


def _store_layout(state: dict[str, Any], config: RunConfig,
                  layout: InputLayout) -> ChannelLayout | None:
    """The channel layout of a store run that stored none (trained before runs stored it):
    that of the store at the run's recorded data path, when it still opens (None if not)."""
    try:
        store = MeshStore(run_data(state, config))
        return store.layout.with_conditions(list(layout.condition_names))
    except (DataError, KeyError):
        return None


__all__ = ["InputLayout", "Predictor", "PredictorError", "load_predictor"]
