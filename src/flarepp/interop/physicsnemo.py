"""NVIDIA PhysicsNeMo's FLARE models in and out of flarepp, without importing PhysicsNeMo.

Shape letters: C channels (``n_hidden``), H heads, D = C / H, M latents (``slice_num``),
L blocks, E embedding and F functional input channels.

A ``.mdlus`` file (``physicsnemo.Module.save``) is a zip archive (a tar one before release
2.0) of ``args.json`` (the class ``__name__``, its ``__module__`` and constructor
``__args__``), ``metadata.json`` (the PhysicsNeMo version) and ``model.pt`` (a plain state
dict, read here with ``torch.load(weights_only=True)``).

Their ``FLARE`` and ``FLAREPlusPlus`` models are the Transolver skeleton (Transolver,
PhysicsNeMo ``models/transolver/transolver.py``) with FLARE-family blocks:
``h = preprocess(cat(embedding, fx))`` (``Linear(E + F, 2C)``, exact GELU, ``Linear(2C, C)``);
per block ``h = h + Attn(LN(h))``, ``h = h + MLP(LN(h))`` (ratio ``mlp_ratio``, exact GELU);
the last block's head ``Linear(LN(h))``. That is flarepp's ``transolver-backbone``
(:class:`~flarepp.models.backbone.TransolverBackboneConfig`) with inputs ``[embedding,
functional]`` in that order. Their attention layers (``nn/module/flare_attention.py``):

* ``FLARE``: ``x_h = in_project_x(x)_h``, shared ``self_k``/``self_v`` (D x D), learned
  ``q_global [1, H, M, D]``, scale 1 (release 2.2) -> flarepp's ``flare`` mixer with
  ``W_K,h = W_k W_in,h`` (:func:`~flarepp.interop.maps.compose_shared`),
  ``fixed_queries = q_global[0]``, ``out_proj = out_linear``;
* ``FLAREPlusPlus`` (the FLARE++ paper's first version; PhysicsNeMo pull request 1940, not
  in release 2.2): as FLARE for the routing keys and values, plus full-width
  ``query_synthesis_k``/``_v`` projections and ``q_global`` as the synthesis seeds ->
  flarepp's ``flarepp-v1`` mixer, ``[W~_K | W~_V | W_K | W_V]``.

Arguments flarepp cannot represent are refused in one sentence naming them (:data:`REFUSED`);
``dropout`` is the identity at inference and is dropped with a note.

**The way back** (:func:`export_mdlus`, ``flarepp export RUN --format mdlus``): a flarepp
run whose function release 2.2's ``FLARE`` computes -- the ``transolver-backbone`` options
(wide input MLP without hidden layers, one-Linear head, exact GELU, LayerNorm, an integer
FFN ratio), the ``flare`` mixer with SDPA scale 1, and key and value maps that factor through
one shared D x D map (:func:`~flarepp.interop.maps.factor_shared`) -- is written as a
``.mdlus`` that ``physicsnemo.Module.from_checkpoint`` loads; anything else is refused
naming the reason (backbone, scale or rank). The normalisers, which a ``.mdlus`` cannot
hold, are written beside it as a statistics file ``--normalizers`` reads back.
"""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from flarepp.interop.maps import (Affine, InteropError, MapError, SourceWeights, compose_shared,
                                  factor_shared)
from flarepp.interop.run import ImportedModel
from flarepp.io import atomic_write, atomic_write_json
from flarepp.storage.checkpoint import read_checkpoint, rebuild_model
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import RunDir

ARCHIVE_FILES = ("args.json", "metadata.json", "model.pt")
MIXER_OF = {"FLARE": "flare", "FLAREPlusPlus": "flarepp-v1"}
KNOWN_ARGS = {"functional_dim", "out_dim", "embedding_dim", "n_layers", "n_hidden", "dropout",
              "n_head", "act", "mlp_ratio", "slice_num", "unified_pos", "ref",
              "structured_shape", "time_input", "use_te", "attn_scale"}
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "unified_pos": (bool, "the model adds a fixed grid's distance embedding to its inputs, "
                          "which flarepp's backbone does not compute"),
    "structured_shape": (lambda v: v is not None,
                         "the model reshapes its tokens to a structured grid; flarepp "
                         "imports the unstructured (point-cloud) FLARE only"),
    "time_input": (bool, "the model adds a sinusoidal time embedding, which flarepp's "
                         "backbone does not compute"),
    "use_te": (bool, "Transformer Engine layers store other weights; import a model built "
                     "with use_te=False"),
    "act": (lambda v: v != "gelu", "flarepp's backbone uses GELU only"),
    "embedding_dim": (lambda v: v is None, "the model has no embedding input"),
}
"""Arguments whose value (the predicate is True) flarepp cannot represent, and why."""


def read_mdlus(path: str | Path) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """``(args, metadata, state_dict)`` of a ``.mdlus`` archive (zip or legacy tar); each
    problem is an :class:`InteropError` naming the file."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise InteropError(f"{str(path)!r} {what} (give a PhysicsNeMo .mdlus file)")
    try:
        if tarfile.is_tarfile(path):
            with tarfile.open(path) as tar:
                names = {m.name.lstrip("./"): m for m in tar.getmembers() if m.isfile()}
                files = {n: tar.extractfile(names[n]).read() for n in ARCHIVE_FILES
                         if n in names}
        elif zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                files = {n: archive.read(n) for n in ARCHIVE_FILES if n in archive.namelist()}
        else:
            raise InteropError(f"{path}: neither a zip nor a tar archive, so not a .mdlus "
                                "file (physicsnemo.Module.save writes those)")
    except (OSError, tarfile.TarError, zipfile.BadZipFile) as err:
        raise InteropError(f"{path}: the archive does not read ({err})") from None
    missing = [n for n in ARCHIVE_FILES if n not in files]
    if missing:
        raise InteropError(f"{path}: the archive lacks {missing} (a .mdlus holds "
                            f"{', '.join(ARCHIVE_FILES)})")
    try:
        args, metadata = json.loads(files["args.json"]), json.loads(files["metadata.json"])
        state = torch.load(io.BytesIO(files["model.pt"]), map_location="cpu",
                           weights_only=True)
    except Exception as err:  # json and torch raise many types for a damaged member
        raise InteropError(f"{path}: args.json, metadata.json or model.pt does not read "
                            f"({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(state, dict) or not isinstance(args, dict) or "__args__" not in args:
        raise InteropError(f"{path}: args.json has no '__args__' or model.pt is no state dict")
    for what, value in (("args.json's '__args__'", args["__args__"]),
                        ("metadata.json", metadata)):
        if not isinstance(value, dict):
            raise InteropError(f"{path}: {what} is a {type(value).__name__}, not an object "
                               "of names and values")
    return args, metadata, state


def check_args(name: str, args: dict[str, Any], path: Path) -> None:
    """Refuse, in one sentence naming the argument, what flarepp cannot represent."""
    unknown = sorted(set(args) - KNOWN_ARGS)
    if unknown:
        raise InteropError(f"{path}: {name} argument(s) {unknown} are unknown to this "
                            "importer (a newer PhysicsNeMo?); flarepp imports the arguments "
                            f"{', '.join(sorted(KNOWN_ARGS))}")
    for arg, (refused, why) in REFUSED.items():
        if arg in args and refused(args[arg]):
            raise InteropError(f"{path}: {name} was built with {arg}={args[arg]!r}: {why}")


def _legacy_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Old Transolver MLP names (``linear_pre``/``linear_post``) as today's ``layers.0``/``2``,
    as PhysicsNeMo's own loader renames them."""
    return {k.replace(".linear_pre.", ".layers.0.").replace(".linear_post.", ".layers.2."): v
            for k, v in state.items()}


def _mixer_weights(w: SourceWeights, block: str, mixer: str, heads: int) -> dict[str, torch.Tensor]:
    attn = f"{block}.Attn"
    inner = w.affine(f"{attn}.in_project_x")
    keys = compose_shared(inner, w.affine(f"{attn}.self_k"), heads)
    values = compose_shared(inner, w.affine(f"{attn}.self_v"), heads)
    stacked = [keys, values]
    if mixer == "flarepp-v1":
        stacked = [w.affine(f"{attn}.query_synthesis_k"), w.affine(f"{attn}.query_synthesis_v"),
                   keys, values]
    queries = "synthesis_seeds" if mixer == "flarepp-v1" else "fixed_queries"
    out = w.affine(f"{attn}.out_linear")
    return {f"mixer.{queries}": w(f"{attn}.q_global")[0],
            "mixer.key_value_proj.weight": torch.cat([a.weight for a in stacked]),
            "mixer.key_value_proj.bias": torch.cat([a.bias for a in stacked]),
            "mixer.out_proj.weight": out.weight, "mixer.out_proj.bias": out.bias}


def _weights(w: SourceWeights, mixer: str, blocks: int, heads: int) -> dict[str, torch.Tensor]:
    """flarepp's state dict of the ``transolver-backbone`` from theirs."""
    names = {"in_proj.fc_in": "preprocess.layers.0", "in_proj.fc_out": "preprocess.layers.2",
             "out_norm": f"blocks.{blocks - 1}.ln_mlp2.0",
             "out_proj": f"blocks.{blocks - 1}.ln_mlp2.1"}
    for i in range(blocks):
        names.update({f"blocks.{i}.mixer_norm": f"blocks.{i}.ln_1",
                      f"blocks.{i}.ffn_norm": f"blocks.{i}.ln_mlp1.0",
                      f"blocks.{i}.ffn.0": f"blocks.{i}.ln_mlp1.1.layers.0",
                      f"blocks.{i}.ffn.2": f"blocks.{i}.ln_mlp1.1.layers.2"})
    state = {f"{ours}.{p}": w(f"{theirs}.{p}") for ours, theirs in names.items()
             for p in ("weight", "bias")}
    for i in range(blocks):
        state.update({f"blocks.{i}.{k}": v for k, v in
                      _mixer_weights(w, f"blocks.{i}", mixer, heads).items()})
    w.check_all_used()
    return state


SIZE_ARGS = {"functional_dim": (None, 0), "out_dim": (None, 1), "embedding_dim": (None, 1),
             "n_layers": (4, 1), "n_hidden": (256, 1), "n_head": (8, 1), "slice_num": (32, 1)}
"""The size arguments: their default (None: required) and least value."""


def check_sizes(args: dict[str, Any], state: dict[str, Any], path: Path) -> dict[str, int]:
    """The size arguments as integers, each checked (given where required, an integer, at
    least its least value) and ``n_layers`` against the blocks the state dict holds,
    before any map is built from them; one sentence naming the argument otherwise."""
    sizes = {}
    for arg, (default, least) in SIZE_ARGS.items():
        value = args.get(arg, default)
        if value is None:
            raise InteropError(f"{path}: args.json lacks the argument {arg!r}, which "
                               "PhysicsNeMo's constructor requires")
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InteropError(f"{path}: argument {arg}={value!r} must be an integer >= "
                               f"{least}")
        sizes[arg] = value
    if sizes["n_hidden"] % sizes["n_head"]:
        raise InteropError(f"{path}: n_hidden={sizes['n_hidden']} is not divisible by "
                           f"n_head={sizes['n_head']}")
    blocks = {key.split(".")[1] for key in state if key.startswith("blocks.")}
    if len(blocks) != sizes["n_layers"]:
        raise InteropError(f"{path}: n_layers={sizes['n_layers']} but model.pt holds "
                           f"{len(blocks)} block(s)")
    return sizes


def _model_config(name: str, a: dict[str, Any]) -> dict[str, Any]:
    heads, dim = int(a.get("n_head", 8)), int(a.get("n_hidden", 256))
    head_dim = dim // heads
    # their default scales: FLARE's is fixed at 1.0 (release 2.2), FLAREPlusPlus's D^-1/2
    scale = a.get("attn_scale", 1.0 if name == "FLARE" else None)
    scale = float(head_dim ** -0.5 if scale is None else scale)
    return {"arch": "transolver-backbone", "in_dim": int(a["embedding_dim"])
            + int(a["functional_dim"]), "out_dim": int(a["out_dim"]), "dim": dim,
            "heads": heads, "blocks": int(a.get("n_layers", 4)),
            "latents": int(a.get("slice_num", 32)), "ffn_ratio": float(a.get("mlp_ratio", 4)),
            "norm": "layernorm", "mixer": MIXER_OF[name], "attn_scale": scale,
            "input_mlp": "wide", "output_mlp": "linear", "gelu": "none", "io_layers": 0,
            "mixer_options": {}}


def import_mdlus(path: str | Path) -> ImportedModel:
    """A PhysicsNeMo ``FLARE`` or ``FLAREPlusPlus`` ``.mdlus`` as an :class:`ImportedModel`
    (module docstring); the inputs are ``[embedding, functional]``, the first E of them
    taken as the coordinates."""
    path = Path(path)
    header, metadata, state = read_mdlus(path)
    name = header.get("__name__")
    if name not in MIXER_OF:
        raise InteropError(f"{path}: holds a {header.get('__module__')}.{name}; flarepp "
                            f"imports PhysicsNeMo's {' and '.join(MIXER_OF)} models")
    args = header["__args__"]
    check_args(name, args, path)
    check_sizes(args, state, path)
    config = _model_config(name, args)
    try:
        weights = _weights(SourceWeights(_legacy_names(state), f"{path} (model.pt)"),
                           config["mixer"], config["blocks"], config["heads"])
    except MapError as err:
        raise InteropError(f"{path}: {err} (n_hidden={args.get('n_hidden', 256)}, "
                           f"n_head={args.get('n_head', 8)})") from None
    notes = []
    if float(args.get("dropout", 0.0)):
        notes.append(f"dropout={args['dropout']} is the identity at inference and is not "
                     "part of flarepp's model (fine-tuning runs without it)")
    source = {"format": "physicsnemo", "file": str(path),
              "class": f"{header.get('__module__')}.{name}",
              "args": args, "physicsnemo_version": metadata.get("physicsnemo_version"),
              "mdlus_file_version": metadata.get("mdlus_file_version")}
    return ImportedModel(config, weights, source, coordinates=int(args["embedding_dim"]),
                         notes=notes)


# ---------------------------------------------------------------------------------------------
# the way back

TARGET_VERSION = {"physicsnemo_version": "2.2.2", "mdlus_file_version": "0.1.0"}
"""What an exported ``.mdlus``'s ``metadata.json`` says (the release whose ``FLARE`` class
loads it)."""
EXPORT_TOLERANCE = 1e-5      # re-imported float32 file vs the float64 model, of max |y|

EXPORTABLE = {"arch": ("surrogate", "transolver-backbone"), "mixer": ("flare",),
              "input_mlp": ("wide",), "io_layers": (0,), "output_mlp": ("linear",),
              "gelu": ("none",), "norm": ("layernorm",), "mixer_options": ({},),
              "attn_scale": (1.0,)}
"""The model config values release 2.2's ``FLARE`` model computes with."""


def exportable(config: dict[str, Any]) -> None:
    """Refuse, naming the setting, a flarepp model release 2.2's ``FLARE`` cannot compute
    (before its weights are looked at)."""
    for key, allowed in EXPORTABLE.items():
        if config.get(key) not in allowed:
            what = "scale" if key == "attn_scale" else "backbone"
            raise InteropError(
                f"model.{key}={config.get(key)!r}: PhysicsNeMo's FLARE cannot compute this "
                f"model ({what}: it needs {key} {' or '.join(map(repr, allowed))})")
    if float(config["ffn_ratio"]) != int(config["ffn_ratio"]):
        raise InteropError(f"model.ffn_ratio={config['ffn_ratio']}: PhysicsNeMo's FLARE "
                            "takes an integer mlp_ratio (backbone)")


def _their_state(model: torch.nn.Module, heads: int) -> dict[str, torch.Tensor]:
    """Release 2.2's ``FLARE`` state dict of a flarepp ``transolver-backbone`` model."""
    ours = {k: v.detach().double() for k, v in model.state_dict().items()}
    blocks = len(model.blocks)
    C = model.config.dim
    names = {"preprocess.layers.0": "in_proj.fc_in", "preprocess.layers.2": "in_proj.fc_out",
             f"blocks.{blocks - 1}.ln_mlp2.0": "out_norm",
             f"blocks.{blocks - 1}.ln_mlp2.1": "out_proj"}
    state = {}
    for i in range(blocks):
        names.update({f"blocks.{i}.ln_1": f"blocks.{i}.mixer_norm",
                      f"blocks.{i}.ln_mlp1.0": f"blocks.{i}.ffn_norm",
                      f"blocks.{i}.ln_mlp1.1.layers.0": f"blocks.{i}.ffn.0",
                      f"blocks.{i}.ln_mlp1.1.layers.2": f"blocks.{i}.ffn.2"})
        w, b = (ours[f"blocks.{i}.mixer.key_value_proj.{p}"] for p in ("weight", "bias"))
        try:
            f = factor_shared(Affine(w[:C], b[:C]), Affine(w[C:], b[C:]), heads)
        except MapError as err:
            raise InteropError(f"block {i}: {err} (rank)") from None
        attn = f"blocks.{i}.Attn"
        for name, a in (("in_project_x", f.inner), ("self_k", f.key), ("self_v", f.value),
                        ("out_linear", Affine(ours[f"blocks.{i}.mixer.out_proj.weight"],
                                              ours[f"blocks.{i}.mixer.out_proj.bias"]))):
            state[f"{attn}.{name}.weight"], state[f"{attn}.{name}.bias"] = a.weight, a.bias
        state[f"{attn}.q_global"] = ours[f"blocks.{i}.mixer.fixed_queries"][None]
    for theirs, mine in names.items():
        for p in ("weight", "bias"):
            state[f"{theirs}.{p}"] = ours[f"{mine}.{p}"]
    return {k: v.float().contiguous() for k, v in state.items()}


def _their_args(config: dict[str, Any], coordinates: int | None) -> dict[str, Any]:
    embedding = config["in_dim"] if coordinates is None else int(coordinates)
    return {"functional_dim": config["in_dim"] - embedding, "out_dim": config["out_dim"],
            "embedding_dim": embedding, "n_layers": config["blocks"],
            "n_hidden": config["dim"], "dropout": 0.0, "n_head": config["heads"],
            "act": "gelu", "mlp_ratio": int(config["ffn_ratio"]),
            "slice_num": config["latents"], "unified_pos": False, "ref": 8,
            "structured_shape": None, "time_input": False, "use_te": False}


def _write_mdlus(path: Path, args: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    header = {"__name__": "FLARE", "__module__": "physicsnemo.models.flare.flare",
              "__args__": args}

    def write(tmp: Path) -> None:
        weights = io.BytesIO()
        torch.save(state, weights)
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr("model.pt", weights.getvalue())
            archive.writestr("args.json", json.dumps(header))
            archive.writestr("metadata.json", json.dumps(TARGET_VERSION))
    atomic_write(path, write)


def normalizers_path(out: str | Path) -> Path:
    """The statistics file written beside an exported ``out.mdlus``."""
    return Path(f"{out}.normalizers.json")


def export_mdlus(run: str | Path, out: str | Path, *, weights: str | None = None
                 ) -> dict[str, Any]:
    """Write the run (directory or checkpoint) as a release-2.2 ``FLARE`` ``.mdlus`` at
    ``out`` and its normalisers beside it (module docstring); the file is re-imported and
    checked against the run's model in float64 (``deviation``, relative to the largest
    output) before it is kept."""
    path = Path(run)
    if path.is_dir():
        path = RunDir(path).require_run().reported_checkpoint() or path
    state = read_checkpoint(path)
    config = state["model_config"]
    exportable(config)
    ema = None if weights is None else weights == "ema"
    model = rebuild_model(state, path, ema=ema, dtype=torch.float64)
    coordinates = state.get("data", {}).get("inputs", {}).get("coordinates")
    args = _their_args(config, coordinates)
    out = Path(out)
    if normalizers_path(out).is_dir():
        raise InteropError(f"{normalizers_path(out)}, where the normalisers of {out.name} "
                           "go, is a directory; nothing was written")
    _write_mdlus(out, args, _their_state(model, config["heads"]))
    deviation = _check_round_trip(model, out, config)
    norms = state["normalizers"]
    atomic_write_json(normalizers_path(out), {
        "x": norms["x"], "y": norms["y"], "coordinates": args["embedding_dim"],
        "input_names": state.get("data", {}).get("inputs", {}).get("names"),
        "field_names": state.get("data", {}).get("field_names", []),
        "units": state.get("data", {}).get("units", "")})
    return {"path": str(out), "normalizers": str(normalizers_path(out)), "args": args,
            "deviation": deviation,
            "weights": weights or RunConfig.from_stored(state["config"]).eval_weights,
            "loads_with": "physicsnemo.Module.from_checkpoint (release 2.2); inputs "
                          f"fx = x[..., {args['embedding_dim']}:], embedding = "
                          f"x[..., :{args['embedding_dim']}], normalised with the statistics "
                          "file beside it"}


def _check_round_trip(model: torch.nn.Module, out: Path, config: dict[str, Any]) -> float:
    """The written file, imported back, against ``model`` (float64, a fixed input); the
    file is removed and :class:`InteropError` raised beyond :data:`EXPORT_TOLERANCE`."""
    back = import_mdlus(out).model()
    x = torch.randn(2, 37, config["in_dim"], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(x), back(x)
    deviation = float((want - got).abs().max() / want.abs().max().clamp_min(1e-300))
    if not deviation <= EXPORT_TOLERANCE:
        out.unlink(missing_ok=True)
        raise InteropError(f"the written {out.name} differs from the run's model by "
                            f"{deviation:.2e} of the largest output (accepted "
                            f"{EXPORT_TOLERANCE:g}); nothing was kept")
    return deviation


__all__ = ["EXPORTABLE", "KNOWN_ARGS", "MIXER_OF", "REFUSED", "SIZE_ARGS", "TARGET_VERSION",
           "check_args", "check_sizes", "export_mdlus", "exportable", "import_mdlus",
           "normalizers_path", "read_mdlus"]
