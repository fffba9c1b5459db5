"""Experiment tracking: a run's config, per-epoch and final metrics and figures sent to
MLflow or TensorBoard, as trainer callbacks (:mod:`flarepp.train.callbacks`).

What a tracker logs, on the writer rank alone:

* at the start, the run's config as parameters: every field of its identity (runtime
  fields aside), nested keys joined by dots (``model.latents``), values as JSON text;
* after every epoch, every number of its ``log.jsonl`` line (``train_loss``, ``lr``,
  ``seconds``, ``test_rel_l2``, ``test_rel_l2_raw``, ...) with the epoch as the step;
* at the end, every number of ``metrics.json`` as ``final/<key>`` (step: the epochs trained),
  and the run's figures (MLflow: artifacts under ``figures/``, beside ``metrics.json`` and
  ``config.json``; TensorBoard: images);
* a run that ends without metrics says how (MLflow: status ``KILLED`` for a pruned or
  interrupted run, ``FAILED`` for an exception, tag ``flarepp.outcome``).

A run of a study is named after its point and grouped with the study's other runs: one
MLflow experiment per study (default: the study directory's name), one TensorBoard log
directory per study (``<study>/tensorboard/<point>``). A resumed run continues its MLflow
run (its id is kept in the run directory's ``tracking.json``) and its TensorBoard log
(events from the epochs redone are purged).

Tracking settings are runtime settings: they are not part of a run's identity, and each
process of a study chooses its own. A tracker that cannot be reached (a server that does not
answer, a store that cannot be opened or written) never stops training: the run says so
once, on stderr, and goes on without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flarepp.registry import Registry
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import RunDir
from flarepp.storage.studydir import StudyDir
from flarepp.train.callbacks import TrainerCallback

EXTRA = "track"
"""The optional extra that installs both trackers."""


def numbers(record: dict[str, Any], skip: tuple[str, ...] = ("epoch",)) -> dict[str, float]:
    """The real numbers of ``record`` (booleans, text, lists and ``skip`` left out)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in skip}


def config_params(config: RunConfig) -> dict[str, str]:
    """The run's identity as flat ``key -> text`` parameters (``model.latents`` -> ``32``)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("", config.identity())
    return out


class Tracker(TrainerCallback):
    """A tracker: the callback hooks with its backend's failures caught once.

    The first failure of the backend is said on stderr in one line, naming the tracker and
    where it logs, and the tracker stops (the run goes on without it)."""

    name = ""
    package = ""

    def __init__(self, where: str, run_name: str, tags: dict[str, str]) -> None:
        self.where, self.run_name, self.tags = where, run_name, dict(tags)
        self.failed: str | None = None

    def _call(self, what: str, step: Callable[..., None], *args: Any) -> None:
        if self.failed is not None:
            return
        try:
            step(*args)
        except Exception as err:  # any failure of the backend: said once, training goes on
            text = (str(err).strip().splitlines() or [""])[0][:300]
            self.failed = f"{type(err).__name__}: {text}"
            print(f"flarepp: {self.name} tracking ({self.where}) failed while {what} "
                  f"({self.failed}); training goes on without it", file=sys.stderr,
                  flush=True)

    def on_run_start(self, config: RunConfig, run_dir: Path, epoch: int) -> None:
        self._call("starting the run", self.start, config, Path(run_dir), epoch)

    def on_epoch_end(self, epoch: int, record: dict[str, Any]) -> None:
        self._call(f"logging epoch {epoch}", self.epoch, epoch, numbers(record))

    def on_run_end(self, metrics: dict[str, Any], figures: list[Path]) -> None:
        self._call("logging the final metrics", self.end, metrics, list(figures))

    def on_run_stopped(self, outcome: str) -> None:
        self._call(f"closing the {outcome} run", self.stopped, outcome)

    @classmethod
    def build(cls, settings: "TrackSettings", run_dir: Path, run_name: str,
              study: Path | None, tags: dict[str, str]) -> "Tracker":
        """The tracker of one run (``study``: the directory of the study it belongs to)."""
        raise NotImplementedError

    # the backend: each raises on failure
    def start(self, config: RunConfig, run_dir: Path, epoch: int) -> None:
        raise NotImplementedError

    def epoch(self, epoch: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def end(self, metrics: dict[str, Any], figures: list[Path]) -> None:
        raise NotImplementedError

    def stopped(self, outcome: str) -> None:
        raise NotImplementedError


TRACKERS: Registry[type[Tracker]] = Registry("tracker")


@TRACKERS.register("mlflow", doc="MLflow: a run per training run, an experiment per study")
class MLflowTracker(Tracker):
    """Logs through ``mlflow.MlflowClient`` to ``uri`` (None: MLflow's own default, the
    ``MLFLOW_TRACKING_URI`` environment variable or ``mlflow.db`` in the working directory);
    ``experiment`` groups the runs."""

    name, package = "mlflow", "mlflow"
    STATUS = {"pruned": "KILLED", "interrupted": "KILLED", "failed": "FAILED"}

    def __init__(self, uri: str | None, experiment: str, run_name: str,
                 tags: dict[str, str]) -> None:
        super().__init__(f"{uri or 'MLflow default URI'}, experiment {experiment!r}",
                         run_name, tags)
        self.uri, self.experiment = uri, experiment
        self.client: Any = None
        self.run_id: str | None = None
        self.run_dir: Path | None = None

    @classmethod
    def build(cls, settings: "TrackSettings", run_dir: Path, run_name: str,
              study: Path | None, tags: dict[str, str]) -> "MLflowTracker":
        experiment = settings.experiment or (study.name if study is not None else "flarepp")
        return cls(settings.uri, experiment, run_name, tags)

    def start(self, config: RunConfig, run_dir: Path, epoch: int) -> None:
        # A server that does not answer would otherwise be retried for minutes per call
        # (MLflow's defaults: 7 retries, 120 s timeout); the user's own settings win.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow import MlflowClient
        from mlflow.entities import Param
        self.client, self.run_dir = MlflowClient(self.uri), run_dir
        self.run_id = self._stored_run(run_dir) if epoch else None
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(self.experiment)
        if found is None:
            try:
                experiment_id = self.client.create_experiment(self.experiment)
            except Exception:  # another process created it meanwhile
                found = self.client.get_experiment_by_name(self.experiment)
                if found is None:
                    raise
                experiment_id = found.experiment_id
        else:
            experiment_id = found.experiment_id
        run = self.client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        params = [Param(k, v[:6000]) for k, v in config_params(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        RunDir(run_dir).write_tracking({"mlflow": {
            "uri": self.client.tracking_uri, "experiment": self.experiment,
            "run_id": self.run_id}})

    def _stored_run(self, run_dir: Path) -> str | None:
        """The MLflow run this run directory logged to before, if it is in the same store."""
        stored = RunDir(run_dir).read_tracking().get("mlflow", {})
        if stored.get("uri") != self.client.tracking_uri \
                or stored.get("experiment") != self.experiment:
            return None
        return stored.get("run_id")

    def _metrics(self, values: dict[str, float], step: int, prefix: str = "") -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(prefix + k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def epoch(self, epoch: int, values: dict[str, float]) -> None:
        self._metrics(values, epoch)

    def end(self, metrics: dict[str, Any], figures: list[Path]) -> None:
        from mlflow.entities import RunTag
        step = int(metrics.get("epochs", 0))
        self._metrics(numbers(metrics, skip=()), step, prefix="final/")
        text = {k: str(v) for k, v in metrics.items() if isinstance(v, str)}
        self.client.log_batch(self.run_id, tags=[RunTag(f"flarepp.{k}", v[:5000])
                                                 for k, v in text.items()])
        run = RunDir(self.run_dir)
        for path in (run.metrics_path, run.config_path):
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        for path in figures:
            self.client.log_artifact(self.run_id, str(path), artifact_path="figures")
        self.client.set_terminated(self.run_id, "FINISHED")

    def stopped(self, outcome: str) -> None:
        if self.run_id is None:
            return
        self.client.set_tag(self.run_id, "flarepp.outcome", outcome)
        self.client.set_terminated(self.run_id, self.STATUS[outcome])


@TRACKERS.register("tensorboard", doc="TensorBoard event files: a log directory per study")
class TensorBoardTracker(Tracker):
    """Writes TensorBoard event files into ``log_dir`` (``torch.utils.tensorboard``)."""

    name, package = "tensorboard", "tensorboard"

    def __init__(self, log_dir: Path, run_name: str, tags: dict[str, str]) -> None:
        super().__init__(str(log_dir), run_name, tags)
        self.log_dir = Path(log_dir)
        self.writer: Any = None

    @classmethod
    def build(cls, settings: "TrackSettings", run_dir: Path, run_name: str,
              study: Path | None, tags: dict[str, str]) -> "TensorBoardTracker":
        if settings.uri is not None:
            return cls(Path(settings.uri) / run_name, run_name, tags)
        return cls(StudyDir(study).tensorboard_path(run_name) if study is not None
                   else RunDir(run_dir).tensorboard_dir, run_name, tags)

    def start(self, config: RunConfig, run_dir: Path, epoch: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        # a resumed run redoes the epochs after its checkpoint: their old events are purged
        self.writer = SummaryWriter(str(self.log_dir), purge_step=epoch + 1 if epoch else None)
        if not epoch:
            text = json.dumps({"tags": self.tags, "config": config_params(config)}, indent=1)
            self.writer.add_text("config", f"```\n{text}\n```", 0)

    def epoch(self, epoch: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, epoch)
        self.writer.flush()

    def end(self, metrics: dict[str, Any], figures: list[Path]) -> None:
        import numpy as np
        from PIL import Image
        step = int(metrics.get("epochs", 0))
        for key, value in numbers(metrics, skip=()).items():
            self.writer.add_scalar(f"final/{key}", value, step)
        for path in figures:
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB"))
            self.writer.add_image(f"figures/{path.stem}", pixels, step, dataformats="HWC")
        self.writer.close()

    def stopped(self, outcome: str) -> None:
        if self.writer is not None:
            self.writer.add_text("outcome", outcome)
            self.writer.close()


@dataclass(frozen=True)
class TrackSettings:
    """Where this process's runs are tracked (runtime, never part of a run's identity).

    ``backend``: a name of :data:`TRACKERS`; ``uri``: MLflow's tracking URI (default
    MLflow's own) or TensorBoard's log root (default: ``<run>/tensorboard`` for one run,
    ``<study>/tensorboard/<point>`` for a study's); ``experiment``: the MLflow experiment
    (default ``flarepp`` for one run, the study directory's name for a study's)."""

    backend: str
    uri: str | None = None
    experiment: str | None = None

    def __post_init__(self) -> None:
        kind = TRACKERS.get(self.backend)
        if importlib.util.find_spec(kind.package) is None:
            raise ValueError(f"--track {self.backend} needs the {kind.package} package, "
                             f"which is not installed: pip install 'flarepp[{EXTRA}]'")

    def callbacks(self, run_dir: str | Path, run_name: str, *,
                  study: str | Path | None = None) -> list[TrainerCallback]:
        """The tracker of the run in ``run_dir``, named ``run_name`` (a study's point when
        ``study`` is its directory)."""
        run_dir = Path(run_dir).resolve()
        tags = {"flarepp.run_dir": str(run_dir)}
        if study is not None:
            study = Path(study).resolve()
            tags.update({"flarepp.study": str(study), "flarepp.point": run_name})
        return [TRACKERS.get(self.backend).build(self, run_dir, run_name, study, tags)]


__all__ = ["EXTRA", "MLflowTracker", "TRACKERS", "TensorBoardTracker",
           "TrackSettings", "Tracker", "config_params", "numbers"]
