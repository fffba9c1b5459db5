"""The ``drivaerml`` run-config dataset: full-surface DrivAerML (paper Section 4.2) as the
surface task reads it -- the surfaces (:mod:`flarepp.data.drivaerml`), the scored split and
the cells drawn per training step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flarepp.data.base import DataError
from flarepp.data.drivaerml import PRESSURE_ARRAY, WALL_SHEAR_ARRAY, DrivAerMLSurfaces
from flarepp.data.registry import DATASETS

DATASET = "drivaerml"
TEST_SPLITS = ("test", "val")



def check_options(*, test_split: str, cells_per_step: int, pressure_array: str,
                  wall_shear_array: str) -> None:
    """Raise a ``ValueError`` naming the ``drivaerml`` option whose value is unusable."""
    if test_split not in TEST_SPLITS:
        raise ValueError(f"dataset_options.test_split must be one of {', '.join(TEST_SPLITS)}"
                         f" (the split that is scored), got {test_split!r}")
    if isinstance(cells_per_step, bool) or not isinstance(cells_per_step, int) \
            or cells_per_step < 1:
        raise ValueError(f"dataset_options.cells_per_step must be a positive integer (cells "
                         f"drawn per training step), got {cells_per_step!r}")
    for key, name in (("pressure_array", pressure_array),
                      ("wall_shear_array", wall_shear_array)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"dataset_options.{key} must name a cell array of the .vtp "
                             f"files, got {name!r}")


def resolve_split_file(root: Path, split_file: str | None) -> Path | None:
    """``None`` (the paper's split, shipped with the package), or ``split_file``: a relative
    path is read in the data directory ``root`` only (never in the working directory, where
    an unrelated ``split.json`` would silently stand in for a missing one); an absolute path
    as given."""
    if split_file is None:
        return None
    path = Path(split_file).expanduser()
    if path.is_absolute():
        if not path.is_file():
            raise DataError(f"split file {str(path)!r} does not exist")
        return path
    if not (root / path).is_file():
        raise DataError(f"split file {split_file!r} is missing from the data directory "
                        f"{str(root)!r} (`flarepp data make surface-flow` writes split.json "
                        "last: a directory without it was not finished, make it again); a "
                        "split file elsewhere needs an absolute path")
    return root / path


@dataclass
class SurfaceData:
    """The ``drivaerml`` dataset: the surfaces, the scored split and the cells per step."""

    surfaces: DrivAerMLSurfaces
    test_split: str
    cells_per_step: int

    def cars(self, split: str) -> list[str]:
        """Car ids (the data set's ``run_<i>`` folders) of the task's ``train`` split or its
        ``test`` split (``test_split``)."""
        if split == "train":
            return self.surfaces.cars("train")
        if split == "test":
            return self.surfaces.cars(self.test_split)
        raise ValueError(f"unknown split {split!r}; the surface task has 'train' and 'test' "
                         f"(the split file's {self.test_split!r})")

    def validate(self) -> "SurfaceData":
        """Both splits list runs, and every listed run has its boundary file."""
        for split, name in (("train", "train"), ("test", self.test_split)):
            if not self.cars(split):
                raise DataError(f"{self.surfaces.split_file}: split {name!r} lists no runs")
        self.surfaces.check_layout(("train", self.test_split))
        return self


def load_drivaerml(root: Path, *, split_file: str | None = None, cache_dir: str | None = None,
                   pressure_array: str = PRESSURE_ARRAY,
                   wall_shear_array: str = WALL_SHEAR_ARRAY, test_split: str = "test",
                   cells_per_step: int = 100_000) -> SurfaceData:
    """The full-surface DrivAerML files under ``root`` (module docstring).

    ``split_file``: JSON of run ids (default: the paper's split, Alkin et al. 2025; a
    relative path is read from ``root`` only); ``cache_dir``: where converted arrays go
    (default ``root/.flarepp_cache``); ``pressure_array`` and ``wall_shear_array``: the cell
    arrays read; ``test_split``: ``test`` or ``val``; ``cells_per_step``: cells drawn from the
    geometry of each training step (100K in the paper).
    """
    check_options(test_split=test_split, cells_per_step=cells_per_step,
                  pressure_array=pressure_array, wall_shear_array=wall_shear_array)
    root = Path(root)
    surfaces = DrivAerMLSurfaces(root, split_file=resolve_split_file(root, split_file),
                                 cache_dir=cache_dir, pressure_array=pressure_array,
                                 wall_shear_array=wall_shear_array)
    return SurfaceData(surfaces, test_split, cells_per_step)


DATASETS.add(DATASET, load_drivaerml,
             doc="full-surface DrivAerML: run_<i>/boundary_<i>.vtp, 6 inputs -> 4 fields "
                 "(surface task)")


__all__ = ["DATASET", "TEST_SPLITS", "SurfaceData", "check_options", "load_drivaerml",
           "resolve_split_file"]
