"""Generators of genuine PDE data, written in the public benchmarks' file layouts.

``GENERATORS`` maps a dataset name to ``make(out, *, n_train, n_test, resolution, seed,
progress, overwrite) -> list[Path]``; the files it writes are read by the loader of the same
name (``flarepp.data.load_dataset(name, out, n_train=..., n_test=...)``).

* ``darcy``: FNO's piecewise-constant Darcy recipe, 5-point finite volumes (``darcy.py``);
* ``elasticity``: a unit cell with a random void, linear elasticity, P1 finite elements on a
  triangle mesh, von Mises stress at 972 points (``elasticity.py``; needs ``flarepp[mesh]``).
* ``elasticity-mesh``: the same unit cells under a random load, one ``.vtu`` file per case
  with the stress at every vertex and the load as field data, as a solver writes them (the
  input of ``flarepp data convert``; ``elasticity.py``; needs ``flarepp[mesh]``).
* ``laplace-store``: solutions of Laplace's equation at random points of a cube, written
  straight into a store (:mod:`flarepp.data.store`) one sample at a time, so a data set of
  any size fits in the memory of one sample (``laplace.py``).
* ``surface-flow``: car-like bodies, potential-flow surface pressure and a skin-friction
  wall shear, DrivAerML's ``run_<i>/boundary_<i>.vtp`` layout (``surface_flow.py``; read with
  ``flarepp.data.drivaerml.DrivAerMLSurfaces``; needs ``flarepp[surface]``).
* ``advection-diffusion``: transient advection-diffusion trajectories with a pulsating
  source on a periodic grid, exact Fourier integrator (``advection_diffusion.py``; read by
  the ``rollout`` task, :mod:`flarepp.tasks.rollout`).
"""

from __future__ import annotations

from flarepp.data.generators.advection_diffusion import make_advection_diffusion
from flarepp.data.generators.darcy import make_darcy
from flarepp.data.generators.elasticity import make_elasticity, make_elasticity_mesh
from flarepp.data.generators.laplace import make_laplace_store
from flarepp.data.generators.surface_flow import make_surface_flow
from flarepp.registry import Registry

GENERATORS: Registry = Registry("generator")
GENERATORS.add("darcy", make_darcy, defaults={"resolution": 85},
               doc="Darcy flow, FNO recipe, finite volumes (.mat, release layout)")
GENERATORS.add("elasticity", make_elasticity, defaults={"resolution": None},
               doc="unit cell with a random void, linear elasticity (.npy, Geo-FNO layout)")
GENERATORS.add("elasticity-mesh", make_elasticity_mesh, defaults={"resolution": None},
               doc="the elasticity unit cells as a solver writes them: one .vtu per case, "
                   "von Mises stress at every vertex, the load a field-data condition")
GENERATORS.add("laplace-store", make_laplace_store, defaults={"resolution": 100_000},
               doc="harmonic fields at random points of a cube, written straight into a "
                   "store one sample at a time (any size: a data set larger than memory)")
GENERATORS.add("surface-flow", make_surface_flow, defaults={"resolution": 5000},
               doc="car-like bodies, source-panel pressure + skin-friction wall shear "
                   "(.vtp, DrivAerML layout; needs flarepp[surface])")
GENERATORS.add("advection-diffusion", make_advection_diffusion, defaults={"resolution": 32},
               doc="transient 2-D advection-diffusion with a pulsating source, exact Fourier "
                   "integrator (.npz trajectories; rollout task)")

_OTHER_SOURCES = {
    "drivaerml": "download the DrivAerML release (docs/drivaerml.md), or make a synthetic "
                 "stand-in in its layout with `flarepp data make surface-flow --out {out}` "
                 "(its split file is {out}/split.json)",
    "listops": "make it with `flarepp lra data make listops --out {out}{options}`",
    "pathfinder": "make it with `flarepp lra data make pathfinder --out {out}{options}`",
}


def how_to_get(dataset: str, out: str, options: str = "") -> str:
    """How to obtain ``dataset``'s files in ``out``, as a clause of a sentence: the
    generator that writes them (with ``options`` appended to its command), or where the
    release is described (docs/data.md, docs/lra.md) when flarepp has no generator for it."""
    options = f" {options}" if options else ""
    if dataset in GENERATORS.names():
        return f"make it with `flarepp data make {dataset} --out {out}{options}`"
    if dataset in _OTHER_SOURCES:
        return _OTHER_SOURCES[dataset].format(out=out, options=options)
    return (f"flarepp has no generator for {dataset!r}: download its release into {out} "
            "(docs/data.md and docs/lra.md list each dataset's files)")


__all__ = ["GENERATORS", "how_to_get", "make_advection_diffusion", "make_darcy",
           "make_elasticity", "make_elasticity_mesh", "make_laplace_store", "make_surface_flow"]
