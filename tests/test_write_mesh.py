"""`flarepp infer --write-mesh`: predictions, targets and errors written back as arrays of
each sample's source mesh (a converted store's VTU), or as a point cloud where the data has
no mesh, each with a picture of the fields on that mesh (its cells, its surface, a cut-away
of a volume: plots3d.plot_mesh_fields, which `flarepp plot` uses too); and the command's
refusals. The surface task's cars and ``--geometry`` are checked in
tests/test_surface_task.py's end-to-end test."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")
pytest.importorskip("skfem")

import flarepp  # noqa: E402
import matplotlib.colors as mcolors  # noqa: E402
import matplotlib.image as mimage  # noqa: E402
from flarepp.cli import main  # noqa: E402
from flarepp.data import DataError  # noqa: E402
from flarepp.inference.infer import Case, write_on_mesh  # noqa: E402
from flarepp.io import UnsafeName, is_temporary  # noqa: E402
from flarepp.data.generators.elasticity import make_elasticity_mesh  # noqa: E402
from flarepp.data.store import MeshStore  # noqa: E402
from tiny_runs import tiny_darcy_run, tiny_store_run  # noqa: E402


@pytest.fixture(scope="module")
def store_run(tmp_path_factory):
    """A store converted from solver VTU files (the load as a condition) and a conditioned
    run on it: ``(cases, store, run)``."""
    return tiny_store_run(tmp_path_factory.mktemp("write-mesh"))


def coloured_share(png) -> float:
    """The share of a picture's pixels that are coloured (saturated and not dark: a
    field's colour map, not white background, black text or grey): a scatter of a few
    thousand points covers about 6%, a mesh's cells or rendered surface 18-40%."""
    hsv = mcolors.rgb_to_hsv(mimage.imread(png)[..., :3])
    return float(((hsv[..., 1] > 0.25) & (hsv[..., 2] > 0.15)).mean())


@pytest.mark.slow
def test_store_predictions_land_on_their_source_vtu(store_run, tmp_path, capsys):
    """Each test sample's VTU is its source mesh (same points and cells) with
    ``pred_von_mises`` equal to the .npz prediction, ``true_von_mises`` the stored target and
    ``error_von_mises`` their difference, and a picture beside it. A failure points to arrays
    attached to the wrong mesh or rows, or conditions that did not reach the model."""
    cases, store, run = store_run
    out = tmp_path / "meshes"
    assert main(["infer", str(run), "--data", str(store), "--out", str(tmp_path / "p.npz"),
                 "--write-mesh", str(out)]) == 0
    assert "wrote " + str(out / "test" / "case_0000.vtu") in capsys.readouterr().out
    stored = MeshStore(store)
    test = stored.split("test")
    with np.load(tmp_path / "p.npz") as pred:
        for i, name in enumerate(test.names):
            mesh = pv.read(out / f"{name}.vtu")
            source = pv.read(cases / f"{name}.vtu")
            assert (mesh.n_points, mesh.n_cells) == (source.n_points, source.n_cells)
            np.testing.assert_array_equal(mesh.points, source.points)
            np.testing.assert_array_equal(mesh.point_data["pred_von_mises"],
                                          pred[f"pred_{name}"][:, 0])
            _, y = test.sample(i)
            np.testing.assert_array_equal(mesh.point_data["true_von_mises"], y[:, 0])
            np.testing.assert_allclose(mesh.point_data["error_von_mises"],
                                       pred[f"pred_{name}"][:, 0] - y[:, 0], atol=1e-6)
            assert coloured_share(out / f"{name}.png") > 0.12
    with np.load(run / "test_predictions.npz") as stored:     # `flarepp plot` finds the meshes
        assert [str(s) for s in stored["sources"]] == [
            str((cases / f"{n}.vtu").resolve()) for n in test.names]
    assert main(["plot", str(run)]) == 0
    assert coloured_share(run / "case_0000_ch0.png") > 0.12


@pytest.mark.slow
def test_data_without_a_mesh_becomes_point_clouds_and_a_gone_source_is_said(store_run,
                                                                            tmp_path, capsys):
    """Generated Darcy samples (no source mesh) are written as point clouds at their
    coordinates, one per sample; a store whose source files were moved away still writes,
    as point clouds, with a warning naming the missing file. A failure points to the
    fallback."""
    data, run = tiny_darcy_run(tmp_path / "darcy")
    out = tmp_path / "darcy-meshes"
    assert main(["infer", str(run), "--data", str(data), "--out", str(tmp_path / "d.npz"),
                 "--write-mesh", str(out)]) == 0
    with np.load(tmp_path / "d.npz") as pred:
        cloud = pv.read(out / "sample_0003.vtp")
        assert cloud.n_points == 81
        np.testing.assert_array_equal(cloud.point_data["pred_pressure_u"], pred["pred"][3, :, 0])
    assert len(list(out.glob("sample_*.vtp"))) == 4 and len(list(out.glob("*.png"))) == 4

    cases, store, run = store_run
    moved = tmp_path / "moved"
    shutil.copytree(cases, moved)
    shutil.rmtree(cases)
    try:
        capsys.readouterr()
        assert main(["infer", str(run), "--data", str(store), "--out",
                     str(tmp_path / "s.npz"), "--write-mesh", str(tmp_path / "clouds")]) == 0
        assert "the source mesh is gone" in capsys.readouterr().err
        assert pv.read(tmp_path / "clouds" / "test" / "case_0000.vtp").n_points > 0
    finally:
        shutil.copytree(moved, cases)


@pytest.mark.slow
def test_infer_refuses_no_cases_or_a_geometry_for_a_fields_run(store_run, tmp_path, capsys):
    """Neither --data nor --geometry, both, and --geometry on a run that is not of the
    surface task: each a sentence, exit 2, nothing written."""
    _, store, run = store_run
    out = tmp_path / "p.npz"
    assert main(["infer", str(run), "--out", str(out)]) == 2
    assert "--data" in capsys.readouterr().err
    assert main(["infer", str(run), "--data", str(store), "--geometry", "x.stl",
                 "--out", str(out)]) == 2
    assert main(["infer", str(run), "--geometry", str(tmp_path / "car.stl"),
                 "--out", str(out)]) == 2
    assert "a surface's cell centres and normals" in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# a new mesh from the command line (issue 39 item 1)

@pytest.mark.slow
def test_a_new_mesh_is_built_as_the_store_was_and_written_onto_itself(store_run, tmp_path):
    """``infer RUN --mesh new.vtu --condition load=1.7 --write-mesh DIR`` on a mesh the
    store never held writes DIR/new.vtu: the new mesh itself (its points and cells) with
    ``pred_von_mises`` equal to ``flarepp.load(run).predict`` of its points and that load
    (1e-6); a folder of meshes with a condition table gives each mesh its row; without a
    condition the mesh's own field data is read, as the conversion read it. A failure
    points to inputs built otherwise than the store's, or conditions lost on the way."""
    _, _, run = store_run
    new = tmp_path / "new"
    make_elasticity_mesh(new, n_train=1, n_test=1, seed=11, progress=False)
    mesh_file = new / "test" / "case_0000.vtu"
    source = pv.read(mesh_file)
    out = tmp_path / "meshes"
    assert main(["infer", str(run), "--mesh", str(mesh_file), "--condition", "load=1.7",
                 "--out", str(tmp_path / "p.npz"), "--write-mesh", str(out)]) == 0
    written = pv.read(out / "case_0000.vtu")
    assert (written.n_points, written.n_cells) == (source.n_points, source.n_cells)
    np.testing.assert_array_equal(written.points, source.points)
    predictor = flarepp.load(run, device="cpu")

    def expected(mesh, load):
        return predictor.predict(np.asarray(mesh.points)[:, :2], conditions={"load": load})

    want = expected(source, 1.7)
    np.testing.assert_allclose(written.point_data["pred_von_mises"], want[:, 0],
                               rtol=1e-6, atol=1e-6)
    with np.load(tmp_path / "p.npz") as pred:
        np.testing.assert_allclose(pred["pred_case_0000"], want, rtol=1e-6, atol=1e-6)
    table = tmp_path / "loads.csv"
    table.write_text("case,load\ntest/case_0000,0.8\ntrain/case_0000,2.2\n")
    assert main(["infer", str(run), "--mesh", str(new), "--conditions", str(table),
                 "--out", str(tmp_path / "folder.npz")]) == 0
    with np.load(tmp_path / "folder.npz") as pred:
        assert sorted(str(c) for c in pred["cases"]) == ["test/case_0000", "train/case_0000"]
        for name, load in (("test/case_0000", 0.8), ("train/case_0000", 2.2)):
            np.testing.assert_allclose(pred[f"pred_{name}"],
                                       expected(pv.read(new / f"{name}.vtu"), load),
                                       rtol=1e-6, atol=1e-6)
    assert main(["infer", str(run), "--mesh", str(mesh_file), "--out",
                 str(tmp_path / "own.npz")]) == 0
    with np.load(tmp_path / "own.npz") as pred:
        np.testing.assert_allclose(
            pred["pred_case_0000"], expected(source, float(source.field_data["load"][0])),
            rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_new_mesh_refusals_are_sentences(store_run, tmp_path, capsys):
    """A condition the run does not have, a NaN condition, --condition beside --data, a
    run whose inputs were not read from mesh arrays (Darcy's generated coefficient: nothing
    to build them by): one sentence each and no output file. A failure points to a mesh
    predicted with made-up inputs."""
    cases, store, run = store_run
    mesh = cases / "test" / "case_0000.vtu"
    out = tmp_path / "p.npz"
    assert main(["infer", str(run), "--mesh", str(mesh), "--condition", "speed=1",
                 "--out", str(out)]) == 2         # a bad option value (was 1, a data error)
    assert "conditions ['speed'] are not this run's" in capsys.readouterr().err
    assert main(["infer", str(run), "--mesh", str(mesh), "--condition", "load=nan",
                 "--out", str(out)]) == 1
    assert "not finite" in capsys.readouterr().err
    assert main(["infer", str(run), "--data", str(store), "--condition", "load=1",
                 "--out", str(out)]) == 2
    _, darcy = tiny_darcy_run(tmp_path / "darcy")
    assert main(["infer", str(darcy), "--mesh", str(mesh), "--out", str(out)]) == 2
    assert "were not read from a mesh array" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_a_new_mesh_probe_of_issue_41(store_run, tmp_path, capsys):
    """`--write-mesh` into the folder of the meshes replaced case_0000.vtu, the user's
    source, by the prediction; a 300-byte VTU declaring 2e9 points aborted the process in
    VTK (std::bad_alloc, exit 134); an OpenFOAM marker without its case was "AttributeError:
    'NoneType' object has no attribute 'GetNumberOfValues'"; a mesh without its condition
    said "nor in None". Each is now a sentence, nothing written."""
    cases, _, run = store_run
    source = tmp_path / "meshes" / "case_0000.vtu"
    source.parent.mkdir()
    shutil.copy(cases / "test" / "case_0000.vtu", source)
    before = source.read_bytes()
    out = tmp_path / "p.npz"
    assert main(["infer", str(run), "--mesh", str(source), "--write-mesh", str(source.parent),
                 "--out", str(out)]) == 1
    assert "is case 'case_0000''s own source mesh" in capsys.readouterr().err
    assert source.read_bytes() == before and not out.exists()
    huge = tmp_path / "huge.vtu"
    huge.write_bytes(b'<?xml version="1.0"?><VTKFile type="UnstructuredGrid"><Unstructured'
                     b'Grid><Piece NumberOfPoints="2000000000000" NumberOfCells="0"></Piece>'
                     b'</UnstructuredGrid></VTKFile>')
    (tmp_path / "foam").mkdir()
    (tmp_path / "foam" / "case.foam").write_text("")
    bare = tmp_path / "bare.vtu"
    mesh = pv.read(source)
    mesh.field_data.clear()
    mesh.save(bare)
    for path, said in ((huge, "declares 2000000000000 points or cells, whose coordinates "
                              "alone need"),
                       (tmp_path / "foam" / "case.foam", "constant/polyMesh missing"),
                       (bare, "nor given by name (infer's --condition NAME=VALUE")):
        assert main(["infer", str(run), "--mesh", str(path), "--out", str(out)]) == 1
        assert said in capsys.readouterr().err and not out.exists()


# ---------------------------------------------------------------------------------------------
# the files --write-mesh writes (issue 41: 3, 5, 9, 14, 19)

PLAIN = SimpleNamespace(layout=None)     # what write_on_mesh asks of a predictor


def _result(name: str, seed: int = 0, n: int = 40) -> dict:
    """A predicted case of ``n`` points without a source mesh (written as a point cloud)."""
    x = np.random.default_rng(seed).random((1, n, 2)).astype(np.float32)
    return {"name": name, "pred": x[..., :1] * 3 + seed, "mask": None, "case": Case(name, x)}


def _files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_write_mesh_keeps_every_case_apart(tmp_path):
    """Cases named test/Re.1e5, test/Re.2e5, test/a/b and test/a_b are written as four
    meshes (their names as paths under DIR, the suffix appended), each holding its own
    prediction; two cases of one name, or a case whose file is another's folder, are
    refused. A failure points to names folded together ("test_Re.vtu" twice: 4 cases, 2
    files, exit 0)."""
    out = tmp_path / "meshes"
    names = ["test/Re.1e5", "test/Re.2e5", "test/a/b", "test/a_b"]
    results = list(write_on_mesh(out, [_result(n, i) for i, n in enumerate(names)], PLAIN))
    assert _files(out) == sorted(f"{n}{suffix}" for n in names for suffix in (".png", ".vtp"))
    for r in results:
        mesh = pv.read(out / f"{r['name']}.vtp")
        np.testing.assert_array_equal(mesh.point_data["pred_y0"], r["pred"][0, :, 0])
    with pytest.raises(DataError, match="would both write"):
        list(write_on_mesh(tmp_path / "twice", [_result("a"), _result("a", 1)], PLAIN))
    with pytest.raises(DataError, match="would both write"):
        list(write_on_mesh(tmp_path / "nested", [_result("x"), _result("x.vtp/y")], PLAIN))


@pytest.mark.parametrize("name", [".", "..", "../x", "/tmp/x", "a/./b", "a//b"])
def test_write_mesh_names_stay_inside_the_folder(tmp_path, name):
    """A case named '.', '..', an absolute path or one with empty or dot parts is refused
    before anything is written; nothing appears beside the folder (a sample named '.'
    wrote DIR.vtu next to DIR)."""
    out = tmp_path / "meshes"
    with pytest.raises(UnsafeName, match="case name"):
        list(write_on_mesh(out, [_result(name)], PLAIN))
    assert _files(tmp_path) == []


def test_write_mesh_never_follows_a_link_at_its_files(tmp_path):
    """A symbolic link at DIR/<name>.png leading out of DIR is refused and its target
    keeps its bytes; a link inside DIR is replaced by the picture, its target untouched.
    A failure points to a picture written through a link (it overwrote the target)."""
    out = tmp_path / "meshes"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (out / "case.png").symlink_to(victim)
    with pytest.raises(UnsafeName, match="symbolic link"):
        list(write_on_mesh(out, [_result("case")], PLAIN))
    assert victim.read_text() == "keep"
    kept = out / "kept.txt"
    kept.write_text("keep")
    (out / "inner.png").symlink_to(kept)
    list(write_on_mesh(out, [_result("inner")], PLAIN))
    assert kept.read_text() == "keep" and not (out / "inner.png").is_symlink()
    assert (out / "inner.png").read_bytes()[:4] == b"\x89PNG"


def test_write_mesh_refuses_a_mesh_the_disk_cannot_hold(tmp_path, monkeypatch):
    """With less free space than the mesh needs (shutil.disk_usage says 1000 bytes), the
    write is refused before VTK's writer runs, naming the file, the bytes needed and free,
    and leaves no file and no temporary. A failure points to VTK started on a full disk
    (SIGSEGV in a 10 MB tmpfs)."""
    out = tmp_path / "meshes"
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: SimpleNamespace(total=10 ** 6, used=10 ** 6 - 1000,
                                                     free=1000))
    with pytest.raises(OSError, match="needs up to .* bytes and its file system has 1,000 "
                                      "free") as err:
        list(write_on_mesh(out, [_result("case")], PLAIN))
    assert err.value.filename == str(out / "case.vtp")
    assert _files(tmp_path) == []


def _infer_child(run, store, out_dir, **popen) -> subprocess.CompletedProcess:
    src = os.path.join(os.path.dirname(os.path.dirname(__file__)), "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flarepp", "infer", str(run), "--data",
                           str(store), "--out", str(out_dir.parent / "p.npz"), "--write-mesh",
                           str(out_dir), "--device", "cpu"], env=env, capture_output=True,
                          text=True, timeout=300, **popen)


@pytest.mark.slow
def test_write_mesh_under_a_file_size_limit_is_a_sentence(store_run, tmp_path):
    """Under ``ulimit -f`` (RLIMIT_FSIZE) below the mesh's size, ``infer --write-mesh``
    exits 1 naming the file and the limit, and leaves no temporary (VTK's writer killed
    the process: SIGSEGV / SIGABRT, with multi-MB temporaries left)."""
    _, store, run = store_run
    out = tmp_path / "meshes"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, resource.RLIM_INFINITY))
    proc = _infer_child(run, store, out, preexec_fn=limit)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "file-size limit (ulimit -f)" in proc.stderr and "case_0000.vtu" in proc.stderr
    assert not [f for f in _files(tmp_path) if is_temporary(os.path.basename(f))]
    assert not (tmp_path / "p.npz").exists()


@pytest.mark.slow
def test_write_mesh_on_a_full_tmpfs_is_a_sentence(store_run, tmp_path):
    """On a real 10 MB tmpfs filled to its last 60 KB, ``infer --write-mesh`` exits 1
    naming the file and the free bytes, and leaves no temporary (it died of SIGSEGV, exit
    139, with temporaries left). Needs root to mount (skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    _, store, run = store_run
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        with open(disk / "fill", "wb") as f:
            f.write(b"\0" * (shutil.disk_usage(disk).free - 60_000))
        proc = _infer_child(run, store, disk / "meshes")
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "its file system has" in proc.stderr and "case_0000.vtu" in proc.stderr
        assert not [f for f in _files(disk) if is_temporary(os.path.basename(f))]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_write_mesh_refuses_a_source_changed_since_conversion(store_run, tmp_path, capsys):
    """A test case's VTU renumbered after conversion (its points permuted, the cells
    re-indexed: the same point count, the same mesh) no longer matches the size and digest
    the store recorded: ``--write-mesh`` is refused in a sentence naming the file, where it
    put every value on the wrong point. Its predictions (no mesh) are still written when
    asked without --write-mesh. A failure points to the store's record of its source not
    being checked."""
    _, _, run = store_run
    cases, store = tmp_path / "cases", tmp_path / "store"
    make_elasticity_mesh(cases, n_train=2, n_test=1, progress=False)
    assert main(["data", "convert", str(cases), "--out", str(store), "--targets",
                 "von_mises", "--conditions", "load", "--test-pattern", "test/*",
                 "--quiet"]) == 0
    path = cases / "test" / "case_0000.vtu"
    mesh = pv.read(path)
    order = np.random.default_rng(0).permutation(mesh.n_points)
    renumbered = pv.UnstructuredGrid(
        {pv.CellType.TRIANGLE: np.argsort(order)[mesh.cells_dict[pv.CellType.TRIANGLE]]},
        np.asarray(mesh.points)[order])
    renumbered.point_data["von_mises"] = mesh.point_data["von_mises"][order]
    renumbered.field_data["load"] = mesh.field_data["load"]
    renumbered.save(path)
    assert renumbered.n_points == mesh.n_points
    out = tmp_path / "meshes"
    assert main(["infer", str(run), "--data", str(store), "--out", str(tmp_path / "p.npz"),
                 "--write-mesh", str(out)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "is not the file the store converted" in err
    assert not (tmp_path / "p.npz").exists() and not (out / "test" / "case_0000.vtu").exists()
    assert main(["infer", str(run), "--data", str(store), "--out",
                 str(tmp_path / "p.npz")]) == 0


@pytest.mark.slow
def test_geometry_takes_any_run_of_a_surface_s_centres_and_normals(tmp_path, capsys):
    """A store converted from surfaces with ``geometry = coordinates, normals`` at cells
    and nothing else gives a run that ``--geometry new.stl`` predicts (it was told "this
    is a 'fields' run (use --data)"): the STL's cell centres and unit normals, equal to
    ``flarepp.load(run).predict`` of them (1e-6), written onto the STL's surface. A
    failure points to --geometry tied to the surface task rather than to the inputs."""
    from mesh_files import write_stl, write_vtp
    from tiny_runs import STORE_TINY
    from flarepp.data.meshes import cell_geometry, read_mesh
    cases, store, run = tmp_path / "cases", tmp_path / "store", tmp_path / "run"
    for i in range(4):
        write_vtp(cases / "train", f"case_{i}", seed=i)
    write_vtp(cases / "test", "case_0", seed=4)
    assert main(["data", "convert", str(cases), "--out", str(store), "--association", "cell",
                 "--geometry", "coordinates,normals", "--targets", "p", "--test-pattern",
                 "test/*", "--quiet"]) == 0
    assert main(["train", "store-tiny", "--data", str(store), "--out", str(run),
                 *STORE_TINY]) == 0
    new = write_stl(tmp_path / "new", "part", seed=7)
    out = tmp_path / "meshes"
    capsys.readouterr()
    assert main(["infer", str(run), "--geometry", str(new), "--out", str(tmp_path / "g.npz"),
                 "--write-mesh", str(out)]) == 0
    assert " cells in " in capsys.readouterr().out
    cells = cell_geometry(read_mesh(new), new)
    want = flarepp.load(run, device="cpu").predict(cells.centres.astype(np.float32),
                                                   features=cells.normals.astype(np.float32))
    with np.load(tmp_path / "g.npz") as pred:
        np.testing.assert_allclose(pred["pred_part"], want, rtol=1e-6, atol=1e-6)
    written = pv.read(out / "part.vtp")
    assert written.n_cells == len(want)
    np.testing.assert_allclose(written.cell_data["pred_p"], want[:, 0], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_run_that_stored_no_layout_reads_its_store_s(store_run, tmp_path, capsys):
    """A checkpoint whose data description has no channel layout (written before runs
    stored one) builds a new mesh's inputs by the layout of the store at the run's
    recorded data path (the same predictions); with that store gone, --mesh is a sentence
    naming it. A failure points to the fallback for older runs."""
    from flarepp.storage.checkpoint import read_checkpoint, save_checkpoint
    from flarepp.storage.rundir import RunDir
    cases, store, run = store_run
    state = read_checkpoint(RunDir(run).reported_checkpoint())
    del state["data"]["layout"]
    old = tmp_path / "old.pt"
    save_checkpoint(old, state)
    assert flarepp.load(old, device="cpu").layout.data_layout == MeshStore(store).layout
    mesh = cases / "test" / "case_0001.vtu"
    for checkpoint, out in ((run, "new.npz"), (old, "old.npz")):
        assert main(["infer", str(checkpoint), "--mesh", str(mesh), "--out",
                     str(tmp_path / out)]) == 0
    with np.load(tmp_path / "new.npz") as new, np.load(tmp_path / "old.npz") as older:
        np.testing.assert_array_equal(new["pred_case_0001"], older["pred_case_0001"])
    state["data"]["identity"]["path"] = str(tmp_path / "gone")
    state["config"]["data_root"] = str(tmp_path / "gone")
    save_checkpoint(old, state)
    capsys.readouterr()
    assert main(["infer", str(old), "--mesh", str(mesh), "--out", str(tmp_path / "x.npz")]) == 2
    assert "stored no channel layout" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the pictures themselves

def _hue_rises_to_the_left(png) -> bool:
    """In the first panel (the left quarter of the figure: the reference, before its colour
    bar), the coloured pixels left of their median column have a larger mean hue than
    those right of it: viridis runs from purple (hue 0.75) to yellow (0.15), so a field
    that grows to the right of the screen reads that way."""
    image = mimage.imread(png)[..., :3]
    panel = mcolors.rgb_to_hsv(image[:, : image.shape[1] // 4])
    rows, cols = np.nonzero((panel[..., 1] > 0.25) & (panel[..., 2] > 0.15))
    hue = panel[rows, cols, 0]
    middle = np.median(cols)
    return hue[cols < middle].mean() > hue[cols > middle].mean() + 0.1


@pytest.mark.slow                 # VTK's off-screen check starts a process
@pytest.mark.parametrize("association", ["cell", "point"])
def test_a_volume_mesh_is_pictured_as_its_cut_away_surface(tmp_path, association):
    """Hexahedra with a field ``x - y`` (which grows to the right of the fixed camera) at
    their cells or points: the picture is VTK's rendering of the cut-away volume, coloured
    over a large share of its pixels, the reference panel's colours running the field's
    way across the screen. A failure points to values attached
    to the wrong cells or points of the surface, or a scatter plot of centres again."""
    from flarepp.bench.data import cell_type_mesh
    from flarepp import plots3d
    if plots3d.vtk_window_class() is None:
        pytest.skip("VTK cannot render off-screen here (no EGL or OSMesa library for the "
                    "vtk wheel); such a machine draws the points instead, which test_surface_"
                    "flow.py::test_backend_choice_falls_back_to_matplotlib_with_a_warning "
                    "checks")
    mesh = cell_type_mesh("hexahedron", 4000)
    where = np.asarray(mesh.points if association == "point" else mesh.cell_centers().points)
    true = (where[:, 0] - where[:, 1])[:, None]
    pred = np.concatenate([true * 1.1, true], axis=1)
    path = plots3d.plot_mesh_fields(tmp_path / "hex.png", mesh, association, pred,
                                    np.concatenate([true, true], axis=1), ["p", "q"], "Pa",
                                    "hexahedra")
    assert coloured_share(path) > 0.15
    assert _hue_rises_to_the_left(path)


def test_a_planar_mesh_is_pictured_by_its_cells_and_a_point_cloud_by_its_points(tmp_path):
    """A triangulated plate (z = 0) with a field at its cells is drawn by its own triangles
    (one flat colour per cell, covering the plate); the same values without a mesh (a
    point cloud) fall back to the points. A failure points to the choice of picture."""
    from flarepp import plots3d
    from flarepp.data.meshes import point_cloud
    plate = pv.Plane(i_resolution=30, j_resolution=20).triangulate()
    centres = np.asarray(plate.cell_centers().points)
    assert plots3d.mesh_kind(plate) == "flat"
    true = (centres[:, 0] - centres[:, 1])[:, None]
    path = plots3d.plot_mesh_fields(tmp_path / "plate.png", plate, "cell", 0.9 * true, true,
                                    ["p"], "Pa", "plate")
    assert coloured_share(path) > 0.2 and _hue_rises_to_the_left(path)
    flat = plots3d.flat_mesh(plate, "cell")
    assert len(flat.triangulation.triangles) == plate.n_cells
    np.testing.assert_array_equal(flat.owner, np.arange(plate.n_cells))
    cloud = point_cloud(centres)
    assert plots3d.mesh_kind(cloud) == "points"
    assert plots3d.plot_mesh_fields(tmp_path / "cloud.png", cloud, "point", true, None,
                                    ["p"], "Pa", "cloud").is_file()


def test_a_machine_that_cannot_render_says_what_to_install(tmp_path, monkeypatch):
    """Where VTK cannot render off-screen, a volume's picture is its points, with a warning
    naming the extra and the system libraries; ``backend="vtk"`` is an error saying so."""
    from flarepp import plots3d
    from flarepp.bench.data import cell_type_mesh
    monkeypatch.setattr(plots3d, "vtk_window_class", lambda: None)
    mesh = cell_type_mesh("tetra", 500)
    values = np.asarray(mesh.points)[:, :1]
    with pytest.warns(RuntimeWarning, match=r"flarepp\[surface\].*libosmesa6"):
        path = plots3d.plot_mesh_fields(tmp_path / "tets.png", mesh, "point", values, values,
                                        ["T"], "K", "tetrahedra")
    assert path.is_file()
    with pytest.raises(RuntimeError, match="cannot render off-screen"):
        plots3d.plot_mesh_fields(tmp_path / "no.png", mesh, "point", values, values, ["T"],
                                 "K", "tetrahedra", backend="vtk")
