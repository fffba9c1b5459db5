"""Other FLARE implementations' checkpoints in and out of flarepp, exactly.

:data:`IMPORT_FORMATS` names each reader (``physicsnemo``: NVIDIA PhysicsNeMo's ``.mdlus``;
``flare-py``: the FLARE authors' case directories and checkpoints); each returns an
:class:`~flarepp.interop.run.ImportedModel` (flarepp's model config and weights, computing
the same function), which :func:`import_checkpoint` writes as a run directory with the
normalisers the user names. :data:`EXPORT_FORMATS` names the ways back
(``mdlus``). The weight algebra is :mod:`flarepp.interop.maps`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flarepp.interop.flare_py import import_flare_py, locate
from flarepp.interop.maps import InteropError
from flarepp.interop.physicsnemo import export_mdlus, import_mdlus
from flarepp.interop.run import (IDENTITY, ImportedModel, NormalizerSource, read_normalizers,
                                 write_imported_run)
from flarepp.registry import Registry

IMPORT_FORMATS: Registry = Registry("import format")
IMPORT_FORMATS.add("physicsnemo", import_mdlus,
                   doc="NVIDIA PhysicsNeMo's FLARE / FLAREPlusPlus model (.mdlus)")
IMPORT_FORMATS.add("flare-py", import_flare_py,
                   doc="the FLARE authors' FLAREModel / FLAREPPModel (vpuri3/FLARE.py)")

EXPORT_FORMATS: Registry = Registry("export format")
EXPORT_FORMATS.add("mdlus", export_mdlus,
                   doc="PhysicsNeMo's FLARE model (.mdlus), where its function is flarepp's")


@dataclass
class ImportReport:
    """What :func:`import_checkpoint` wrote: the checkpoint, the model it holds, where the
    normalisers came from and the import's notes."""

    checkpoint: Path
    imported: ImportedModel
    normalizers: NormalizerSource


def import_checkpoint(fmt: str, source: str | Path, out: str | Path, *, normalizers: str,
                      coordinates: int | None = None, **options: Any) -> ImportReport:
    """Read ``source`` with the reader ``fmt`` names and write the run directory ``out``
    with the normalisers ``normalizers`` names (a store, a statistics file or ``identity``);
    ``coordinates`` overrides how many leading input channels are point coordinates;
    ``options`` go to the reader (``config`` for ``flare-py``)."""
    imported = IMPORT_FORMATS.get(fmt)(source, **options)
    config = imported.model_config
    norms = read_normalizers(normalizers, config["in_dim"], config["out_dim"])
    if coordinates is not None:
        if not 0 <= coordinates <= config["in_dim"]:
            raise InteropError(f"--coordinates {coordinates}: the model takes "
                               f"{config['in_dim']} input channels")
        norms.coordinates = coordinates
    elif norms.coordinates is None:     # what the source says (PhysicsNeMo: its embedding)
        norms.coordinates = imported.coordinates
    path = write_imported_run(out, imported, norms, source_file=_source_file(fmt, source))
    return ImportReport(path, imported, norms)


def _source_file(fmt: str, source: str | Path) -> Path:
    """The file whose hash the provenance records (a flare-py case's checkpoint)."""
    if fmt == "flare-py":
        return locate(Path(source), None)[0]
    return Path(source)


__all__ = ["EXPORT_FORMATS", "IDENTITY", "IMPORT_FORMATS", "ImportReport", "ImportedModel",
           "InteropError", "NormalizerSource", "import_checkpoint", "read_normalizers"]
