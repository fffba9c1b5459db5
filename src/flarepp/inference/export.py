"""A trained run as a standalone file: ``flarepp export RUN --format pt2|onnx|safetensors``.

Shape letters: B samples, N points, I input and O output channels.

The exported function is the run's :class:`~flarepp.models.surrogate.Surrogate` itself, its
plain forward: physical inputs ``x [B, N, I]`` and a padding mask ``mask [B, N]`` (bool,
True at real points) to physical outputs ``y [B, N, O]`` (zero at padding), FP32, with B
and N dynamic, the maps traced in as buffers. Streamed and token-sharded execution stay in
PyTorch (``flarepp infer --chunk-size``, ``--context-parallel``).

* ``pt2``: ``torch.export.export`` saved with ``torch.export.save``; loads with
  ``torch.export.load(path).module()(x, mask)`` where only torch is installed.
* ``onnx``: ``torch.onnx.export(..., dynamo=True)`` (needs ``onnx`` and ``onnxscript``),
  inputs ``x`` and ``mask``, output ``y``; runs under onnxruntime.
* ``safetensors``: the surrogate's state dict (the model's weights under ``model.``, the
  maps as ``input_shift``, ``input_scale``, ``output_shift``, ``output_scale``), the model
  config and input layout as JSON metadata (rebuild with
  ``Surrogate(flarepp.models.model_from_config(config), inputs=..., outputs=...)``).

Every export is checked before it is kept: the file is loaded back and run at a point count
and batch unlike the example's, with padding, against the PyTorch forward (the dynamo ONNX
export of SDPA can fix a dynamic dimension to the example's size, pytorch issue 152018).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from flarepp.inference.predictor import Predictor, load_predictor
from flarepp.io import atomic_write, atomic_write_bytes
from flarepp.models import model_from_config
from flarepp.models.surrogate import Surrogate
from flarepp.version import __version__

FORMATS = ("pt2", "onnx", "safetensors")
EXPORT_EXTRA = "pip install 'flarepp[export]'"
EXAMPLE = (2, 64)            # (B, N) traced
CHECK = (3, 101)             # (B, N) the file is checked at, with padding
TOLERANCE = 1e-4             # max |exported - PyTorch| relative to max |y| accepted (FP32)


class ExportError(ValueError):
    """A run that cannot be exported in the asked format, or an export that does not
    reproduce the PyTorch forward."""


def exported_surrogate(predictor: Predictor) -> Surrogate:
    """The predictor's surrogate as it is exported (eval mode; its device and weights); a
    conditioned model is refused in a sentence."""
    if predictor.layout is not None and predictor.layout.conditions is not None:
        raise ExportError("this run's model is conditioned on per-sample tokens; export "
                          "takes models of points alone (x and mask) for now")
    return predictor.surrogate.eval()


def _channels(module: Surrogate) -> int:
    """Input channels of the exported function."""
    if module.input_shift is not None:
        return int(module.input_shift.numel())
    return int(module.model.config.in_dim)


def example_inputs(channels: int, batch: int, points: int, *, padded: bool,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [B, N, I], mask [B, N])``: standard normal inputs; with ``padded`` the last
    sample's final third of points are padding (zeros)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, points, channels, generator=generator)
    mask = torch.ones(batch, points, dtype=torch.bool)
    if padded:
        mask[-1, points - points // 3:] = False
        x = x * mask[..., None]
    return x, mask


def _dynamic_shapes() -> dict[str, dict[int, Any]]:
    batch, points = torch.export.Dim("batch", min=1), torch.export.Dim("points", min=2)
    return {"x": {0: batch, 1: points}, "mask": {0: batch, 1: points}}


def _require(*modules: str) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            raise ExportError(f"flarepp export needs {name} for this format, which is not "
                              f"installed: {EXPORT_EXTRA}") from None


def _exporting(what: str, module: Surrogate, call: Callable[[], Any]) -> Any:
    """``call()``, with an exporter's failure as one sentence naming the architecture."""
    try:
        return call()
    except ExportError:
        raise
    except Exception as err:  # the exporters raise many types, each with pages of detail
        config = getattr(module.model, "config", None)
        arch = getattr(config, "arch", type(module.model).__name__)
        mixer = getattr(config, "mixer", None)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ExportError(f"{what} cannot export this {arch!r} model"
                          + (f" (mixer {mixer!r})" if mixer else "")
                          + f" with dynamic batch and point counts: {type(err).__name__}: "
                            f"{first[:300]}") from None


def export_pt2(module: Surrogate, path: Path) -> Callable:
    """``torch.export`` with B and N dynamic, saved with ``torch.export.save``; returns the
    loaded file's function."""
    x, mask = example_inputs(_channels(module), *EXAMPLE, padded=True)
    program = _exporting("torch.export", module, lambda: torch.export.export(
        module, (x, mask), dynamic_shapes=_dynamic_shapes()))
    buffer = io.BytesIO()       # torch.export.save names a file by its .pt2 suffix
    torch.export.save(program, buffer)
    atomic_write_bytes(path, buffer.getvalue())
    loaded = torch.export.load(path).module()
    return lambda x, mask: loaded(x, mask).detach().numpy()


def export_onnx(module: Surrogate, path: Path) -> Callable:
    """``torch.onnx.export(dynamo=True)`` with B and N dynamic; returns an onnxruntime
    session's function (CPU)."""
    _require("onnx", "onnxscript", "onnxruntime")
    import onnxruntime
    x, mask = example_inputs(_channels(module), *EXAMPLE, padded=True)

    def write(tmp: Path) -> None:
        with contextlib.redirect_stdout(io.StringIO()):   # the exporter's progress lines
            program = _exporting("the dynamo ONNX exporter", module, lambda: torch.onnx.export(
                module, (x, mask), dynamo=True, dynamic_shapes=_dynamic_shapes(),
                input_names=["x", "mask"], output_names=["y"], verbose=False))
        program.save(str(tmp))
    atomic_write(path, write)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x, mask: session.run(["y"], {"x": x.numpy(), "mask": mask.numpy()})[0]


def export_safetensors(module: Surrogate, path: Path, metadata: dict[str, str]
                       ) -> Callable:
    """The surrogate's state dict as named tensors, the model config as metadata; returns
    the forward of a surrogate rebuilt from the file alone."""
    _require("safetensors")
    from safetensors.torch import load_file, save
    tensors = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    # as bytes: safetensors' own file writer recreates the file with mode 0600
    atomic_write_bytes(path, save(tensors, metadata=metadata))
    restored = load_file(str(path))
    maps = {role: (restored[f"{prefix}_shift"], restored[f"{prefix}_scale"])
            for role, prefix in (("inputs", "input"), ("outputs", "output"))
            if f"{prefix}_shift" in restored}
    rebuilt = Surrogate(model_from_config(json.loads(metadata["model_config"])), **maps)
    rebuilt.load_state_dict(restored)
    rebuilt.eval()
    return lambda x, mask: rebuilt(x, mask).detach().numpy()


def check_export(module: Surrogate, run: Callable, fmt: str) -> float:
    """The exported function against the PyTorch forward at :data:`CHECK` (another batch
    and point count than the example's, with padding): the largest difference relative to
    the largest output; :class:`ExportError` beyond :data:`TOLERANCE`."""
    x, mask = example_inputs(_channels(module), *CHECK, padded=True, seed=1)
    with torch.no_grad():
        want = module(x, mask).numpy()
    try:
        got = np.asarray(run(x, mask))
    except Exception as err:  # a runtime refusing the shape is the trap this check is for
        raise ExportError(f"the {fmt} export does not run at B={CHECK[0]}, N={CHECK[1]} "
                          f"(traced at B={EXAMPLE[0]}, N={EXAMPLE[1]}): {type(err).__name__}: "
                          f"{str(err).strip().splitlines()[0][:300]}") from None
    scale = max(float(np.abs(want).max()), 1e-30)
    if got.shape != want.shape:
        raise ExportError(f"the {fmt} export gives shape {list(got.shape)} at B={CHECK[0]}, "
                          f"N={CHECK[1]}, the PyTorch forward {list(want.shape)}")
    deviation = float(np.abs(got - want).max()) / scale
    if not deviation <= TOLERANCE:
        raise ExportError(f"the {fmt} export differs from the PyTorch forward by "
                          f"{deviation:.2e} of the largest output at B={CHECK[0]}, "
                          f"N={CHECK[1]} (accepted: {TOLERANCE:g})")
    return deviation


def export_run(path: str | Path, out: str | Path, fmt: str, *,
               weights: str | None = None) -> dict[str, Any]:
    """Export the run (directory or checkpoint) at ``path`` to ``out`` in ``fmt``
    (:data:`FORMATS`), FP32 on the CPU, and check it (:func:`check_export`); returns what
    was written: ``path``, ``format``, ``deviation`` and the input and output layout."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; known: {', '.join(FORMATS)}")
    predictor = load_predictor(path, device="cpu", precision="fp32", weights=weights)
    module = exported_surrogate(predictor)
    out = Path(out)
    layout = predictor.layout
    facts = {"inputs": {"x": ["B", "N", layout.channels], "mask": ["B", "N"]},
             "outputs": {"y": ["B", "N", layout.outputs]},
             "coordinates": layout.coordinates,
             "input_names": list(layout.names or ()),
             "field_names": list(layout.field_names), "units": layout.units}
    if fmt == "pt2":
        run = export_pt2(module, out)
    elif fmt == "onnx":
        run = export_onnx(module, out)
    else:
        run = export_safetensors(module, out, {
            "model_config": json.dumps(predictor.model.config.to_dict()),
            "layout": json.dumps(facts), "flarepp": __version__})
    try:
        deviation = check_export(module, run, fmt)
    except ExportError:
        out.unlink(missing_ok=True)
        raise
    return {"path": str(out), "format": fmt, "deviation": deviation, **facts}


__all__ = ["EXAMPLE", "CHECK", "ExportError", "FORMATS", "check_export", "example_inputs",
           "export_run", "exported_surrogate"]
