"""``flarepp sweep``: a grid of runs over config keys, and ``flarepp sweep report DIR``.

Every experiment command (``sweep``, ``compare``, ``lra compare``, ``drivaerml pareto``)
builds a study and hands it to :func:`execute`; ``flarepp sweep --out DIR`` continues any
of them, ``flarepp sweep report DIR`` reports on any of them. ``--search optuna`` samples
the ``--grid`` space adaptively instead (:mod:`flarepp.experiments.search`). ``flarepp sweep
--plan FILE`` runs (or joins) every study of a plan file in turn
(:mod:`flarepp.experiments.plan`), ``flarepp sweep report --plan FILE`` writes their reports
and the plan's page. ``--launcher local|slurm`` starts workers for a grid
(:mod:`flarepp.cli.launcher`). ``flarepp sweep report DIR --pair KEY[=A,B]`` has the paired
comparison compare another axis than the mixers, ``--against OTHER`` the runs of two
studies (:mod:`flarepp.experiments.reports.stats`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flarepp.cli import CLIError, add_threads_argument, at_least
from flarepp.cli.launcher import add_launcher_options, claim_grace, launch_spec, run_launched
from flarepp.cli.tracking import add_tracking_arguments, track_settings
from flarepp.experiments import engine, plan, reports, search
from flarepp.experiments.studies import parse_axes, sweep_study
from flarepp.locks import GRACE_S
from flarepp.storage.studydir import StudyDir


def execute(study, out: str | Path, *, quiet: bool = False, runtime: list[str] | None = None,
            report: bool = True, track=None, trials: int | None = None,
            claim_grace_s: float | None = None) -> int:
    """Create (or join) ``study`` in ``out`` -- a study's points or a point source (a
    search's :class:`~flarepp.experiments.search.SearchSource`); ``None``: what continues
    the study already there, with ``trials`` for a search -- work on it through the one
    loop (:func:`~flarepp.experiments.engine.run_study`), print what this process did and
    write the report. Exit status 1 when a point was left for a rerun by an error, 0
    otherwise (a diverged point is a result)."""
    source = search.study_source(out, trials) if study is None else study
    log = (lambda _: None) if quiet else print
    try:
        done = engine.run_study(source, out, runtime=runtime, track=track, log=log,
                                claim_grace_s=claim_grace_s or GRACE_S)
    except engine.StudyInterrupted as err:
        print(f"flarepp: {err}", file=sys.stderr)
        return err.exit_code
    print(f"this process: {len(done['finished'])} finished, {len(done['pruned'])} pruned, "
          f"{len(done['failed'])} failed (final), {len(done['error'])} left for a rerun by an "
          f"error, {len(done['skipped'])} held by other processes, {len(done['reused'])} "
          "already done")
    if done["error"]:
        print(f"points left by an error (see {StudyDir(out).events_dir}): "
              f"{', '.join(done['error'])}; fix the cause and run "
              f"`{engine.continue_command(out)}`", file=sys.stderr)
    if report:
        print("\n".join(str(p) for p in reports.write_report(out).values()))
    return 1 if done["error"] else 0


def _plan(args: argparse.Namespace) -> int:
    """``--plan FILE``: every study of the plan in turn, each created or joined, or (``report``)
    their reports and the plan's page."""
    if args.grid or args.directory or args.preset not in (None, "report"):
        raise CLIError("--plan FILE names the studies: give no PRESET, DIR or --grid")
    chosen_plan = plan.read_plan(args.plan)
    out, data = Path(args.out or chosen_plan.out), args.data or chosen_plan.data_dir
    chosen = chosen_plan.select(args.only)
    if args.preset == "report":
        for entry in chosen:
            if StudyDir(out / entry.name).has_study():
                print("\n".join(str(p) for p in reports.write_report(out / entry.name).values()))
        if chosen_plan.page and args.only is None:
            print(plan.write_page(chosen_plan, out))
        return 0
    engine.check_runtime(args.set)
    grace = claim_grace(args)
    studies = [(entry, entry.study(chosen_plan, data)) for entry in chosen]  # all checked first
    status = 0
    for entry, study in studies:
        for name in entry.draws():
            chosen_plan.data[name].make(data)
        print(f"{entry.name}: {entry.command(chosen_plan, data, out)}", flush=True)
        code = execute(study, out / entry.name, quiet=args.quiet, runtime=args.set or [],
                       report=args.report, track=track_settings(args),
                       claim_grace_s=grace)
        if code > 1:  # interrupted: the rest waits for the rerun
            return code
        status = max(status, code)
    return status


def _pair(text: str | None) -> tuple[str, list[str] | None] | None:
    """``--pair KEY`` or ``KEY=A,B``: the axis the ``paired`` plug-in compares (A first)."""
    if text is None:
        return None
    key, sep, values = text.partition("=")
    arms = [v.strip() for v in values.split(",")] if sep else None
    if not key.strip() or (arms is not None and (len(arms) < 2 or not all(arms))):
        raise CLIError(f"--pair expects KEY or KEY=A,B (two values or more), got {text!r}")
    return key.strip(), arms


def _report(args: argparse.Namespace) -> int:
    """``flarepp sweep report DIR [--pair KEY[=A,B]] [--against OTHER]``."""
    if not args.directory:
        raise CLIError("usage: flarepp sweep report DIR")
    pair = _pair(args.pair)
    if args.against:
        rep = reports.paired_against(args.directory, args.against, pair)
        if "paired" not in rep.paths:
            raise CLIError(f"--against: {args.directory} and {args.against} share no "
                           "(setting, seed, data draw) to compare")
        print("\n".join(rep.lines + ["", str(rep.paths["paired"])]))
        return 0
    options = {"pair": pair} if pair else {}
    print("\n".join(str(p) for p in reports.write_report(args.directory, options).values()))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    if args.plan:
        return _plan(args)
    if args.only:
        raise CLIError("--only names studies of a --plan FILE")
    if args.preset == "report":
        return _report(args)
    if args.pair or args.against:
        raise CLIError("--pair and --against ask `flarepp sweep report DIR` for a comparison")
    if args.directory:
        raise CLIError(f"unexpected argument {args.directory!r} (a sweep takes PRESET "
                       "--grid ... --out DIR; a report: flarepp sweep report DIR)")
    if args.out is None:
        raise CLIError("give --out DIR (the sweep's directory)")
    axes = parse_axes(args.grid or [])
    searching = {k: v for k, v in dict(sampler=args.sampler, pruner=args.pruner,
                                       startup_trials=args.startup_trials).items()
                 if v is not None}
    track = track_settings(args)
    study, runtime = None, args.set or []  # continuing: --set may only change how it runs
    if args.preset is None and not any(k == "preset" for k, _ in axes):
        if args.grid or args.data or searching:
            raise CLIError("--grid, --data, --sampler, --pruner and --startup-trials "
                           "describe a new study: give its PRESET")
    elif not args.search:
        if args.trials or searching:
            raise CLIError("--trials, --sampler, --pruner and --startup-trials need "
                           "--search optuna")
        study, runtime = sweep_study(args.preset or dict(axes)["preset"][0], axes,
                                     sets=args.set or [], data=args.data), []
    elif args.preset is None or args.trials is None:
        raise CLIError("--search optuna needs a PRESET (fixed: a search does not vary it) "
                       "and --trials K (the trials of the study)")
    else:
        spec = search.search_spec(args.preset, axes, sets=args.set or [], data=args.data,
                                  **searching)
        study, runtime = search.SearchSource(spec, args.trials), []
    launch = launch_spec(args, runtime)
    if launch is not None:
        if args.search or args.trials:
            raise CLIError("--launcher starts the workers of a grid; a search's workers are "
                           "several `flarepp sweep --out DIR` processes (each asks Optuna "
                           "for its next trial)")
        return run_launched(study, args.out, launch, wait=args.wait, report=args.report,
                            track=track)
    return execute(study, args.out, quiet=args.quiet, runtime=runtime, report=args.report,
                   track=track, trials=args.trials, claim_grace_s=args.claim_grace)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="train a grid of runs over config keys (resumable, "
                                     "shareable by several processes); `sweep --out DIR` "
                                     "continues any study, `sweep report DIR` reports on it")
    p.add_argument("preset", nargs="?", metavar="PRESET|report",
                   help="the base preset (omit to continue the study in --out), or `report`")
    p.add_argument("directory", nargs="?", metavar="DIR", help="the study to report on")
    p.add_argument("--grid", nargs="+", metavar="KEY=V1,V2",
                   help="axes of the grid, e.g. model.mixer=flare,flarepp model.blocks=2,4 "
                        "seed=0,1,2 precision=fp32,fp16 data_root=A,B (any --set key) or "
                        "preset=P1,P2; with --search also ranges: lr=1e-4:1e-2:log, "
                        "pct_start=0.1:0.3, model.latents=16..64")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override the preset for every point (repeatable); when continuing "
                        "a study or with --plan, runtime fields only (device=cpu)")
    p.add_argument("--data", help="dataset directory (default: the preset's data_root); with "
                                  "--plan, the folder of its data draws")
    p.add_argument("--out", help="the study's directory (one run directory per point); with "
                                 "--plan, the folder of its studies")
    p.add_argument("--plan", metavar="FILE", help="a plan file (JSON): run or join each of "
                                                  "its studies in turn; `sweep report --plan "
                                                  "FILE` writes their reports and its page")
    p.add_argument("--only", nargs="+", metavar="STUDY", help="with --plan: these studies")
    p.add_argument("--report", action="store_true",
                   help="write the report when this process is done")
    p.add_argument("--quiet", action="store_true", help="no per-point lines")
    for option, metavar, text in (
            ("--pair", "KEY[=A,B]", "the axis the paired comparison compares (default the "
             "mixers; e.g. preset, model for wirings, KEY=A,B for two values, A the "
             "reference), runs paired by seed and data draw"),
            ("--against", "OTHER", "the paired comparison of DIR's runs against those of the "
             "study OTHER (e.g. the same sweep by earlier code), printed")):
        p.add_argument(option, metavar=metavar, help=f"with report: {text}")
    p.add_argument("--search", choices=["optuna"],
                   help="sample the --grid space adaptively (Optuna; pip install "
                        "'flarepp[search]'): each trial is a point of the study")
    p.add_argument("--trials", type=at_least(1), metavar="K",
                   help="with --search: the study's number of trials (shared by workers)")
    p.add_argument("--sampler", choices=search.SAMPLERS.names(), help="with --search (default tpe)")
    p.add_argument("--pruner", choices=search.PRUNERS.names(),
                   help="with --search: stop trials early on the validation metric "
                        "(default median)")
    p.add_argument("--startup-trials", type=at_least(0), metavar="N",
                   help="with --search: TPE draws the first N trials at random, and "
                        "nothing is pruned before N have completed (default 5)")
    add_tracking_arguments(p)
    add_launcher_options(p)
    add_threads_argument(p)
    p.set_defaults(func=_sweep)
