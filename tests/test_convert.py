"""`flarepp data convert` and the store: the spec, the splits, conditions, every bad input of
issue 30 as one sentence naming the file, array or key (exit 1 runtime, 2 usage), atomic
samples, a killed conversion resumed, a store edited after conversion."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pytest.importorskip("pyvista")
pytest.importorskip("meshio")

from flarepp.cli import main  # noqa: E402
from flarepp.data import DataError, load_dataset  # noqa: E402
from flarepp.data.convert import convert  # noqa: E402
from flarepp.data.meshes import read_mesh  # noqa: E402
from flarepp.data.spec import SpecError, load_spec, parse_spec  # noqa: E402
from flarepp.data.store import MeshStore  # noqa: E402
from flarepp.io import is_temporary  # noqa: E402
from mesh_files import point_field, volume_mesh, write_gmsh, write_vtu  # noqa: E402


def cases(folder, n=4, seed=0, **arrays):
    """``n`` VTU cases ``case_<i>.vtu``; ``arrays`` name -> fn(mesh, i) added as point data."""
    for i in range(n):
        mesh = volume_mesh(seed + i, n=2)
        for name, fn in arrays.items():
            mesh.point_data[name] = fn(mesh, i)
        folder.mkdir(parents=True, exist_ok=True)
        mesh.save(folder / f"case_{i}.vtu")
    return folder


def run(argv, capsys):
    capsys.readouterr()                  # what the test printed before (a writer's warning)
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def convert_argv(source, out, *extra):
    return ["data", "convert", str(source), "--out", str(out), "--quiet", *extra]


# ---------------------------------------------------------------------------------------------
# the spec

def test_spec_file_and_flags_and_every_key_checked(tmp_path):
    """A TOML spec with arrays as names or tables (renamed, scaled, with units), flags over
    it; an unknown key at the top, in an array table or in the split is refused naming
    it. A failure points to a key read silently or a flag that does not win."""
    path = tmp_path / "spec.toml"
    path.write_text(textwrap.dedent("""
        # a comment: why TOML
        association = "cell"
        geometry = ["coordinates", "volumes"]
        targets = [{array = "p", name = "pressure", scale = 1e-3, units = "kPa"}, "U"]
        conditions = ["load"]
        [split]
        test = "case_3"
    """))
    spec = load_spec(path, {"conditions": ["speed"], "split": None})
    assert spec.association == "cell" and spec.geometry == ("coordinates", "volumes")
    assert [(t.array, t.name, t.scale, t.units) for t in spec.targets] == [
        ("p", "pressure", 1e-3, "kPa"), ("U", "U", 1.0, "")]
    assert [c.name for c in spec.conditions] == ["speed"] and spec.split.test == "case_3"
    for text, named in (('targest = ["p"]', "targest"),
                        ('targets = [{array = "p", unit = "Pa"}]', "unit"),
                        ('targets = ["p"]\n[split]\ntest_fractio = 0.2', "test_fractio")):
        path.write_text(text)
        with pytest.raises(SpecError, match=f"unknown .*'{named}'"):
            load_spec(path)
    with pytest.raises(SpecError, match="geometry .*normals.* association = 'cell'"):
        parse_spec({"targets": ["p"], "geometry": ["coordinates", "normals"]})


def test_an_unknown_spec_key_is_a_usage_error(tmp_path, capsys):
    """From the command line: exit 2, one sentence naming the spec file and the key."""
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    spec = tmp_path / "spec.toml"
    spec.write_text('targets = ["T"]\nassociaton = "point"\n')
    code, _, err = run(convert_argv(source, tmp_path / "store", "--spec", str(spec)), capsys)
    assert code == 2 and str(spec) in err and "'associaton'" in err and "Traceback" not in err


def test_splits_by_glob_and_by_a_fixed_seed_fraction(tmp_path):
    """``split.test`` (and ``val``) globs pick cases by name; ``test_fraction`` draws a
    fixed-seed share, the same on every conversion and not the last cases of the sort."""
    spec = parse_spec({"targets": [], "split": {"test": "t*", "val": "v*"}})
    assert spec.split.assign(["a", "t1", "v1", "b"]) == {"train": ["a", "b"], "test": ["t1"],
                                                         "val": ["v1"]}
    names = [f"case_{i:02d}" for i in range(20)]
    split = parse_spec({"targets": [], "split": {"test_fraction": 0.25}}).split.assign(names)
    assert len(split["test"]) == 5 and split["test"] != names[-5:]
    assert split == parse_spec({"targets": [], "split": {"test_fraction": 0.25}}
                               ).split.assign(names)


# ---------------------------------------------------------------------------------------------
# conversion and the store

def test_convert_then_check_describes_the_store(tmp_path, capsys):
    """`data convert` writes a store whose manifest records, per sample, its source and
    rows, and for the store the channel layout (inputs with the leading coordinate
    channels, targets with their scale and units, conditions); `data check` describes it.
    A failure points to a layout a predictor could not assemble inputs from."""
    source = cases(tmp_path / "src", 4, T=lambda m, i: point_field(m.points),
                   V=lambda m, i: np.c_[m.points[:, :2], m.points[:, :1] * 0 + i])
    spec = tmp_path / "spec.toml"
    spec.write_text('inputs = ["V"]\ntargets = [{array = "T", name = "temperature", scale = 2.0,'
                    ' units = "K"}]\nconditions = ["load"]\n[split]\ntest = "case_3"\n')
    code, out, _ = run(convert_argv(source, tmp_path / "store", "--spec", str(spec)), capsys)
    assert code == 0 and "converted 4 case(s)" in out
    store = MeshStore(tmp_path / "store")
    layout = store.layout
    assert layout.input_channels == ["x", "y", "z", "V_x", "V_y", "V_z"]
    assert layout.coordinates == 3 and layout.association == "point"
    assert layout.target_channels == ["temperature"] and layout.targets[0].scale == 2.0
    assert layout.targets[0].units == "K" and layout.condition_names == ["load"]
    assert store.splits == {"train": ["case_0", "case_1", "case_2"], "test": ["case_3"]}
    entry = store.samples["case_2"]
    assert entry["source"]["case"] == str((source / "case_2.vtu").resolve())
    assert entry["conditions"] == [3.5]
    x, y = store.split("train").sample(2)
    np.testing.assert_allclose(y[:, 0], 2 * point_field(x[:, :3].astype(float)), rtol=1e-6)
    code, out, _ = run(["data", "check", str(tmp_path / "store"), "--verify"], capsys)
    assert code == 0 and "targets: temperature ['temperature'] [K] x2 from T" in out
    assert "every byte compared" in out


@pytest.mark.parametrize("kinds", [("tetra",), ("hexahedron",), ("wedge",), ("pyramid",),
                                   ("tetra", "hexahedron", "wedge", "pyramid")])
def test_cells_of_each_type_convert_to_their_slow_reference_geometry(tmp_path, kinds):
    """A VTU of warped cells of one type, or of all four interleaved, converted with data
    at the cells: each stored row holds its own cell's centre and volume as the
    cell-by-cell fan reference computes them (in the store's float32) and its own cell
    array value. A failure points to rows reordered by the per-type grouping, or a
    geometry that differs from its definition."""
    import pyvista as pv
    from mesh_files import LINEAR_VOLUME_TYPES, cells_of_type, fan_reference
    parts = [cells_of_type(LINEAR_VOLUME_TYPES[k], (2, 2, 1), warp=0.05, seed=i)
             for i, k in enumerate(kinds)]
    mesh = pv.merge(parts, merge_points=False) if len(parts) > 1 else parts[0]
    mesh = mesh.extract_cells(np.random.default_rng(1).permutation(mesh.n_cells))
    mesh = mesh.cast_to_unstructured_grid()
    mesh.clear_data()
    mesh.cell_data["p"] = np.arange(mesh.n_cells, dtype=np.float64)
    (tmp_path / "src").mkdir()
    mesh.save(tmp_path / "src" / "case.vtu")
    spec = parse_spec({"association": "cell", "geometry": ["coordinates", "volumes"],
                       "targets": ["p"]})
    store = convert(tmp_path / "src", tmp_path / "store", spec, progress=False).store
    x, y = store.split("train").sample(0)
    centres, volumes = fan_reference(mesh)
    np.testing.assert_array_equal(x[:, :3], centres.astype(np.float32))
    np.testing.assert_array_equal(x[:, 3], volumes.astype(np.float32))
    np.testing.assert_array_equal(y[:, 0], np.arange(mesh.n_cells, dtype=np.float32))


def test_conditions_from_a_table_by_case_name_or_stem(tmp_path):
    """A CSV table keyed by case (here by the file's stem) gives each case its conditions,
    over the files' field data; a JSON table alike."""
    source = cases(tmp_path / "src", 3, T=lambda m, i: point_field(m.points))
    (source / "table.csv").write_text("case,load,speed\ncase_0,10,1\ncase_1,11,2\ncase_2,12,3\n")
    spec = parse_spec({"targets": ["T"], "conditions": ["load", "speed"],
                       "condition_table": "table.csv", "split": {"test": "case_2"}})
    store = convert(source, tmp_path / "store", spec, progress=False).store
    assert [store.samples[f"case_{i}"]["conditions"] for i in range(3)] == [
        [10.0, 1.0], [11.0, 2.0], [12.0, 3.0]]
    (source / "table.json").write_text('{"case_0": {"speed": 5}, "case_1": {"speed": 6},'
                                       ' "case_2": {"speed": 7}}')
    spec = parse_spec({"targets": ["T"], "conditions": ["speed"],
                       "condition_table": "table.json"})
    store = convert(source, tmp_path / "store2", spec, progress=False).store
    assert store.samples["case_1"]["conditions"] == [6.0]


def test_a_new_mesh_gets_the_inputs_its_store_was_converted_with(tmp_path):
    """``mesh_inputs`` of a case file and the store's layout gives exactly the stored sample's
    inputs and conditions (cell centres, volumes and a scaled array; a scaled condition from
    field data), conditions given by name in stored units win over the file's, and a
    condition the run lacks, or a layout of in-memory inputs, is refused by name. A failure
    points to a new mesh predicted from inputs other than those the model trained on."""
    from flarepp.data.convert import mesh_inputs
    from flarepp.data.layout import plain_layout
    source = tmp_path / "src"
    for i in range(3):
        write_vtu(source, f"case_{i}", seed=i)
    spec = parse_spec({"association": "cell", "geometry": ["coordinates", "volumes"],
                       "inputs": [{"array": "U", "name": "velocity", "scale": 2.0}],
                       "targets": ["p"], "conditions": [{"array": "load", "scale": 10.0}],
                       "split": {"test": "case_2"}})
    store = convert(source, tmp_path / "store", spec, progress=False).store
    test = store.split("test")
    x, conditions = mesh_inputs(source / "case_2.vtu", store.layout)
    np.testing.assert_array_equal(x, test.sample(0)[0])
    assert conditions == store.samples["case_2"]["conditions"] == [35.0]
    _, given = mesh_inputs(source / "case_2.vtu", store.layout, {"load": 7.0})
    assert given == [pytest.approx(7.0, rel=1e-15)]
    with pytest.raises(DataError, match=r"conditions \['speed'\] are not this run's"):
        mesh_inputs(source / "case_2.vtu", store.layout, {"speed": 1.0})
    with pytest.raises(SpecError, match="'inputs'.*not read from a mesh array"):
        mesh_inputs(source / "case_2.vtu", plain_layout(3, ["u"], 2))


def test_streaming_statistics_equal_the_in_memory_fit(tmp_path, monkeypatch):
    """The store's statistics, streamed sample by sample in chunks of 7 rows (float64,
    Chan et al.'s pairwise update), equal the whole-array fit of the same values (and
    Normalizer.fit) to 1e-10 relative, with a large offset in the data. A failure points
    to a merge error or a chunk left out."""
    from flarepp.data import ChannelStatistics, Normalizer
    from flarepp.data import store as store_module
    source = cases(tmp_path / "src", 5, T=lambda m, i: 1e4 + point_field(m.points) * (i + 1))
    store = convert(source, tmp_path / "store", parse_spec({"targets": ["T"]}),
                    progress=False).store
    samples = store.split("train")
    monkeypatch.setattr(store_module, "CHUNK_ROWS", 7)
    streamed = samples.fit_statistics()
    xs, ys = zip(*(samples.sample(i) for i in range(len(samples))))
    for got, arrays in ((streamed.x, xs), (streamed.y, ys)):
        whole = ChannelStatistics.of_array(np.concatenate(arrays)[None])
        assert got.count == whole.count
        for key in ("mean", "std", "low", "high"):
            np.testing.assert_allclose(getattr(got, key), getattr(whole, key), rtol=1e-10)
    fitted = Normalizer.fit(np.concatenate(ys)[None])
    np.testing.assert_allclose(Normalizer.from_statistics(streamed.y).std, fitted.std,
                               rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# bad input: a sentence naming the file, array or key; exit 1 (runtime) or 2 (usage)

def _fails(argv, capsys, *named, code=1):
    got, _, err = run(argv, capsys)
    assert got == code, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for text in named:
        assert text in err, err
    return err


def test_a_file_without_the_named_array(tmp_path, capsys):
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    _fails(convert_argv(source, tmp_path / "s", "--targets", "pressure"), capsys,
           str(source / "case_0.vtu"), "no array 'pressure'", "'T'")


def test_point_and_cell_data_mixed_up(tmp_path, capsys):
    source = cases(tmp_path / "src", 2)
    _fails(convert_argv(source, tmp_path / "s", "--targets", "p"), capsys,
           "case_0.vtu", "array 'p' is cell data", "association = 'cell'")


def test_inputs_and_targets_with_different_point_counts(tmp_path, capsys):
    """An XDMF case whose target T has 5 values on a mesh of 4 points."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "case.xdmf").write_text(textwrap.dedent("""\
        <?xml version="1.0"?>
        <Xdmf Version="3.0"><Domain><Grid Name="mesh" GridType="Uniform">
        <Topology TopologyType="Triangle" NumberOfElements="2">
        <DataItem Dimensions="2 3" NumberType="Int" Format="XML">0 1 2 1 3 2</DataItem></Topology>
        <Geometry GeometryType="XYZ"><DataItem Dimensions="4 3" NumberType="Float"
         Precision="8" Format="XML">0 0 0 1 0 0 0 1 0 1 1 0</DataItem></Geometry>
        <Attribute Name="T" AttributeType="Scalar" Center="Node"><DataItem Dimensions="5"
         NumberType="Float" Precision="8" Format="XML">1 2 3 4 5</DataItem></Attribute>
        </Grid></Domain></Xdmf>
        """))
    _fails(convert_argv(source, tmp_path / "s", "--targets", "T"), capsys,
           str(source / "case.xdmf"), 'len(points) = 4, but len(point_data["T"]) = 5')


def test_nan_or_inf_values(tmp_path, capsys):
    def with_nan(mesh, i):
        values = point_field(mesh.points)
        values[3] = np.inf if i else np.nan
        return values
    source = cases(tmp_path / "src", 2, T=with_nan)
    _fails(convert_argv(source, tmp_path / "s", "--targets", "T"), capsys,
           "case_0.vtu", "array 'T' holds NaN or inf at 1 row(s), first at row 3")


def test_an_empty_or_degenerate_mesh(tmp_path, capsys):
    """No points; every point at one place; a cell of zero area."""
    import pyvista as pv
    source = tmp_path / "empty"
    source.mkdir()
    pv.UnstructuredGrid().save(source / "case.vtu")
    _fails(convert_argv(source, tmp_path / "s1", "--targets", "T"), capsys,
           "case.vtu", "no points")
    point = tmp_path / "point"
    point.mkdir()
    mesh = pv.PolyData(np.zeros((3, 3)))
    mesh.point_data["T"] = np.ones(3)
    mesh.save(point / "case.vtp")
    _fails(convert_argv(point, tmp_path / "s2", "--targets", "T"), capsys,
           "case.vtp", "degenerate mesh", "coincide")
    flat = tmp_path / "flat"
    flat.mkdir()
    tri = pv.PolyData(np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0], [0, 1, 0.]]),
                      faces=[3, 0, 1, 3, 3, 0, 1, 2])
    tri.cell_data["p"] = np.ones(2)
    tri.save(flat / "case.vtp")
    _fails(convert_argv(flat, tmp_path / "s3", "--targets", "p", "--association", "cell"),
           capsys, "case.vtp", "cell 1 has zero area")


def test_mixed_formats_in_one_directory(tmp_path, capsys):
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    write_gmsh(source, "other", 0)
    err = _fails(convert_argv(source, tmp_path / "s", "--targets", "T"), capsys,
                 str(source), "several formats", "gmsh (other.msh)", "vtu (case_0.vtu)")
    assert "--format" in err
    code, _, _ = run(convert_argv(source, tmp_path / "s", "--targets", "T", "--format", "vtu"),
                     capsys)
    assert code == 0


def test_a_truncated_file(tmp_path, capsys):
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    raw = (source / "case_1.vtu").read_bytes()
    (source / "case_1.vtu").write_bytes(raw[: len(raw) // 2])
    _fails(convert_argv(source, tmp_path / "s", "--targets", "T"), capsys,
           str(source / "case_1.vtu"), "unreadable or truncated")


def test_a_condition_missing_for_a_case(tmp_path, capsys):
    """Missing from a table row (names the case, the key and the table) or from a file's
    field data (names the file and its field data)."""
    source = cases(tmp_path / "src", 3, T=lambda m, i: point_field(m.points))
    (source / "table.csv").write_text("case,speed\ncase_0,1\ncase_2,3\n")
    _fails(convert_argv(source, tmp_path / "s", "--targets", "T", "--conditions", "speed",
                        "--condition-table", "table.csv"), capsys,
           "case_1.vtu", "condition 'speed' is missing", "no row for case 'case_1'")
    _fails(convert_argv(source, tmp_path / "s2", "--targets", "T", "--conditions", "Re"),
           capsys, "case_0.vtu", "condition 'Re' is missing", "['load']")


def test_a_store_edited_after_conversion(tmp_path, capsys):
    """An array rewritten with other values (a new modification time) is refused when the
    store is opened for training, naming the file; an edit that kept the size and time is
    seen by `data check --verify` (every byte); a store converted again from changed
    sources has another fingerprint, so `--resume` refuses it."""
    source = cases(tmp_path / "src", 3, T=lambda m, i: point_field(m.points))
    spec = parse_spec({"targets": ["T"], "split": {"test": "case_2"}})
    store = convert(source, tmp_path / "store", spec, progress=False).store
    before = store.split("train").fingerprint(tmp_path / "store")
    array = tmp_path / "store" / "case_1" / "T.npy"
    stat = array.stat()
    values = np.load(array)
    np.save(array, values * 2)
    with pytest.raises(DataError, match=r"case_1/T.npy holds other bytes: the store was "
                                        "changed after conversion"):
        load_dataset("store", tmp_path / "store")
    os.utime(array, ns=(stat.st_atime_ns, stat.st_mtime_ns))   # time restored too
    load_dataset("store", tmp_path / "store")                     # the quick check passes
    _fails(["data", "check", str(tmp_path / "store"), "--verify"], capsys,
           "case_1/T.npy holds other bytes")
    np.save(array, values)
    mesh = volume_mesh(1, n=2)
    mesh.point_data["T"] = point_field(mesh.points) + 1
    mesh.save(source / "case_1.vtu")
    again = convert(source, tmp_path / "store", spec, progress=False)
    assert (again.read, again.reused) == (1, 2)
    after = again.store.split("train").fingerprint(tmp_path / "store")
    assert after["sha256"] != before["sha256"]


def test_another_spec_on_an_existing_store_is_refused(tmp_path, capsys):
    """Converting with another spec into an existing store would mix two layouts: refused
    naming what differs, unless --overwrite (which replaces it)."""
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    assert run(convert_argv(source, tmp_path / "s", "--targets", "T"), capsys)[0] == 0
    _fails(convert_argv(source, tmp_path / "s", "--targets", "T", "--conditions", "load"),
           capsys, "holds a store made otherwise", "['spec']", "--overwrite")
    assert run(convert_argv(source, tmp_path / "s", "--targets", "T", "--conditions", "load",
                            "--overwrite"), capsys)[0] == 0
    assert MeshStore(tmp_path / "s").layout.condition_names == ["load"]


# ---------------------------------------------------------------------------------------------
# atomic samples, a killed conversion resumed

@pytest.mark.slow
def test_a_killed_conversion_resumes_without_rereading_finished_cases(tmp_path):
    """SIGKILL in the middle of a conversion: no reader takes the unfinished store; the
    same conversion again reads only the cases without a finished sample (none read twice)
    and gives the store a conversion without a kill gives, with no temporary left. A
    failure points to a half-written sample counted as done, or finished ones read again."""
    source = cases(tmp_path / "src", 24, T=lambda m, i: point_field(m.points) * (i + 1))
    out = tmp_path / "store"
    spec = {"targets": ["T"], "split": {"test": "case_2*"}}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from flarepp.data.convert import convert
        from flarepp.data.meshes import read_mesh
        from flarepp.data.spec import parse_spec
        def slow(path, fmt):
            time.sleep(0.25)
            return read_mesh(path, fmt)
        convert({str(source)!r}, {str(out)!r}, parse_spec({spec!r}), progress=False, read=slow)
    """)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while len(list(out.glob("*/meta.json"))) < 5 and time.time() < deadline:
            assert child.poll() is None, "the conversion ended before it was killed"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    finished = len(list(out.glob("*/meta.json")))
    assert 5 <= finished < 24
    with pytest.raises(DataError, match="the store is unfinished"):
        load_dataset("store", out)
    reads = []

    def counting(path, fmt):
        reads.append(path.name)
        return read_mesh(path, fmt)
    report = convert(source, out, parse_spec(spec), progress=False, read=counting)
    assert (report.read, report.reused) == (24 - finished, finished)
    assert len(reads) == len(set(reads)) == 24 - finished
    fresh = convert(source, tmp_path / "fresh", parse_spec(spec), progress=False).store
    for split in ("train", "test"):
        a, b = report.store.split(split), fresh.split(split)
        assert a.names == b.names
        for i in range(len(a)):
            for u, v in zip(a.sample(i), b.sample(i)):
                np.testing.assert_array_equal(u, v)
    assert not [p for p in out.rglob("*") if is_temporary(p.name)]


# ---------------------------------------------------------------------------------------------
# issue 41's probe: names, tables, scales, spec values, a second writer, the output

def test_an_array_name_that_is_not_a_plain_file_name_is_a_usage_error(tmp_path, capsys):
    """A target ``name = "../../../x"`` wrote ``x.npy`` above the store (every sample
    overwriting it) and ``name = "sub/vm"`` made a store that reported itself changed: a
    name is stored as ``<sample>/<name>.npy``, so it is one plain file name; anything else
    is exit 2 naming the spec file and the key, before anything is written."""
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    spec = tmp_path / "spec.toml"
    for name in ("../../../x", "sub/vm", str(tmp_path / "abs")):
        spec.write_text(f'targets = [{{array = "T", name = "{name}"}}]\n')
        _fails(convert_argv(source, tmp_path / "a" / "b" / "store", "--spec", str(spec)),
               capsys, str(spec), "targets[0] name", "not a plain file name", code=2)
    assert sorted(p.name for p in tmp_path.rglob("*.npy")) == []
    assert not (tmp_path / "a").exists()


def _xdmf_case(folder, binary):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "case.xdmf").write_text(textwrap.dedent(f"""\
        <?xml version="1.0"?>
        <Xdmf Version="3.0"><Domain><Grid Name="mesh" GridType="Uniform">
        <Topology TopologyType="Triangle" NumberOfElements="2">
        <DataItem Dimensions="2 3" DataType="Int" Format="XML">0 1 2 1 3 2</DataItem></Topology>
        <Geometry GeometryType="XYZ"><DataItem Dimensions="4 3" Precision="8"
         Format="XML">0 0 0 1 0 0 0 1 0 1 1 0</DataItem></Geometry>
        <Attribute Name="T" AttributeType="Scalar" Center="Node"><DataItem Dimensions="4"
         DataType="Float" Precision="8" Format="Binary">{binary}</DataItem></Attribute>
        </Grid></Domain></Xdmf>
        """))
    return folder / "case.xdmf"


def test_an_xdmf_data_item_is_read_from_its_case_directory_only(tmp_path, capsys):
    """An XDMF ``Binary`` data item pulled any local file into the store: an absolute path
    anywhere, or a relative one from the working directory (meshio's reading). It is read
    relative to the case's file (as XDMF defines, and as meshio reads HDF5 items), or at an
    absolute path inside the case's directory; one leading elsewhere is refused, naming
    the case and the item, and nothing is written."""
    values = np.array([5.0, 6.0, 7.0, 8.0])
    inside = tmp_path / "inside"
    values.tofile(_xdmf_case(inside, "T.bin").with_name("T.bin"))
    assert run(convert_argv(inside, tmp_path / "s1", "--targets", "T"), capsys)[0] == 0
    np.testing.assert_array_equal(MeshStore(tmp_path / "s1").split("train").sample(0)[1][:, 0],
                                  values)
    (inside / "case.xdmf").unlink()
    _xdmf_case(inside, str(inside / "T.bin"))   # meshio's writer names the absolute path
    assert run(convert_argv(inside, tmp_path / "s2", "--targets", "T"), capsys)[0] == 0
    secret = tmp_path / "secret.bin"
    values.tofile(secret)
    for binary in (str(secret), "../secret.bin"):
        case = _xdmf_case(tmp_path / f"out_{len(binary)}", binary)
        _fails(convert_argv(case.parent, tmp_path / "s3", "--targets", "T"), capsys,
               str(case), "the Binary data item's file", "its own directory")
    values.tofile("T.bin")          # in the working directory, beside no case
    case = _xdmf_case(tmp_path / "cwd_case", "T.bin")
    _fails(convert_argv(case.parent, tmp_path / "s3", "--targets", "T"), capsys,
           str(case), "No such file")
    assert not list((tmp_path / "s3").rglob("*.npy"))


@pytest.mark.parametrize("table, said", [
    ("case,load\ncase_0,1\ncase_1,2\ncase_0,9\n", "case 'case_0' is given twice (lines 2 and 4)"),
    ('{"case_0": {"load": 1}, "case_1": {"load": 2}, "case_0": {"load": 9}}',
     "key 'case_0' is given twice in one object"),
    ("case,load\ncase_0,1,5\ncase_1,2\n", "line 2 has 3 value(s) for the 2 columns"),
    ("case,load,speed\ncase_0,1\ncase_1,2,3\n", "line 2 has 2 value(s) for the 3 columns"),
    ('{"case_0": {"load": true}, "case_1": {"load": 2}}',
     "condition 'load' of case 'case_0' is True, not a number"),
])
def test_a_condition_table_that_says_two_things_is_refused(table, said, tmp_path, capsys):
    """A repeated case (CSV row or JSON key) silently took its last row, ``case_0,1,5``
    was read as 1 and JSON ``true`` as 1.0: each is a sentence naming the table and the
    line or key, and no store is written."""
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    name = "table.json" if table.startswith("{") else "table.csv"
    (source / name).write_text(table)
    _fails(convert_argv(source, tmp_path / "s", "--targets", "T", "--conditions", "load",
                        "--condition-table", name), capsys, str(source / name), said)
    assert not (tmp_path / "s").exists()


def test_a_table_row_by_stem_that_fits_several_cases_is_refused(tmp_path, capsys):
    """A row keyed ``case_0`` gave its conditions to both ``train/case_0`` and
    ``test/case_0``; it is refused, naming both; rows by full name are taken, and a stem
    that fits one case still works."""
    source = tmp_path / "src"
    cases(source / "train", 2, T=lambda m, i: point_field(m.points))
    cases(source / "test", 1, T=lambda m, i: point_field(m.points))
    (source / "t.csv").write_text("case,load\ncase_0,7\ncase_1,8\n")
    argv = convert_argv(source, tmp_path / "s", "--targets", "T", "--conditions", "load",
                        "--condition-table", "t.csv", "--test-pattern", "test/*")
    _fails(argv, capsys, str(source / "t.csv"), "row 'case_0' names the cases 'test/case_0' "
           "and 'train/case_0' by their file's stem", "full name")
    (source / "t.csv").write_text("case,load\ntrain/case_0,7\ntest/case_0,6\ncase_1,8\n")
    assert run(argv, capsys)[0] == 0
    samples = MeshStore(tmp_path / "s").samples
    assert [samples[n]["conditions"] for n in ("train/case_0", "test/case_0",
                                               "train/case_1")] == [[7.0], [6.0], [8.0]]


@pytest.mark.parametrize("scale, key, said, code", [
    ("1e39", "targets", "beyond the range of float32", 1),
    ("1e-50", "targets", "below the smallest normal float32", 1),
    ("1e39", "conditions", "beyond the range of float32", 1),
    ("nan", "targets", "'scale' must be a finite non-zero number, got nan", 2),
    ("inf", "targets", "'scale' must be a finite non-zero number, got inf", 2),
])
def test_a_unit_scale_the_store_cannot_keep_is_refused(scale, key, said, code, tmp_path,
                                                       capsys):
    """A scale of 1e39 stored inf and 1e-50 zeros with exit 0, and ``scale = nan`` was
    reported as NaN in the file's array: the store keeps float32, so a scaled array
    beyond its range, or all below its smallest normal number, is a sentence naming the
    spec's key (exit 1); a scale that is not finite is a usage error naming it (exit 2)."""
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    spec = tmp_path / "spec.toml"
    scaled = {"targets": f'targets = [{{array = "T", scale = {scale}}}]\n',
              "conditions": f'targets = ["T"]\nconditions = [{{array = "load", scale = '
                            f'{scale}}}]\n'}
    spec.write_text(scaled[key])
    _fails(convert_argv(source, tmp_path / "s", "--spec", str(spec)), capsys, said,
           f"{key}[0]" if code == 2 else f"the spec's {key}[0].scale", code=code)
    assert not list(tmp_path.rglob("*.npy"))


@pytest.mark.parametrize("text, said", [
    ('targets = ["T"]\ndimensions = 3.0\n', "dimensions must be the integer 2 or 3, got 3.0"),
    ('targets = ["T"]\npattern = "/x/*"\n', "pattern '/x/*' is not a relative path"),
    ('targets = ["T"]\npattern = "../*.vtu"\n', "pattern '../*.vtu' is not a relative path"),
    ("x = " + "[" * 100_000 + "]" * 100_000 + "\n", "nested thousands of levels deep"),
])
def test_spec_values_that_passed_the_checks_are_usage_errors(text, said, tmp_path, capsys):
    """``dimensions = 3.0`` ended in a TypeError, ``pattern = "/x/*"`` in pathlib's
    NotImplementedError, a 100k-deep TOML in a RecursionError: each is one sentence naming
    the spec file and the key (exit 2)."""
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    _fails(convert_argv(source, tmp_path / "s", "--spec", str(spec)), capsys, str(spec), said,
           code=2)


def test_a_one_file_source_warns_that_the_test_split_is_empty(tmp_path, capsys):
    """One case gave a store with an empty test split without a word (training then failed
    on KeyError 'ref_norm'): the store is written, with a warning saying so and how to
    give it test cases."""
    source = cases(tmp_path / "src", 1, T=lambda m, i: point_field(m.points))
    code, _, err = run(convert_argv(source / "case_0.vtu", tmp_path / "s", "--targets", "T"),
                       capsys)
    assert code == 0 and "warning: the store's test split is empty" in err
    assert "--test-pattern" in err and MeshStore(tmp_path / "s").splits["test"] == []


def test_overwrite_deletes_only_what_a_store_consists_of(tmp_path, capsys):
    """``--overwrite`` on a folder holding a ``convert.json`` deleted the whole folder, its
    other files included, and on a symlinked ``--out`` failed with shutil's words. It
    deletes only the store's own files (refusing, and deleting nothing, while the folder
    holds others) and keeps a link a link."""
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    out = tmp_path / "s"
    assert run(convert_argv(source, out, "--targets", "T"), capsys)[0] == 0
    (out / "notes.txt").write_text("mine")
    (out / "case_0" / "plot.png").write_text("mine too")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    _fails(convert_argv(source, out, "--targets", "T", "--conditions", "load", "--overwrite"),
           capsys, "holds files a store does not ('notes.txt' and 1 more)",
           "--overwrite deletes only a store's own files")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    (out / "notes.txt").unlink()
    (out / "case_0" / "plot.png").unlink()
    link = tmp_path / "link"
    link.symlink_to(out)
    assert run(convert_argv(source, link, "--targets", "T", "--conditions", "load",
                            "--overwrite"), capsys)[0] == 0
    assert link.is_symlink() and MeshStore(out).layout.condition_names == ["load"]


def test_a_second_conversion_into_a_store_being_written_is_refused(tmp_path, capsys):
    """Two conversions of one ``--out`` at once could both exit 0 and leave samples of two
    specs (two unit scales) under one manifest, or one died on the other's temporaries:
    the store is written under its lease (``STORE/.lock``), so the second is refused,
    naming the first, and leaves the store as it was."""
    from flarepp.data.store import StoreWriter
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    out = tmp_path / "s"
    with StoreWriter(out, {"spec": "the first"}):
        _fails(convert_argv(source, out, "--targets", "T"), capsys,
               f"{str(out / '.lock')!r} is held by process {os.getpid()}",
               f"it is writing the store {str(out)!r}: wait for it to finish")
        assert sorted(p.name for p in out.iterdir()) == [".lock", "convert.json"]
    assert run(convert_argv(source, out, "--targets", "T"), capsys)[0] == 0


def test_verify_finds_samples_of_another_conversion(tmp_path, capsys):
    """A store whose manifest lists a sample another conversion wrote (another unit scale:
    its bytes and recorded digests agree) passed `data check --verify`: each sample's own
    ``meta.json`` records the conversion that wrote it, and verify refuses the mix."""
    import json
    import shutil
    source = cases(tmp_path / "src", 3, T=lambda m, i: point_field(m.points))
    for out, scale in (("a", 1.0), ("b", 1000.0)):
        convert(source, tmp_path / out, parse_spec(
            {"targets": [{"array": "T", "scale": scale}]}), progress=False)
    a = tmp_path / "a"
    shutil.rmtree(a / "case_1")
    shutil.copytree(tmp_path / "b" / "case_1", a / "case_1")
    manifest = json.loads((a / "manifest.json").read_text())
    manifest["samples"]["case_1"] = json.loads((tmp_path / "b" / "manifest.json").read_text()
                                               )["samples"]["case_1"]
    (a / "manifest.json").write_text(json.dumps(manifest))
    assert run(["data", "check", str(a)], capsys)[0] == 0     # sizes and digests agree
    _fails(["data", "check", str(a), "--verify"], capsys, "case_1/meta.json",
           "written by another conversion", "layout and identity differ",
           "mixes two conversions")


@pytest.mark.slow
def test_a_full_disk_during_convert_names_the_file(tmp_path):
    """A full disk during conversion printed numpy's "requested and written" without the
    file, and an array smaller than C's write buffer was left truncated with no error at
    all (numpy's ``tofile`` does not report a failed flush): the kernel's file-size limit
    refuses the write as a full disk does; the sentence names the array being written, no
    sample is finished and no temporary is left."""
    source = tmp_path / "src"
    source.mkdir()
    mesh = volume_mesh(0, n=8)                  # 243 points: 3 KB of coordinates
    mesh.point_data["T"] = point_field(mesh.points)
    mesh.save(source / "case_0.vtu")
    out = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import resource, signal, sys
        from flarepp.cli import main
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
        sys.exit(main(["data", "convert", {str(source)!r}, "--out", {str(out)!r},
                       "--targets", "T", "--quiet"]))
    """)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert f"{out}/case_0/coordinates.npy: File too large" in proc.stderr
    assert "Traceback" not in proc.stderr and not list(out.rglob("meta.json"))
    assert not [p for p in out.rglob("*") if is_temporary(p.name)]


@pytest.mark.slow
def test_a_closed_output_is_not_an_error_of_convert(tmp_path):
    """`flarepp data convert ... | head` exited 1 ("Broken pipe") after writing a complete
    store: a reader that closes the output is not an error of the conversion."""
    source = cases(tmp_path / "src", 2, T=lambda m, i: point_field(m.points))
    proc = subprocess.Popen([sys.executable, "-m", "flarepp", "data", "convert", str(source),
                             "--out", str(tmp_path / "s"), "--targets", "T", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                  # the reader goes away before anything is printed
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert err == "" and len(MeshStore(tmp_path / "s").samples) == 2
