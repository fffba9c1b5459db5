"""The tracking options that ``train`` and ``sweep`` share (:mod:`flarepp.train.tracking`)."""

from __future__ import annotations

import argparse

from flarepp.cli import CLIError
from flarepp.train.tracking import TRACKERS, TrackSettings


def add_tracking_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--track", choices=TRACKERS.names(),
                   help="also log config, per-epoch and final metrics and figures to MLflow "
                        "or TensorBoard (extra: pip install 'flarepp[track]'); this "
                        "process's runs only, not part of their identity")
    p.add_argument("--track-uri", metavar="URI",
                   help="MLflow tracking URI (e.g. sqlite:///mlflow.db, http://host:5000; "
                        "default MLflow's own) or TensorBoard log directory (default: "
                        "RUN/tensorboard, STUDY/tensorboard/POINT)")
    p.add_argument("--track-experiment", metavar="NAME",
                   help="MLflow experiment (default: the study directory's name; flarepp "
                        "for a single run)")


def track_settings(args: argparse.Namespace):
    """The :class:`~flarepp.train.tracking.TrackSettings` the options ask for, or None."""
    if args.track is None:
        if args.track_uri or args.track_experiment:
            raise CLIError("--track-uri and --track-experiment need --track mlflow|tensorboard")
        return None
    if args.track_experiment and args.track != "mlflow":
        raise CLIError("--track-experiment names an MLflow experiment: it needs --track mlflow")
    return TrackSettings(args.track, args.track_uri, args.track_experiment)
