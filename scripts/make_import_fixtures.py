"""Make tests/fixtures/interop/ with the real packages: PhysicsNeMo's and the FLARE authors'.

    python scripts/make_import_fixtures.py SCRATCH [--physicsnemo-pr DIR] [--flare-py DIR]
                                           [--out tests/fixtures/interop]

``SCRATCH`` is a folder outside the repository (e.g. /tmp/import-fixtures). The script

1. installs ``nvidia-physicsnemo==2.2.2`` and the pure-Python packages its import needs into
   ``SCRATCH/site`` with ``pip install --target`` (``--no-deps`` where a package would pull a
   CUDA torch: torch itself is this environment's CPU build). PyPI's torchvision is a CUDA
   build whose operators do not register against a CPU torch, so the workers put a stand-in
   for ``torchvision._meta_registrations`` in ``sys.modules`` before importing PhysicsNeMo
   (timm imports torchvision; no FLARE code uses it). No PhysicsNeMo file is edited.
2. ``--physicsnemo-pr DIR``: the three files of PhysicsNeMo pull request 1940 that add
   ``FLAREPlusPlus`` (``physicsnemo/experimental/models/flare/flare.py``,
   ``physicsnemo/experimental/nn/flare_attention.py``, ``.../nn/__init__.py``; the release
   lacks it), laid over a copy of the release in ``SCRATCH/site-pr1940``.
3. ``--flare-py DIR``: ``pdebench/models/flare.py`` and ``pdebench/models/flarepp.py`` of the
   FLARE authors' repository at the pinned commit, loaded under empty package ``__init__``
   files with stand-ins for the three names of their ``pdebench.distributed`` they import
   (used only by their context-parallel path, which never runs here).
4. builds small models with random O(1) weights in worker processes that import the real
   code, saves them their way (``Module.save``; their trainer's snapshot layout and
   ``config.yaml``), and stores each with its own forward on a fixed float64 input, the input
   gradient of a fixed linear functional, and (PhysicsNeMo) the round trip: flarepp's
   ``export --format mdlus`` of the imported model loaded by ``Module.from_checkpoint``.

``provenance.json`` records the package versions, the commits and the SHA-256 of every
source file the workers ran. Their code is never copied into flarepp nor made a dependency.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PHYSICSNEMO = "nvidia-physicsnemo==2.2.2"
PR_FILES = ("physicsnemo/experimental/models/flare/flare.py",
            "physicsnemo/experimental/nn/flare_attention.py",
            "physicsnemo/experimental/nn/__init__.py")
PR_SOURCE = {"repository": "mnabian/physicsnemo", "pull_request": "NVIDIA/physicsnemo#1940",
             "commits": {PR_FILES[0]: "c3811e7eacdfa884904a5743f65fe56b8e044152",
                         PR_FILES[1]: "b42e3ca1684c8ac0680232fd90cb710d64d2026e",
                         PR_FILES[2]: "b42e3ca1684c8ac0680232fd90cb710d64d2026e"}}
FLARE_PY_FILES = ("pdebench/models/flare.py", "pdebench/models/flarepp.py")
FLARE_PY_SOURCE = {"repository": "vpuri3/FLARE.py",
                   "commit": "3b66f4cf3d00f7301ba40715dfab41848b530471"}
# (package, install with --no-deps): pure Python, or binaries that need no CUDA torch
PACKAGES = [("einops jaxtyping warp-lang treelib termcolor nvtx omegaconf "
             "antlr4-python3-runtime==4.9.3 hydra-core timm huggingface_hub pyyaml "
             "safetensors filelock cloudpickle pyvers<0.3.0,>=0.2.0 tensordict "
             "torchvision<0.29", True), ("s3fs", False)]
SIZES = dict(C=16, H=4, M=6, L=2, E=2, F=1, O=2, B=2, N=37)
HERE = Path(__file__).resolve()


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# the driver (this environment: flarepp importable)

def install(scratch: Path) -> Path:
    site = scratch / "site"
    if (site / "physicsnemo").is_dir():
        return site
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(site)]
    subprocess.run(pip + ["--no-deps", PHYSICSNEMO], check=True)
    for names, no_deps in PACKAGES:
        subprocess.run(pip + (["--no-deps"] if no_deps else []) + names.split(), check=True)
    return site


def overlay_pr(site: Path, pr: Path, scratch: Path) -> Path:
    """A copy of the release with the pull request's files laid over it."""
    target = scratch / "site-pr1940"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir()
    shutil.copytree(site / "physicsnemo", target / "physicsnemo")
    for name in PR_FILES:
        shutil.copyfile(pr / name, target / name)
    return target


def flare_py_package(src: Path, scratch: Path) -> Path:
    """Their two model files under empty package inits, with the CP stand-ins."""
    root = scratch / "flare-py"
    if root.exists():
        shutil.rmtree(root)
    for pkg in ("pdebench", "pdebench/models", "pdebench/distributed"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    for name in FLARE_PY_FILES:
        shutil.copyfile(src / name, root / name)
    stand_ins = {"context_parallel": "class ContextParallelState: pass\n",
                 "flare_cp": "class FlareEncoderCPFlash:\n    pass\n\n\n"
                             "class FlareEncoderCPNaiive:\n    pass\n",
                 "utils": "def gather_sequence_tensor(*args, **kwargs):\n"
                          "    raise RuntimeError('context parallelism is not set up')\n"}
    for name, text in stand_ins.items():
        (root / "pdebench/distributed" / f"{name}.py").write_text(
            "# stand-in: the fixture harness never runs their context-parallel path\n" + text)
    return root


def worker(path: Path, role: str, out: Path, *args: str) -> dict:
    """Run this script's worker ``role`` with ``path`` first on sys.path; its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1",
           "PYTHONNOUSERSITE": "1"}
    proc = subprocess.run([sys.executable, str(HERE), "--worker", role, str(out), *args],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"worker {role} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def round_trip(fixture: Path, site: Path, out: Path) -> dict:
    """flarepp's export of the imported fixture, loaded by PhysicsNeMo: outputs compared."""
    import numpy as np
    import torch

    from flarepp.interop import import_checkpoint
    from flarepp.interop.physicsnemo import export_mdlus
    with tempfile.TemporaryDirectory() as tmp:
        report = import_checkpoint("physicsnemo", fixture, Path(tmp) / "run",
                                   normalizers="identity")
        exported = Path(tmp) / "back.mdlus"
        facts = export_mdlus(Path(tmp) / "run", exported)
        data = np.load(fixture.with_suffix(".npz"))
        with torch.no_grad():
            ours = report.imported.model()(torch.from_numpy(data["x"])).numpy()
        np.save(Path(tmp) / "ours.npy", ours)
        theirs = worker(site, "load", Path(tmp), str(exported), str(fixture.with_suffix(".npz")))
        got = np.load(Path(tmp) / "theirs.npy")
    deviation = float(np.abs(got - ours).max() / np.abs(ours).max())
    return {"exported_args": facts["args"], "from_checkpoint": theirs["class"],
            "max_abs_difference_relative": deviation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scratch", type=Path)
    parser.add_argument("--physicsnemo-pr", type=Path)
    parser.add_argument("--flare-py", type=Path)
    parser.add_argument("--out", type=Path, default=HERE.parents[1] / "tests/fixtures/interop")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    site = install(args.scratch.resolve())
    record = {"torch": __import__("torch").__version__, "sizes": SIZES, "fixtures": {},
              "harness": [
                  "PhysicsNeMo installed with pip --target next to this environment's CPU "
                  "torch; torchvision._meta_registrations replaced by an empty module in "
                  "sys.modules (PyPI's torchvision is a CUDA build); no PhysicsNeMo file "
                  "edited",
                  "FLAREPlusPlus: the release with the pull request's three files laid over "
                  "it (commits and SHA-256 below)",
                  "FLARE.py: pdebench/models/{flare,flarepp}.py at the commit below under "
                  "empty package __init__ files; pdebench.distributed's three imported names "
                  "are stand-ins (their context-parallel path never runs)",
                  "their checkpoints: config.yaml as their script writes it (the model "
                  "section is asdict of their config dataclass), ckpt01/model.pt in their "
                  "trainer's snapshot layout (model_state with torch.compile's _orig_mod. "
                  "prefix for flarepp; ema_shadow for flare)"]}
    record["physicsnemo"] = worker(site, "versions", args.out)
    record["fixtures"]["physicsnemo_flare"] = worker(site, "physicsnemo", args.out, "FLARE")
    record["fixtures"]["physicsnemo_flare"]["round_trip"] = round_trip(
        args.out / "physicsnemo_flare.mdlus", site, args.out)
    if args.physicsnemo_pr:
        pr_site = overlay_pr(site, args.physicsnemo_pr.resolve(), args.scratch.resolve())
        record["physicsnemo_pr1940"] = {**PR_SOURCE, "sha256": {
            f: sha256(args.physicsnemo_pr / f) for f in PR_FILES}}
        record["fixtures"]["physicsnemo_flareplusplus"] = worker(
            f"{pr_site}{os.pathsep}{site}", "physicsnemo", args.out, "FLAREPlusPlus")
    if args.flare_py:
        package = flare_py_package(args.flare_py.resolve(), args.scratch.resolve())
        record["flare_py"] = {**FLARE_PY_SOURCE, "sha256": {
            f: sha256(args.flare_py / f) for f in FLARE_PY_FILES}}
        for kind in ("flare", "flarepp"):
            record["fixtures"][f"flare_py_{kind}"] = worker(
                f"{package}{os.pathsep}{site}", "flare-py", args.out, kind)
    (args.out / "provenance.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


# ---------------------------------------------------------------------------------------------
# the workers (the scratch environment: PhysicsNeMo or FLARE.py importable)

def _stand_in_torchvision() -> None:
    import types
    sys.modules["torchvision._meta_registrations"] = types.ModuleType(
        "torchvision._meta_registrations")


def _randomise(model, seed: int) -> None:
    """Every parameter O(1): matrices ``N(0, 1/fan_in)``, vectors and latents ``N(0, 1)``
    scaled by 0.5 (norm weights around 1)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.dim() == 2:
                p.copy_(noise * p.shape[1] ** -0.5)
            elif name.endswith("weight") and ("norm" in name or "ln" in name):
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(0.5 * noise)


def _probe(forward, out: Path, name: str, **inputs) -> dict:
    """``forward`` on the fixed float64 input, the gradient of ``sum(w * y)`` w.r.t. it;
    written to ``out/name.npz``."""
    import numpy as np
    import torch
    g = torch.Generator().manual_seed(1)
    S = SIZES
    x = torch.randn(S["B"], S["N"], S["E"] + S["F"], generator=g, dtype=torch.float64)
    w = torch.randn(S["B"], S["N"], S["O"], generator=g, dtype=torch.float64)
    x.requires_grad_(True)
    y = forward(x)
    (w * y).sum().backward()
    arrays = {"x": x.detach().numpy(), "w": w.numpy(), "y": y.detach().numpy(),
              "x_grad": x.grad.numpy(), **inputs}
    np.savez(out / f"{name}.npz", **arrays)
    return {"y_abs_max": float(y.abs().max()), "x_grad_abs_max": float(x.grad.abs().max())}


def worker_versions(out: Path) -> dict:
    _stand_in_torchvision()
    import importlib.metadata as md
    return {p: md.version(p) for p in ("nvidia-physicsnemo", "warp-lang", "einops", "timm",
                                       "torchvision", "tensordict", "jaxtyping")}


def worker_physicsnemo(out: Path, cls_name: str) -> dict:
    _stand_in_torchvision()
    import torch
    import physicsnemo
    S = SIZES
    if cls_name == "FLARE":
        from physicsnemo.models.flare import FLARE as cls
        extra = {"use_te": False}
    else:
        from physicsnemo.experimental.models.flare.flare import FLAREPlusPlus as cls
        extra = {}
    model = cls(functional_dim=S["F"], out_dim=S["O"], embedding_dim=S["E"], n_layers=S["L"],
                n_hidden=S["C"], n_head=S["H"], slice_num=S["M"], mlp_ratio=2, dropout=0.1,
                **extra)
    _randomise(model, seed=3)
    name = "physicsnemo_" + cls_name.lower()
    model.save(str(out / f"{name}.mdlus"))
    loaded = physicsnemo.Module.from_checkpoint(str(out / f"{name}.mdlus")).double().eval()
    facts = _probe(lambda x: loaded(x[..., S["E"]:], embedding=x[..., :S["E"]]), out, name)
    return {**facts, "class": f"{type(loaded).__module__}.{type(loaded).__name__}",
            "physicsnemo": physicsnemo.__version__, "mdlus_sha256": sha256(out / f"{name}.mdlus"),
            "input_layout": "x = cat(embedding [E], functional [F]), as their forward cats"}


def worker_load(out: Path, mdlus: str, inputs: str) -> dict:
    """PhysicsNeMo's from_checkpoint of flarepp's export, run on the fixture's input."""
    _stand_in_torchvision()
    import numpy as np
    import torch
    import physicsnemo
    model = physicsnemo.Module.from_checkpoint(mdlus).double().eval()
    E = model.embedding_dim
    x = torch.from_numpy(np.load(inputs)["x"])
    with torch.no_grad():
        y = model(x[..., E:], embedding=x[..., :E])
    np.save(out / "theirs.npy", y.numpy())
    return {"class": f"{type(model).__module__}.{type(model).__name__}"}


def worker_flare_py(out: Path, kind: str) -> dict:
    """Their FLAREModel / FLAREPPModel: a case directory (config.yaml, ckpt01/model.pt in
    their trainer's snapshot layout) and the float64 forward."""
    import dataclasses
    import torch
    import yaml
    S = SIZES
    if kind == "flare":
        from pdebench.models.flare import FlareConfig as Config, FLAREModel as Model
        config = Config(num_blocks=S["L"], channel_dim=S["C"], num_heads=S["H"],
                        num_latents=S["M"], num_layers_k_proj=-1, num_layers_v_proj=-1,
                        num_layers_ffn=0, ffn_mlp_ratio=2.0, attn_scale=1.0)
    else:
        from pdebench.models.flarepp import FlarePPConfig as Config, FLAREPPModel as Model
        config = Config(num_blocks=S["L"], channel_dim=S["C"], num_heads=S["H"],
                        num_latents=S["M"])
    model = Model(config, metadata={"c_in": S["E"] + S["F"], "c_out": S["O"]})
    _randomise(model, seed=5)
    case = out / f"flare_py_{kind}"
    shutil.rmtree(case, ignore_errors=True)
    (case / "ckpt01").mkdir(parents=True)
    (case / "config.yaml").write_text(yaml.safe_dump(
        {"model": dataclasses.asdict(config), "dataset": {"dataset": "elasticity"}}))
    # their trainer compiles by default: its state dict keys then start with _orig_mod.
    compiled = torch.compile(model) if kind == "flarepp" else model
    snapshot = {"model_state": {k: v.clone() for k, v in compiled.state_dict().items()},
                "step": 0, "epoch": 0}
    facts = _probe(lambda x: model.double().eval()(x), out, f"flare_py_{kind}")
    if kind == "flare":   # a second weight set as the EMA shadow (their EMA's layout: the
        _randomise(model.float(), seed=7)    # named parameters), with its own forward
        snapshot["ema_shadow"] = {k: v.detach().clone() for k, v in model.named_parameters()}
        facts["ema"] = _probe(lambda x: model.double().eval()(x), out, f"flare_py_{kind}_ema")
    torch.save(snapshot, case / "ckpt01" / "model.pt")
    return {**facts, "class": f"{Model.__module__}.{Model.__name__}",
            "config": dataclasses.asdict(config)}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        role, target, *rest = sys.argv[2:]
        result = {"versions": worker_versions, "physicsnemo": worker_physicsnemo,
                  "load": worker_load, "flare-py": worker_flare_py}[role](Path(target), *rest)
        print(json.dumps(result))
    else:
        main()
