"""Figures like the paper's 9-12 and training curves, as PNG files in a run directory.

Field panels: reference, prediction and the signed error in percent of the case's
reference RMS (so the RMS of the error panel is the case's relative L2 in percent), on the
true geometry: ``pcolormesh`` on the mesh coordinates for structured meshes, a
triangulation of the points for point clouds (triangles spanning holes are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.tri as mtri  # noqa: E402
import numpy as np  # noqa: E402

from flarepp.storage.rundir import RunDir  # noqa: E402


def _triangulation(xy: np.ndarray) -> mtri.Triangulation:
    tri = mtri.Triangulation(xy[:, 0], xy[:, 1])
    pts = xy[tri.triangles]
    edges = np.linalg.norm(pts - np.roll(pts, 1, axis=1), axis=-1).max(axis=1)
    tri.set_mask(edges > 3.0 * np.median(edges))  # voids and concave boundaries
    return tri


@dataclass(frozen=True)
class FlatMesh:
    """A planar mesh drawn by its own cells: ``triangulation`` of its polygons (fans, in
    the mesh's two in-plane coordinates) and, for values at the cells, ``owner [T]``: the
    cell of each triangle (None: values at the points, interpolated across triangles)."""

    triangulation: mtri.Triangulation
    owner: np.ndarray | None = None


def _panel(ax, values, coords, grid_shape, mask, flat: FlatMesh | None = None, **kw):
    if flat is not None:
        if flat.owner is not None:
            return ax.tripcolor(flat.triangulation, facecolors=values[flat.owner], **kw)
        return ax.tripcolor(flat.triangulation, values, shading="gouraud", **kw)
    if grid_shape is not None:
        shape = tuple(int(s) for s in grid_shape)
        X, Y = coords[:, 0].reshape(shape), coords[:, 1].reshape(shape)
        return ax.pcolormesh(X, Y, values.reshape(shape), shading="gouraud", **kw)
    keep = np.ones(len(values), bool) if mask is None else mask
    points, values = coords[keep], values[keep]
    extent = np.ptp(points, axis=0) if len(points) else np.zeros(points.shape[1])
    if points.shape[1] >= 3 and extent[2] > 0:
        # 3-D points without a mesh: the view along the axis of least extent, nearest last
        depth = int(np.argmin(extent))
        u, v = (k for k in range(3) if k != depth)
        order = np.argsort(points[:, depth])
        size = max(0.5, 4e4 / max(len(points), 1))
        return ax.scatter(points[order, u], points[order, v], c=values[order], s=size,
                          linewidths=0, **kw)
    return ax.tripcolor(_triangulation(points[:, :2]), values, shading="gouraud", **kw)


ERROR_LABEL = "error [% of reference RMS]"


def field_panel_specs(ref: np.ndarray | None, prd: np.ndarray, valid: np.ndarray | None = None
                      ) -> list[tuple[np.ndarray, str, dict]]:
    """``(values, title, colour options)`` of the panels of one channel: reference,
    prediction (colour limits the reference's 0.5th and 99.5th percentiles) and the signed
    error ``100 (prediction - reference) / RMS(reference)`` (symmetric limits at its
    99.5th percentile of magnitude), or the prediction alone without a reference."""
    valid = np.ones(len(prd), bool) if valid is None else valid
    shown = prd if ref is None else ref
    lo, hi = np.percentile(shown[valid], [0.5, 99.5])
    panels = [(prd, "prediction", dict(cmap="viridis", vmin=lo, vmax=hi))]
    if ref is None:
        return panels
    rms = np.sqrt(np.mean(ref[valid] ** 2)) or 1.0
    err = np.where(valid, 100.0 * (prd - ref) / rms, 0.0)
    elim = np.percentile(np.abs(err[valid]), 99.5) or 1.0
    return [(ref, "reference", panels[0][2]), panels[0],
            (err, "signed error", dict(cmap="RdBu_r", vmin=-elim, vmax=elim))]


def field_panels(fig, axes, ref, prd, coords, grid, mask, label: str,
                  flat: FlatMesh | None = None) -> None:
    """Reference, prediction and signed error (in % of the reference's RMS) of one channel
    on ``axes`` (three of them; one, the prediction, when ``ref`` is None)."""
    for ax, (vals, title, kw) in zip(axes, field_panel_specs(ref, prd, mask)):
        art = _panel(ax, vals, coords, grid, mask, flat, **kw)
        ax.set_title(title)
        ax.set_aspect("equal")
        ax.set_xticks([]), ax.set_yticks([])
        fig.colorbar(art, ax=ax, shrink=0.85,
                     label=ERROR_LABEL if title == "signed error" else label)


def channel_label(names: list[str], channel: int, units: str) -> str:
    """``"name [units]"`` of output channel ``channel`` (``channel k`` when unnamed)."""
    name = names[channel] if channel < len(names) else f"channel {channel}"
    return f"{name} [{units}]" if units else name


def plot_fields(path: str | Path, coords: np.ndarray, pred: np.ndarray,
                true: np.ndarray | None, names: list[str], units: str, title: str, *,
                flat: FlatMesh | None = None) -> Path:
    """One figure of a sample's fields, a row per output channel (at most 4): reference,
    prediction and signed error, or the prediction alone without a reference; on a planar
    mesh's own cells (``flat``), else on the points (3-D points seen along their axis of
    least extent). Written to ``path``."""
    rows = min(pred.shape[1], 4)
    cols = 1 if true is None else 3
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.6 * rows), squeeze=False,
                             constrained_layout=True)
    for ch in range(rows):
        field_panels(fig, axes[ch], None if true is None else true[:, ch], pred[:, ch],
                      coords, None, None, channel_label(names, ch, units), flat)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


@dataclass(frozen=True)
class Series:
    """One line of a curve panel: the ``log.jsonl`` key it draws, times ``scale``; records
    that hold the key ``unless`` are left out of it (a stand-in for older logs)."""

    key: str
    label: str
    scale: float = 1.0
    linestyle: str = "-"
    unless: str | None = None


def weight_series(key: str, label: str, scale: float = 1.0) -> tuple[Series, ...]:
    """The lines of an evaluated metric, ``key`` of ``log.jsonl``: its raw weights' values
    (``key_raw``, solid) and its EMA weights' (``key_ema``, dashed); a log written before
    both were stored holds only ``key``, which was the EMA weights'."""
    return (Series(f"{key}_raw", f"{label} (raw weights)", scale),
            Series(f"{key}_ema", f"{label} (EMA weights)", scale, "--"),
            Series(key, f"{label} (EMA weights)", scale, "--", unless=f"{key}_ema"))


@dataclass(frozen=True)
class Panel:
    """One axis of ``curves.png``: its y label, its lines, a log or linear y axis, and
    horizontal reference lines ``(y, label, linestyle)`` (e.g. chance level)."""

    ylabel: str
    series: tuple[Series, ...]
    log: bool = True
    references: tuple[tuple[float, str, str], ...] = ()


def plot_curves(run_dir: str | Path, panels: list[Panel]) -> Path:
    """``curves.png`` of a run: one axis per panel, each series against epoch (a series
    absent from the log is left out; sparse ones, e.g. evaluations every few epochs, get
    markers). Every task draws its training curves through this one function."""
    run = RunDir(run_dir)
    records = run.read_log()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8),
                             constrained_layout=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for series in panel.series:
            points = [(r["epoch"], series.scale * r[series.key]) for r in records
                      if series.key in r and (series.unless is None or series.unless not in r)]
            if not points:
                continue
            sparse = len(points) < len(records)
            ax.plot(*zip(*points), marker="o" if sparse else None, ms=3, label=series.label,
                    ls=series.linestyle)
        for y, label, style in panel.references:
            ax.axhline(y, color="gray", ls=style, lw=1, label=label)
        if panel.log:
            ax.set_yscale("log")
        ax.set_xlabel("epoch"), ax.set_ylabel(panel.ylabel), ax.grid(alpha=.3)
        if len(panel.series) + len(panel.references) > 1:
            ax.legend()
    path = run.curves
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["ERROR_LABEL", "FlatMesh", "Panel", "Series", "channel_label", "field_panel_specs",
           "field_panels",
           "plot_curves", "plot_fields",
           "weight_series"]
