"""The ``advection-diffusion`` dataset as the rollout task reads it: trajectories written by
``flarepp data make advection-diffusion`` and how samples are formed from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flarepp.data.base import DataError
from flarepp.data.generators.advection_diffusion import Trajectories, read_trajectories
from flarepp.data.registry import DATASETS


@dataclass
class RolloutData:
    """The ``advection-diffusion`` dataset as the rollout task reads it."""

    train: Trajectories
    test: Trajectories
    source: str
    history: int
    patches: int
    unroll: int
    horizon: int

    @property
    def steps(self) -> int:
        """T: the steps of a trajectory (T + 1 states)."""
        return int(self.train.u.shape[1]) - 1

    def validate(self) -> RolloutData:
        R, T = self.train.resolution, self.steps
        if self.test.resolution != R or self.test.u.shape[1] != T + 1:
            raise DataError(f"{self.source}: train and test trajectories differ in grid or "
                            f"length: {list(self.train.u.shape)} vs {list(self.test.u.shape)}")
        if self.patches < 1 or R % self.patches:
            raise DataError(f"{self.source}: patches={self.patches} must divide the grid's "
                            f"{R} points per side")
        if not 1 <= self.unroll <= T or not 1 <= self.horizon <= T:
            raise DataError(f"{self.source}: need 1 <= unroll <= {T} and 1 <= horizon <= "
                            f"{T}, got unroll={self.unroll}, horizon={self.horizon}")
        if self.history < 0:
            raise DataError(f"history must be >= 0, got {self.history}")
        return self


def load_rollout_data(root: Path, *, n_train: int | None = None, n_test: int | None = None,
                      history: int = 2, patches: int = 4, unroll: int = 1,
                      horizon: int | None = None) -> RolloutData:
    """Trajectories from ``root`` (``flarepp data make advection-diffusion``) and how the
    rollout task forms its samples: ``history`` earlier states summarised over
    ``patches`` x ``patches`` patches as conditioning, ``unroll`` steps per training sample,
    ``horizon`` steps per evaluation rollout (default: the whole trajectory)."""
    train = read_trajectories(root, "train", n_train)
    test = read_trajectories(root, "test", n_test)
    steps = int(train.u.shape[1]) - 1
    return RolloutData(train, test, str(root), history, patches, unroll,
                       steps if horizon is None else horizon)


DATASETS.add("advection-diffusion", load_rollout_data,
             doc="transient advection-diffusion trajectories (rollout task)")


__all__ = ["RolloutData", "load_rollout_data"]
