"""The one predictor: a trained model with its normalisers, precision, device and execution.

Shape letters: B samples, N points, I input channels (G coordinates, then F features), O
outputs, K conditioning tokens of C features.

A model maps normalised inputs to normalised outputs. :class:`Predictor` holds the model
together with the maps a run stored (``x`` inputs, ``y`` outputs, and ``conditions`` for a
model conditioned on per-sample tokens), the precision it runs in, its device and the
execution strategy, and is the one place that

* **normalises** physical inputs: ``x_n = (x - shift_x) / scale_x``, exactly zero at padding
  (as in training); conditions likewise with their own map;
* **runs** the model on a normalised batch through :func:`predict_tokens` (plain,
  streamed in chunks, token-sharded over a context-parallel group,
  or both: paper Appendix B), under autocast;
* **de-normalises** its outputs: ``y = y_n scale_y + shift_y``, zero at padding
  (:meth:`Predictor.denormalise`, the only de-normalisation of model outputs in flarepp).

The idea is neuraloperator's ``DataProcessor`` (preprocess, model, postprocess as one
object). The trainer's evaluation, ``flarepp eval``, ``flarepp plot``, ``flarepp infer``,
whole-surface prediction, :func:`flarepp.load` and the export all predict through it. A
task's own batches come with inputs already normalised by the task (they are also what the
trainer steps on, with the same stored maps), so they enter at :meth:`Predictor.run`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from flarepp.data import Normalizer
from flarepp.device import amp_dtype, autocast, resolve_device
from flarepp.distributed.mesh import SINGLE, ParallelPlan
from flarepp.distributed.parallel import gather_tokens, shard_slice
from flarepp.distributed.streaming import stream_forward
from flarepp.tasks.base import Batch
from flarepp.threads import ThreadTuner


class PredictorError(ValueError):
    """Inputs that do not fit the run's model (channels, shapes, conditions)."""


@dataclass(frozen=True)
class InputLayout:
    """What a run's model takes, from what the run stored (``describe_data()`` in its
    checkpoint): ``channels`` inputs per point of which the first ``coordinates`` are point
    positions (None: the run did not say, so every channel counts as one), their ``names``,
    ``conditions`` ``(K, C)`` conditioning tokens for a conditioned model (None: it takes
    none), and the outputs' ``field_names`` and ``units``."""

    channels: int
    outputs: int
    coordinates: int | None = None
    names: tuple[str, ...] | None = None
    conditions: tuple[int, int] | None = None
    field_names: tuple[str, ...] = ()
    units: str = ""
    condition_names: tuple[str, ...] = ()

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> "InputLayout":
        model, data = state["model_config"], state.get("data", {})
        inputs = data.get("inputs", {})
        conditions = None
        if "cond_dim" in model:
            conditions = (int(model["cond_tokens"]), int(model["cond_dim"]))
        names = inputs.get("names")
        return cls(int(model["in_dim"]), int(model["out_dim"]), inputs.get("coordinates"),
                   None if names is None else tuple(names), conditions,
                   tuple(data.get("field_names", ())), str(data.get("units", "")),
                   tuple(data.get("conditions", ())))

    @property
    def features(self) -> int:
        return self.channels - (self.channels if self.coordinates is None else self.coordinates)

    def describe(self) -> str:
        """``"2 coordinate channels (x, y) and 1 feature channel (a)"``."""
        if self.coordinates is None:
            return (f"{self.channels} input channels (the run did not say which are "
                    "coordinates: pass them all as points)")
        names = self.names or ()
        parts = [(self.coordinates, "coordinate", names[:self.coordinates]),
                 (self.features, "feature", names[self.coordinates:])]
        return " and ".join(f"{n} {what} channel{'s' * (n != 1)}"
                            + (f" ({', '.join(named)})" if named else "")
                            for n, what, named in parts if n or what == "coordinate")


@torch.no_grad()
def predict_tokens(model: nn.Module, batch: Batch, *, device: torch.device,
                   chunk_size: int | None = None, group: Any = None,
                   forward: Callable[[Batch], torch.Tensor] | None = None,
                   hidden_on: str = "auto", memmap_dir: str | None = None,
                   progress: bool = False) -> torch.Tensor:
    """The one prediction path: ``model``'s output for every token of ``batch``.

    ``batch`` holds ``x`` ``[B, N, I]`` (and ``mask`` ``[B, N]``) already cut to this rank's
    token shard when ``group`` (the context-parallel group, paper Appendix B) is given.
    With ``chunk_size`` the tokens are streamed through ``device`` in chunks whose encoder
    partials merge by the log-sum-exp rule (:func:`~flarepp.distributed.stream_forward`);
    otherwise ``forward(batch)`` (default ``model(x, mask)``) runs on tensors already on
    ``device``. Under ``group`` every rank returns the gathered ``[B, N, O]``. Every
    strategy computes the same function as ``model(x, mask)``; autocast is the caller's.
    ``hidden_on``, ``memmap_dir`` and ``progress`` are :func:`~flarepp.distributed.
    stream_forward`'s: where a streamed mesh's hidden state lives, and a progress bar.
    """
    if chunk_size is not None:
        pred = stream_forward(model, batch["x"], batch.get("mask"), chunk_size=chunk_size,
                              device=device, group=group, hidden_on=hidden_on,
                              memmap_dir=memmap_dir, progress=progress)
    elif forward is not None:
        pred = forward(batch)
    else:
        mask = batch.get("mask")
        pred = model(batch["x"].to(device), mask=None if mask is None else mask.to(device))
    if group is not None:
        pred = gather_tokens(pred.to(device).contiguous(), group)
    return pred


def shard_tokens(batch: Batch, plan: ParallelPlan, token_keys: tuple[str, ...]) -> Batch:
    """This rank's contiguous token shard of every token entry of ``batch`` (paper App. B;
    the batch itself without a context-parallel group)."""
    if plan.cp_group is None:
        return batch
    rank, world = plan.cp_rank, plan.cp_size
    return {k: (v[:, shard_slice(v.shape[1], rank, world)] if k in token_keys else v)
            for k, v in batch.items()}


class Predictor:
    """A trained model with its normalisers, precision, device and execution strategy.

    ``inputs``, ``outputs``, ``conditions``: the run's normalisers (None: the model sees the
    values as they are, as for tasks without maps); ``precision`` the autocast
    (``fp32``, ``bf16``, ``fp16``); ``plan`` the context-parallel group whose ranks split
    each sample's tokens (the model must be wrapped by
    :func:`~flarepp.distributed.context_parallel` on every rank); ``chunk_size`` streams
    K tokens at a time; ``hidden_on``, ``memmap_dir``, ``progress`` place a streamed
    sample's hidden state (:func:`~flarepp.distributed.stream_forward`); ``forward`` the
    model call on a device batch (default ``model(x, mask=mask)``, with ``conditioning``
    when the batch holds it); ``layout`` what the inputs are (:class:`InputLayout`);
    ``config`` the run's :class:`~flarepp.storage.config.RunConfig` when loaded from a run;
    ``threads`` times each forward to choose the CPU threads (:mod:`flarepp.threads`).
    """

    def __init__(self, model: nn.Module, *, inputs: Normalizer | None = None,
                 outputs: Normalizer | None = None, conditions: Normalizer | None = None,
                 device: str | torch.device | None = None, precision: str = "fp32",
                 plan: ParallelPlan = SINGLE, chunk_size: int | None = None,
                 token_keys: tuple[str, ...] = ("x", "mask"),
                 forward: Callable[[Batch], torch.Tensor] | None = None,
                 hidden_on: str = "auto", memmap_dir: str | None = None,
                 progress: bool = False, layout: InputLayout | None = None,
                 config: Any = None, threads: ThreadTuner | None = None) -> None:
        amp_dtype(precision)  # refuses an unknown precision, naming the known ones
        self.model = model
        self.inputs, self.outputs, self.conditions = inputs, outputs, conditions
        self.device = (torch.device(device) if device is not None
                       else next(model.parameters()).device)
        self.precision, self.plan, self.chunk_size = precision, plan, chunk_size
        self.token_keys, self.hidden_on, self.memmap_dir = token_keys, hidden_on, memmap_dir
        self.progress, self.layout, self.config = progress, layout, config
        self.threads = threads
        self._forward = forward

    def replace(self, **changes: Any) -> "Predictor":
        """A predictor with some settings changed (the same model and maps)."""
        settings = {k: getattr(self, k) for k in (
            "inputs", "outputs", "conditions", "device", "precision", "plan", "chunk_size",
            "token_keys", "hidden_on", "memmap_dir", "progress", "layout", "config",
            "threads")}
        return Predictor(self.model, forward=self._forward, **{**settings, **changes})

    def to(self, device: str | torch.device) -> "Predictor":
        """The model moved to ``device`` (``auto``: CUDA when available), and predicting
        there."""
        device = resolve_device(device)
        self.model.to(device)
        self.device = device
        return self

    # -- the maps ------------------------------------------------------------------------
    def normalise(self, x_BNI: np.ndarray, mask_BN: np.ndarray | None = None,
                  conditions_BKC: np.ndarray | None = None) -> Batch:
        """A host batch the model takes from physical inputs: ``x`` normalised (zero at
        padding, as in training), ``mask``, and normalised ``conditioning``."""
        x = np.asarray(x_BNI)
        if self.inputs is not None:
            x = self.inputs.encode(x)
        batch = {"x": torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))}
        if mask_BN is not None:
            batch["mask"] = torch.from_numpy(np.asarray(mask_BN, dtype=bool))
            batch["x"] = batch["x"] * batch["mask"][..., None]
        if conditions_BKC is not None:
            c = np.asarray(conditions_BKC)
            if self.conditions is not None:
                c = self.conditions.encode(c)
            batch["conditioning"] = torch.from_numpy(np.ascontiguousarray(c, np.float32))
        return batch

    def denormalise(self, y_BNO: torch.Tensor, mask_BN: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """Physical outputs from the model's: ``y_n scale_y + shift_y`` in at least FP32,
        zero at padding; the model's outputs as they are without an output map."""
        if self.outputs is None:
            return y_BNO
        y = self.outputs.decode(y_BNO.float())
        return y if mask_BN is None else y * mask_BN.to(y.device)[..., None]

    # -- running ---------------------------------------------------------------------------
    def forward(self, batch: Batch) -> torch.Tensor:
        """The model on a normalised batch already on the device (this rank's shard)."""
        if self._forward is not None:
            return self._forward(batch)
        mask = batch.get("mask")
        extra = ({"conditioning": batch["conditioning"].to(self.device)}
                 if "conditioning" in batch else {})
        return self.model(batch["x"].to(self.device),
                          mask=None if mask is None else mask.to(self.device), **extra)

    @torch.no_grad()
    def run(self, batch: Batch) -> torch.Tensor:
        """The model's (normalised) outputs for every token of a normalised ``batch``:
        sharded over the plan's context-parallel group and gathered, or streamed in chunks,
        under autocast (:func:`predict_tokens`)."""
        shard = shard_tokens(batch, self.plan, self.token_keys)
        custom = self._forward is not None or "conditioning" in batch
        timed = self.threads.step() if self.threads is not None else contextlib.nullcontext()
        with timed, autocast(self.precision, self.device):
            return predict_tokens(self.model, shard, device=self.device,
                                  chunk_size=self.chunk_size, group=self.plan.cp_group,
                                  forward=self.forward if custom else None,
                                  hidden_on=self.hidden_on, memmap_dir=self.memmap_dir,
                                  progress=self.progress)

    def predict_batch(self, batch: Batch) -> torch.Tensor:
        """Physical predictions for a normalised batch (a task's own batches)."""
        return self.denormalise(self.run(batch), batch.get("mask"))

    @torch.no_grad()
    def predict_arrays(self, x_SNI: np.ndarray, mask_SN: np.ndarray | None = None,
                       conditions_SKC: np.ndarray | None = None, *,
                       batch_size: int = 1) -> np.ndarray:
        """Physical predictions ``[S, N, O]`` (float32, zero at padding) for physical host
        arrays, ``batch_size`` samples per forward; inputs stay on the host and only the
        chunk (or shard) being computed moves to the device. Under a context-parallel
        plan every rank returns all of them."""
        self.model.eval()
        outputs = []
        for start in range(0, x_SNI.shape[0], batch_size):
            part = slice(start, start + batch_size)
            mask = None if mask_SN is None else mask_SN[part]
            batch = self.normalise(x_SNI[part], mask,
                                   None if conditions_SKC is None else conditions_SKC[part])
            y = self.run(batch).float().cpu()
            outputs.append(self.denormalise(y, batch.get("mask")).numpy())
        return np.concatenate(outputs, axis=0)

    # -- the Python API --------------------------------------------------------------------
    def predict(self, points: Any, features: Any = None, *, conditions: Any = None,
                mask: Any = None, chunk_size: int | None = None, batch_size: int = 1,
                as_torch: bool = False) -> np.ndarray | torch.Tensor:
        """Fields in physical units at ``points``: ``[N, O]`` for one mesh ``[N, G]``, or
        ``[B, N, O]`` for a batch ``[B, N, G]`` (NumPy arrays or tensors).

        ``features`` ``[(B,) N, F]``: the input channels after the coordinates (the run's
        layout says how many: :attr:`layout`); ``conditions`` ``[(B,) K, C]``: per-sample
        conditioning tokens of a conditioned model; ``mask`` ``[(B,) N]`` bool, True at
        real points (padded points get zeros); ``chunk_size`` streams K points at a time
        (exact); ``batch_size`` samples per forward; ``as_torch`` returns a CPU tensor."""
        x, mask_arr, cond, single = self._inputs(points, features, conditions, mask)
        predictor = self if chunk_size is None else self.replace(chunk_size=chunk_size)
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
    checkpoint alone (the one ``metrics.json`` names for a finished run, else the newest),
    with the weights the run reports (``weights``: ``raw`` or ``ema`` to choose), its stored
    normalisers and input layout, in its own precision (or ``precision``), on ``device``.

    Raises one sentence for a path that is no run and no checkpoint, and for a run whose
    task does not map mesh points to fields (no stored normalisers)."""
    from flarepp.storage.checkpoint import mesh_normalizers, read_checkpoint, rebuild_model
    from flarepp.storage.config import RunConfig
    from flarepp.storage.rundir import NotARunDirectory, RunDir
    path = Path(path)
    if path.is_dir():
        found = RunDir(path).require_run().reported_checkpoint()
        if found is None:
            raise NotARunDirectory(f"run directory {str(path)!r} holds no checkpoint yet")
        path = found
    elif not path.exists():
        raise NotARunDirectory(f"{str(path)!r} does not exist: give a flarepp run directory "
                               "or a checkpoint file")
    state = read_checkpoint(path)
    norms = mesh_normalizers(state, path)
    if weights not in (None, "raw", "ema"):
        raise ValueError(f"weights must be 'raw' or 'ema' (default: those the run reports), "
                         f"got {weights!r}")
    model = rebuild_model(state, path, ema=None if weights is None else weights == "ema")
    config = RunConfig.from_stored(state["config"])
    device = resolve_device(device)
    conditions = norms.get("c")
    return Predictor(model.to(device).eval(), inputs=Normalizer.from_state_dict(norms["x"]),
                     outputs=Normalizer.from_state_dict(norms["y"]),
                     conditions=None if conditions is None
                     else Normalizer.from_state_dict(conditions),
                     device=device, precision=precision or config.precision,
                     chunk_size=chunk_size, layout=InputLayout.from_checkpoint(state),
                     config=config)


__all__ = ["InputLayout", "Predictor", "PredictorError", "load_predictor", "predict_tokens",
           "shard_tokens"]
