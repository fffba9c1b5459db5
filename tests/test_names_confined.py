"""Every name read from a file or a spec that becomes a path stays in its directory.

A hostile probe found names that wrote and read outside where they belong: a spec's array
``name = "../../../x"`` wrote ``x.npy`` above the store, a store's ``manifest.json`` naming a
sample ``../x`` or an absolute path was read (``data check --verify`` and ``train`` passed),
an XDMF case's ``Binary`` data item pulled any local file into the store. Every such name
now goes through :func:`flarepp.io.confined`. This test is generated over the entry points
(the rows of ``ENTRY_POINTS``) and the attacks (``ATTACKS``): each row is one function that
turns a hostile name into the path it would become; a later entry point is one more row. Each pair must be refused, and nothing outside the
directory the entry point may write in may change.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

pytest.importorskip("pyvista")
pytest.importorskip("meshio")

from flarepp.data.convert import convert, find_cases, read_condition_table  # noqa: E402
from flarepp.data.meshes import read_mesh  # noqa: E402
from flarepp.data.spec import parse_spec  # noqa: E402
from flarepp.data.store import MeshStore, StoreWriter, load_store  # noqa: E402
from mesh_files import point_field, volume_mesh  # noqa: E402

ATTACKS = ("parent", "absolute", "climb", "link")
"""``../x``, an absolute path outside, ``a/../../x``, and a symbolic link planted in the
entry point's directory that leads outside."""


@dataclass
class Scene:
    """The files of one attempt: ``work`` (where the entry point's inputs and outputs
    are), ``outside`` (a directory no entry point may touch) and a source of 2 cases."""

    work: Path
    outside: Path
    source: Path

    def name(self, attack: str, root: Path, leaf: str = "x") -> str:
        """The hostile name of ``attack`` for a directory ``root``; ``link`` plants
        ``root/link`` leading to ``outside`` and names ``link/<leaf>``."""
        if attack == "link":
            root.mkdir(parents=True, exist_ok=True)
            (root / "link").symlink_to(self.outside, target_is_directory=True)
            return f"link/{leaf}"
        return {"parent": f"../{leaf}", "absolute": str(self.outside / leaf),
                "climb": f"a/../../{leaf}"}[attack]


def _cases(folder: Path, n: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        mesh = volume_mesh(i, n=2)
        mesh.point_data["T"] = point_field(mesh.points)
        mesh.save(folder / f"case_{i}.vtu")
    return folder


def _store(scene: Scene) -> Path:
    store = scene.work / "store"
    convert(scene.source, store, parse_spec({"targets": ["T"]}), progress=False)
    return store


def _edit_manifest(store: Path, edit: Callable[[dict], None]) -> None:
    manifest = json.loads((store / "manifest.json").read_text())
    edit(manifest)
    (store / "manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------------------------------------
# the entry points: each returns the directory it may write in (None: it only reads) and
# a call that must be refused

def spec_array_name(scene: Scene, attack: str):
    """A spec's input or target ``name``: stored as ``<sample>/<name>.npy``."""
    store = scene.work / "store"
    if attack != "link":
        name = scene.name(attack, store)
        return store, lambda: convert(scene.source, store, parse_spec(
            {"targets": [{"array": "T", "name": name}]}), progress=False)
    spec = parse_spec({"targets": [{"array": "T", "name": "x"}]})
    convert(scene.source, store, spec, progress=False)
    (store / "manifest.json").unlink()          # an unfinished store: the rerun resumes it
    (scene.outside / "x.npy").write_bytes((store / "case_0" / "x.npy").read_bytes())
    (store / "case_0" / "x.npy").unlink()
    (store / "case_0" / "x.npy").symlink_to(scene.outside / "x.npy")
    return store, lambda: convert(scene.source, store, spec, progress=False)


def manifest_sample_name(scene: Scene, attack: str):
    """A sample name in ``manifest.json``: read as ``STORE/<name>/`` (check, train)."""
    store = _store(scene)
    name = scene.name(attack, store, "case_0")
    target = Path(name) if Path(name).is_absolute() else store / name
    shutil.copytree(store / "case_0", target.resolve())   # a real sample there

    def rename(manifest: dict) -> None:
        manifest["samples"][name] = manifest["samples"].pop("case_0")
        manifest["splits"] = {k: [name if n == "case_0" else n for n in v]
                              for k, v in manifest["splits"].items()}
    _edit_manifest(store, rename)

    def read() -> None:
        MeshStore(store).check(full=True)
        load_store(store).train.sample(0)
    return None, read


def manifest_group_name(scene: Scene, attack: str):
    """An array (group) name in ``manifest.json``: read as ``<sample>/<name>.npy``."""
    store = _store(scene)
    if attack == "link":     # the name stays; its file becomes a link out of the store
        (scene.outside / "T.npy").write_bytes((store / "case_0" / "T.npy").read_bytes())
        (store / "case_0" / "T.npy").unlink()
        (store / "case_0" / "T.npy").symlink_to(scene.outside / "T.npy")
    else:
        name = scene.name(attack, store / "case_0", "T")
        for sample in ("case_0", "case_1"):
            target = Path(name) if Path(name).is_absolute() else store / sample / name
            shutil.copy(store / sample / "T.npy", f"{target.resolve()}.npy")

        def rename(manifest: dict) -> None:
            manifest["layout"]["targets"][0]["name"] = name
            for entry in manifest["samples"].values():
                entry["stored"][name] = entry["stored"].pop("T")
        _edit_manifest(store, rename)

    def read() -> None:
        store_ = MeshStore(store)
        store_.check(full=True)
        store_.split("train").sample(0)
    return None, read


def case_name(scene: Scene, attack: str):
    """A case's name in ``data convert``: written as ``STORE/<name>/`` by the sink."""
    store = scene.work / "store"
    writer = StoreWriter(store, {"spec": "x"})
    name = scene.name(attack, store, "case_0")

    def write() -> None:
        try:
            writer.write(name, {"u": np.zeros((3, 1), np.float32)}, {"source": {}})
        finally:
            writer.close()
    return store, write


def condition_table_case(scene: Scene, attack: str):
    """A case in a condition table: it names a case by its path under the source."""
    name = scene.name(attack, scene.source, "case_0")
    table = scene.work / "table.json"
    table.write_text(json.dumps({name: {"load": 1.0}}))
    return None, lambda: read_condition_table(table, ["load"])


def xdmf_data_item(scene: Scene, attack: str):
    """The file of an XDMF case's ``Binary`` data item: read relative to the case."""
    case_dir = scene.work / "xdmf"
    case_dir.mkdir()
    if attack == "link":
        (scene.outside / "T.bin").write_bytes(np.arange(4, dtype=np.float64).tobytes())
        (case_dir / "T.bin").symlink_to(scene.outside / "T.bin")
        name = "T.bin"
    else:
        name = scene.name(attack, case_dir, "T.bin")
        target = Path(name) if Path(name).is_absolute() else case_dir / name
        np.arange(4, dtype=np.float64).tofile(target.resolve())
    (case_dir / "case.xdmf").write_text(XDMF.format(binary=name))
    return None, lambda: read_mesh(case_dir / "case.xdmf")


def spec_pattern(scene: Scene, attack: str):
    """A spec's ``pattern``: a glob of case files under the source."""
    _cases(scene.outside, 1)
    pattern = scene.name(attack, scene.source, "*.vtu")
    return None, lambda: find_cases(scene.source, parse_spec({"targets": ["T"],
                                                              "pattern": pattern}))


def study_point(scene: Scene, attack: str):
    """A study's point name (``study.json``, an Optuna journal's trial): its claim is
    created as ``claims/<name>/.lock``, its run as ``runs/<name>/``."""
    from flarepp.storage.studydir import StudyDir
    study = scene.work / "study"
    name = scene.name(attack, study / "claims")
    return study, lambda: StudyDir(study).claim(name).acquire()


def write_mesh_name(scene: Scene, attack: str):
    """A case's name under ``infer --write-mesh DIR``: written as ``DIR/<name>.vtu``."""
    from flarepp.inference.infer import _Targets
    out = scene.work / "meshes"
    name = scene.name(attack, out)
    return out, lambda: _Targets(out).claim(name, ".vtu")


XDMF = """<?xml version="1.0"?>
<Xdmf Version="3.0"><Domain><Grid Name="mesh" GridType="Uniform">
<Topology TopologyType="Triangle" NumberOfElements="1">
<DataItem Dimensions="1 3" Format="XML" DataType="Int">0 1 2</DataItem></Topology>
<Geometry GeometryType="XYZ">
<DataItem Dimensions="4 3" Format="XML">0 0 0 1 0 0 0 1 0 1 1 0</DataItem></Geometry>
<Attribute Name="T" AttributeType="Scalar" Center="Node">
<DataItem Dimensions="4" Format="Binary" DataType="Float" Precision="8">{binary}</DataItem>
</Attribute></Grid></Domain></Xdmf>
"""

ENTRY_POINTS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "spec array name": (spec_array_name, ATTACKS),
    "manifest sample name": (manifest_sample_name, ATTACKS),
    "manifest group name": (manifest_group_name, ATTACKS),
    "case name": (case_name, ATTACKS),
    # a table's case is looked up among the cases, never opened: no link can lead it out
    "condition table case": (condition_table_case, ("parent", "absolute", "climb")),
    "xdmf data item": (xdmf_data_item, ATTACKS),
    "spec pattern": (spec_pattern, ATTACKS),
    "study point": (study_point, ATTACKS),
    "write-mesh name": (write_mesh_name, ATTACKS),
}
"""Every entry point where a read name becomes a path, with the attacks that apply."""


def _snapshot(top: Path, allowed: Path | None) -> dict[str, tuple[str, bytes]]:
    """Every entry under ``top`` outside ``allowed``: its kind and content (a link: its
    target)."""
    seen = {}
    for path in sorted(top.rglob("*")):
        if allowed is not None and (path == allowed or allowed in path.parents):
            continue
        kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
        seen[str(path)] = (kind, str(path.readlink()).encode() if kind == "link" else
                           path.read_bytes() if kind == "file" else b"")
    return seen


@pytest.mark.parametrize("entry, attack", [(entry, attack)
                                           for entry, (_, attacks) in ENTRY_POINTS.items()
                                           for attack in attacks])
def test_a_hostile_name_is_refused_and_nothing_outside_changes(entry, attack, tmp_path):
    """Each entry point refuses each attack with one sentence (a ``ValueError``: a
    ``DataError`` or ``SpecError``) and leaves everything outside the directory it may
    write in as it was. A failure names the entry point and the attack that got through."""
    scene = Scene(tmp_path / "work", tmp_path / "outside", _cases(tmp_path / "work" / "src"))
    scene.outside.mkdir()
    (scene.outside / "keep.txt").write_text("a file no entry point may touch")
    allowed, attempt = ENTRY_POINTS[entry][0](scene, attack)
    before = _snapshot(tmp_path, allowed)
    with pytest.raises(ValueError) as refused:
        attempt()
    message = str(refused.value)
    assert "\n" not in message and ("link" in message or "relative path" in message
                                    or "plain file name" in message), message
    assert _snapshot(tmp_path, allowed) == before, f"{entry}: {attack} changed files outside"
