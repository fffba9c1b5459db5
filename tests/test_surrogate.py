"""A model in physical units (flarepp.models.surrogate) apart from how it runs
(flarepp.inference.execution).

A failure of the composition tests points to the maps (their order, dtype or masking); of
the streaming test, to the maps inside the streaming plan; of the stored-run test, to a
surrogate rebuilt from a checkpoint's normalisers that no longer computes what the run
stored; of the source scan, to a second de-normalisation added somewhere in ``src/``.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import flarepp
from flarepp.inference.execution import STREAM_ABOVE, Execution, predict_tokens
from flarepp.inference.infer import predict_cases, read_cases
from flarepp.models import Surrogate, UnitMaps, model_from_config
from flarepp.storage.checkpoint import read_checkpoint, rebuild_surrogate
from flarepp.tasks import TASKS, Task

SRC = Path(__file__).resolve().parents[1] / "src" / "flarepp"
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "main_958c132"

MAPS = {"inputs": ([0.5, -1.0, 2.0], [2.0, 0.5, 3.0]), "outputs": ([3.0, -2.0], [4.0, 0.25])}


def tiny_model(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_from_config({"in_dim": 3, "out_dim": 2, "mixer": "flarepp", "dim": 16,
                              "heads": 2, "blocks": 2, "latents": 4, **extra}).eval()


def padded_inputs(samples: int = 2, points: int = 23) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(samples, points, 3, generator=generator) * 4 + 1
    mask = torch.ones(samples, points, dtype=torch.bool)
    mask[-1, points - 9:] = False
    return x, mask


def test_surrogate_is_the_model_between_its_maps():
    """``Surrogate(model, maps)(x, mask)`` equals ``(model((x - m) / s * mask, mask) s_y +
    m_y) * mask`` written out, zero at padding; a conditioned model's tokens get their own
    map; without maps it is the model; the maps are buffers named in the state dict."""
    model = tiny_model()
    surrogate = Surrogate(model, **MAPS)
    x, mask = padded_inputs()
    (mx, sx), (my, sy) = (tuple(torch.tensor(v) for v in MAPS[k]) for k in MAPS)
    with torch.no_grad():
        want = (model((x - mx) / sx * mask[..., None], mask=mask) * sy + my) * mask[..., None]
        got = surrogate(x, mask)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert not got[-1, -9:].any()
        torch.testing.assert_close(Surrogate(model)(x, mask), model(x, mask=mask))
    assert {"input_shift", "input_scale", "output_shift", "output_scale"} <= set(
        surrogate.state_dict())
    conditioned = model_from_config({"arch": "conditioned", "in_dim": 3, "out_dim": 2,
                                     "cond_dim": 2, "cond_tokens": 1, "conditioning": "concat",
                                     "mixer": "flarepp", "dim": 16, "heads": 2, "blocks": 1,
                                     "latents": 4}).eval()
    c = torch.tensor([[[7.0, -3.0]], [[1.0, 2.0]]])
    with torch.no_grad():
        got = Surrogate(conditioned, **MAPS, conditions=([1.0, 2.0], [2.0, 5.0]))(
            x, mask, conditioning=c)
        raw = conditioned((x - mx) / sx * mask[..., None], mask=mask,
                          conditioning=(c - torch.tensor([1.0, 2.0])) / torch.tensor([2.0, 5.0]))
    torch.testing.assert_close(got, (raw * sy + my) * mask[..., None], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="the outputs map: shift has 2 channel"):
        Surrogate(model, outputs=([0.0, 1.0], [1.0]))


def test_a_streamed_or_batched_surrogate_equals_its_plain_forward():
    """``predict_tokens`` of a surrogate streamed in chunks of 5 and 23 tokens (the maps
    inside the streaming plan) equals its plain forward; conditioning tokens given to a
    model that takes none refuse streaming in a sentence."""
    surrogate = Surrogate(tiny_model(), **MAPS)
    x, mask = padded_inputs()
    plain = predict_tokens(surrogate, {"x": x, "mask": mask}, Execution())
    for chunk in (5, 23):
        streamed = predict_tokens(surrogate, {"x": x, "mask": mask},
                                  Execution(chunk_size=chunk))
        torch.testing.assert_close(streamed, plain, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="takes no conditioning tokens, so it cannot be "
                       "streamed with them"):
        predict_tokens(surrogate, {"x": x, "conditioning": torch.zeros(2, 1, 2)},
                       Execution(chunk_size=5))


def test_execution_is_one_frozen_setting():
    """One setting, changed by ``dataclasses.replace`` only; a precision, hidden-state
    place or chunk size it cannot run is a sentence naming it."""
    execution = Execution("cpu", "bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        execution.chunk_size = 8
    streamed = dataclasses.replace(execution, chunk_size=8, hidden_on="host")
    assert (streamed.chunk_size, streamed.precision, streamed.device) == (
        8, "bf16", torch.device("cpu"))
    with pytest.raises(ValueError, match="precision must be one of"):
        Execution(precision="fp8")
    with pytest.raises(ValueError, match="hidden_on must be one of"):
        Execution(hidden_on="disk")
    with pytest.raises(ValueError, match="chunk_size must be a positive number"):
        Execution(chunk_size=0)


def test_an_old_run_loads_as_a_surrogate_to_its_stored_predictions(tmp_path):
    """A run written before the surrogate existed (tests/fixtures/main_958c132) loads as
    one: its maps are the checkpoint's stored normalisers, and ``flarepp.load`` predicts
    the test samples to the predictions the run stored at the end of its training."""
    old = tmp_path / "old"
    shutil.copytree(FIXTURE, old)
    checkpoint = old / "run" / "checkpoints" / "epoch_0002.pt"
    state = read_checkpoint(checkpoint)
    surrogate = rebuild_surrogate(state, checkpoint)
    stored = state["normalizers"]
    np.testing.assert_array_equal(surrogate.output_scale.numpy(), stored["y"]["std"])
    np.testing.assert_array_equal(surrogate.input_shift.numpy(), stored["x"]["mean"])
    predictor = flarepp.load(old / "run", device="cpu")
    assert isinstance(predictor.surrogate, Surrogate)
    assert predictor.execution == Execution("cpu", "fp32", stream_above=STREAM_ABOVE)
    result, = predict_cases(predictor, read_cases(predictor, old / "data"))
    with np.load(old / "run" / "test_predictions.npz") as written:
        np.testing.assert_allclose(result["pred"], written["pred"], rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(result["rel_l2"], written["rel_l2"], rtol=1e-5)


def test_task_hooks_are_declared_on_the_task():
    """Every registered task answers ``inference_cases`` and ``check_config`` as declared
    by :class:`Task` (None and nothing by default; the surface task reads its own cars),
    so no caller probes for them."""
    for name in TASKS.names():
        task = TASKS.get(name)
        assert callable(task.inference_cases) and callable(task.check_config)
    assert TASKS.get("fields").inference_cases is not None
    assert TASKS.get("fields").inference_cases.__func__ is Task.inference_cases.__func__
    assert TASKS.get("surface").inference_cases.__func__ is not Task.inference_cases.__func__
    probes = [f"{path.relative_to(SRC)}:{node.lineno}" for path in SRC.rglob("*.py")
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "hasattr"
              and re.search(r"task", ast.unparse(node.args[0]))]
    assert not probes, f"task hooks probed with hasattr: {probes}"


# ---------------------------------------------------------------------------------------------
# one de-normalisation in src/

SCALE, SHIFT, MAP = re.compile(r"std|output_scale"), re.compile(r"mean|output_shift"), \
    re.compile(r"norm|outputs")
ALLOWED = {("models/surrogate.py", "denormalise"),   # UnitMaps.denormalise: the one
           ("data/base.py", "decode")}               # Normalizer.decode, which src never calls


def denormalisations(source: str) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of every ``y * std + mean`` (or ``* output_scale +
    output_shift``) and every ``<normaliser>.decode(...)`` call in ``source``."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(function):
            affine = (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                      and isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.Mult)
                      and SCALE.search(ast.unparse(node.left))
                      and SHIFT.search(ast.unparse(node.right)))
            decode = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr == "decode" and MAP.search(ast.unparse(node.func.value)))
            if affine or decode:
                found.append((getattr(function, "name", "<lambda>"), node.lineno))
    return sorted(set(found))


def test_one_denormalisation_in_src():
    """De-normalising model outputs (``y_n * std + mean``, or a normaliser's ``decode``) is
    written once in ``src/``: :meth:`UnitMaps.denormalise`, which the trainer's loss, the
    engine, ``flarepp.load``, ``infer`` and ``export`` all reach (the data floor's
    ``Normalizer.decode`` is the arithmetic no caller in ``src/`` uses). A failure names
    a second one; the fix is to call the surrogate's ``denormalise``."""
    found = [(str(path.relative_to(SRC)), name, line) for path in sorted(SRC.rglob("*.py"))
             for name, line in denormalisations(path.read_text())]
    others = [f"{path}:{line} ({name})" for path, name, line in found
              if (path, name) not in ALLOWED]
    assert not others, "de-normalised outside UnitMaps.denormalise:\n  " + "\n  ".join(others)
    assert {(path, name) for path, name, _ in found} == ALLOWED
    assert UnitMaps.denormalise is Surrogate.denormalise


def test_the_scan_finds_a_planted_denormalisation():
    """The scan above catches the shapes a second de-normalisation takes (so it cannot pass
    by reading nothing) and leaves an adaptive norm's ``h * (1 + scale) + shift`` alone."""
    planted = ("def loss(self, pred):\n"
               "    a = pred * self.y_norm.std + self.y_norm.mean\n"
               "    b = self.y_norm.decode(pred)\n"
               "    return (pred.float() * self.output_scale + self.output_shift), a, b\n"
               "def block(h, scale1, shift1):\n"
               "    return h * (1 + scale1) + shift1\n")
    assert denormalisations(planted) == [("loss", 2), ("loss", 3), ("loss", 4)]
