"""``flarepp drivaerml prepare|pareto|report|figures``: the full-surface task's data, Figure 5
and Figures 13-14 of several runs."""

from __future__ import annotations

import argparse

from flarepp.cli import CLIError, check_output
from flarepp.cli.sweep import execute
from flarepp.device import DEVICE_HELP
from flarepp.experiments.reports import write_report
from flarepp.experiments.studies import pareto_study
from flarepp.paper import DRIVAERML_FULL
from flarepp.tasks.surface import load_drivaerml
from flarepp.train import get_preset


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _prepare(args: argparse.Namespace) -> int:
    data = load_drivaerml(args.data, split_file=args.split_file, cache_dir=args.cache_dir,
                          test_split=args.test_split)
    data.validate()
    splits = ["train", args.test_split]
    data.surfaces.prepare(splits, progress=not args.quiet)
    stats = data.surfaces.statistics("train", progress=not args.quiet)
    print(f"converted {sum(len(data.surfaces.cars(s)) for s in splits)} runs of {splits} into "
          f"{data.surfaces.cache_dir}; training statistics over {stats.n_cells} cells of "
          f"{stats.n_runs} runs: mean {stats.field_mean}, std {stats.field_std}")
    return 0


def _pareto(args: argparse.Namespace) -> int:
    if args.preset is None:
        if args.set or args.data:
            raise CLIError("--set and --data describe a new study: give its PRESET")
        return execute(None, args.out, quiet=args.quiet)
    study = pareto_study(get_preset(args.preset, args.set or []), args.mixers.split(","),
                         args.blocks, args.latents, args.seeds, args.anchors, data=args.data)
    return execute(study, args.out, quiet=args.quiet)


def _report(args: argparse.Namespace) -> int:
    for path in write_report(args.directory).values():
        print(path)
    return 0


def _figures(args: argparse.Namespace) -> int:
    from flarepp.inference.surface import plot_runs_together  # (start-up time: ~7 ms)
    check_output(args.out, directory=True)
    for path in plot_runs_together(args.runs, args.out, chunk_size=args.chunk_size,
                                   device=args.device, backend=args.backend):
        print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("drivaerml", help="full-surface DrivAerML: convert the files, "
                                              "train and plot error against cost (Figure 5)")
    actions = parser.add_subparsers(dest="drivaerml_command", metavar="ACTION", required=True)

    p = actions.add_parser("prepare", help="convert every .vtp of the split to the "
                                           "memory-mapped cache and compute the statistics")
    p.add_argument("--data", required=True, help="directory of run_<i>/boundary_<i>.vtp")
    p.add_argument("--split-file", help="JSON of run ids (default: the paper's split)")
    p.add_argument("--cache-dir", help="where converted arrays go (default DATA/.flarepp_cache)")
    p.add_argument("--test-split", choices=["test", "val"], default="test")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_prepare)

    p = actions.add_parser("pareto", help="train the depth x latent grid of FLARE, FLARE++ "
                                          "and AB-UPT and report error against cost")
    p.add_argument("preset", nargs="?", help="a surface preset (drivaerml-tiny, "
                   "drivaerml-b2-m64, ...); omit to continue the study in --out")
    p.add_argument("--out", required=True, help="the study's directory")
    p.add_argument("--data", help="dataset directory (default: the preset's data_root)")
    p.add_argument("--mixers", default="flare,flarepp,abupt",
                   help="comma-separated mixers (default flare,flarepp,abupt)")
    p.add_argument("--blocks", type=_ints, default=list(DRIVAERML_FULL.blocks),
                   help="depths B (default 2,4,8)")
    p.add_argument("--latents", type=_ints, default=list(DRIVAERML_FULL.latents),
                   help="latent budgets M of FLARE and FLARE++ (default 64,128,256)")
    p.add_argument("--anchors", type=int, default=DRIVAERML_FULL.abupt_anchors,
                   help="AB-UPT's anchors at every depth (default 512, Table 9)")
    p.add_argument("--seeds", type=_ints, default=[0], help="seeds (default 0)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override the preset for every run (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no per-run lines")
    p.set_defaults(func=_pareto)

    p = actions.add_parser("report", help="results.csv, report.md and fig5_cost_error.png "
                                          "of a study")
    p.add_argument("directory")
    p.set_defaults(func=_report)

    p = actions.add_parser("figures", help="Figures 13-14 with several runs' predictions of "
                                           "one car (the last run's median case)")
    p.add_argument("runs", nargs="+", metavar="RUN", help="finished surface run directories")
    p.add_argument("--out", required=True, help="directory for the PNGs")
    p.add_argument("--chunk-size", type=int, metavar="K",
                   help="stream a car predicted again K cells at a time")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--backend", choices=["auto", "vtk", "matplotlib"], default="auto",
                   help="renderer (auto: VTK off-screen where it works, else matplotlib)")
    p.set_defaults(func=_figures)
