"""``flarepp import``: another FLARE implementation's checkpoint as a flarepp run directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from flarepp.cli import at_least, check_output
from flarepp.interop import import_checkpoint

NORMALIZERS_HELP = ("the maps the model's training data went through, which the checkpoint "
                    "does not hold: a store (its training split's mean and std, and its "
                    "channel layout), a JSON statistics file ({\"x\": {\"mean\": [...], "
                    "\"std\": [...]}, \"y\": {...}}), or 'identity'")


def _import(args: argparse.Namespace) -> int:
    check_output(args.out, directory=True)
    options = {"config": args.config} if getattr(args, "config", None) else {}
    report = import_checkpoint(args.format, args.source, args.out, normalizers=args.normalizers,
                               coordinates=args.coordinates, **options)
    c = report.imported.model_config
    source = report.imported.source
    print(f"imported {source['class']} ({args.source}) as flarepp's {c['arch']!r} with the "
          f"{c['mixer']!r} mixer: C={c['dim']}, H={c['heads']}, M={c['latents']}, "
          f"{c['blocks']} blocks, in {c['in_dim']} -> out {c['out_dim']}, SDPA scale "
          f"{c['attn_scale']:g}")
    print(f"normalisers: {report.normalizers.describe}")
    layout = report.normalizers.coordinates
    print("input layout: " + ("not given (every input channel is passed as a point "
                              "channel)" if layout is None else
                              f"the first {layout} input channel(s) are coordinates"))
    for note in report.imported.notes:
        print(f"note: {note}")
    print(f"wrote {report.checkpoint} (flarepp infer / export / train --init-from read it)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="another FLARE implementation's checkpoint as a run "
                       "directory (PhysicsNeMo .mdlus, the FLARE authors' FLARE.py)")
    formats = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    for name, what, source in (
            ("physicsnemo", "NVIDIA PhysicsNeMo's FLARE or FLAREPlusPlus model",
             "a .mdlus file (physicsnemo.Module.save)"),
            ("flare-py", "the FLARE authors' FLAREModel or FLAREPPModel (vpuri3/FLARE.py)",
             "their case directory (config.yaml, ckptNN/model.pt), a ckptNN directory or a "
             "model.pt")):
        f = formats.add_parser(name, help=what, description=f"Import {what} exactly; "
                               "arguments flarepp cannot represent are refused.")
        f.add_argument("source", help=source)
        f.add_argument("--out", required=True, help="the run directory to write (new)")
        f.add_argument("--normalizers", required=True, metavar="STORE|STATS.json|identity",
                       help=NORMALIZERS_HELP)
        f.add_argument("--coordinates", type=at_least(0), metavar="G",
                       help="the first G input channels are point coordinates (default: "
                            "the store's or statistics file's layout; PhysicsNeMo: its "
                            "embedding_dim)")
        if name == "flare-py":
            f.add_argument("--config", type=Path, help="their config.yaml, when it is not in "
                           "the case directory")
        f.set_defaults(func=_import)
