"""The FLARE authors' models (github.com/vpuri3/FLARE.py) in flarepp, without their code.

Shape letters: C channels (``channel_dim``), H heads, D = C / H, M latents.

Their training script writes a case directory: ``config.yaml`` (the run's config in
sections; ``model`` holds the model's config, ``model: flare`` or ``model: flarepp`` among
its fields) and ``ckptNN/model.pt``, a ``torch.save`` of their trainer's snapshot (its
``model_state``, and ``ema_shadow`` when EMA was on; keys start with ``_orig_mod.`` when the
model was compiled). :func:`import_flare_py` reads a case directory (its newest ``ckptNN``),
a ``ckptNN`` directory or a ``model.pt`` (the config from ``--config`` or from the case
directory two levels up), or a bare state dict with ``--config``. Everything is read with
``torch.load(weights_only=True)`` and ``yaml.safe_load``: no code of theirs runs.

Both their models share flarepp's backbone (Table 7): ``in_proj`` a residual MLP with
``num_layers_in_out_proj`` hidden layers, blocks ``x + mixer(norm1(x))``,
``x + FFN(norm2(x))``, ``out_proj`` a norm then a residual MLP, tanh GELU:

* ``FLAREPPModel`` (``pdebench/models/flarepp.py``: ``FLAREPPMixer``) -> the ``flarepp``
  mixer: ``latent_q0`` the synthesis seeds, ``latent_q_fixed`` the fixed queries,
  ``[k0_proj | k_proj | v_proj]`` the stacked projections, ``q0_norm``/``k_norm`` the affine
  per-head norms, SDPA scale ``D^-1/2``. Their gated sum is rounded to float32 even when
  the model runs in float64 (``.float()``): the imported mixer keeps that rounding
  (``gate_sum="float32"``), so the two agree in float64 too.
* ``FLAREModel`` (``pdebench/models/flare.py``) -> the ``flare`` mixer when its key and value
  projections are linear (``num_layers_k_proj = num_layers_v_proj = -1``: ``x + W x + b``,
  i.e. ``W_K = I + W``): ``latent_q [C, M]`` viewed as ``[H, M, D]`` the fixed queries, its
  SDPA scale as configured (``one``: 1, ``sqrt``: ``D^-1/2``, ``sqrt`` whenever D > 16).

Settings flarepp's model does not compute are refused naming them (deeper key or value
MLPs, an FFN with hidden layers or residuals, ``qk_norm``, SiLU, no output norm, ...).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from flarepp.interop.maps import Affine, InteropError, SourceWeights, residual_linear
from flarepp.interop.run import ImportedModel

CONFIG_NAME = "config.yaml"
CHECKPOINT_NAME = "model.pt"
CKPT_DIR = re.compile(r"ckpt(\d+)")
PREFIXES = ("_orig_mod.", "module.")


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:
        raise InteropError(f"{path}: reading the FLARE authors' config.yaml needs PyYAML, "
                           "which is not installed: pip install 'flarepp[interop]'") from None
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise InteropError(f"{path}: not a readable YAML config "
                           f"({' '.join(str(err).split())})") from None
    model = config.get("model", config) if isinstance(config, dict) else None
    if not isinstance(model, dict) or "model" not in model:
        raise InteropError(f"{path}: no 'model' section naming the model (model: flare or "
                            "flarepp), as their config.yaml holds")
    return model


def locate(path: Path, config: Path | None) -> tuple[Path, Path | None]:
    """``(checkpoint file, config file or None)`` of a case directory, a ``ckptNN``
    directory or a checkpoint file."""
    if path.is_dir():
        ckpts = sorted((int(m.group(1)), p) for p in path.iterdir()
                       if (m := CKPT_DIR.fullmatch(p.name)) and (p / CHECKPOINT_NAME).is_file())
        if ckpts:
            path = ckpts[-1][1] / CHECKPOINT_NAME
        elif (path / CHECKPOINT_NAME).is_file():
            path = path / CHECKPOINT_NAME
        else:
            raise InteropError(f"{path}: no ckptNN/{CHECKPOINT_NAME} and no "
                                f"{CHECKPOINT_NAME} (give their case directory, a ckptNN "
                                "directory or a checkpoint file)")
    elif not path.is_file():
        raise InteropError(f"{str(path)!r} does not exist")
    if config is None:
        beside = [p / CONFIG_NAME for p in (path.parent, path.parent.parent)]
        config = next((p for p in beside if p.is_file()), None)
    return path, config


def read_snapshot(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """``(model_state, ema_shadow or None)`` with the compile/DDP prefixes removed."""
    try:
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a foreign or damaged file
        raise InteropError(f"{path}: not a checkpoint torch reads with weights_only=True "
                            f"({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(snapshot, dict):
        raise InteropError(f"{path}: holds a {type(snapshot).__name__}, not their "
                            "trainer's snapshot or a state dict")
    state = snapshot.get("model_state", snapshot)
    ema = snapshot.get("ema_shadow")
    for what, value in (("model_state", state), ("ema_shadow", ema)):
        if value is not None and not isinstance(value, dict):
            raise InteropError(f"{path}: its {what} is a {type(value).__name__}, not a state "
                               "dict")

    def strip(d):
        out = {}
        for k, v in d.items():
            for prefix in PREFIXES:
                k = k[len(prefix):] if k.startswith(prefix) else k
            out[k] = v
        return out
    return strip(state), None if ema is None else strip(ema)


def _refuse(config: dict[str, Any], key: str, allowed: Any, why: str, path: Path) -> None:
    value = config.get(key, allowed)
    ok = value in allowed if isinstance(allowed, tuple) else value == allowed
    if not ok:
        raise InteropError(f"{path}: {config['model']} with {key}={value!r}: {why}")


SIZES = ("channel_dim", "num_heads", "num_blocks", "num_latents")
"""The model section's size settings, each required, an integer >= 1."""


def _check_sizes(c: dict[str, Any], path: Path) -> None:
    for key in SIZES:
        value = c.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InteropError(f"{path}: {c['model']} with {key}={value!r}: " + (
                "the model section lacks it" if key not in c else "must be an integer >= 1"))
    if c["channel_dim"] % c["num_heads"]:
        raise InteropError(f"{path}: channel_dim={c['channel_dim']} is not divisible by "
                           f"num_heads={c['num_heads']}")


def _check_common(c: dict[str, Any], path: Path) -> None:
    _check_sizes(c, path)
    _refuse(c, "act", (None, "gelu"), "flarepp's backbone uses the tanh GELU only", path)
    _refuse(c, "out_proj_norm", True, "flarepp's backbone always norms before its output "
            "MLP", path)
    _refuse(c, "num_layers_ffn", 0, "flarepp's FFN is Linear, GELU, Linear (no hidden "
            "residual layers)", path)
    if int(c["channel_dim"] * c.get("ffn_mlp_ratio", 2.0)) == c["channel_dim"]:
        raise InteropError(f"{path}: {c['model']} with ffn_mlp_ratio="
                            f"{c.get('ffn_mlp_ratio')}: a C-wide FFN adds residuals around "
                            "its layers, which flarepp's FFN does not")
    if c.get("num_layers_in_out_proj", 2) < 0:
        raise InteropError(f"{path}: num_layers_in_out_proj="
                            f"{c['num_layers_in_out_proj']}: flarepp's input and output MLPs "
                            "have hidden layers (0 or more)")


def _model_config(c: dict[str, Any], mixer: str, in_dim: int, out_dim: int,
                  scale: float) -> dict[str, Any]:
    options = {"gate_sum": "float32"} if mixer == "flarepp" else {}
    return {"arch": "surrogate", "in_dim": in_dim, "out_dim": out_dim,
            "dim": int(c["channel_dim"]), "heads": int(c["num_heads"]),
            "blocks": int(c["num_blocks"]), "latents": int(c["num_latents"]),
            "ffn_ratio": float(c.get("ffn_mlp_ratio", 2.0)),
            "io_layers": int(c.get("num_layers_in_out_proj", 2)),
            "norm": "rmsnorm" if c.get("rmsnorm") else "layernorm", "mixer": mixer,
            "attn_scale": scale, "input_mlp": "residual", "output_mlp": "residual",
            "gelu": "tanh", "mixer_options": options}


NORMS = ("mixer_norm", "ffn_norm", "out_norm", "seed_norm.norm", "routing_key_norm.norm")


def _backbone_names(kind: str, layers: int, blocks: int) -> dict[str, str]:
    """Their in_proj, block norms and FFNs, out_proj: flarepp's name -> theirs."""
    ffn = "mlp" if kind == "flare" else "ffn"
    names = {"in_proj.fc_in": "in_proj.fc1", "in_proj.fc_out": "in_proj.fc2",
             "out_norm": "out_proj.0", "out_proj.fc_in": "out_proj.1.fc1",
             "out_proj.fc_out": "out_proj.1.fc2"}
    names.update({f"in_proj.hidden.{j}": f"in_proj.fcs.{j}" for j in range(layers)})
    names.update({f"out_proj.hidden.{j}": f"out_proj.1.fcs.{j}" for j in range(layers)})
    for i in range(blocks):
        names.update({f"blocks.{i}.mixer_norm": f"blocks.{i}.norm1",
                      f"blocks.{i}.ffn_norm": f"blocks.{i}.norm2",
                      f"blocks.{i}.ffn.0": f"blocks.{i}.{ffn}.fc1",
                      f"blocks.{i}.ffn.2": f"blocks.{i}.{ffn}.fc2"})
    return names


def _flarepp_mixer(w: SourceWeights, i: int) -> dict[str, str | torch.Tensor]:
    m = f"blocks.{i}.mixer"
    stacked = [w.affine(f"{m}.{p}") for p in ("k0_proj", "k_proj", "v_proj")]
    return {"synthesis_seeds": w(f"{m}.latent_q0"), "fixed_queries": w(f"{m}.latent_q_fixed"),
            "gate_logit": w(f"{m}.gate_logit"),
            "key_value_proj.weight": torch.cat([a.weight for a in stacked]),
            "key_value_proj.bias": torch.cat([a.bias for a in stacked]),
            "out_proj": f"{m}.out_proj", "seed_norm.norm": f"{m}.q0_norm",
            "routing_key_norm.norm": f"{m}.k_norm"}


def _flare_mixer(w: SourceWeights, i: int, c: dict[str, Any]) -> dict[str, str | torch.Tensor]:
    m = f"blocks.{i}.att"
    kv = [residual_linear(w.affine(f"{m}.{p}.fc")) for p in ("k_proj", "v_proj")]
    queries = w(f"{m}.latent_q")                  # [C, M], read by them as .view(H, M, D)
    return {"fixed_queries": queries.reshape(int(c["num_heads"]), int(c["num_latents"]), -1),
            "key_value_proj.weight": torch.cat([a.weight for a in kv]),
            "key_value_proj.bias": torch.cat([a.bias for a in kv]),
            "out_proj": f"{m}.out_proj"}


def _read(w: SourceWeights, names: dict[str, str | torch.Tensor]) -> dict[str, torch.Tensor]:
    """flarepp's state dict: tensors as given, names of their layers read as weight and bias
    (a norm without a bias, RMSNorm, has none)."""
    state = {}
    for ours, theirs in names.items():
        if isinstance(theirs, torch.Tensor):
            state[ours] = theirs
            continue
        state[f"{ours}.weight"] = w(f"{theirs}.weight")
        if f"{theirs}.bias" in w or not ours.endswith(NORMS):
            state[f"{ours}.bias"] = w(f"{theirs}.bias")
    return state


def _scale(c: dict[str, Any], path: str) -> float:
    """SDPA scale: FLAREPPModel's ``D^-1/2``; FLAREModel's configured one (their rule:
    ``sqrt`` whenever D > 16)."""
    head_dim = int(c["channel_dim"]) // int(c["num_heads"])
    if c["model"] == "flarepp":
        return float(head_dim ** -0.5)
    scale = c.get("attn_scale", "one")
    if isinstance(scale, str):
        if scale not in ("one", "sqrt"):
            raise InteropError(f"{path}: attn_scale={scale!r} is neither 'one', 'sqrt' nor "
                                "a number")
        scale = "sqrt" if head_dim > 16 else scale
        return float(head_dim ** -0.5) if scale == "sqrt" else 1.0
    return float(scale)


def _check_flare(c: dict[str, Any], path: Path) -> None:
    for side in ("k", "v"):
        _refuse(c, f"num_layers_{side}_proj", -1, f"flarepp's FLARE projects "
                f"{'keys' if side == 'k' else 'values'} with one linear map; a deeper "
                "residual MLP is another mixer", path)
    _refuse(c, "qk_norm", False, "flarepp's FLARE has no query or key norms", path)


def _check_flarepp(c: dict[str, Any], path: Path) -> None:
    for key, why in (("share_k0_v0", "flarepp's FLARE++ shares the synthesis keys as "
                      "values (Table 2)"), ("k_norm", "flarepp's FLARE++ always norms its "
                      "routing keys"), ("q_fixed_norm", "flarepp's FLARE++ always norms its "
                      "fixed queries")):
        _refuse(c, key, True, why, path)


def _convert(c: dict[str, Any], state: dict[str, torch.Tensor], where: str
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    kind, blocks = c["model"], int(c["num_blocks"])
    held = {key.split(".")[1] for key in state if key.startswith("blocks.")}
    if len(held) != blocks:
        raise InteropError(f"{where}: num_blocks={blocks} but the state dict holds "
                           f"{len(held)} block(s)")
    w = SourceWeights(state, where)
    names: dict[str, str | torch.Tensor] = dict(_backbone_names(
        kind, int(c.get("num_layers_in_out_proj", 2)), blocks))
    for i in range(blocks):
        mixer = _flare_mixer(w, i, c) if kind == "flare" else _flarepp_mixer(w, i)
        names.update({f"blocks.{i}.mixer.{k}": v for k, v in mixer.items()})
    weights = _read(w, names)
    w.check_all_used()
    config = _model_config(c, kind, int(weights["in_proj.fc_in.weight"].shape[1]),
                           int(weights["out_proj.fc_out.weight"].shape[0]), _scale(c, where))
    return config, weights


def import_flare_py(path: str | Path, config: str | Path | None = None) -> ImportedModel:
    """Their ``FLAREModel`` or ``FLAREPPModel`` checkpoint as an :class:`ImportedModel`
    (module docstring); ``config`` their ``config.yaml`` when it is not in the case
    directory."""
    checkpoint, config_path = locate(Path(path), None if config is None else Path(config))
    if config_path is None:
        raise InteropError(f"{checkpoint}: no {CONFIG_NAME} in its case directory; give "
                            "their config with --config")
    c = _load_yaml(config_path)
    if c["model"] not in ("flare", "flarepp"):
        raise InteropError(f"{config_path}: model {c['model']!r}; flarepp imports their "
                            "'flare' (FLAREModel) and 'flarepp' (FLAREPPModel) models")
    _check_common(c, config_path)
    (_check_flare if c["model"] == "flare" else _check_flarepp)(c, config_path)
    state, ema = read_snapshot(checkpoint)
    model_config, weights = _convert(c, state, str(checkpoint))
    ema_weights = None if ema is None else _convert(c, ema, f"{checkpoint} (ema_shadow)")[1]
    cls = {"flare": "FLAREModel", "flarepp": "FLAREPPModel"}[c["model"]]
    source = {"format": "flare-py", "file": str(checkpoint),
              "class": f"pdebench.models.{c['model']}.{cls}",
              "config": str(Path(config_path).resolve()), "model_config": c}
    return ImportedModel(model_config, weights, source, ema=ema_weights)


__all__ = ["import_flare_py", "locate", "read_snapshot"]
