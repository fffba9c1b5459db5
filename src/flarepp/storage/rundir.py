"""A run directory's identity: who may write into it.

* :class:`RunLock` -- an exclusive lock on ``<run>/.lock`` held for the run's life, so two
  ``flarepp train`` processes cannot interleave one log and overwrite each other's
  checkpoints. It is a ``fcntl.flock`` on the file: the kernel releases it when the holder
  exits, however it exits (SIGKILL included), so a lock left by a dead process never blocks.
  The file records the holder (pid, host, start time, command) for the message a second
  process gets, :class:`RunLocked`.

The fingerprint of the data a run was trained on belongs to the data layer
(:mod:`flarepp.data.fingerprint`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


LOCK_NAME = ".lock"


class RunLocked(ValueError):
    """The run directory is locked by another live process."""


@dataclass(frozen=True)
class LockHolder:
    """What a lock file records about the process holding it."""

    pid: int
    host: str
    started: str
    command: str

    @classmethod
    def this_process(cls) -> "LockHolder":
        return cls(os.getpid(), socket.gethostname(),
                   time.strftime("%Y-%m-%d %H:%M:%S %z"), shlex.join(sys.orig_argv))

    @classmethod
    def parse(cls, text: str) -> "LockHolder | None":
        """The holder recorded in ``text``; ``None`` when empty or not a lock record."""
        try:
            record = json.loads(text)
            return cls(int(record["pid"]), str(record["host"]), str(record["started"]),
                       str(record["command"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self, max_command: int = 300) -> str:
        command = self.command
        if len(command) > max_command:
            command = command[:max_command] + " ..."
        return (f"process {self.pid} on host {self.host!r} (started {self.started}, "
                f"command: {command})")

    def is_dead_here(self) -> bool:
        """True if the holder ran on this host and its process no longer exists."""
        if self.host != socket.gethostname():
            return False  # another machine's pids mean nothing here
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, owned by another user
            return False
        return False


def _read_holder(fd: int) -> LockHolder | None:
    return LockHolder.parse(os.pread(fd, 65536, 0).decode("utf-8", "replace"))


class RunLock:
    """Exclusive, non-blocking lock on a run directory: ``with RunLock(out_dir): ...``.

    Taking it creates ``out_dir`` (and ``out_dir/.lock``) if needed. When another live
    process holds it, :class:`RunLocked` names that process's pid, host and command. If the
    recorded holder is dead on this host but the lock is still held -- a child that
    inherited the descriptor by ``fork`` outlived it -- the stale file is replaced. After
    :meth:`acquire`, ``stale`` is the holder a previous run recorded and never released
    (it was killed), or ``None``.
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self.stale: LockHolder | None = None
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(20):  # retried only when the file was replaced under us
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder, inode = _read_holder(fd), os.fstat(fd).st_ino
                os.close(fd)
                if holder is not None and holder.is_dead_here():
                    self._replace_stale_file(inode)
                    continue
                raise RunLocked(self._locked_message(holder)) from None
            except BaseException:
                os.close(fd)
                raise
            if not self._is_current_file(fd):  # released and unlinked while we waited
                os.close(fd)
                continue
            self.stale = _read_holder(fd)
            record = json.dumps(asdict(LockHolder.this_process())).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, record + b"\n", 0)
            os.fsync(fd)
            self._fd = fd
            return self
        raise RunLocked(f"could not take the lock {self.path}: it keeps being replaced by "
                        "other processes")

    def release(self) -> None:
        """Remove the lock file and release the lock (unlink first: a process that opened
        the old file meanwhile sees it is gone and retries on a fresh one)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._is_current_file(fd):
                self.path.unlink()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _is_current_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _replace_stale_file(self, inode: int) -> None:
        """Unlink the lock file if it is still the stale one (inode ``inode``).

        Serialised by a lock on the directory itself, so that of two processes breaking the
        same stale lock the second cannot unlink the fresh file the first just created.
        """
        dir_fd = os.open(self.out_dir, os.O_RDONLY)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):  # another process removed it first
                if os.stat(self.path).st_ino == inode:
                    self.path.unlink()
        finally:
            fcntl.flock(dir_fd, fcntl.LOCK_UN)
            os.close(dir_fd)

    def _locked_message(self, holder: LockHolder | None) -> str:
        who = holder.describe() if holder else "another process (it has not yet recorded its pid)"
        return (f"run directory {str(self.out_dir)!r} is in use by {who}, which holds "
                f"{str(self.path)!r}; wait for that run to end or stop it, or choose "
                "another --out")


__all__ = ["LockHolder", "RunLock", "RunLocked"]
