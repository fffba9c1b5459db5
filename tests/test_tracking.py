"""The trainer's callbacks and the trackers built on them (``--track mlflow|tensorboard``):
what a callback sees of a run, how a pruned run ends, and that what reaches MLflow's store
and TensorBoard's event files is what the run's own ``log.jsonl`` and ``metrics.json`` hold,
read back through each tool's own reader."""

import json
import socket
from pathlib import Path

import pytest

from flarepp.cli import main
from flarepp.io import read_json_lines
from flarepp.train import Trainer, get_preset
from flarepp.train.callbacks import Callbacks, TrainerCallback, TrainingPruned

TINY = ["epochs=3", "checkpoint_every=1", "batch_size=4", "model.dim=8", "model.heads=2",
        "model.blocks=1", "model.latents=4",
        "dataset_options={'resolution': 15, 'n_train': 12, 'n_test': 4}"]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """One local SQLite store for the module's MLflow tests (creating one takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _sets(items):
    return [a for s in items for a in ("--set", s)]


def _numbers(record):
    return {k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "epoch"}


class Recorder(TrainerCallback):
    """Records every hook call; stops the run after ``stop_at`` epochs when given."""

    def __init__(self, stop_at=None, splits=()):
        self.calls, self.stop_at, self.splits = [], stop_at, tuple(splits)

    def on_run_start(self, config, run_dir, epoch):
        self.calls.append(("start", epoch))

    def on_epoch_end(self, epoch, record):
        self.calls.append(("epoch", dict(record)))
        return "too slow" if epoch == self.stop_at else None

    def on_run_end(self, metrics, figures):
        self.calls.append(("end", metrics, figures))

    def on_run_stopped(self, outcome):
        self.calls.append(("stopped", outcome))


def test_callbacks_run_on_the_writer_rank_only():
    """A rank that does not write calls no hook but still evaluates the splits the hooks
    ask for (evaluation is collective). A failure means a tracker would log once per rank,
    or ranks would disagree on what to evaluate and hang."""
    hook = Recorder(splits=("val",))
    other = Callbacks([hook], is_writer=False)
    other.run_start(None, Path("."), 0)
    assert other.epoch_end(1, {}) is None and hook.calls == [] and other.splits == ("val",)
    writer = Callbacks([hook, Recorder(stop_at=1)], is_writer=True)
    assert writer.epoch_end(1, {"epoch": 1}) == "too slow" and len(hook.calls) == 1


@pytest.mark.slow
def test_a_callback_sees_every_epoch_and_a_pruned_run_ends_checkpointed(darcy_dir, tmp_path):
    """A callback gets each epoch's log.jsonl line (with the validation split it asked for),
    then stops the run after epoch 2: the trainer writes that epoch's checkpoint, raises
    TrainingPruned, tells the hooks the run was pruned, writes no metrics.json, and the run
    resumes from the checkpoint to the end, where the hooks get metrics.json and the figures
    drawn. A failure means a pruned run is lost (no checkpoint) or mistaken for a finished
    one, or trackers log something other than the run's own log."""
    config = get_preset("darcy-tiny", [*TINY, "val_fraction=0.25", "checkpoint_every=5"])
    out = tmp_path / "run"
    hook = Recorder(stop_at=2, splits=("val",))
    trainer = Trainer(config, out, data_root=darcy_dir, progress=False, callbacks=[hook])
    with pytest.raises(TrainingPruned, match="too slow") as stopped:
        trainer.fit()
    assert stopped.value.epoch == 2 and stopped.value.checkpoint.is_file()
    assert not (out / "metrics.json").exists()
    records = [c[1] for c in hook.calls if c[0] == "epoch"]
    assert records == read_json_lines(out / "log.jsonl")
    assert all("val_rel_l2" in r and "test_rel_l2" in r for r in records)
    assert [c[0] for c in hook.calls] == ["start", "epoch", "epoch", "stopped"]
    assert hook.calls[-1] == ("stopped", "pruned")
    again = Recorder()
    metrics = Trainer(config, out, data_root=darcy_dir, progress=False, resume=True,
                      callbacks=[again], plot=True).fit()
    assert again.calls[0] == ("start", 2) and [c[0] for c in again.calls] == [
        "start", "epoch", "end"]
    _, ended, figures = again.calls[-1]
    assert ended == metrics == json.loads((out / "metrics.json").read_text())
    assert out / "curves.png" in figures and all(p.is_file() for p in figures)


@pytest.mark.slow
def test_mlflow_holds_what_the_run_logged_and_a_resumed_run_continues_it(darcy_dir, tmp_path,
                                                                          mlflow_uri):
    """`flarepp train --track mlflow` against a real local SQLite store: MLflow's own client
    reads back, for every number of log.jsonl, the history log.jsonl holds (epoch = step),
    even though the run was stopped after one epoch and resumed (one MLflow run, continued);
    the config as parameters, metrics.json's numbers as final/..., the figures and
    metrics.json as artifacts, status FINISHED. A failure means a tracker drops, repeats or
    renames what the run logged."""
    from mlflow import MlflowClient
    uri = mlflow_uri
    out = tmp_path / "run"
    command = ["train", "darcy-tiny", "--data", str(darcy_dir), "--out", str(out), "--quiet",
               *_sets(TINY), "--track", "mlflow", "--track-uri", uri]
    assert main([*command, "--stop-after", "1"]) == 0
    assert main([*command, "--resume"]) == 0
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("flarepp").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    log = read_json_lines(out / "log.jsonl")
    assert [r["epoch"] for r in log] == [1, 2, 3]
    for key in _numbers(log[0]):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                              key))
        assert history == [(r["epoch"], r[key]) for r in log], key
    metrics = json.loads((out / "metrics.json").read_text())
    assert run.data.metrics["final/test_rel_l2"] == metrics["test_rel_l2"]
    assert run.data.params["model.latents"] == "4" and run.data.params["lr"] == "0.003"
    assert "device" not in run.data.params  # runtime fields are not the run's identity
    figures = {a.path for a in client.list_artifacts(run.info.run_id, "figures")}
    assert "figures/curves.png" in figures
    assert "metrics.json" in {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.mark.slow
def test_a_sweep_groups_its_runs_in_one_mlflow_experiment(tmp_path, darcy_dir, mlflow_uri):
    """A 2-point sweep with --track mlflow: one experiment named after the study directory,
    one run per point named after it, each holding its own log.jsonl's test metric. A
    failure means a study's runs are scattered or mixed up."""
    from mlflow import MlflowClient
    uri = mlflow_uri
    out = tmp_path / "depth"
    assert main(["sweep", "darcy-tiny", "--data", str(darcy_dir), "--out", str(out),
                 "--quiet", *_sets([*TINY, "epochs=2"]), "--grid", "seed=0,1",
                 "--track", "mlflow", "--track-uri", uri]) == 0
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("depth").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["seed-0", "seed-1"]
    for run in runs:
        assert run.data.tags["flarepp.study"] == str(out.resolve())
        log = read_json_lines(out / "runs" / run.info.run_name / "log.jsonl")
        history = client.get_metric_history(run.info.run_id, "test_rel_l2")
        assert sorted((m.step, m.value) for m in history) == [(r["epoch"], r["test_rel_l2"])
                                                              for r in log]


@pytest.mark.slow
def test_tensorboard_event_files_hold_what_the_run_logged(darcy_dir, tmp_path):
    """`--track tensorboard`: TensorBoard's own EventAccumulator reads from RUN/tensorboard
    every number of log.jsonl per epoch, metrics.json's as final/..., and the figures as
    images. A failure means TensorBoard shows other numbers than the run's log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    assert main(["train", "darcy-tiny", "--data", str(darcy_dir), "--out", str(out),
                 "--quiet", *_sets(TINY), "--track", "tensorboard"]) == 0
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    log = read_json_lines(out / "log.jsonl")
    for key in _numbers(log[0]):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["epoch"], pytest.approx(r[key], rel=1e-6)) for r in log], key
    metrics = json.loads((out / "metrics.json").read_text())
    (final,) = events.Scalars("final/test_rel_l2")
    assert (final.step, final.value) == (3, pytest.approx(metrics["test_rel_l2"], rel=1e-6))
    assert "figures/curves" in events.Tags()["images"]


@pytest.mark.slow
def test_a_tracker_that_cannot_be_reached_is_said_once_and_training_goes_on(
        darcy_dir, tmp_path, monkeypatch, capsys):
    """An MLflow server that does not answer (a closed port on this machine): the run
    trains to the end, its files are all there, and stderr says once which tracker failed
    and that training goes on. A failure means tracking can stop or slow a run, or floods
    the log with one error per epoch."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    out = tmp_path / "run"
    assert main(["train", "darcy-tiny", "--data", str(darcy_dir), "--out", str(out),
                 "--quiet", *_sets(TINY), "--track", "mlflow", "--track-uri",
                 f"http://127.0.0.1:{port}"]) == 0
    assert (out / "metrics.json").is_file() and not (out / "tracking.json").exists()
    err = capsys.readouterr().err
    assert err.count("training goes on without it") == 1, err
    assert f"mlflow tracking (http://127.0.0.1:{port}" in err


def test_a_missing_tracker_names_its_extra(monkeypatch, capsys):
    """--track with the package missing is one sentence naming the extra to install (exit
    2); --track-uri without --track is refused. A failure means a user finds out at the end
    of a run, or from a traceback."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert main(["train", "darcy-tiny", "--track", "mlflow"]) == 2
    assert "pip install 'flarepp[track]'" in capsys.readouterr().err
    assert main(["train", "darcy-tiny", "--track-uri", "x"]) == 2
    assert "need --track" in capsys.readouterr().err
