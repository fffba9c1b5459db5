"""`flarepp infer --write-mesh`: predictions, targets and errors written back as arrays of
each sample's source mesh (a converted store's VTU), or as a point cloud where the data has
no mesh, each with a picture; and the command's refusals. The surface task's cars and
``--geometry`` are checked in tests/test_surface_task.py's end-to-end test."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")
pytest.importorskip("skfem")

from flarepp.cli import main  # noqa: E402
from flarepp.data.generators.elasticity import make_elasticity_mesh  # noqa: E402
from flarepp.data.store import MeshStore  # noqa: E402
from tiny_runs import tiny_darcy_run  # noqa: E402

TINY = ["--set", "epochs=1", "--set", "model.dim=8", "--set", "model.blocks=1",
        "--set", "model.latents=4", "--set", "model.heads=2", "--quiet"]


@pytest.fixture(scope="module")
def store_run(tmp_path_factory):
    """A store converted from solver VTU files (the load as a condition) and a conditioned
    run on it: ``(cases, store, run)``."""
    root = tmp_path_factory.mktemp("write-mesh")
    cases, store, run = root / "cases", root / "store", root / "run"
    make_elasticity_mesh(cases, n_train=6, n_test=2, progress=False)
    assert main(["data", "convert", str(cases), "--out", str(store), "--targets", "von_mises",
                 "--conditions", "load", "--test-pattern", "test/*", "--quiet"]) == 0
    assert main(["train", "store-conditioned-tiny", "--data", str(store), "--out", str(run),
                 *TINY]) == 0
    return cases, store, run


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
    assert "wrote " + str(out / "test_case_0000.vtu") in capsys.readouterr().out
    stored = MeshStore(store)
    test = stored.split("test")
    with np.load(tmp_path / "p.npz") as pred:
        for i, name in enumerate(test.names):
            mesh = pv.read(out / f"{name.replace('/', '_')}.vtu")
            source = pv.read(cases / f"{name}.vtu")
            assert (mesh.n_points, mesh.n_cells) == (source.n_points, source.n_cells)
            np.testing.assert_array_equal(mesh.points, source.points)
            np.testing.assert_array_equal(mesh.point_data["pred_von_mises"],
                                          pred[f"pred_{name}"][:, 0])
            _, y = test.sample(i)
            np.testing.assert_array_equal(mesh.point_data["true_von_mises"], y[:, 0])
            np.testing.assert_allclose(mesh.point_data["error_von_mises"],
                                       pred[f"pred_{name}"][:, 0] - y[:, 0], atol=1e-6)
            assert (out / f"{name.replace('/', '_')}.png").stat().st_size > 10_000


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
        assert pv.read(tmp_path / "clouds" / "test_case_0000.vtp").n_points > 0
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
    assert "surface task's inputs" in capsys.readouterr().err
    assert not out.exists()
