"""The leases, as the storage floor and those above it have imported them: they live on the
base floor, :mod:`flarepp.locks`, so that the data floor's conversion can take one on its
output store (``flarepp data convert``); this module names the same objects."""

from flarepp.locks import (ACQUIRE_PATIENCE_S, GRACE_S, HOST_ENV, LOCK_NAME, LOST_EXIT,  # noqa: F401
                           TAKEOVER_STALE_S, Lease, LeaseLost, LockHolder, LockUnavailable,
                           RunLock, RunLocked, Verdict, file_safe, host_id, process_alive,
                           process_start)
from flarepp.locks import __all__  # noqa: F401
