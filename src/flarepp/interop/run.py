"""An imported model as a flarepp run directory, with the normalisers the user supplies.

Shape letters: I input and O output channels.

Another implementation's checkpoint holds weights and constructor arguments, never the maps
its training data went through nor what its input channels mean. The user names them
(:func:`read_normalizers`):

* a **store** (``flarepp data convert``): its training split's per-channel mean and standard
  deviation, fitted in one streamed pass as flarepp's own runs fit them, and its channel
  layout (names, leading coordinates, field names, units);
* a **statistics file** (JSON): ``{"x": {"mean": [I], "std": [I]}, "y": {"mean": [O],
  "std": [O]}}``, optionally ``"coordinates"``, ``"input_names"``, ``"field_names"``,
  ``"units"``;
* ``identity``: the model sees physical values as they are.

:func:`write_imported_run` writes the run through :class:`~flarepp.storage.rundir.RunDir` and
the checkpoint writer: ``config.json``, ``checkpoints/epoch_0000.pt`` (the weights in
float64, the precision their composition is computed in: a float32 model rounds them once,
a float64 one rebuilds them exactly) and ``provenance.json`` naming the source file and its
SHA-256. ``flarepp infer``, :func:`flarepp.load`, ``flarepp export`` and ``flarepp train
--init-from`` read it like any trained run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flarepp.data import DataError, Normalizer
from flarepp.data.fingerprint import file_sha256
from flarepp.data.store import MANIFEST, MeshStore
from flarepp.interop.maps import InteropError
from flarepp.io import UnreadableFile, read_json
from flarepp.models import model_from_config
from flarepp.storage.checkpoint import save_checkpoint
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import RunDir, provenance

IDENTITY = "identity"


@dataclass
class NormalizerSource:
    """The maps and input layout an imported run is given, and a sentence saying where they
    came from (``describe``)."""

    x: Normalizer
    y: Normalizer
    describe: str
    store: Path | None = None
    coordinates: int | None = None
    input_names: list[str] | None = None
    field_names: list[str] = field(default_factory=list)
    units: str = ""


def _identity(width: int) -> Normalizer:
    return Normalizer(np.zeros(width, np.float32), np.ones(width, np.float32))


def _check_width(what: str, source: str, got: int, want: int, side: str) -> None:
    if got != want:
        raise InteropError(f"--normalizers {source}: its {what} have {got} channel(s), but "
                           f"the model {side} {want}")


def _from_store(root: Path, in_dim: int, out_dim: int) -> NormalizerSource:
    store = MeshStore(root)
    samples = store.split("train")
    _check_width("inputs", str(root), samples.in_dim, in_dim, "takes")
    _check_width("targets", str(root), samples.out_dim, out_dim, "predicts")
    stats = samples.fit_statistics()
    layout = store.layout
    units = ", ".join(g.units for g in layout.targets if g.units)
    return NormalizerSource(
        Normalizer.from_statistics(stats.x, what="input"),
        Normalizer.from_statistics(stats.y, what="output"),
        f"fitted on the training split of store {str(root)!r} ({len(samples)} samples)",
        store=root, coordinates=layout.coordinates or None,
        input_names=layout.input_channels, field_names=layout.target_channels, units=units)


def _from_statistics(path: Path, in_dim: int, out_dim: int) -> NormalizerSource:
    stats = read_json(path)
    maps = {}
    for side, width, verb in (("x", in_dim, "takes"), ("y", out_dim, "predicts")):
        entry = stats.get(side) if isinstance(stats, dict) else None
        if not (isinstance(entry, dict) and "mean" in entry and "std" in entry):
            raise InteropError(f"--normalizers {path}: no {side!r} entry with 'mean' and "
                               "'std' lists (the statistics file holds {\"x\": {\"mean\": "
                               "[...], \"std\": [...]}, \"y\": {...}})")
        try:
            norm = Normalizer.from_state_dict(entry)
        except (TypeError, ValueError):
            raise InteropError(f"--normalizers {path}: {side}.mean and {side}.std must be "
                               f"lists of numbers") from None
        _check_width("x means" if side == "x" else "y means", str(path), norm.mean.size,
                     width, verb)
        if not np.isfinite(norm.mean).all():
            raise InteropError(f"--normalizers {path}: {side}.mean must be {width} finite "
                               f"numbers, got {entry['mean']!r}")
        if (norm.std.shape != norm.mean.shape or not (norm.std > 0).all()
                or not np.isfinite(norm.std).all()):
            raise InteropError(f"--normalizers {path}: {side}.std must be {width} positive "
                               f"finite numbers, got {entry['std']!r}")
        maps[side] = norm
    coordinates = stats.get("coordinates")
    if coordinates is not None and (isinstance(coordinates, bool) or not isinstance(
            coordinates, int) or not 0 <= coordinates <= in_dim):
        raise InteropError(f"--normalizers {path}: coordinates={coordinates!r} must be an "
                           f"integer from 0 to the model's {in_dim} input channels")
    names = {}
    for key, width in (("input_names", in_dim), ("field_names", out_dim)):
        given = stats.get(key)
        if given is not None and (not isinstance(given, list) or len(given) != width
                                  or not all(isinstance(n, str) for n in given)):
            raise InteropError(f"--normalizers {path}: {key} must be {width} names, one per "
                               f"channel, got {given!r}")
        names[key] = given
    return NormalizerSource(maps["x"], maps["y"], f"read from statistics file {str(path)!r}",
                            coordinates=coordinates, input_names=names["input_names"],
                            field_names=list(names["field_names"] or []),
                            units=str(stats.get("units", "")))


def read_normalizers(spec: str, in_dim: int, out_dim: int) -> NormalizerSource:
    """The :class:`NormalizerSource` of ``--normalizers SPEC``: a store directory, a JSON
    statistics file, or ``identity`` (module docstring)."""
    if spec == IDENTITY:
        return NormalizerSource(_identity(in_dim), _identity(out_dim),
                                "the identity (the model sees physical values)")
    path = Path(spec)
    try:
        if path.is_dir():
            if not (path / MANIFEST).is_file():
                raise InteropError(f"--normalizers {spec}: the directory is not a store (no "
                                   f"{MANIFEST}); give a store, a statistics file or identity")
            return _from_store(path, in_dim, out_dim)
        if path.is_file():
            return _from_statistics(path, in_dim, out_dim)
    except (DataError, UnreadableFile) as err:
        raise InteropError(f"--normalizers {spec}: {err}") from None
    raise InteropError(f"--normalizers {spec}: no such store or statistics file (give a "
                       "store directory, a JSON statistics file or 'identity')")


@dataclass
class ImportedModel:
    """What a reader makes of another implementation's checkpoint: flarepp's
    ``model_config`` and state dicts (``ema`` None when the source holds no average),
    the input channels that are coordinates where the source says so, ``source`` facts for
    the provenance (format, file, class, arguments, versions) and ``notes``, sentences on what
    the import dropped or assumed."""

    model_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    source: dict[str, Any]
    ema: dict[str, torch.Tensor] | None = None
    coordinates: int | None = None
    notes: list[str] = field(default_factory=list)

    def model(self, which: str = "raw") -> torch.nn.Module:
        """The flarepp model in float64 with these weights (strict: every key mapped); each
        weight's shape is compared with the model's, built first without memory (on
        PyTorch's meta device), so that sizes the source's arguments and weights disagree on
        are a sentence naming the weight, and nothing is allocated for them."""
        weights = self.weights if which == "raw" else self.ema
        with torch.device("meta"):
            shapes = {k: tuple(v.shape)
                      for k, v in model_from_config(self.model_config).state_dict().items()}
        for key, want in shapes.items():
            got = tuple(weights[key].shape) if key in weights else None
            if got is not None and got != want:
                raise InteropError(f"{self.source.get('file', 'the source')}: the weight "
                                   f"{key!r} has shape {list(got)} where the model its "
                                   f"arguments describe has {list(want)}")
        model = model_from_config(self.model_config).double()
        model.load_state_dict(weights)
        return model.eval()


def _run_config(name: str, imported: ImportedModel, source: NormalizerSource) -> RunConfig:
    model = {k: v for k, v in imported.model_config.items() if k not in ("in_dim", "out_dim")}
    data = (dict(dataset="store", data_root=str(source.store)) if source.store is not None
            else dict(dataset="npz", data_root="."))
    return RunConfig(name=name, model=model, eval_weights="raw", input_norm="standard",
                     **data)


def write_imported_run(out: str | Path, imported: ImportedModel,
                       source: NormalizerSource, *, source_file: Path) -> Path:
    """Write ``imported`` as the run directory ``out`` (which must hold no run yet); returns
    its checkpoint. The weights are loaded into the flarepp model first (strict), so a map
    that misses a key fails before anything is written."""
    run = RunDir(out)
    if run.path.exists() and run.is_run():
        raise InteropError(f"--out {str(run.path)!r} already holds a run; choose another "
                           "directory")
    model_config = imported.model().config.to_dict()   # every key mapped, every shape right
    if imported.ema is not None:
        imported.model("ema")
    config = _run_config(run.path.name or "imported", imported, source)
    origin = {**imported.source, "file": str(Path(source_file).resolve()),
              "sha256": file_sha256(Path(source_file)), "normalizers": source.describe,
              "notes": imported.notes}
    state = {"config": config.to_dict(), "model_config": model_config,
             "model": imported.weights,
             "ema": imported.ema if imported.ema is not None else imported.weights,
             "epoch": 0, "history": [], "task": config.task,
             "normalizers": {"x": source.x.state_dict(), "y": source.y.state_dict()},
             "data": {"dataset": config.dataset, "units": source.units,
                      "field_names": source.field_names or [
                          f"y{k}" for k in range(imported.model_config["out_dim"])],
                      "inputs": {"coordinates": source.coordinates,
                                 "names": source.input_names}},
             "imported_from": origin}
    path = run.checkpoint(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, state)
    run.write_config(config)
    run.record_provenance(provenance(imported_from=origin))
    return path


__all__ = ["IDENTITY", "ImportedModel", "NormalizerSource",
           "read_normalizers", "write_imported_run"]
