"""Leases that hold across hosts sharing a study directory (flarepp.storage.locks), the
per-process event files of a study, and a command line that starts where ``fcntl`` does not
exist. Two hosts are simulated on one machine by ``FLAREPP_HOST_ID``: a holder of another
host is judged by its heartbeat only, never by its pid."""

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from flarepp.cli import main
from flarepp.experiments.engine import create_study, events_file, read_events, run_study
from flarepp.experiments.studies import parse_axes, sweep_study
from flarepp.storage.locks import (HOST_ENV, Lease, LockHolder, LockUnavailable, RunLocked,
                                   process_start)

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["checkpoint_every=1", "model.dim=8", "model.heads=2", "model.latents=4",
        "model.blocks=1", "batch_size=4", "pct_start=0.3"]
NEVER_A_PID = 2 ** 30  # above any pid_max: no process ever has it


def _record(path: Path, holder: LockHolder, heartbeat_age_s: float) -> None:
    """A lease file as ``holder`` would have left it, its last heartbeat that long ago."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(holder.__dict__))
    then = time.time() - heartbeat_age_s
    os.utime(path, (then, then))


def _holder(host: str, pid: int = NEVER_A_PID, grace_s: float | None = 60.0) -> LockHolder:
    return LockHolder(pid, host, "earlier", "flarepp sweep", "0123abcd", None, grace_s)


def _npz(path: Path, n: int = 16) -> Path:
    rng = np.random.default_rng(0)
    x = rng.random((n, 40, 2)).astype(np.float32)
    np.savez(path, x=x, y=(np.sin(3 * x[..., :1]) + x[..., 1:] ** 2))
    return path


# ---------------------------------------------------------------------------------------------
# the lease


def test_a_lease_is_exclusive_names_its_holder_and_is_released(tmp_path):
    """A second taker is refused, naming the holder's pid and host; after release the file is
    gone and the lease free. A failure points to the exclusive create (O_EXCL) or release."""
    path = tmp_path / "claims" / "p" / ".lock"
    with Lease(path) as first:
        assert first.held and first.stale is None
        with pytest.raises(RunLocked, match=f"process {os.getpid()} on host .*alive on this host"):
            Lease(path).acquire()
    assert not path.exists()
    with Lease(path) as again:
        assert again.held


def test_a_dead_process_of_this_host_is_taken_over_at_once(tmp_path, monkeypatch):
    """A lease whose holder ran on this host and no longer exists is taken over at once,
    however fresh its heartbeat; so is one whose pid now belongs to a later process (its
    recorded start time differs). A failure points to the pid check."""
    monkeypatch.setenv(HOST_ENV, "here")
    path = tmp_path / ".lock"
    _record(path, _holder("here"), heartbeat_age_s=0)
    with Lease(path) as lease:
        assert lease.stale is not None and lease.stale.pid == NEVER_A_PID
    if process_start(os.getpid()) is not None:  # Linux: a reused pid is not its old holder
        reused = LockHolder(os.getpid(), "here", "earlier", "x", "t", "1", 60.0)
        _record(path, reused, heartbeat_age_s=0)
        with Lease(path) as lease:
            assert lease.stale == reused


def test_a_stale_heartbeat_of_a_live_process_on_this_host_is_not_taken_over(tmp_path,
                                                                            monkeypatch):
    """A holder alive on this host keeps its lease however old its heartbeat (a suspended or
    starved process is not dead). A failure points to judging this host's holders by time."""
    monkeypatch.setenv(HOST_ENV, "here")
    path = tmp_path / ".lock"
    alive = LockHolder(os.getpid(), "here", "earlier", "x", "t", process_start(os.getpid()), 1.0)
    _record(path, alive, heartbeat_age_s=3600)
    with pytest.raises(RunLocked, match="alive on this host"):
        Lease(path, grace_s=1.0).acquire()
    assert json.loads(path.read_text())["token"] == "t"


def test_another_hosts_lease_is_taken_over_only_after_its_grace_period(tmp_path, monkeypatch):
    """Another host's pid means nothing here: its lease is kept while its heartbeat is younger
    than the grace period the holder recorded, and taken over after it. A failure points to
    a pid checked on the wrong host or a grace period not honoured."""
    monkeypatch.setenv(HOST_ENV, "b")
    path = tmp_path / ".lock"
    _record(path, _holder("a", pid=os.getpid(), grace_s=60.0), heartbeat_age_s=50)
    with pytest.raises(RunLocked, match="last heartbeat 50 s ago; another host takes it over "
                                        "after 60 s"):
        Lease(path, grace_s=1.0).acquire()  # the holder's own grace counts, not the taker's
    _record(path, _holder("a", pid=os.getpid(), grace_s=60.0), heartbeat_age_s=70)
    with Lease(path) as lease:
        assert lease.stale.host == "a"
        assert LockHolder.parse(path.read_text()).host == "b"


@pytest.mark.slow
def test_a_live_holder_on_another_host_keeps_its_lease_by_its_heartbeat(tmp_path, monkeypatch):
    """Host a holds a lease with a 0.5 s grace period; three periods later host b still finds
    it held, because a's heartbeat thread keeps refreshing it. A failure points to the
    heartbeat (not refreshed, or refreshed on a replaced file)."""
    path = tmp_path / ".lock"
    monkeypatch.setenv(HOST_ENV, "a")
    with Lease(path, grace_s=0.5):
        monkeypatch.setenv(HOST_ENV, "b")
        time.sleep(1.5)
        with pytest.raises(RunLocked, match="on host 'a'.*last heartbeat 0 s ago"):
            Lease(path, grace_s=0.5).acquire()


def test_two_takers_of_one_gone_lease_cannot_both_win(tmp_path, monkeypatch):
    """Eight threads take over one lease of a lost host at the same instant: exactly one
    holds it afterwards, the others are refused naming it. A failure points to the takeover
    (a rename both takers believe they won)."""
    monkeypatch.setenv(HOST_ENV, "b")
    path = tmp_path / ".lock"
    for _ in range(5):
        _record(path, _holder("a"), heartbeat_age_s=3600)
        barrier, won, refused = threading.Barrier(8), [], []

        def take() -> None:
            lease = Lease(path, heartbeat=False)
            barrier.wait()
            try:
                won.append(lease.acquire())
            except RunLocked:
                refused.append(lease)

        threads = [threading.Thread(target=take) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(refused) == 7
        assert LockHolder.parse(path.read_text()).token == won[0].holder.token
        assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # no moved file left
        won[0].release()


def test_a_takeover_guard_left_by_a_dead_taker_does_not_block(tmp_path, monkeypatch):
    """A taker killed inside its takeover leaves ``.lock.takeover`` behind: the next taker
    removes it (its process is gone) and takes the gone lease over; a guard of a live taker
    from another host is left alone until it is ``TAKEOVER_STALE_S`` old. A failure points to
    a left guard that blocks every later takeover."""
    monkeypatch.setenv(HOST_ENV, "b")
    path = tmp_path / ".lock"
    guard = tmp_path / ".lock.takeover"
    _record(path, _holder("a"), heartbeat_age_s=3600)
    guard.write_text(json.dumps(_holder("b").__dict__))  # this host, its pid gone
    lease = Lease(path, heartbeat=False).acquire()
    assert lease.stale is not None and lease.stale.host == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
    lease.release()

    _record(path, _holder("a"), heartbeat_age_s=3600)
    guard.write_text(json.dumps(_holder("c").__dict__))  # another host: judged by its age
    monkeypatch.setattr("flarepp.locks.ACQUIRE_PATIENCE_S", 0.3)
    with pytest.raises(RunLocked, match="keeps being replaced"):
        Lease(path, heartbeat=False).acquire()
    then = time.time() - 3600
    os.utime(guard, (then, then))
    assert Lease(path, heartbeat=False).acquire().stale.host == "a"


def test_a_holder_whose_lease_was_taken_over_stops(tmp_path, monkeypatch):
    """When another process took the lease over (here: the file replaced by another host's),
    the holder's heartbeat finds a foreign token and calls on_lost instead of refreshing the
    taker's file; releasing then leaves the taker's file alone. A failure points to a holder
    that would go on writing after losing its lease."""
    path = tmp_path / ".lock"
    lost = threading.Event()
    reasons = []
    lease = Lease(path, grace_s=0.3, on_lost=lambda _, why: (reasons.append(why), lost.set()))
    lease.acquire()
    _record(path, _holder("elsewhere", grace_s=300.0), heartbeat_age_s=0)
    assert lost.wait(timeout=10), "the holder never noticed that its lease was taken over"
    assert "another process took it over" in reasons[0]
    lease.release()
    assert LockHolder.parse(path.read_text()).host == "elsewhere"


@pytest.mark.parametrize("code, said", [(errno.EROFS, "read-only"),
                                        (errno.EOPNOTSUPP, "not supported")])
def test_a_study_where_no_claim_can_be_made_is_a_sentence(tmp_path, monkeypatch, capsys,
                                                          code, said):
    """A study directory where an exclusive create fails (a read-only filesystem, one
    without O_EXCL) stops the sweep before anything is trained, with one sentence naming the
    lease file and the filesystems that work (exit 1). A failure points to an uncaught
    OSError or to a point trained without a claim."""
    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_EXCL and str(path).endswith(".lock"):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    out = tmp_path / "sw"
    argv = ["sweep", "npz", "--data", str(tmp_path / "d.npz"), "--out", str(out), "--grid",
            "seed=0,1", "--quiet"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("flarepp sweep: error: cannot take the lease") and said in err
    assert "exclusive create" in err and err.count("\n") == 1
    assert not (out / "runs").exists()
    with pytest.raises(LockUnavailable):
        Lease(tmp_path / "x" / ".lock").acquire()


# ---------------------------------------------------------------------------------------------
# claims of a study shared by two hosts


def test_a_live_workers_claim_on_this_host_is_not_taken_over_by_a_sweep(tmp_path, monkeypatch):
    """A point claimed by a live process of this host with a heartbeat an hour old is left
    to it by `run_study` (skipped, nothing trained), whatever the grace period."""
    out = tmp_path / "sw"
    study = sweep_study("npz", parse_axes(["seed=0"]), data=str(_npz(tmp_path / "d.npz")),
                        sets=TINY)
    create_study(out, study)
    me = LockHolder.this_process(grace_s=1.0)
    _record(out / "claims" / "seed-0" / ".lock", me, heartbeat_age_s=3600)
    done = run_study(study, out, claim_grace_s=1.0, log=lambda _: None)
    assert done["skipped"] == ["seed-0"] and not (out / "runs").exists()


def _sweep(env_host: str, out: Path, data: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", HOST_ENV: env_host,
           "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sets = [a for s in TINY for a in ("--set", s)]
    return subprocess.Popen([sys.executable, "-m", "flarepp", "sweep", "npz", "--data",
                             str(data), "--out", str(out), *sets, *args, "--quiet"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_two_hosts_share_a_study_and_a_dead_hosts_point_is_taken_over(tmp_path, monkeypatch):
    """Hosts a and b sweep one study at once: every point trains exactly once. Then host a
    is SIGKILLed in the middle of a point of a second study: host b leaves it alone while its
    heartbeat is younger than the grace period, takes it over after it, and resumes it from
    a's checkpoint to the end (each epoch logged once). A failure points to a claim that two
    hosts both hold, one never taken over, or a takeover that restarts from scratch."""
    data = _npz(tmp_path / "d.npz")
    out = tmp_path / "shared"
    procs = [_sweep(h, out, data, "--grid", "seed=0,1,2,3", "--set", "epochs=2")
             for h in ("a", "b")]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-2000:]
    events = read_events(out)
    finished = sorted(e["point"] for e in events if e["event"] == "finish")
    assert finished == ["seed-0", "seed-1", "seed-2", "seed-3"]
    assert {p.name.split("-")[0] for p in (out / "events").iterdir()} <= {"a", "b"}

    out = tmp_path / "takeover"
    grace = 3.0
    a = _sweep("a", out, data, "--grid", "seed=0", "--set", "epochs=6", "--claim-grace",
               str(grace))
    deadline = time.monotonic() + 300
    while not list(out.glob("runs/seed-0/checkpoints/*.pt")) and time.monotonic() < deadline:
        assert a.poll() is None, a.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    a.send_signal(signal.SIGKILL)
    a.wait()
    killed_at = time.monotonic()
    monkeypatch.setenv(HOST_ENV, "b")
    study = sweep_study("npz", parse_axes(["seed=0"]), data=str(data),
                        sets=[*TINY, "epochs=6"])
    early = run_study(study, out, claim_grace_s=grace, log=lambda _: None)
    if time.monotonic() - killed_at < grace:  # a's last heartbeat is younger than its grace
        assert early["skipped"] == ["seed-0"]
    time.sleep(max(0.0, grace + 0.5 - (time.monotonic() - killed_at)))
    done = run_study(study, out, claim_grace_s=grace, log=lambda _: None)
    assert done["finished"] == ["seed-0"]
    mine = [e["event"] for e in read_events(out) if e["host"] == "b"]
    assert mine == ["takeover", "resume", "finish"]
    log = (out / "runs" / "seed-0" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in log] == list(range(1, 7))


# ---------------------------------------------------------------------------------------------
# events


def test_events_of_several_processes_are_merged_and_a_broken_line_is_said(tmp_path):
    """Each process appends to its own file; reading merges every file (and an earlier
    flarepp's single events.jsonl) in time order, and a line that is not a record is named
    with its file and line number instead of vanishing. A failure points to the merge or to
    an unreadable line dropped silently."""
    out = tmp_path / "sw"
    (out / "events").mkdir(parents=True)
    (out / "events.jsonl").write_text(json.dumps(
        {"point": "p", "event": "start", "pid": 1, "host": "old", "time": 1.0}) + "\n")
    (out / "events" / "a-7.jsonl").write_text("\n".join(json.dumps(
        {"point": "p", "event": e, "pid": 7, "host": "a", "time": t})
        for e, t in [("resume", 3.0), ("finish", 5.0)]) + "\n")
    (out / "events" / "b-9.jsonl").write_text(json.dumps(
        {"point": "q", "event": "start", "pid": 9, "host": "b", "time": 4.0}) + "\n"
        + '{"point": "q", "event": "fini')
    said = []
    events = read_events(out, unreadable=said.append)
    assert [(e["host"], e["event"]) for e in events] == [
        ("old", "start"), ("a", "resume"), ("b", "start"), ("a", "finish")]
    assert len(said) == 1 and f"{out / 'events' / 'b-9.jsonl'} line 2" in said[0]
    from flarepp.experiments.engine import record_event
    record_event(out, "q", "finish")
    assert events_file(out).is_file() and read_events(out, unreadable=said.append)[-1][
        "event"] == "finish"


# ---------------------------------------------------------------------------------------------
# platforms without fcntl

_NO_FCNTL = '''
import sys

class _NoFcntl:
    def find_spec(self, name, path=None, target=None):
        if name == "fcntl":
            raise ModuleNotFoundError("No module named 'fcntl'", name=name)
        return None

sys.meta_path.insert(0, _NoFcntl())
'''


@pytest.mark.slow
def test_the_command_line_starts_and_trains_where_fcntl_does_not_exist(tmp_path):
    """With `fcntl` unimportable (as on Windows), `flarepp --help` and a tiny training run
    both succeed: no lock needs it. A failure points to an fcntl import on a command's path."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_NO_FCNTL)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(hook), SRC, os.environ.get("PYTHONPATH", "")])}
    check = subprocess.run([sys.executable, "-c", "import fcntl"], env=env, capture_output=True)
    assert check.returncode != 0  # the hook works
    run = [sys.executable, "-m", "flarepp"]
    helped = subprocess.run([*run, "--help"], env=env, capture_output=True, text=True)
    assert helped.returncode == 0, helped.stderr
    data = _npz(tmp_path / "d.npz")
    sets = [a for s in [*TINY, "epochs=2"] for a in ("--set", s)]
    trained = subprocess.run([*run, "train", "npz", "--data", str(data), "--out",
                              str(tmp_path / "run"), *sets], env=env, capture_output=True,
                             text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.json").is_file()


# ---------------------------------------------------------------------------------------------
# impossible lease records (issue 41)


def test_an_impossible_heartbeat_or_grace_does_not_hold_a_lease_forever(tmp_path, monkeypatch):
    """Another host's lease whose heartbeat is a year in the future (its age read as 0), or
    whose recorded grace period is NaN (`age > NaN` is never true), blocked its point
    forever. The future heartbeat counts from the file's last change and is judged gone one
    grace period later; a NaN grace gives way to the taker's; the message says which. A
    failure points to Lease.judge trusting an impossible record."""
    monkeypatch.setenv(HOST_ENV, "b")
    path = tmp_path / ".lock"
    _record(path, _holder("a", grace_s=0.2), heartbeat_age_s=-365 * 86400)
    with pytest.raises(RunLocked, match="on host 'a'.*in the future, impossible"):
        Lease(path).acquire()
    time.sleep(0.4)
    with Lease(path) as lease:
        assert lease.stale is not None and lease.stale.host == "a"
    _record(path, _holder("a", grace_s=float("nan")), heartbeat_age_s=70)
    with Lease(path, grace_s=60.0) as lease:
        assert lease.stale is not None and lease.stale.host == "a"
    _record(path, _holder("a", grace_s=float("inf")), heartbeat_age_s=10)
    with pytest.raises(RunLocked, match="grace period inf is impossible: 60 s counts"):
        Lease(path, grace_s=60.0).acquire()


def test_a_point_held_by_another_host_is_left_naming_its_holder(tmp_path, monkeypatch):
    """`sweep` left a point held by another process as "1 held by other processes" without
    naming the holder: the loop's line names it (pid, host, command) and why it is kept. A
    failure points to a RunLocked swallowed by the claim loop."""
    out = tmp_path / "sw"
    study = sweep_study("npz", parse_axes(["seed=0"]), data=str(_npz(tmp_path / "d.npz")),
                        sets=TINY)
    create_study(out, study)
    monkeypatch.setenv(HOST_ENV, "b")
    _record(out / "claims" / "seed-0" / ".lock", _holder("a", grace_s=300.0),
            heartbeat_age_s=5)
    said = []
    done = run_study(study, out, log=said.append)
    assert done["skipped"] == ["seed-0"] and not (out / "runs").exists()
    assert any(line.startswith("[1/1] seed-0: left to its holder") and "on host 'a'" in line
               and "last heartbeat 5 s ago" in line for line in said), said
