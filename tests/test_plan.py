"""``flarepp sweep --plan FILE``: a plan file's checks (unknown keys, presets, data and
plug-ins refused by name before anything trains), the sweeps it stands for, and a plan of
two tiny studies run, rerun and reported end to end (its page built from the studies'
reports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flarepp.cli import main
from flarepp.experiments.plan import read_plan
from flarepp.experiments.studies import parse_axes, sweep_study

TINY = ["dataset_options.n_train=8", "dataset_options.n_test=2", "dataset_options.resolution=6",
        "model.dim=8", "model.heads=2", "model.blocks=1", "model.latents=4", "batch_size=4",
        "pct_start=0.3", "device=cpu"]


def _plan(tmp_path: Path, **changes) -> Path:
    spec = {"out": str(tmp_path / "studies"), "data_dir": str(tmp_path / "data"),
            "page": "page.md", "head": "head.md", "figures": "figures",
            "data": {f"d{s}": {"dataset": "darcy", "train": 8, "test": 2, "seed": s,
                               "resolution": 6} for s in (0, 1)},
            "studies": [
                {"name": "mixers", "title": "Two mixers", "preset": "darcy-tiny",
                 "grid": ["model.mixer=flare,flarepp"], "data": ["d0", "d1"],
                 "sets": [*TINY, "epochs=1"], "sections": ["paired"]},
                {"name": "length", "title": "Two lengths", "preset": "darcy-tiny",
                 "grid": ["epochs=1,2", "model.mixer=flare,flarepp"], "data": "d0",
                 "sets": TINY, "sections": ["length"], "caveat": "Tiny."}]}
    for key, value in changes.items():
        target, _, name = key.rpartition("__")
        where = spec if not target else spec["studies"][int(target[-1])] \
            if target.startswith("study") else spec["data"][target]
        if value is None:
            del where[name]
        else:
            where[name] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(spec))
    (tmp_path / "head.md").write_text("# A page\n\nOf two studies.\n")
    return path


@pytest.mark.parametrize("changes, message", [
    ({"workers": 2}, r"unknown key\(s\) 'workers'"),
    ({"study0__seeds": 3}, r"study 'mixers': unknown key\(s\) 'seeds'"),
    ({"d1__sed": 1}, r"data 'd1': unknown key\(s\) 'sed'"),
    ({"study1__preset": "darcy-tinny"}, r"study 'length': unknown preset 'darcy-tinny'"),
    ({"study0__preset": None}, r"study 'mixers': give its 'preset'"),
    ({"study1__data": "d7"}, r"study 'length': data 'd7' is not in the plan's 'data' "
                             r"\(it holds: d0, d1\)"),
    ({"study0__sections": ["pairs"]}, r"study 'mixers': sections: unknown report 'pairs'"),
    ({"d0__dataset": "darcyy"}, r"data 'd0': unknown generator 'darcyy'"),
    ({"d0__train": None}, r"data 'd0': give train"),
    ({"study1__name": "mixers"}, r"study name\(s\) 'mixers' given twice"),
    ({"study0__grid": ["seed"]}, r"study 'mixers': --grid expects KEY=V1,V2"),
    ({"study0__name": "../up"}, r"a name is one directory name"),
])
def test_a_plan_names_what_it_cannot_read(tmp_path, changes, message):
    """Each mistake is refused when the plan is read, in one sentence naming the file, the
    study or draw, and the key or name at fault. A failure means a typo trains the wrong
    thing or fails hours later."""
    path = _plan(tmp_path, **changes)
    with pytest.raises(ValueError, match=message) as err:
        read_plan(path)
    assert str(path) in str(err.value)
    assert main(["sweep", "--plan", str(path)]) == 2   # a usage error, nothing made
    assert not (tmp_path / "data").exists() and not (tmp_path / "studies").exists()


def test_a_plan_study_is_the_sweep_its_command_says(tmp_path):
    """A study's ``data`` list becomes the grid's last axis (``data_root``), one name its
    ``--data``; the config is checked before anything runs (a bad --set item names the
    study); ``--only`` refuses an unknown study, ``--set`` anything but a runtime field. A
    failure means the plan runs another study than the page says, or the results page's
    studies would not be joined."""
    plan = read_plan(_plan(tmp_path))
    mixers, length = plan.studies
    data = tmp_path / "data"
    assert mixers.command(plan, "DATA", "STUDIES") == (
        "flarepp sweep darcy-tiny --out STUDIES/mixers --quiet --grid "
        "model.mixer=flare,flarepp data_root=DATA/d0,DATA/d1 " + " ".join(
            f"--set {s}" for s in [*TINY, "epochs=1"]))
    expected = sweep_study("darcy-tiny", parse_axes(
        ["model.mixer=flare,flarepp", f"data_root={data / 'd0'},{data / 'd1'}"]),
        sets=[*TINY, "epochs=1"])
    assert mixers.study(plan, data).identity() == expected.identity()
    single = length.study(plan, data)
    assert {p.config.data_root for p in single.points} == {str(data / "d0")}
    assert "--data DATA/d0 --grid epochs=1,2" in length.command(plan, "DATA", "STUDIES")
    bad = read_plan(_plan(tmp_path, study1__sets=["model.latnts=4"]))
    with pytest.raises(ValueError, match="study 'length': .*latnts"):
        bad.studies[1].study(bad, data)
    with pytest.raises(ValueError, match="no study 'lenght'"):
        plan.select(["lenght"])
    # a process's --set may change only how it runs: refused before any data is made
    assert main(["sweep", "--plan", str(plan.path), "--set", "lr=1"]) == 2
    assert not data.exists()


@pytest.mark.slow  # 411 configs checked
def test_the_results_plan_reads_and_asks_for_its_studies():
    """docs/results/plan.json reads and names the studies of docs/results.md with the
    commands the page shows. A failure means the page and its plan disagree."""
    root = Path(__file__).resolve().parents[1]
    plan = read_plan(root / "docs" / "results" / "plan.json")
    page = (root / "docs" / "results.md").read_text()
    for entry in plan.studies:
        assert f"## {entry.title}" in page
        assert f"`{entry.command(plan, 'DATA', 'STUDIES')}`" in page
        entry.study(plan, plan.data_dir)   # every config checks


@pytest.mark.slow
def test_a_plan_of_two_studies_runs_reruns_and_reports(tmp_path, capsys):
    """``flarepp sweep --plan FILE`` makes the two missing data draws and trains both
    studies through the one engine; run again it trains nothing; ``sweep report --plan``
    writes each study's report and the page: the head, each study's heading, command,
    counts and caveat, its plug-ins' sections with the figure copied beside the page. A
    failure points to the plan loop, the data making or the page."""
    path = _plan(tmp_path)
    assert main(["sweep", "--plan", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.count("this process: 4 finished") == 2   # 2 mixers x 2 draws, 2 x 2 lengths
    studies, data = tmp_path / "studies", tmp_path / "data"
    assert sorted(p.name for p in data.iterdir()) == ["d0", "d1"]   # no temporary left
    assert len(list(studies.glob("*/runs/*/metrics.json"))) == 8
    assert main(["sweep", "--plan", str(path), "--quiet", "--only", "length"]) == 0
    assert "this process: 0 finished" in (rerun := capsys.readouterr().out)
    assert "4 already done" in rerun and "mixers" not in rerun
    assert main(["sweep", "report", "--plan", str(path)]) == 0
    assert (studies / "mixers" / "report.md").is_file()
    assert (studies / "length" / "results.csv").is_file()
    page = (tmp_path / "page.md").read_text()
    assert page.startswith("# A page\n\nOf two studies.\n\n## Two mixers\n")
    assert "`flarepp sweep darcy-tiny --out STUDIES/mixers --quiet --grid" in page
    assert page.count("4 of 4 runs done, 0 failed, 0 pending") == 2 and "*Tiny.*" in page
    assert "### Mixers compared, paired by seed and data draw" in page
    assert "### The metric against training length" in page
    assert "](figures/length_length.png)" in page
    assert (tmp_path / "figures" / "length_length.png").stat().st_size > 0


def test_a_draw_made_by_two_processes_at_once_is_whole_and_kept_once(tmp_path, monkeypatch):
    """A draw is generated into a temporary sibling and renamed into place: when another
    process put the draw there meanwhile, this one's copy is removed and the first kept; a
    draw that exists is never regenerated; a missing 'path' draw is an error naming it. A
    failure means a worker could read half-written data or two copies could mix."""
    from flarepp.data.generators import GENERATORS
    from flarepp.experiments.plan import DataDraw
    from flarepp.registry import Entry
    calls = []

    def generate(out, **options):      # writes its files, while "another process" wins
        calls.append(options)
        Path(out).mkdir(parents=True)
        (Path(out) / "mine.txt").write_text("late copy")
        (tmp_path / "d0").mkdir(exist_ok=True)
        (tmp_path / "d0" / "theirs.txt").write_text("first copy")
        return [Path(out) / "mine.txt"]
    monkeypatch.setitem(GENERATORS._entries, "darcy", Entry("darcy", generate,
                                                           {"resolution": 85}))
    draw = DataDraw("d0", "darcy", train=8, test=2, seed=3)
    assert draw.make(tmp_path, log=lambda _: None) == tmp_path / "d0"
    assert [p.name for p in tmp_path.iterdir()] == ["d0"]           # no temporary left
    assert [p.name for p in (tmp_path / "d0").iterdir()] == ["theirs.txt"]
    assert calls == [dict(n_train=8, n_test=2, resolution=85, seed=3, progress=False,
                          overwrite=False)]
    draw.make(tmp_path, log=lambda _: None)
    assert len(calls) == 1                                           # there: not made again
    with pytest.raises(FileNotFoundError, match="data 'real': .*nowhere"):
        DataDraw("real", path=str(tmp_path / "nowhere")).make(tmp_path)
