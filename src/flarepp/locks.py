"""Leases on shared directories: who may write a run, work on a study's point, or create a study.

A kernel lock (``fcntl.flock``) is not what it seems on a cluster's shared filesystem: it is
node-local on NFS mounted ``nolock`` / ``local_lock``, on Lustre ``localflock`` and on BeeGFS
by default (two hosts then both "hold" it), raises on Lustre ``noflock``, and does not exist
on Windows. A :class:`Lease` relies on none of it:

* **Taking it** is an exclusive create (``O_CREAT | O_EXCL``) of the lease file, atomic on a
  local disk and on NFSv3/v4 (the server decides), on Lustre and on BeeGFS; the file then
  records the holder: host id (:func:`host_id`), pid, the process's start time where the
  platform tells it, a random token, the command and the holder's grace period.
* **The heartbeat** is the file's modification time: a background thread touches it every
  ``grace_s / 10`` seconds while the lease is held, after checking the file still carries
  its token.
* **A holder is judged gone** (:meth:`Lease.judge`) at once when it ran on this host and its
  process no longer exists (or its pid now belongs to a process started later); never while
  its process is alive on this host, however old its heartbeat (a suspended or busy process
  keeps what it holds); and, for a holder on another host, whose pids mean nothing here,
  when its heartbeat is older than its grace period. Hosts' clocks must agree to well within
  that period (NTP does). An impossible record never holds a lease forever: a recorded grace
  period that is NaN, infinite or not above 0 is replaced by the judge's own, and a heartbeat
  further in the future than the grace period is read from the file's last change (its
  ctime) instead.
* **Taking over** a gone holder's lease happens under a takeover guard, ``<lease>.takeover``,
  itself an ``O_EXCL`` file held for milliseconds: its holder reads the lease file again,
  removes it only if it is still the one judged gone (same inode and token), gives the guard
  back and creates the lease afresh with ``O_EXCL``, which only one process can win. Takers
  that find the guard held wait for it. (Renaming the gone file away without a guard is not
  safe: a taker that judged the old file can move a fresh holder's file aside, and a third
  process then creates another, so two hold the lease.) A guard left by a taker killed in
  those milliseconds is removed once its process is gone (this host) or it is
  ``TAKEOVER_STALE_S`` old.
* **A holder that finds its lease taken over** (the file is gone or carries another token,
  or no heartbeat could be written for a whole grace period) has been judged gone by another
  host: it stops at once without writing more (``on_lost``; by default the process exits with
  status 75), since the taker now continues its work from the last checkpoint. It finds out
  at its next heartbeat, and before each write only the holder may make
  (:meth:`Lease.verify`: a run checks before every checkpoint and every log line).

:class:`RunLock` is the lease of a run directory (``<run>/.lock``); the experiment engine
takes one per study point (``claims/<point>/.lock``) and one, held for milliseconds, around a
study's creation.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import shlex
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

HOST_ENV = "FLAREPP_HOST_ID"
"""Environment variable naming this machine for leases and event files (default: its host
name). Set it where host names repeat across machines that share a directory (containers)."""

GRACE_S = 300.0
"""Seconds without a heartbeat after which another host takes a lease over."""

LOST_EXIT = 75
"""Exit status of a process whose lease another host took over (``EX_TEMPFAIL``)."""

LOCK_NAME = ".lock"

TAKEOVER_STALE_S = 30.0
"""Age in seconds after which a takeover guard (held for milliseconds) is judged left behind."""

ACQUIRE_PATIENCE_S = 30.0
"""Seconds :meth:`Lease.acquire` keeps retrying while other processes replace the lease file
or take it over (a live holder is refused at once)."""


def host_id() -> str:
    """This machine's name for leases and event files: ``$FLAREPP_HOST_ID`` or the host name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def process_start(pid: int) -> str | None:
    """When process ``pid`` started, in the kernel's clock ticks since boot (Linux
    ``/proc/<pid>/stat``, field 22), or ``None`` where that cannot be read: with the pid it
    tells a live holder from a later process that reuses its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def process_alive(pid: int, started: str | None = None) -> bool | None:
    """Whether process ``pid`` of this host exists (and, given ``started``, is the process
    that started then); ``None`` where this platform cannot tell without side effects
    (Windows, whose ``os.kill`` would end the process)."""
    if os.name != "posix":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return started is None or process_start(pid) in (None, started)


class RunLocked(ValueError):
    """The lease (a run directory, a study point) is held by another live process."""


class LeaseLost(RuntimeError):
    """This process's lease was taken over by another (:meth:`Lease.verify`)."""


class LockUnavailable(OSError):
    """A lease file cannot be created or read on this filesystem (read-only, no permission,
    no exclusive create): no lease can be taken, so nothing is started."""


@dataclass(frozen=True)
class LockHolder:
    """What a lease file records about the process holding it (records written by an earlier
    flarepp, without token or grace, still parse)."""

    pid: int
    host: str
    started: str
    command: str
    token: str = ""
    pid_start: str | None = None
    grace_s: float | None = None

    @classmethod
    def this_process(cls, grace_s: float | None = None) -> "LockHolder":
        return cls(os.getpid(), host_id(), time.strftime("%Y-%m-%d %H:%M:%S %z"),
                   shlex.join(getattr(sys, "orig_argv", sys.argv)), secrets.token_hex(8),
                   process_start(os.getpid()), grace_s)

    @classmethod
    def parse(cls, text: str) -> "LockHolder | None":
        """The holder recorded in ``text``; ``None`` when empty or not a lease record."""
        try:
            r = json.loads(text)
            grace = r.get("grace_s")
            return cls(int(r["pid"]), str(r["host"]), str(r["started"]), str(r["command"]),
                       str(r.get("token", "")), r.get("pid_start"),
                       None if grace is None else float(grace))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def same_process(self, other: "LockHolder") -> bool:
        return (self.host, self.pid, self.pid_start) == (other.host, other.pid, other.pid_start)

    def describe(self, max_command: int = 300) -> str:
        command = self.command
        if len(command) > max_command:
            command = command[:max_command] + " ..."
        return (f"process {self.pid} on host {self.host!r} (started {self.started}, "
                f"command: {command})")

    def alive_here(self) -> bool | None:
        """Whether the holder's process is alive: ``None`` for another host's holder (its pid
        means nothing here) or where the platform cannot tell."""
        if self.host != host_id():
            return None
        return process_alive(self.pid, self.pid_start)

    def is_dead_here(self) -> bool:
        """True if the holder ran on this host and its process no longer exists."""
        return self.alive_here() is False


@dataclass(frozen=True)
class Verdict:
    """What :meth:`Lease.judge` found: the holder (``None``: the file is empty or unreadable,
    being written), the heartbeat's age in seconds, whether the holder is gone, and why."""

    holder: LockHolder | None
    age_s: float
    gone: bool
    reason: str
    inode: int


def _exit_on_loss(lease: "Lease", reason: str) -> None:
    print(f"flarepp: lost {str(lease.path)!r}: {reason}; stopping at once without writing more "
          "(the process that took it over continues from the last checkpoint)",
          file=sys.stderr, flush=True)
    os._exit(LOST_EXIT)


class Lease:
    """An exclusive lease on ``path`` that holds across hosts (module docstring).

    ``grace_s``: seconds without a heartbeat after which another host may take it over (a
    holder's own grace, recorded in its file, is what others judge it by); ``heartbeat``:
    refresh it from a background thread while held (off for leases held for milliseconds);
    ``on_lost(lease, reason)``: called from that thread when another host took it over (by
    default the process exits at once). After :meth:`acquire`, ``stale`` is the holder that
    left the lease without releasing it (killed, or its host lost), or ``None``.
    """

    def __init__(self, path: str | Path, *, grace_s: float = GRACE_S, heartbeat: bool = True,
                 on_lost: Callable[["Lease", str], None] = _exit_on_loss) -> None:
        if not grace_s > 0:
            raise ValueError(f"a lease's grace period must be > 0 seconds, got {grace_s}")
        self.path = Path(path)
        self.grace_s = float(grace_s)
        self.heartbeat = heartbeat
        self.on_lost = on_lost
        self.stale: LockHolder | None = None
        self.holder: LockHolder | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self.holder is not None

    # -- taking and giving back -------------------------------------------------------------

    def acquire(self) -> "Lease":
        """Take the lease, taking over a gone holder's; :class:`RunLocked` names a live one."""
        if self.holder is not None:
            raise RuntimeError(f"{self.path} is already held by this lease")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self._unavailable(err) from None
        deadline = time.monotonic() + ACQUIRE_PATIENCE_S
        while time.monotonic() < deadline:  # retried only while others replace the file
            me = LockHolder.this_process(self.grace_s)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                verdict = self.judge()
                if verdict is None:
                    continue  # released meanwhile
                if not verdict.gone:
                    raise RunLocked(self.held_message(verdict)) from None
                self._take_over(verdict)
                continue
            except OSError as err:
                raise self._unavailable(err) from None
            try:
                os.write(fd, (json.dumps(asdict(me)) + "\n").encode())
                os.fsync(fd)
            except OSError as err:
                os.close(fd)
                self.path.unlink(missing_ok=True)
                raise self._unavailable(err) from None
            os.close(fd)
            self.holder = me
            if self.heartbeat:
                self._stop.clear()
                self._beat = threading.Thread(target=self._refresh, daemon=True,
                                              name=f"heartbeat {self.path}")
                self._beat.start()
            return self
        guard = self.path.with_name(f"{self.path.name}.takeover")
        raise RunLocked(f"could not take {str(self.path)!r} within {ACQUIRE_PATIENCE_S:g} s: "
                        "it keeps being replaced by other processes" + (
                            f", or a taker holds {str(guard)!r}" if guard.exists() else ""))

    def wait(self, timeout_s: float, poll_s: float = 0.02) -> "Lease":
        """:meth:`acquire`, retried while a live process holds it, for at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.acquire()
            except RunLocked:
                if time.monotonic() > deadline:
                    raise
                time.sleep(poll_s)

    def release(self) -> None:
        """Stop the heartbeat and remove the lease file, if it is still ours."""
        if self.holder is None:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        token, self.holder = self.holder.token, None
        try:
            if self._read_token() == token:
                self.path.unlink(missing_ok=True)
        except OSError as err:  # left behind: judged gone by its pid or heartbeat later
            print(f"flarepp: could not remove the lease {str(self.path)!r} ({err}); it is "
                  "taken over once its holder is judged gone", file=sys.stderr)

    def verify(self) -> None:
        """Check, before a write that only the holder may make (a checkpoint, a log line),
        that the lease file still carries this holder's token; if another process took it
        over (a holder judged gone, e.g. the same host id in another PID namespace), call
        ``on_lost`` (by default the process exits at once) and raise :class:`LeaseLost`, so
        nothing more is written. One read of a small file."""
        if self.holder is None:
            raise LeaseLost(f"{str(self.path)!r} is not held by this process")
        try:
            current = self._read_token()
        except OSError:
            return  # a passing filesystem error: the heartbeat judges a lasting one
        if current == self.holder.token:
            return
        reason = ("its file was removed" if current is None else
                  "another process took it over (it judged this holder gone)")
        self.on_lost(self, reason)
        raise LeaseLost(f"lost {str(self.path)!r}: {reason}; nothing more is written (the "
                        "process that took it over continues from the last checkpoint)")

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- judging another holder --------------------------------------------------------------

    def judge(self) -> Verdict | None:
        """Whether the lease's current holder is gone (module docstring); ``None`` when the
        lease file no longer exists."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as err:
            raise self._unavailable(err) from None
        try:
            st = os.fstat(fd)
            holder = LockHolder.parse(os.read(fd, 65536).decode("utf-8", "replace"))
        finally:
            os.close(fd)
        grace, note = self._grace_of(holder)
        age, beat_note = self._heartbeat_age(st, holder, grace)
        note = "; ".join(n for n in (note, beat_note) if n)
        note = f" ({note})" if note else ""
        alive = holder.alive_here() if holder is not None else None
        if alive is True:
            return Verdict(holder, age, False, "its process is alive on this host", st.st_ino)
        if alive is False:
            return Verdict(holder, age, True, "its process no longer exists", st.st_ino)
        if age > grace:
            return Verdict(holder, age, True, f"no heartbeat for {age:.0f} s (its grace "
                                              f"period is {grace:.0f} s){note}", st.st_ino)
        return Verdict(holder, age, False, f"last heartbeat {age:.0f} s ago; another host "
                                           f"takes it over after {grace:.0f} s without "
                                           f"one{note}", st.st_ino)

    def _grace_of(self, holder: LockHolder | None) -> tuple[float, str]:
        """The grace period a holder is judged by: the one it recorded, or this lease's
        where it recorded none or an impossible one (NaN, infinite, not above 0: it would
        keep its lease forever), said."""
        recorded = holder.grace_s if holder is not None else None
        if recorded is None:
            return self.grace_s, ""
        if math.isfinite(recorded) and recorded > 0:
            return recorded, ""
        return self.grace_s, (f"its recorded grace period {recorded} is impossible: "
                              f"{self.grace_s:.0f} s counts")

    @staticmethod
    def _heartbeat_age(st: os.stat_result, holder: LockHolder | None,
                       grace: float) -> tuple[float, str]:
        """Seconds since the lease file's heartbeat, and a note where its time is
        impossible. A record's heartbeat is its mtime; a file not yet holding a record may
        still carry an NFSv3 exclusive create's verifier as its mtime, so the server-set
        ctime counts. A heartbeat further in the future than the grace period is impossible
        (hosts' clocks agree to well within it, and a heartbeat sets the filesystem's time):
        the file's last change, its ctime, counts instead, so such a lease is judged gone
        one grace period after it was last written."""
        now = time.time()
        beat = st.st_mtime if holder is not None else max(st.st_mtime, st.st_ctime)
        if beat > now + grace:
            return max(0.0, now - st.st_ctime), (f"its heartbeat is {beat - now:.0f} s in the "
                                                 "future, impossible: the file's last change "
                                                 "counts")
        return max(0.0, now - beat), ""

    def take_over_from(self, gone: LockHolder) -> bool:
        """Remove the lease file if it is held by ``gone``'s process (judged gone through
        another lease it held, e.g. its study point); returns whether it was."""
        verdict = self.judge()
        if verdict is None or verdict.holder is None or not verdict.holder.same_process(gone):
            return False
        self._take_over(replace(verdict, gone=True))
        return True

    def held_message(self, verdict: Verdict) -> str:
        who = (verdict.holder.describe() if verdict.holder is not None
               else "another process (it has not yet recorded itself)")
        return f"{str(self.path)!r} is held by {who}: {verdict.reason}"

    # -- internals ---------------------------------------------------------------------------

    def _take_over(self, verdict: Verdict) -> None:
        """Remove the lease file judged gone in ``verdict``, under the takeover guard (module
        docstring); returns without removing anything when another taker holds the guard (after
        a short wait) or the file is no longer the one judged gone."""
        guard = self.path.with_name(f"{self.path.name}.takeover")
        try:
            fd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            self._clear_left_guard(guard)
            time.sleep(0.002 + 0.008 * secrets.randbelow(1000) / 1000)
            return
        except OSError as err:
            raise self._unavailable(err) from None
        try:
            try:
                os.write(fd, (json.dumps(asdict(LockHolder.this_process())) + "\n").encode())
            finally:
                os.close(fd)
            now = self.judge()
            if now is None or now.inode != verdict.inode:
                return  # released, or already replaced by a fresh lease
            if (now.holder is None) != (verdict.holder is None) or (
                    now.holder is not None and verdict.holder is not None
                    and now.holder.token != verdict.holder.token):
                return  # another holder's file (an inode number can be reused)
            if verdict.holder is None and not now.gone:
                return  # an empty file judged by its age: a fresh one is being written
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                return
            except OSError as err:
                raise self._unavailable(err) from None
            if self.stale is None and verdict.holder is not None:
                self.stale = verdict.holder
        finally:
            guard.unlink(missing_ok=True)

    @staticmethod
    def _clear_left_guard(guard: Path) -> None:
        """Remove a takeover guard whose taker died (this host) or that is older than
        ``TAKEOVER_STALE_S``; a guard being written or held by a live taker stays."""
        try:
            st = os.stat(guard)
            taker = LockHolder.parse(guard.read_text(errors="replace"))
        except OSError:
            return
        age = time.time() - st.st_mtime
        if (taker is not None and taker.alive_here() is False) or age > TAKEOVER_STALE_S:
            guard.unlink(missing_ok=True)

    def _read_token(self) -> str | None:
        try:
            holder = LockHolder.parse(self.path.read_text(errors="replace"))
        except FileNotFoundError:
            return None
        return None if holder is None else holder.token

    def _refresh(self) -> None:
        interval = self.grace_s / 10
        token = self.holder.token if self.holder is not None else ""
        last_ok = time.monotonic()
        while not self._stop.wait(interval):
            try:
                current = self._read_token()
                if current != token:
                    reason = ("its file was removed" if current is None else
                              "another process took it over (judged gone after "
                              "its heartbeat stopped)")
                    break
                os.utime(self.path)
                last_ok = time.monotonic()
                continue
            except OSError as err:
                if time.monotonic() - last_ok <= self.grace_s:
                    continue  # a passing filesystem error: the next beat retries
                reason = f"no heartbeat could be written for {self.grace_s:.0f} s ({err})"
                break
        else:
            return
        if not self._stop.is_set():
            self.on_lost(self, reason)

    def _unavailable(self, err: OSError) -> LockUnavailable:
        what = {errno.EROFS: "the filesystem is read-only",
                errno.EACCES: "no permission to write there",
                errno.EPERM: "the filesystem does not allow it"}.get(err.errno, err.strerror
                                                                         or str(err))
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return LockUnavailable(f"cannot take the lease {str(self.path)!r}: {what} (the "
                                   "filesystem or your quota is full); free some space")
        return LockUnavailable(
            f"cannot take the lease {str(self.path)!r}: {what}; a directory that several "
            "processes share must be writable on a filesystem with exclusive create (O_EXCL: "
            "a local disk, NFSv3/v4, Lustre, BeeGFS; see docs/reliability.md)")


class RunLock(Lease):
    """The lease of a run directory, ``<run>/.lock``: ``with RunLock(out_dir): ...``.

    Taking it creates ``out_dir`` if needed; while another live process holds it,
    :class:`RunLocked` names that process's pid, host and command. A holder killed on this
    host (SIGKILL included) never blocks: its pid is gone, so the next run takes the directory
    at once and finds the dead holder in ``stale``; one on a lost host is taken over once its
    heartbeat is ``grace_s`` old.
    """

    def __init__(self, out_dir: str | Path, *, grace_s: float = GRACE_S,
                 on_lost: Callable[[Lease, str], None] = _exit_on_loss) -> None:
        self.out_dir = Path(out_dir)
        super().__init__(self.out_dir / LOCK_NAME, grace_s=grace_s, on_lost=on_lost)

    def held_message(self, verdict: Verdict) -> str:
        who = (verdict.holder.describe() if verdict.holder is not None
               else "another process (it has not yet recorded its pid)")
        return (f"run directory {str(self.out_dir)!r} is in use by {who}, which holds "
                f"{str(self.path)!r} ({verdict.reason}); wait for that run to end or stop it, "
                "or choose another --out")


_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def file_safe(name: str) -> str:
    """``name`` with every character other than letters, digits, ``.``, ``_``, ``-`` as ``_``."""
    return _SAFE_NAME.sub("_", name)


__all__ = ["ACQUIRE_PATIENCE_S", "GRACE_S", "HOST_ENV", "LOCK_NAME", "LOST_EXIT",
           "TAKEOVER_STALE_S", "Lease", "LeaseLost", "LockHolder", "LockUnavailable",
           "RunLock", "RunLocked", "Verdict", "file_safe", "host_id", "process_alive",
           "process_start"]
