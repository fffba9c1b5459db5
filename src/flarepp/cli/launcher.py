"""``flarepp sweep ... --launcher local|slurm``: the launcher options and what a launch says.

Not a command of its own: :mod:`flarepp.cli.sweep` adds these options and hands a launch
here (:mod:`flarepp.experiments.launch` starts the workers).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from flarepp.cli import CLIError, at_least
from flarepp.experiments.engine import continue_command
from flarepp.experiments import launch as launching
from flarepp.experiments.reports import write_report
from flarepp.experiments.studies import open_any_study
from flarepp.locks import GRACE_S

LAUNCH_OPTIONS = ("workers", "time", "partition", "account", "qos", "gpus_per_task",
                  "cpus_per_task", "sbatch", "wait")


def add_launcher_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workers started for the study (submitit; pip install "
                             "'flarepp[cluster]')")
    g.add_argument("--launcher", metavar="local|slurm",
                   help="start --workers processes that share the study: `local` on this "
                        "machine, `slurm` as one job array (requeued on preemption)")
    g.add_argument("--workers", type=at_least(1), help="how many workers (default 1)")
    g.add_argument("--time", type=at_least(1), metavar="MINUTES",
                   help="each job's time limit (required for slurm)")
    g.add_argument("--partition", help="SLURM partition")
    g.add_argument("--account", help="SLURM account")
    g.add_argument("--qos", help="SLURM quality of service")
    g.add_argument("--gpus-per-task", type=at_least(0), metavar="G",
                   help="GPUs of each worker (local: GPUs i*G..(i+1)*G-1 of worker i)")
    g.add_argument("--cpus-per-task", type=at_least(1), metavar="C",
                   help="SLURM cores of each worker, within which it times its threads "
                        "(local workers get an equal share of this machine's cores)")
    g.add_argument("--sbatch", action="append", metavar="KEY=VALUE",
                   help="another #SBATCH option, e.g. constraint=a100 (repeatable)")
    g.add_argument("--wait", action="store_true",
                   help="wait for slurm workers to end (local workers are always waited for)")
    g.add_argument("--claim-grace", type=float, metavar="SECONDS",
                   help="seconds without a heartbeat after which another host takes over a "
                        "point this process or its workers hold (default 300)")


def claim_grace(args: argparse.Namespace) -> float:
    """``--claim-grace`` (default 300 s), a finite number of seconds > 0."""
    grace = GRACE_S if args.claim_grace is None else args.claim_grace
    if not 0 < grace < math.inf:  # inf: the heartbeat's wait overflowed in its thread
        raise CLIError(f"--claim-grace must be a finite number of seconds > 0, got "
                       f"{args.claim_grace}")
    return grace


def launch_spec(args: argparse.Namespace, runtime: list[str]):
    """The :class:`~flarepp.experiments.launch.LaunchSpec` the options ask for (``runtime``:
    the workers' runtime ``--set`` items), or ``None`` without ``--launcher`` (then no
    launcher option may be given)."""
    grace = claim_grace(args)
    if args.launcher is None:
        given = [o for o in LAUNCH_OPTIONS if getattr(args, o) not in (None, False)]
        if given:
            raise CLIError(f"--{given[0].replace('_', '-')} describes launched workers: give "
                           "--launcher local|slurm")
        return None
    pairs = []
    for item in args.sbatch or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CLIError(f"--sbatch expects KEY=VALUE, got {item!r}")
        pairs.append((key.strip(), value))
    return launching.LaunchSpec(args.launcher, args.workers or 1, args.time, args.partition,
                      args.gpus_per_task or 0, args.cpus_per_task, args.account, args.qos,
                      tuple(pairs), grace, tuple(runtime))


def run_launched(study, out: str | Path, spec, *, wait: bool, report: bool,
                 track=None) -> int:
    """Launch ``spec``'s workers on ``study`` in ``out`` (``track``: where they track their
    runs); say what they did (exit 1 when a point is left pending or a worker died, 0
    otherwise)."""
    study = open_any_study(out) if study is None else study
    wait = wait or spec.launcher == "local"
    done = launching.launch(study, out, spec, wait=wait, track=track)
    if done.note:
        print(done.note, flush=True)
    if done.jobs:
        print(f"started {len(done.jobs)} {spec.launcher} worker(s): job(s) "
              f"{', '.join(str(j.job_id) for j in done.jobs)}; their logs are in "
              f"{done.folder}", flush=True)
    if done.states is None:
        print(f"`flarepp sweep report {out}` reports on the study as it goes")
        return 0
    states = done.states
    print(f"the study: {len(states['done'])} of {len(study.points)} points done, "
          f"{len(states['failed'])} failed (final), {len(states['pending'])} pending")
    for line in done.died or []:
        print(line, file=sys.stderr)
    if states["pending"]:
        print(f"points left pending: {', '.join(states['pending'])}; their state is kept: "
              f"launch again (or run `{continue_command(out)}`) to finish them",
              file=sys.stderr)
    if report:
        print("\n".join(str(p) for p in write_report(out).values()))
    return 1 if states["pending"] or done.died else 0
