"""``flarepp export``: a run as a standalone file (pt2, ONNX or safetensors)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flarepp.cli import CLIError, check_output
from flarepp.inference.export import FORMATS, export_run
from flarepp.interop import EXPORT_FORMATS
from flarepp.storage.rundir import owning_run, run_checkpoint


def _export(args: argparse.Namespace) -> int:
    checkpoint = run_checkpoint(args.run)
    run = owning_run(checkpoint)
    out = args.out or run.exported(args.format)
    check_output(out, directory=False)
    record = run.record_of(out) or (Path(out).resolve() == checkpoint.resolve() or None)
    if record:      # the checkpoint being read, or a record of its run: never replaced
        raise CLIError(f"--out {str(out)!r} is the run's own "
                       f"{'checkpoint' if record is True else record}; write the export "
                       "elsewhere")
    if args.format in EXPORT_FORMATS:   # another implementation's format (flarepp.interop)
        written = EXPORT_FORMATS.get(args.format)(args.run, out, weights=args.weights)
        print(json.dumps(written))
        return 0
    written = export_run(args.run, out, args.format, weights=args.weights)
    print(json.dumps(written))
    print(f"wrote {written['path']} ({args.format}: x [B, N, {written['inputs']['x'][2]}] "
          f"and mask [B, N] -> y [B, N, {written['outputs']['y'][2]}] in physical units; "
          f"checked at another B and N: largest difference {written['deviation']:.1e} of "
          "the largest output)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a run's model with its normalisers as a standalone "
                       "file: pt2 (torch.export), onnx, safetensors")
    p.add_argument("run", help="a run directory (its reported checkpoint) or a checkpoint")
    p.add_argument("--format", choices=(*FORMATS, *EXPORT_FORMATS.names()), required=True,
                   help="pt2: torch.export, loads with torch alone; onnx: dynamo exporter, "
                        "for onnxruntime; safetensors: weights, normalisers, model config; "
                        "mdlus: PhysicsNeMo's FLARE where it computes the run's function")
    p.add_argument("--out", help="the file to write (default: RUN/model.<format>, beside "
                   "the checkpoint for one outside a run's checkpoints/)")
    p.add_argument("--weights", choices=("raw", "ema"),
                   help="which weights (default: those the run reports)")
    p.set_defaults(func=_export)
