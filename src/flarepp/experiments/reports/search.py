"""The ``search`` report plug-in: an adaptive search's trials
(:mod:`flarepp.experiments.search`), their states and values, and the best trial; the other
plug-ins read the trials' points as grid points."""

from __future__ import annotations

from typing import Any

from flarepp.experiments.reports.common import Report, fmt, markdown
from flarepp.experiments.search import OPTUNA_STUDY, SearchSpec, journal_storage, superseded
from flarepp.io import UnreadableFile
from flarepp.storage.studydir import StudyDir


def _value(value: Any) -> Any:
    return fmt(value) if isinstance(value, float) else value


def _note(trial: Any, retries: dict[int, Any]) -> str:
    attrs = trial.user_attrs
    if trial.number in retries:
        retry = retries[trial.number]
        return f"replaced by #{retry.number}: {retry.user_attrs.get('retry_why', '')}"
    if "retry_of" in attrs:
        return f"retry of #{attrs['retry_of']}"
    for key, text in (("duplicate", "values another worker was training"),
                      ("error", None), ("failed", None)):
        if key in attrs:
            return text or str(attrs[key])[:120].replace("|", "/")
    return ""


def search_report(rep: Report) -> None:
    """An adaptive search: every trial's state, point and value; the best trial."""
    info = rep.study.info.get("search")
    if not info:
        return
    spec = SearchSpec.from_dict(info)
    rep.lines += ["", "## Search (Optuna)", ""]
    try:
        import optuna
    except ImportError:
        rep.lines.append("Install the search extra (pip install 'flarepp[search]') to list "
                         "the trials.")
        return
    path = StudyDir(rep.out_dir).journal_path
    if not path.is_file():
        rep.lines.append(f"No trials recorded ({path.name} is missing).")
        return
    try:
        study = optuna.load_study(study_name=OPTUNA_STUDY, storage=journal_storage(path))
    except KeyError:  # Optuna reads a lone line that does not decode as one cut short
        raise UnreadableFile(f"{path}: holds no search (emptied or overwritten)") from None
    trials = study.get_trials(deepcopy=False)
    replaced = superseded(trials)
    retries = {int(t.user_attrs["retry_of"]): t for t in trials if "retry_of" in t.user_attrs}
    states = [t.state.name.lower() for t in trials if t.number not in replaced]
    counts = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states))
    keys = [k for k, _ in spec.space]
    rep.lines += [f"{len(states)} trials of {rep.study.info.get('trials')} ({counts}; "
                  f"{len(replaced)} more replaced by a retry). Objective: `{spec.metric}` "
                  f"({spec.direction}), sampler `{spec.sampler}`, pruner `{spec.pruner}` "
                  f"after {spec.startup_trials} startup trials; space: "
                  + ", ".join(f"`{k}` = {v}" for k, v in spec.space) + ".", ""]
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = None
    if done:
        best = study.best_trial
        by_point = {r.point: r for r in rep.rows}
        row = by_point.get(best.user_attrs.get("point"))
        test = f"; its test `{row.metric}` {fmt(row.value)}" if row is not None else ""
        rep.lines += [f"**Best trial: #{best.number}**, point `{best.user_attrs.get('point')}`"
                      f": `{spec.metric}` {fmt(best.value)}{test}.", ""]
    else:
        rep.lines += ["No trial has completed yet.", ""]
    body = []
    for t in trials:
        if t.state == optuna.trial.TrialState.WAITING:
            continue
        last = max(t.intermediate_values) if t.intermediate_values else "-"
        body.append([f"#{t.number}" + (" (best)" if best is not None and t.number ==
                                       best.number else ""),
                     t.state.name.lower(), t.user_attrs.get("point", "-"),
                     *[_value(t.params.get(k, "-")) for k in keys], fmt(t.value), last,
                     _note(t, retries)])
    rep.lines += markdown(["trial", "state", "point", *keys, spec.metric, "last epoch",
                           "note"], body)


__all__ = ["search_report"]
