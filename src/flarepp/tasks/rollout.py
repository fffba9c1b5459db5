"""Autoregressive rollout of a transient PDE with a conditioned surrogate (the ``rollout`` task).

Shape letters: B batch, N = R^2 grid points, S rollout steps, K conditioning tokens of F
features, k history length, P^2 patches per state summary.

The talk's transient problem (Aim 1(b)): ``(t, x, u_{t-k}, ..., u_t) -> u_{t+1}``, here on
the advection-diffusion trajectories of :mod:`flarepp.data.generators.advection_diffusion`
(dataset ``advection-diffusion``, :func:`load_rollout_data`). One step of the model:

* mesh tokens, one per grid point (``POINT_FEATURES`` = 10): ``(sin 2 pi x, cos 2 pi x,
  sin 2 pi y, cos 2 pi y)`` (the domain is periodic), the state and its 5-point-stencil
  differences ``(u, (u_E - u_W) / 2, (u_N - u_S) / 2, u_E + u_W + u_N + u_S - 4 u)`` (the
  local first and second derivatives that advection and diffusion act through, each
  divided by its standard deviation over the training split), and the source's shape
  ``g(x)`` (a spatial field, like the state);
* conditioning tokens ``c [K, F]`` with ``K = 1 + k P^2``, ``F = 7``: one global token
  ``(1, t, v_x, v_y, log kappa, A, 0)`` (the scalars: time and the parameters,
  standardised with the training split's statistics) and, for each of the previous k
  states, its mean over each of P x P patches as a token ``(0, sin/cos 2 pi of the patch
  centre, lag / k, mean)``. Lags before ``t = 0`` do not exist: their tokens are masked
  (``conditioning_mask``), so a rollout can start from ``u_0`` alone. What the mesh
  tokens do not carry -- the velocity, the diffusivity, the source's amplitude and the
  time that sets its phase -- reaches the model only through the conditioning;
* the prediction ``u_{t+1} = u_t + sigma_delta f(tokens, c)``, a residual update scaled by
  the training split's standard deviation of one-step changes.

Training (``unroll`` U steps, default 1): a sample is a window of a training trajectory
starting at state s (every s in 0..T-U, the history before it as conditioning); the model
is applied U times, each step feeding its own prediction back (the history shifts
accordingly), gradients through all steps. U = 1 is one-step teacher forcing. Loss: the
summed squared error of the predicted states in units of ``sigma_delta`` over the U steps
and N points, counted per value (the loss convention of :mod:`flarepp.tasks.base`).

Evaluation: every test trajectory is rolled out from ``u_0`` over the ``horizon`` (default:
all T steps) with the model's own predictions only; the metric is the relative L2 error
``||u_hat_j - u_j|| / ||u_j||`` at each step j, averaged over trajectories
(``rel_l2_per_step``), and its mean over the horizon (``rollout_rel_l2``, the headline).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from flarepp.data import DataError
from flarepp.data.fingerprint import data_fingerprint
from flarepp.data.rollout import RolloutData, load_rollout_data  # noqa: F401
from flarepp.data.generators.advection_diffusion import (Trajectories, grid, periodic_gaussian)
from flarepp.io import atomic_write_npz
from flarepp.models import build_model
from flarepp.models.surrogate import UnitMaps
from flarepp.plots import Panel, Series, plot_curves, weight_series
from flarepp.tasks.base import Batch, Item, Task, TokenSum, units_on
from flarepp.storage.rundir import RunDir
from flarepp.tasks.registry import TASKS

POINT_FEATURES = 9
TOKEN_FEATURES = 7
SAVED_CASES = 4


def _standardise(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and std (std 1 for a constant column)."""
    mean, std = values.mean(0), values.std(0)
    return mean, np.where(std > 0, std, 1.0)


def global_parameters(params_S6: np.ndarray) -> np.ndarray:
    """The scalar parameters ``(v_x, v_y, log kappa, A)`` ``[S, 4]``."""
    vx, vy, kappa, _, _, amplitude = params_S6.T.astype(np.float64)
    return np.stack([vx, vy, np.log(kappa), amplitude], axis=1)


@TASKS.register("rollout", doc="autoregressive rollout of a transient PDE: per-step rel. L2")
class RolloutTask(Task):
    """Conditioned one-step surrogate trained on windows, evaluated by full rollouts."""

    name = "rollout"
    headline = "rollout_rel_l2"
    lower_is_better = True
    token_keys = ()
    eval_splits = ("test",)

    def __init__(self, config: Any, data_root: str | Path, *,
                 data: RolloutData | None = None) -> None:
        super().__init__(config, data_root)
        self.data = data or load_rollout_data(self.data_root,
                                              **config.dataset_options).validate()
        d = self.data
        self.resolution = d.train.resolution
        self.dt = float(d.train.times[1] - d.train.times[0])
        self.windows = d.steps - d.unroll + 1           # training windows per trajectory
        x, y = grid(self.resolution)
        angle = 2 * np.pi
        self.point_xy = np.stack([np.sin(angle * x), np.cos(angle * x), np.sin(angle * y),
                                  np.cos(angle * y)], -1).reshape(-1, 4).astype(np.float32)
        centres = (np.arange(d.patches) + 0.5) / d.patches
        px, py = np.meshgrid(centres, centres, indexing="ij")
        self.patch_xy = np.stack([np.sin(angle * px), np.cos(angle * px), np.sin(angle * py),
                                  np.cos(angle * py)], -1).reshape(-1, 4).astype(np.float32)
        u = d.train.u.astype(np.float64)
        normalised = (u - u.mean()) / u.std()
        stencil = self.stencil(torch.from_numpy(normalised.reshape(-1, self.resolution ** 2)))
        self.set_statistics({
            "u_mean": float(u.mean()), "u_std": float(u.std()),
            "stencil_std": stencil.flatten(0, 1).std(0).tolist(),
            "delta_std": float((u[:, 1:] - u[:, :-1]).std()),
            "param_mean": _standardise(global_parameters(d.train.params))[0].tolist(),
            "param_std": _standardise(global_parameters(d.train.params))[1].tolist()})

    @classmethod
    def check_config(cls, config: Any) -> None:
        if config.dataset != "advection-diffusion":
            raise ValueError(f"task rollout reads dataset 'advection-diffusion', got "
                             f"{config.dataset!r}")
        if config.loss != "reference":
            raise ValueError(f"task rollout trains on the squared error of the predicted "
                             f"states (in units of the one-step change); leave loss at "
                             f"'reference', got {config.loss!r}")
        if config.model.get("arch") != "conditioned":
            raise ValueError(f"task rollout needs model.arch='conditioned', got "
                             f"{config.model.get('arch')!r}")
        options = config.dataset_options
        for key, low in (("patches", 1), ("history", 0), ("unroll", 1), ("horizon", 1),
                         ("n_train", 1), ("n_test", 1)):
            value = options.get(key)
            if value is not None and value < low:
                raise ValueError(f"dataset_options.{key} must be at least {low} for task "
                                 f"rollout, got {value}")

    def set_statistics(self, stats: dict[str, Any]) -> None:
        self.stats = dict(stats)
        self.__dict__.pop("_device_cache", None)  # made from the statistics
        self._param_mean = np.asarray(stats["param_mean"], np.float64)
        self._param_std = np.asarray(stats["param_std"], np.float64)
        state_map = (np.float64(stats["u_mean"]), np.float64(stats["u_std"]))
        self.state_units = UnitMaps(inputs=state_map, outputs=state_map)

    @property
    def cond_tokens(self) -> int:
        return 1 + self.data.history * self.data.patches ** 2

    # -- data ----------------------------------------------------------------------------
    def _split(self, split: str) -> Trajectories:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; the rollout task has 'train' "
                             "(windows) and 'test' (rollouts from u_0)")
        return getattr(self.data, split)

    def num_samples(self, split: str) -> int:
        return len(self._split(split)) * (self.windows if split == "train" else 1)

    def get(self, split: str, index: int, seed: int, *, training: bool = False) -> Item:
        """``train``: window ``index`` (trajectory ``index // windows``, start state
        ``index % windows``); ``test``: trajectory ``index`` from ``u_0``. States from
        ``start - history`` to ``start + steps`` (indices below 0 clamped, their lags
        masked), ``[history + 1 + steps, N]``."""
        d, traj = self.data, self._split(split)
        if split == "train":
            trajectory, start, steps = divmod(index, self.windows) + (d.unroll,)
        else:
            trajectory, start, steps = index, 0, d.horizon
        rows = np.arange(start - d.history, start + steps + 1)
        states = traj.u[trajectory][np.clip(rows, 0, None)].reshape(len(rows), -1)
        params = (global_parameters(traj.params[trajectory:trajectory + 1])[0]
                  - self._param_mean) / self._param_std
        x, y = grid(self.resolution)
        source = periodic_gaussian(x, y, tuple(traj.params[trajectory, 3:5]),
                                   traj.source_width).reshape(-1)
        return {"index": np.int64(index), "states": states.astype(np.float32),
                "source": source.astype(np.float32), "lag_valid": rows[:d.history] >= 0,
                "time": np.float32(traj.times[start]),
                "params": params.astype(np.float32)}

    def collate(self, items: list[Item]) -> Batch:
        def stack(key: str) -> torch.Tensor:
            return torch.from_numpy(np.stack([it[key] for it in items]))

        return {"states": stack("states"), "source": stack("source"),
                "lag_valid": stack("lag_valid"),
                "time": stack("time"), "params": stack("params"),
                "index": torch.tensor([int(it["index"]) for it in items])}

    # -- model ---------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return build_model(in_dim=POINT_FEATURES, out_dim=1, cond_dim=TOKEN_FEATURES,
                           cond_tokens=self.cond_tokens, **self.config.model_kwargs())

    def conditioning(self, time_B: torch.Tensor, params_B4: torch.Tensor,
                     history_BkN: torch.Tensor, lag_valid_Bk: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Conditioning tokens ``[B, K, F]`` and their mask ``[B, K]`` (module doc);
        ``history`` oldest first, normalised states."""
        B, k, _ = history_BkN.shape
        P, R = self.data.patches, self.resolution
        one = torch.ones(B, 1, device=time_B.device, dtype=params_B4.dtype)
        tokens = [torch.cat([one, time_B[:, None].to(one.dtype), params_B4,
                             torch.zeros_like(one)], dim=1)[:, None]]
        masks = [torch.ones(B, 1, dtype=torch.bool, device=one.device)]
        if k:
            means = history_BkN.reshape(B, k, P, R // P, P, R // P).mean((3, 5))
            means = means.reshape(B, k, P * P, 1)                          # [B, k, P^2, 1]
            lag = (torch.arange(k, 0, -1, device=one.device, dtype=one.dtype) / k)
            patch_xy = self._device_constants(one.device, one.dtype)[2]
            zero = torch.zeros(B, k, P * P, 1, device=one.device, dtype=one.dtype)
            tokens.append(torch.cat([zero, patch_xy.expand(B, k, -1, -1),
                                     lag.view(1, k, 1, 1).expand(B, k, P * P, 1), means],
                                    dim=-1).reshape(B, k * P * P, TOKEN_FEATURES))
            masks.append(lag_valid_Bk[:, :, None].expand(B, k, P * P).reshape(B, -1))
        return torch.cat(tokens, dim=1), torch.cat(masks, dim=1)

    def stencil(self, u_BN: torch.Tensor) -> torch.Tensor:
        """``(u, (u_E - u_W) / 2, (u_N - u_S) / 2, u_E + u_W + u_N + u_S - 4 u)`` at every
        grid point (periodic neighbours), ``[B, N, 4]``."""
        R = self.resolution
        u = u_BN.reshape(-1, R, R)
        east, west = torch.roll(u, -1, 1), torch.roll(u, 1, 1)
        north, south = torch.roll(u, -1, 2), torch.roll(u, 1, 2)
        out = torch.stack([u, (east - west) / 2, (north - south) / 2,
                           east + west + north + south - 4 * u], dim=-1)
        return out.reshape(len(u_BN), R * R, 4)

    def _device_constants(self, device: torch.device, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(point_xy [N, 4], stencil std [4], patch_xy [P^2, 4])`` on ``device``, copied
        from host memory once per (device, dtype): a copy in every forward (every unrolled
        step, for patch_xy) would wait for the device's queued work (pageable host memory)."""
        cache = self.__dict__.setdefault("_device_cache", {})
        if (device, dtype) not in cache:
            host = (torch.as_tensor(self.point_xy, dtype=dtype),
                    torch.as_tensor(self.stats["stencil_std"], dtype=dtype),
                    torch.as_tensor(self.patch_xy, dtype=dtype))
            cache[(device, dtype)] = tuple(t.to(device) for t in host)
        return cache[(device, dtype)]

    def __getstate__(self) -> dict:  # device tensors stay out of pickles (loader workers)
        return {k: v for k, v in self.__dict__.items() if k != "_device_cache"}

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Predicted states ``[B, S, N]`` for the ``S = states - history - 1`` steps after
        the start state, each step fed the previous prediction."""
        s, k = self.stats, self.data.history
        units = units_on(self.state_units, batch["states"].device)
        states = units.normalise(batch["states"])
        history, current = states[:, :k], states[:, k]
        valid, time = batch["lag_valid"], batch["time"]
        point_xy, stencil_std, _ = self._device_constants(states.device, states.dtype)
        scale = s["delta_std"] / s["u_std"]
        preds = []
        for step in range(states.shape[1] - k - 1):
            cond, cond_mask = self.conditioning(time + step * self.dt, batch["params"],
                                                history, valid)
            local = self.stencil(current) / stencil_std
            x = torch.cat([point_xy.expand(len(current), -1, -1), local,
                           batch["source"][..., None].to(current.dtype)], -1)
            update = model(x, conditioning=cond, conditioning_mask=cond_mask)[..., 0]
            following = current + scale * update.to(current.dtype)
            preds.append(following)
            if k:
                history = torch.cat([history[:, 1:], current[:, None]], dim=1)
                valid = torch.cat([valid[:, 1:], torch.ones_like(valid[:, :1])], dim=1)
            current = following
        return units.denormalise(torch.stack(preds, dim=1))                 # physical

    # -- loss and metrics ----------------------------------------------------------------
    def _targets(self, batch: Batch) -> torch.Tensor:
        return batch["states"][:, self.data.history + 1:]

    def loss(self, pred: torch.Tensor, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        """``sum_{b, j, n} ((u_hat - u) / sigma_delta)^2`` over the unrolled steps."""
        err = (pred.float() - self._targets(batch)) / self.stats["delta_std"]
        return token_sum(err.square().sum())

    def loss_count(self, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        return token_sum(torch.full((), float(self._targets(batch).numel()),
                                    device=batch["states"].device))

    def eval_records(self, pred: torch.Tensor, batch: Batch) -> dict[str, np.ndarray]:
        true = self._targets(batch).double()
        err = (pred.detach().double() - true).square().sum(-1).sqrt()
        rel = err / true.square().sum(-1).sqrt()                            # [B, S]
        return {"index": batch["index"].cpu().numpy(), "rel_l2": rel.cpu().numpy()}

    def summarize(self, split: str, records: dict[str, np.ndarray]) -> dict[str, Any]:
        per_step = records["rel_l2"].mean(0)
        return {"rollout_rel_l2": float(per_step.mean()),
                "final_rel_l2": float(per_step[-1]),
                "rel_l2_per_step": [float(v) for v in per_step]}

    # -- state and outputs ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return dict(self.stats)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_statistics(state)

    def describe_data(self) -> dict[str, Any]:
        d = self.data
        return {"dataset": "advection-diffusion", "resolution": self.resolution,
                "steps": d.steps, "dt": self.dt, "history": d.history, "patches": d.patches,
                "unroll": d.unroll, "horizon": d.horizon,
                "trajectories": {"train": len(d.train), "test": len(d.test)}}

    def data_identity(self) -> dict[str, Any]:
        return data_fingerprint({"u": self.data.train.u, "params": self.data.train.params},
                                self.data_root)

    def check_model(self, model_config: dict[str, Any]) -> None:
        want = {"arch": "conditioned", "in_dim": POINT_FEATURES, "out_dim": 1,
                "cond_dim": TOKEN_FEATURES, "cond_tokens": self.cond_tokens}
        got = {k: model_config.get(k) for k in want}
        if got != want:
            raise DataError(f"task rollout with history={self.data.history}, patches="
                            f"{self.data.patches} needs a model with {want}, the checkpoint's "
                            f"has {got}")

    def predictions_to_keep(self, split: str) -> list[int]:
        """The first :data:`SAVED_CASES` trajectories, whose rollouts :meth:`write_outputs`
        saves."""
        return list(range(min(SAVED_CASES, self.num_samples(split))))

    def write_outputs(self, out_dir: Path, split: str, records: dict[str, np.ndarray], *,
                      predictions: Mapping[int, np.ndarray] | None = None) -> list[Path]:
        """``test_rollout.npz``: per-trajectory, per-step errors and a few rollouts (the
        kept ``predictions`` of the first :data:`SAVED_CASES` trajectories)."""
        d = self.data
        cases = records["index"][:SAVED_CASES]
        R = self.resolution
        kept = predictions or {}
        arrays = {"rel_l2": records["rel_l2"], "index": records["index"],
                  "pred": np.stack([kept[int(i)] for i in cases]).reshape(len(cases), -1, R, R),
                  "true": d.test.u[cases][:, :d.horizon + 1],
                  "times": d.test.times[:d.horizon + 1]}
        return [atomic_write_npz(RunDir(out_dir).file(RunDir.ROLLOUT, split=split), arrays,
                                 compressed=True)]

    @classmethod
    def plot_run(cls, out_dir: Path, cases: int) -> list[Path]:
        return plot_rollout_run(Path(out_dir), cases)


def plot_rollout_run(run_dir: Path, cases: int = 3) -> list[Path]:
    """``curves.png`` (training loss, test rollout error per epoch), ``rollout_error.png``
    (relative L2 against rollout step) and ``rollout_cases.png`` (true / predicted fields)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    run = RunDir(run_dir)
    if run.has_log():
        written.append(plot_curves(run_dir, [
            Panel("training loss", (Series("train_loss", "training (live weights)"),)),
            Panel("test rollout rel. L2 (mean over horizon)",
                  weight_series("test_rollout_rel_l2", "test"))]))
    path = run.file(RunDir.ROLLOUT, split="test")
    if not path.is_file():
        return written
    with np.load(path) as f:
        rel, pred, true, times = f["rel_l2"], f["pred"], f["true"], f["times"]
    fig, ax = plt.subplots(figsize=(5.5, 3.6), constrained_layout=True)
    steps = np.arange(1, rel.shape[1] + 1)
    ax.plot(steps, rel.mean(0), marker="o", ms=3)
    ax.set_xlabel("rollout step"), ax.set_ylabel("relative L2"), ax.grid(alpha=.3)
    written.append(run.figure(RunDir.ROLLOUT_ERROR_FIGURE))
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    shown = [s for s in (1, rel.shape[1] // 2, rel.shape[1]) if s >= 1]
    rows = min(cases, len(pred))
    if rows:
        fig, axes = plt.subplots(rows, 2 * len(shown), figsize=(2.2 * 2 * len(shown),
                                                                  2.2 * rows),
                                 squeeze=False, constrained_layout=True)
        for r in range(rows):
            for c, s in enumerate(shown):
                lim = np.abs(true[r, s]).max()
                for j, (field, what) in enumerate(((true[r, s], "true"),
                                                   (pred[r, s - 1], "rollout"))):
                    ax = axes[r, 2 * c + j]
                    ax.imshow(field.T, origin="lower", cmap="RdBu_r", vmin=-lim, vmax=lim)
                    ax.set_xticks([]), ax.set_yticks([])
                    ax.set_title(f"{what}, t={times[s]:.2f}", fontsize=8)
        written.append(run.figure(RunDir.ROLLOUT_CASES_FIGURE))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


__all__ = ["RolloutData", "RolloutTask", "global_parameters", "load_rollout_data",
           "plot_rollout_run"]
