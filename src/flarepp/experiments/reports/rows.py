"""A study's rows: one typed :class:`Row` per point, the one seed aggregation, the status
counts, and ``results.csv`` (written from the rows, read back into them).

:func:`collect` reads a study's directory into one :class:`Row` per point (its fields say
what each holds). A row's *columns* (:meth:`Row.columns`, the header and order of
``results.csv``) are its fields, the point's labels (axis values, model, dataset, seed...)
and the columns a plug-in adds (:attr:`Row.extra`, e.g. the cost plug-in's hours); a label
of the same name as a config fact (``mixer``, ``seed``, ...) is what that column shows,
while the measured fields (``status``, ``value``, ``epochs``, ...) are never shadowed by a
label. :meth:`Row.get` reads any column by name, which is how plug-ins group by labels.

:func:`aggregate` is the one seed aggregation: mean, sample standard deviation (ddof 1; NaN
for one run) and count per group of finished runs.
"""

from __future__ import annotations

import csv
import io
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from flarepp.experiments.engine import (DataFingerprints, PointState, Study, finite,
                                        point_state, read_events)
from flarepp.experiments.studies import open_any_study
from flarepp.storage.studydir import StudyDir
from flarepp.tasks import TASKS

STATUSES = ("done", "failed", "pruned", "pending")


@dataclass(kw_only=True)
class Row:
    """One point of a study as its reports see it.

    ``status``: ``done``, ``failed`` (numerically, or a finished run whose test value is
    not finite), ``pruned`` (stopped early by an adaptive search, final) or ``pending``;
    ``error``: why it failed, or the last error that left it
    pending. ``metric`` is the task's ``headline``; ``value`` its test value and
    ``train_value`` its train value where the task evaluates one, both of the weights named
    in ``weights``; ``value_raw`` and ``value_ema`` the test values of the raw and the EMA
    weights where the run stored them (a run written before both were stored reported only
    EMA); ``val_value``, ``val_value_raw``, ``val_value_ema`` the same on the validation
    split carved from the training data; ``train_constant`` the training metric of the best
    constant predictor where the task states it, and ``did_not_fit`` whether the run's own
    training metric is no better (:func:`did_not_fit`). ``mixer``, ``blocks``, ``latents``,
    ``precision``, ``seed`` and ``sdpa_scale`` are the config facts every table states;
    ``epochs`` those trained (else configured); ``labels`` the point's own; ``extra`` the
    columns plug-ins add."""

    point: str
    mixer: str
    blocks: int | None = None
    latents: int | None = None
    precision: str = "fp32"
    seed: int | None = None
    sdpa_scale: str = "-"
    labels: dict[str, Any] = field(default_factory=dict)
    status: str = "pending"
    error: str | None = None
    metric: str = ""
    lower_is_better: bool = True
    value: float | None = None
    train_value: float | None = None
    weights: str | None = None
    value_raw: float | None = None
    value_ema: float | None = None
    val_value: float | None = None
    val_value_raw: float | None = None
    val_value_ema: float | None = None
    train_constant: float | None = None
    params: int | None = None
    seconds: float | None = None
    device: str | None = None
    epochs: int | None = None
    did_not_fit: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def test_column(self) -> str:
        """The task's own name of ``value``: ``test_rel_l2``, ``test_accuracy``..."""
        return f"test_{self.metric}"

    def columns(self) -> dict[str, Any]:
        """The row as ``results.csv`` holds it: facts, labels, measured fields, plug-ins'."""
        out = {name: getattr(self, name) for name in _FACTS}
        out.update(self.labels)
        for name in _MEASURED:
            out[name] = getattr(self, name)
            if name == "train_value":
                out[self.test_column] = self.value
        out.update(self.extra)
        return out

    def get(self, key: str, default: Any = None) -> Any:
        """The column ``key`` (:meth:`columns`): a field, a label or a plug-in's column."""
        return self.columns().get(key, default)

    @classmethod
    def from_columns(cls, columns: Mapping[str, str], labels: dict[str, Any]) -> "Row":
        """The row a line of ``results.csv`` holds (its text ``columns``), with the point's
        ``labels`` (their types are the study's): the inverse of :meth:`columns`."""
        kinds = typing.get_type_hints(cls)
        fields = {name: _parse(columns.get(name, ""), kinds[name])
                  for name in (*_FACTS, *_MEASURED)}
        row = cls(**fields, labels=dict(labels))
        known = row.columns()  # an empty cell of another task's metric is no column of it
        row.extra = {k: _parse(v, Any) for k, v in columns.items() if k not in known and v}
        return row


# the fields in their columns' order: the config facts (a label may show instead), then,
# after the labels, what was measured
_FACTS = ("point", "mixer", "blocks", "latents", "precision", "seed", "sdpa_scale")
_MEASURED = ("status", "error", "metric", "lower_is_better", "value", "train_value",
             "weights", "value_raw", "value_ema", "val_value", "val_value_raw",
             "val_value_ema", "train_constant", "params", "seconds", "device", "epochs",
             "did_not_fit")


def _parse(text: str, kind: Any) -> Any:
    """A ``results.csv`` cell back into the type of its field (``Any``: a number where the
    text is one)."""
    if text == "":
        return None
    options = set(typing.get_args(kind)) - {type(None)} or {kind}
    if bool in options:
        return {"True": True, "False": False}[text]
    for number in (int, float):
        if number in options or kind is Any:
            try:
                return number(text)
            except ValueError:
                continue
    return text


def collect(out_dir: str | Path) -> tuple[Study, list[Row]]:
    """The study of ``out_dir`` and one :class:`Row` per point."""
    out_dir = Path(out_dir)
    study = open_any_study(out_dir)
    last_error: dict[str, str | None] = {}
    for e in read_events(out_dir):  # the newest error since the point last (re)started
        if e["event"] == "error":
            last_error[e["point"]] = e.get("error")
        elif e["event"] in ("start", "resume", "finish"):
            last_error[e["point"]] = None
    rows = []
    state_of = _checked_states(out_dir)
    for point in study.points:
        config = point.config
        task = TASKS.get(config.task)
        model = config.model_kwargs()
        state = state_of(point)
        metrics = state.metrics or {}
        weights = metrics.get("eval_weights", "ema" if metrics else None)
        test, val = f"test_{task.headline}", f"val_{task.headline}"
        row = Row(
            point=point.name, mixer=model.get("mixer", model.get("arch", "surrogate")),
            blocks=model.get("blocks"), latents=model.get("latents"),
            precision=config.precision, seed=config.seed, sdpa_scale=config.sdpa_scale_text(),
            labels=dict(point.labels), status=state.status,
            error=state.error or last_error.get(point.name), metric=task.headline,
            lower_is_better=task.lower_is_better, value=metrics.get(test),
            train_value=metrics.get(f"train_{task.headline}"), weights=weights,
            value_raw=metrics.get(f"{test}_raw"),
            value_ema=metrics.get(f"{test}_ema", metrics.get(test) if weights == "ema"
                                  else None),
            val_value=metrics.get(val), val_value_raw=metrics.get(f"{val}_raw"),
            val_value_ema=metrics.get(f"{val}_ema"),
            train_constant=metrics.get(f"train_constant_{task.headline}"),
            params=metrics.get("params"), seconds=metrics.get("seconds"),
            device=metrics.get("device"),
            epochs=metrics.get("epochs", config.epochs))  # trained, else configured
        if row.status == "done" and not finite(row.value):
            row.status, row.error = "failed", f"test {task.headline} is {row.value}"
        row.did_not_fit = did_not_fit(row)
        rows.append(row)
    return study, rows


def _checked_states(out_dir: Path):
    """A point's state with its run checked against the data at its path now, as the
    engine checks it: a run of data regenerated there since is pending (the next ``sweep
    --out`` trains it afresh), not a result. Data that cannot be read here (moved, on
    another machine) leaves each run's state as its files say."""
    fingerprints, unreadable = DataFingerprints(), set()

    def state(point) -> PointState:
        key = point.config.data_root
        if key not in unreadable:
            try:
                fingerprints(point.config)
            except Exception:  # noqa: BLE001 (any reader's error: the data is not here)
                unreadable.add(key)
        return point_state(out_dir, point, None if key in unreadable else fingerprints)
    return state


def did_not_fit(row: Row) -> bool | None:
    """Whether a finished run failed to fit its training data: its training metric
    (``train_value``) no better than the best constant predictor's (``train_constant``).
    None where either is unknown (a run still going, a task that states no constant)."""
    train, constant = row.train_value, row.train_constant
    if row.status != "done" or not (finite(train) and finite(constant)):
        return None
    return bool(train >= constant if row.lower_is_better else train <= constant)


def status_counts(rows: Sequence[Row]) -> dict[str, int]:
    """How many rows are ``done``, ``failed`` and ``pending``."""
    return {s: sum(r.status == s for r in rows) for s in STATUSES}


def training_hours(rows: Sequence[Row]) -> float:
    """The training time of the rows' runs added up (their ``seconds``), in hours."""
    return sum(r.seconds for r in rows if r.seconds) / 3600.0


# ---------------------------------------------------------------------------------------------
# the one aggregation


@dataclass
class Group:
    """Finished runs that share ``key``; statistics of one of their columns."""

    key: dict[str, Any]
    rows: list[Row] = field(default_factory=list)

    def stats(self, value: str = "value") -> tuple[float, float, int]:
        """``(mean, sample std, n)`` of column ``value`` over the group's runs (std NaN for
        one)."""
        arr = np.asarray([v for v in (r.get(value) for r in self.rows) if finite(v)], float)
        if not len(arr):
            return math.nan, math.nan, 0
        return (float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else math.nan,
                len(arr))


def aggregate(rows: Sequence[Row], keys: Sequence[str]) -> list[Group]:
    """The finished rows grouped by the columns ``keys``, in first-seen order: the one seed
    aggregation of every table and figure."""
    groups: dict[tuple, Group] = {}
    for r in rows:
        if r.status == "done":
            k = tuple(r.get(key) for key in keys)
            groups.setdefault(k, Group(dict(zip(keys, k)))).rows.append(r)
    return list(groups.values())


# ---------------------------------------------------------------------------------------------
# results.csv

RESULTS_NAME = StudyDir.RESULTS


def results_header(rows: Sequence[Row], label_keys: Sequence[str]) -> list[str]:
    """``results.csv``'s columns: the labels, each task's test metric, the facts every
    table states, then every other column in the rows' order (the plug-ins' last)."""
    metrics = [r.test_column for r in rows]
    return list(dict.fromkeys(
        [*label_keys, *metrics, "status", "error", "mixer", "blocks", "latents",
         "precision", "seed", "sdpa_scale", "metric", "value", "train_value", "params",
         "seconds", "epochs", "device", "point"] + [k for r in rows for k in r.columns()]))


def results_text(rows: Sequence[Row], label_keys: Sequence[str]) -> str:
    """``results.csv``: one line per row under :func:`results_header` (empty: None)."""
    header = results_header(rows, label_keys)
    return csv_text([header] + [["" if c.get(k) is None else c.get(k) for k in header]
                                for c in (r.columns() for r in rows)])


def read_results(out_dir: str | Path) -> list[Row]:
    """The rows of ``out_dir/results.csv`` (as the last report wrote them), with their
    labels from the study: what a reader needs without the run directories."""
    out_dir = Path(out_dir)
    labels = {p.name: p.labels for p in open_any_study(out_dir).points}
    with open(StudyDir(out_dir).results_path, newline="") as f:
        lines = list(csv.DictReader(f))
    return [Row.from_columns(line, labels[line["point"]]) for line in lines]


def csv_text(rows: list[list[Any]]) -> str:
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    return text.getvalue()


__all__ = ["Group", "RESULTS_NAME", "Row", "STATUSES", "aggregate", "collect", "csv_text",
           "did_not_fit", "read_results", "results_header", "results_text",
           "status_counts", "training_hours"]
