"""A run directory's identity: who may write into it.

* :class:`RunLock` -- the lease on ``<run>/.lock`` held for the run's life, so two
  ``flarepp train`` processes, on one host or on two sharing the directory, cannot interleave
  one log and overwrite each other's checkpoints. It lives with every other lease in
  :mod:`flarepp.storage.locks` (an exclusive create with a heartbeat, not a kernel lock, which
  shared filesystems do not keep coherent); a second process gets :class:`RunLocked`, naming
  the holder (pid, host, start time, command).

The fingerprint of the data a run was trained on belongs to the data layer
(:mod:`flarepp.data.fingerprint`).
"""

from __future__ import annotations

from flarepp.storage.locks import LOCK_NAME, LockHolder, RunLock, RunLocked

__all__ = ["LOCK_NAME", "LockHolder", "RunLock", "RunLocked"]
