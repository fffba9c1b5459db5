"""Generators of genuine PDE data, written in the public benchmarks' file layouts.

``GENERATORS`` maps a dataset name to ``make(out, *, n_train, n_test, resolution, seed,
progress, overwrite) -> list[Path]``; the files it writes are read by the loader of the same
name (``flarepp.data.load_dataset(name, out, n_train=..., n_test=...)``).

* ``darcy``: FNO's piecewise-constant Darcy recipe, 5-point finite volumes (``darcy.py``);
* ``elasticity``: a unit cell with a random void, linear elasticity, P1 finite elements on a
  triangle mesh, von Mises stress at 972 points (``elasticity.py``; needs ``flarepp[mesh]``).
"""

from __future__ import annotations

from flarepp.data.generators.darcy import make_darcy
from flarepp.data.generators.elasticity import make_elasticity
from flarepp.registry import Registry

GENERATORS: Registry = Registry("generator")
GENERATORS.add("darcy", make_darcy, defaults={"resolution": 85},
               doc="Darcy flow, FNO recipe, finite volumes (.mat, release layout)")
GENERATORS.add("elasticity", make_elasticity, defaults={"resolution": None},
               doc="unit cell with a random void, linear elasticity (.npy, Geo-FNO layout)")

__all__ = ["GENERATORS", "make_darcy", "make_elasticity"]
