"""`flarepp serve` (issue 39): trained runs behind KServe's model server.

The process tests start ``flarepp serve`` on loopback ports the server chose, with a token
and a small budget, serving a conditioned store run (elasticity meshes) and a surface run,
and call it as users do: ``tritonclient`` over HTTP and gRPC, the mesh endpoint with a
multipart upload, raw sockets for a stalled client. Every answer is compared with
``flarepp.load(run).predict`` (1e-6), every bad request must get a 4xx with a sentence and
leave the server answering. The batcher, the guard and the command line's refusals are
checked in this process without a server (KServe is never imported here: its gRPC protos and
``tritonclient``'s share names and cannot both be loaded in one process).
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import os
import shutil
import sys
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pyvista")
if importlib.util.find_spec("kserve") is None:
    pytest.skip("flarepp serve needs KServe: pip install 'flarepp[serve]'",
                allow_module_level=True)
http = pytest.importorskip("tritonclient.http")
grpc_client = pytest.importorskip("tritonclient.grpc")

import flarepp  # noqa: E402
from flarepp.cli import main  # noqa: E402
from flarepp.inference.infer import geometry_case  # noqa: E402
from flarepp.inference.execution import Execution  # noqa: E402
from flarepp.inference.predictor import Predictor  # noqa: E402
from flarepp.models.surrogate import Surrogate  # noqa: E402
from flarepp.serve.batching import MicroBatcher, make_job  # noqa: E402
from flarepp.serve.limits import Guard, Limits, Refused  # noqa: E402
from flarepp.serve.process import call_model, declared_body, start_server  # noqa: E402
from flarepp.tasks.surface import integrated_forces  # noqa: E402
from tiny_runs import tiny_store_run, tiny_surface_run  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve")    # one server, its tests in file order
TOKEN = "a-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHUNK = 4096
SERVE_OPTIONS = ["--chunk-size", str(CHUNK), "--max-points", "300000", "--max-body-mb", "8",
                 "--read-timeout", "2", "--device", "cpu"]


def assert_same(got, want):
    """Equal to 1e-6 of the fields' scale (float32 sums in another order differ by rounding)."""
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * max(1.0, np.abs(want).max()))


# ---------------------------------------------------------------------------------------------
# the batcher, the guard, the command line: no server

def _random_predictor() -> Predictor:
    model = flarepp.build_model(mixer="flarepp", in_dim=2, out_dim=3, dim=16, heads=2,
                                blocks=2, latents=4)
    return Predictor(Surrogate(model.eval()), Execution(torch.device("cpu")))


def test_padded_batches_equal_each_request_alone():
    """Jobs of different sizes (one with its own mask) queued together are predicted in one
    padded forward, and each gets exactly what it gets alone (1e-6); a NaN job in the batch
    gets its own error and no other job does; a job above the chunk streams alone, equal to
    the plain forward; a job past its deadline and one at a full queue get 429. A failure
    points to padding that leaks into the real points, or answers handed to the wrong job."""
    predictor = _random_predictor()
    calls = []

    def predict(*args, **kwargs):
        calls.append((np.shape(args[0]), kwargs.get("chunk_size")))
        return predictor.predict(*args, **kwargs)

    rng = np.random.default_rng(0)
    meshes = [rng.random((n, 2), dtype=np.float32) for n in (50, 80, 30)]
    own_mask = rng.random(80) > 0.3
    nan = meshes[2].copy()
    nan[4, 1] = np.nan
    big = rng.random((1, 500, 2), dtype=np.float32)

    async def scenario():
        batcher = MicroBatcher(predict, chunk_size=400, max_batch=8, max_queue=5)
        jobs = [make_job(meshes[0]), make_job(meshes[1], mask=own_mask), make_job(nan),
                make_job(meshes[2]), make_job(big)]
        futures = [asyncio.ensure_future(batcher.submit(j)) for j in jobs]
        await asyncio.sleep(0)                       # all five queued before the worker
        with pytest.raises(Refused, match="busy: 5 requests are queued") as full:
            await batcher.submit(make_job(meshes[0]))
        assert full.value.status == 429
        worker = asyncio.ensure_future(batcher.work())
        results = await asyncio.gather(*futures, return_exceptions=True)
        late = asyncio.ensure_future(batcher.submit(make_job(meshes[0], deadline=0.0)))
        with pytest.raises(Refused, match="waited in the queue past its time budget"):
            await late
        worker.cancel()
        return results

    results = asyncio.run(scenario())
    assert calls[0] == ((4, 80, 2), None)            # the four small jobs in one forward
    assert_same(results[0], predictor.predict(meshes[0]))
    alone = predictor.predict(meshes[1], mask=own_mask)
    assert_same(results[1], alone)
    assert isinstance(results[2], ValueError) and "NaN" in str(results[2])
    assert_same(results[3], predictor.predict(meshes[2]))
    assert calls[-1] == ((1, 500, 2), 400)           # streamed alone, in chunks of 400
    assert_same(results[4], predictor.predict(big))


def _asgi(guard: Guard, path: str, headers: dict[str, str], chunks: list[bytes],
          stall: bool = False) -> tuple[int, dict, bytes | None]:
    """``(status, JSON answer, body the app received)`` of one request through ``guard``."""
    seen: dict = {}

    async def app(scope, receive, send):
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard.app = app
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1 or stall}
               for i, c in enumerate(chunks)]

    async def receive():
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)                    # a client that stopped sending

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(guard(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), seen.get("body")


def test_the_guard_refuses_with_a_sentence_and_passes_the_rest():
    """No token or a wrong one: 401; the health endpoints and the page stay open; the model
    repository's load/unload: 403; a body over the budget, declared or streamed: 413; a body
    that stops arriving: 408 after the read timeout; a good request reaches the app with its
    body whole. A failure points to a guard that lets a request through or blocks a probe."""
    limits = Limits(max_body_bytes=100, read_timeout=0.2)
    guard = Guard(None, token=TOKEN, limits=limits)
    status, answer, _ = _asgi(guard, "/v2/models/m/infer", {}, [b"{}"])
    assert status == 401 and "needs a token" in answer["error"]
    status, answer, _ = _asgi(guard, "/v2/models/m/infer", {"Authorization": "Bearer x"}, [b""])
    assert status == 401 and "the token is wrong" in answer["error"]
    for path in ("/v2/health/ready", "/v2/health/live", "/page/", "/page/vtk.js"):
        assert _asgi(guard, path, {}, [b""])[0] == 200
    status, answer, _ = _asgi(guard, "/v2/repository/models/m/unload", AUTH, [b""])
    assert status == 403 and "repository management is off" in answer["error"]
    status, answer, _ = _asgi(guard, "/v2/models/m/infer", {**AUTH, "Content-Length": "101"},
                              [b"x" * 101])
    assert status == 413 and "101 bytes, over this server's budget of 100" in answer["error"]
    status, answer, _ = _asgi(guard, "/v2/models/m/infer", AUTH, [b"x" * 60, b"x" * 60])
    assert status == 413 and "120 bytes" in answer["error"]
    status, answer, _ = _asgi(guard, "/v2/models/m/infer", AUTH, [b"x" * 10], stall=True)
    assert status == 408 and "did not arrive within 0.2 s" in answer["error"]
    status, _, body = _asgi(guard, "/v2/models/m/infer", AUTH, [b"ab", b"cd"])
    assert (status, body) == (200, b"abcd")


def test_listening_beyond_loopback_needs_a_token(tmp_path, capsys, monkeypatch):
    """`--host 0.0.0.0` without a token is a usage error naming the option, before any run
    is loaded or KServe imported; a token file that is missing is named too."""
    monkeypatch.delenv("FLAREPP_SERVE_TOKEN", raising=False)
    assert main(["serve", str(tmp_path), "--host", "0.0.0.0"]) == 2
    assert "--host 0.0.0.0 listens beyond this machine: give a token" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--token-file", str(tmp_path / "none")]) == 2
    assert "--token-file" in capsys.readouterr().err
    assert "kserve" not in sys.modules


def test_the_command_line_refuses_what_it_cannot_serve_as_asked(tmp_path, capsys, monkeypatch):
    """The serve probe of issue 41: `--grpc-port 99999` served gRPC on 34463 (modulo 65536),
    `--grpc-port -5` served none, `--port 99999` was an OverflowError traceback; a blank
    $FLAREPP_SERVE_TOKEN was a token no client can send, taken on 0.0.0.0; a run that does
    not exist was "model name ''". Each is a usage error (exit 2) before KServe is imported."""
    for args, said in ((["--port", "99999"], "--port: must be an integer from 0 to 65535"),
                       (["--grpc-port", "99999"], "from -1 to 65535, got 99999"),
                       (["--grpc-port", "-5"], "from -1 to 65535, got -5")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", str(tmp_path), *args])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    monkeypatch.setenv("FLAREPP_SERVE_TOKEN", "   ")
    assert main(["serve", str(tmp_path), "--host", "0.0.0.0"]) == 2
    assert "$FLAREPP_SERVE_TOKEN is empty" in capsys.readouterr().err
    monkeypatch.delenv("FLAREPP_SERVE_TOKEN")
    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert "nope' (from" in capsys.readouterr().err
    assert "kserve" not in sys.modules


# ---------------------------------------------------------------------------------------------
# a server

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-runs")
    cases, _, store_run = tiny_store_run(root)
    surfaces, surface_run = tiny_surface_run(root)
    return {"cases": cases, "elastic": store_run, "surfaces": surfaces, "car": surface_run}


@pytest.fixture(scope="module")
def server(runs, tmp_path_factory):
    """``flarepp serve elastic=... car=...`` with a token, in a working directory, HOME and
    TMPDIR of its own (checked empty when it stops)."""
    root = tmp_path_factory.mktemp("serve-process")
    dirs = {name: root / name for name in ("cwd", "home", "tmp")}
    for d in dirs.values():
        d.mkdir()
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    env = {**os.environ, "HOME": str(dirs["home"]), "TMPDIR": str(dirs["tmp"])}
    process = start_server([f"elastic={runs['elastic']}", f"car={runs['car']}"],
                           ["--token-file", str(token_file), *SERVE_OPTIONS], env=env,
                           cwd=dirs["cwd"], log=root / "server.log")
    # what importing flarepp writes (matplotlib's per-user font cache, once), before serving
    dirs["home_at_start"] = _tree(dirs["home"])
    yield process, dirs
    process.stop()


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def reference(runs):
    return {name: flarepp.load(runs[name], device="cpu") for name in ("elastic", "car")}


def infer(client_module, server, model, arrays, token=TOKEN):
    """``fields`` by tritonclient over HTTP or gRPC (the module), with ``token``."""
    process, _ = server
    protocol, url = ("http", process.rest) if client_module is http else ("grpc", process.grpc)
    return call_model(protocol, url, model, arrays, token=token)


def request(server, path, *, data=None, headers=AUTH, method=None):
    """``(status, body, headers)`` of a REST call (headers: case-insensitive)."""
    process, _ = server
    req = urllib.request.Request(f"http://{process.rest}{path}", data=data,
                                 headers=dict(headers), method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers


def upload(server, model, filename, content, conditions=None, query="", headers=AUTH):
    """The mesh endpoint with a multipart body (the file as ``mesh``, ``conditions``)."""
    boundary = uuid.uuid4().hex
    parts = [(f'--{boundary}\r\nContent-Disposition: form-data; name="mesh"; '
              f'filename="{filename}"\r\n\r\n').encode() + content + b"\r\n"]
    if conditions is not None:     # an object, or a string sent as it is
        text = conditions if isinstance(conditions, str) else json.dumps(conditions)
        parts.append((f'--{boundary}\r\nContent-Disposition: form-data; name="conditions"'
                      f'\r\n\r\n{text}\r\n').encode())
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return request(server, f"/v2/models/{model}/mesh{query}", data=body,
                   headers={**headers, "Content-Type": f"multipart/form-data; boundary={boundary}"})


def points_of(rng, n):
    return rng.random((n, 2), dtype=np.float32)


def assert_still_serving(server, reference):
    """The server answers a good request, exactly."""
    rng = np.random.default_rng(99)
    x, c = points_of(rng, 64), np.array([1.1], np.float32)
    got = infer(http, server, "elastic", {"points": x, "conditions": c})
    assert_same(got, reference["elastic"].predict(x, conditions=c))


@pytest.mark.slow
def test_tritonclient_over_http_and_grpc_gets_what_load_predict_gives(server, reference):
    """One mesh [N, 2] and a padded batch [B, N, 2] with a mask, each with its conditions,
    over HTTP and gRPC: what `flarepp.load(run).predict` gives (1e-6). A failure points to a
    tensor decoded in the wrong layout, a lost mask or conditions, or units not restored."""
    rng = np.random.default_rng(1)
    one, c1 = points_of(rng, 300), np.array([1.3], np.float32)
    batch = rng.random((3, 200, 2), dtype=np.float32)
    mask = np.ones((3, 200), bool)
    mask[1, 150:] = mask[2, 90:] = False
    cb = np.array([[[0.9]], [[1.2]], [[1.8]]], np.float32)
    expect_one = reference["elastic"].predict(one, conditions=c1)
    expect_batch = reference["elastic"].predict(batch, conditions=cb, mask=mask)
    for client in (http, grpc_client):
        assert_same(infer(client, server, "elastic",
                                         {"points": one, "conditions": c1}),
                                   expect_one)
        got = infer(client, server, "elastic",
                    {"points": batch, "conditions": cb, "mask": mask})
        assert_same(got, expect_batch)


@pytest.mark.slow
def test_concurrent_clients_each_get_their_own_exact_answer(server, reference):
    """16 clients at once, meshes of different sizes and conditions (batched together where
    they arrive together): each answer is its own request's (1e-6), none lost."""
    rng = np.random.default_rng(2)
    work = [(points_of(rng, int(n)), np.array([0.8 + 0.1 * k], np.float32))
            for k, n in enumerate(rng.integers(100, 900, 16))]
    answers: dict[int, np.ndarray] = {}

    def client(k):
        x, c = work[k]
        answers[k] = infer(grpc_client if k % 2 else http, server, "elastic",
                           {"points": x, "conditions": c})

    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == list(range(len(work)))
    for k, (x, c) in enumerate(work):
        assert_same(answers[k], reference["elastic"].predict(x, conditions=c))


@pytest.mark.slow
def test_a_request_above_the_chunk_streams_exactly(server, reference):
    """10000 cells with a chunk of 4096 for the surface run (a streamable backbone):
    streamed, equal to the whole forward (1e-6); the conditioned run (concat conditioning,
    which streams exactly) too, both models' metadata saying so."""
    rng = np.random.default_rng(3)
    cells = rng.random((10_000, 6), dtype=np.float32)
    got = infer(grpc_client, server, "car", {"points": cells[:, :3], "features": cells[:, 3:]})
    assert_same(got, reference["car"].predict(cells[:, :3],
                                                             features=cells[:, 3:]))
    x, c = points_of(rng, 10_000), np.array([1.5], np.float32)
    got = infer(grpc_client, server, "elastic", {"points": x, "conditions": c})
    assert_same(got, reference["elastic"].predict(x, conditions=c))
    layouts = {m: json.loads(request(server, f"/v2/models/{m}")[1])["parameters"]["layout"]
               for m in ("car", "elastic")}
    assert layouts["car"]["streaming"] == layouts["elastic"]["streaming"] == "supported"


@pytest.mark.slow
def test_metadata_gives_the_tensors_and_the_layout(server):
    """The v2 metadata: the tensors with the run's sizes (REST and gRPC), and over REST the
    layout (names, units, conditions, what the mesh endpoint takes)."""
    status, body, _ = request(server, "/v2/models/elastic")
    meta = json.loads(body)
    assert status == 200
    assert [(t["name"], t["shape"]) for t in meta["inputs"]] == [
        ("points", [-1, -1, 2]), ("mask", [-1, -1]), ("conditions", [-1, 1, 1])]
    assert meta["outputs"] == [{"name": "fields", "datatype": "FP32", "shape": [-1, -1, 1]}]
    layout = meta["parameters"]["layout"]
    assert layout["field_names"] == ["von_mises"] and layout["condition_names"] == ["load"]
    assert layout["association"] == "point" and layout["mesh"] == "supported"
    grpc_meta = grpc_client.InferenceServerClient(server[0].grpc).get_model_metadata(
        "car", headers={"authorization": f"Bearer {TOKEN}"})
    assert [(t.name, list(t.shape)) for t in grpc_meta.inputs] == [
        ("points", [-1, -1, 3]), ("features", [-1, -1, 3]), ("mask", [-1, -1])]


@pytest.mark.slow
def test_the_mesh_endpoint_returns_the_mesh_with_its_predicted_fields(server, runs, reference,
                                                                      tmp_path):
    """A solver's VTU (not in the store's training split) with its condition given, then
    from its own field data: the same mesh (points, cells) with ``pred_von_mises`` equal to
    `predict` at its points (1e-6); the summary header says so; ``surface=true`` gives a
    VTP. A failure points to inputs built differently from the store's conversion, or
    fields written onto the wrong rows."""
    import pyvista as pv
    source = runs["cases"] / "test" / "case_0001.vtu"
    mesh = pv.read(source)
    x = np.asarray(mesh.points[:, :2], np.float32)
    for conditions, load in (({"load": 1.7}, 1.7), (None, float(mesh.field_data["load"][0]))):
        status, body, headers = upload(server, "elastic", "case_0001.vtu",
                                       source.read_bytes(), conditions)
        assert status == 200, body
        (tmp_path / "out.vtu").write_bytes(body)
        out = pv.read(tmp_path / "out.vtu")
        assert (out.n_points, out.n_cells) == (mesh.n_points, mesh.n_cells)
        expect = reference["elastic"].predict(x, conditions=np.array([load], np.float32))
        assert_same(out.point_data["pred_von_mises"], expect[:, 0])
        summary = json.loads(headers["Flarepp-Summary"])
        assert summary["rows"] == mesh.n_points and summary["force"] is None
        assert summary["fields"]["von_mises"] == pytest.approx(
            [float(expect.min()), float(expect.max())], abs=1e-6)
    status, body, _ = upload(server, "elastic", "case.vtu", source.read_bytes(), {"load": 1},
                             "?surface=true")
    assert status == 200 and b'<VTKFile type="PolyData"' in body[:300]


@pytest.mark.slow
def test_a_surface_run_gets_its_fields_and_force_from_an_stl(server, runs, reference, tmp_path):
    """An STL of a body (geometry only): each triangle's pressure and wall shear equal
    `predict` at the cell centres and normals DrivAerML's reader computes (1e-6), and the
    force in the summary and the file is ``sum (-p n + tau) A`` of those (1e-9 relative)."""
    import pyvista as pv
    stl = tmp_path / "body.stl"
    pv.read(runs["surfaces"] / "run_3" / "boundary_3.vtp").triangulate().save(stl)
    status, body, headers = upload(server, "car", "body.stl", stl.read_bytes())
    assert status == 200, body
    (tmp_path / "out.vtp").write_bytes(body)
    out = pv.read(tmp_path / "out.vtp")
    case = geometry_case(stl)
    expect = reference["car"].predict(case.x[0, :, :3], features=case.x[0, :, 3:])
    got = np.stack([out.cell_data[f"pred_{n}"] for n in ("p_s", "tau_x", "tau_y", "tau_z")], 1)
    assert_same(got, expect)
    force = integrated_forces(torch.from_numpy(expect[None]).double(),
                              torch.from_numpy(case.x[:1, :, 3:6]).double(),
                              torch.from_numpy(case.areas[None]))[0].numpy()
    summary = json.loads(headers["Flarepp-Summary"])
    np.testing.assert_allclose(summary["force"], force, rtol=1e-9)
    np.testing.assert_allclose(out.field_data["force"], force, rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# the page, in a real browser

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@pytest.mark.slow
def test_the_page_shows_an_uploaded_body_with_its_fields_and_force(server, runs, tmp_path):
    """Headless Chromium on the page: the token typed in, the surface run chosen, an STL
    uploaded; the page draws the body in colour (most of the view not background, many
    colours), with a colour bar, the four fields to choose from (choosing another redraws
    it), and the numbers the mesh endpoint gives (cells, force). A failure points to the
    page, its vtk.js reading the returned VTP, or a number lost on its way."""
    if CHROMIUM is None:
        pytest.skip("no Chromium to drive: Debian's package `chromium` (make test installs "
                    "it where it runs as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the page test drives "
                                   "Chromium with Playwright: pip install 'flarepp[test]'")
    import pyvista as pv
    stl = tmp_path / "body.stl"
    pv.read(runs["surfaces"] / "run_3" / "boundary_3.vtp").triangulate().save(stl)
    expected = json.loads(upload(server, "car", "body.stl", stl.read_bytes())[2]
                          ["Flarepp-Summary"])
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--use-angle=swiftshader", "--enable-unsafe-swiftshader"])
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        page.goto(f"http://{server[0].rest}/page/")
        page.wait_for_selector("body[data-state=error]")           # the token is missing
        assert "this server needs a token" in page.inner_text("#status")
        page.fill("#token", TOKEN)
        page.press("#token", "Tab")                                 # leaving it: change
        page.wait_for_selector("body[data-state=ready]")
        page.select_option("#model", "car")
        page.wait_for_function("document.getElementById('about').textContent"
                               ".startsWith('surface run')")
        page.set_input_files("#mesh", str(stl))
        page.click("#predict")
        page.wait_for_selector("body[data-state=shown], body[data-state=error]")
        assert page.get_attribute("body", "data-state") == "shown", page.inner_text("#status")
        shown = {k: page.inner_text(f"dd[data-key='{k}']") for k in ("cells", "force (x, y, z)")}
        fields = page.eval_on_selector_all("#field option", "o => o.map(e => e.value)")
        before = _pixels(page.locator("#view").screenshot())
        page.select_option("#field", "tau_x")
        after = _pixels(page.locator("#view").screenshot())
        page.screenshot(path=str(tmp_path / "page.png"))
        browser.close()
    assert int(shown["cells"]) == expected["rows"]
    np.testing.assert_allclose([float(v) for v in shown["force (x, y, z)"].split(",")],
                               expected["force"], rtol=1e-5)
    assert fields == ["p_s", "tau_x", "tau_y", "tau_z"]
    drawn = (before < 245).any(axis=2)                               # not the white background
    assert drawn.mean() > 0.05, "the view is (nearly) blank"
    assert len(np.unique(before[drawn], axis=0)) > 50, "the body is not coloured by a field"
    assert (before != after).any(axis=2).mean() > 0.01, "choosing tau_x did not redraw"


# ---------------------------------------------------------------------------------------------
# bad requests: a 4xx with a sentence each, and the server keeps serving

@pytest.mark.slow
def test_wrong_shapes_get_400_naming_the_shape(server, reference):
    rng = np.random.default_rng(4)
    with pytest.raises(InferenceServerException, match="points have 3 channels, but this "
                       "run's model takes 2 coordinate channels") as err:
        infer(http, server, "elastic", {"points": rng.random((50, 3), dtype=np.float32),
                                        "conditions": np.array([1.0], np.float32)})
    assert err.value.status() == "400"
    with pytest.raises(InferenceServerException, match=r"conditions must be \[B, K, C\]"):
        infer(grpc_client, server, "elastic", {"points": points_of(rng, 50),
                                               "conditions": np.ones((1, 2, 3), np.float32)})
    with pytest.raises(InferenceServerException, match="input 'pressure' is unknown: model "
                       "'elastic' takes points, mask, conditions"):
        infer(http, server, "elastic", {"points": points_of(rng, 5),
                                        "pressure": np.ones((5, 1), np.float32)})
    assert_still_serving(server, reference)


@pytest.mark.slow
def test_nan_inputs_get_400(server, reference):
    x = points_of(np.random.default_rng(5), 40)
    x[7, 0] = np.nan
    with pytest.raises(InferenceServerException, match="NaN or inf at real points") as err:
        infer(http, server, "elastic", {"points": x, "conditions": np.array([1.0], np.float32)})
    assert err.value.status() == "400"
    assert_still_serving(server, reference)


@pytest.mark.slow
def test_a_broken_or_unreadable_mesh_gets_400_naming_the_file(server, reference):
    for name, content, said in (
            ("broken.vtu", b"<?xml version='1.0'?><VTKFile type='Unstr", "mesh.vtu"),
            ("notes.xyz", b"1 2 3", "no registered mesh format reads '.xyz' files"),
            ("empty.stl", b"", "empty (0 bytes)")):
        status, body, _ = upload(server, "elastic", name, content, {"load": 1.0})
        assert status == 400, (name, body)
        assert said in json.loads(body)["error"], (name, body)
    status, body, _ = upload(server, "elastic", "x.vtu", b"", {"load": "heavy"})
    assert status == 400 and "conditions must be a JSON object of numbers" in body.decode()
    assert_still_serving(server, reference)


@pytest.mark.slow
def test_hostile_uploads_are_refused_and_the_server_lives(server, reference, tmp_path):
    """The serve probe of issue 41: a 100-byte VTU declaring 2e9 points aborted the server
    (VTK's std::bad_alloc), a legacy grid of 1e8 points was a 500 after 763 MiB; a VTKHDF
    whose points are another file's bytes was read (and would be returned); a cell naming a
    missing point was a 500 (IndexError) for the surface run; an EnSight case read files
    its text names; conditions true, "2" or given twice were taken. Now: 413 or 400, each
    a sentence, and the server answers on."""
    import h5py
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.zeros(30).tobytes())
    hdf = tmp_path / "ext.vtkhdf"
    with h5py.File(hdf, "w") as f:
        g = f.create_group("VTKHDF")
        g.attrs["Version"], g.attrs["Type"] = (2, 1), np.bytes_("UnstructuredGrid")
        g.create_dataset("Points", shape=(10, 3), dtype="f8",
                         external=[(str(secret), 0, h5py.h5f.UNLIMITED)])
    big_vtu = (b'<?xml version="1.0"?><VTKFile type="UnstructuredGrid"><UnstructuredGrid>'
               b'<Piece NumberOfPoints="2000000000" NumberOfCells="0"></Piece>'
               b'</UnstructuredGrid></VTKFile>')
    grid = (b"# vtk DataFile Version 3.0\nx\nASCII\nDATASET STRUCTURED_POINTS\nDIMENSIONS "
            b"1000 1000 100\nORIGIN 0 0 0\nSPACING 1 1 1\n")
    bad_cell = (b"# vtk DataFile Version 3.0\nx\nASCII\nDATASET POLYDATA\nPOINTS 3 float\n"
                b"0 0 0 1 0 0 0 1 0\nPOLYGONS 1 4\n3 0 1 99\n")
    for model, name, content, conditions, status, said in (
            ("elastic", "big.vtu", big_vtu, {"load": 1.0}, 413, "declares 2000000000 points"),
            ("car", "grid.vtk", grid, None, 413, "over the 300000 allowed (--max-points)"),
            ("elastic", "ext.vtkhdf", hdf.read_bytes(), {"load": 1.0}, 400,
             "reads its data from external files"),
            ("car", "bad.vtk", bad_cell, None, 400, "a cell names point 99"),
            ("elastic", "x.case", b"FORMAT\ntype: ensight gold\nGEOMETRY\nmodel: ../x.geo\n",
             {"load": 1.0}, 400, "names other files"),
            ("elastic", "x.vtu", b"", '{"load": true}', 400, "is True, not a number"),
            ("elastic", "x.vtu", b"", '{"load": "2"}', 400, "is '2', not a number"),
            ("elastic", "x.vtu", b"", '{"load": 1, "load": 2}', 400, "given twice"),
            ("elastic", "x.vtu", b"", '{"load": ' + "[" * 10**5 + "]" * 10**5 + "}", 400,
             "nested too deeply")):
        status_got, body, _ = upload(server, model, name, content, conditions)
        assert status_got == status and said in json.loads(body)["error"], (name, body[:300])
    # a body that is no v2 request: FastAPI's 422 {"detail": [...]} echoing the input
    for body in (b"[1, 2]", b"{", b"{}"):
        status_got, answer, _ = request(server, "/v2/models/elastic/infer", data=body,
                                        headers={**AUTH, "Content-Type": "application/json"})
        assert status_got == 400 and "not a v2 inference request" in json.loads(answer)["error"]
    assert request(server, "/v2/nothing-here")[0] == 404
    # finite inputs the model overflows on: NaN fields were answered with 200
    with pytest.raises(InferenceServerException, match="NaN or infinite at 5 of 5 point"):
        infer(http, server, "elastic", {"points": np.full((5, 2), 3e38, np.float32),
                                        "conditions": np.ones(1, np.float32)})
    assert_still_serving(server, reference)


@pytest.mark.slow
def test_a_huge_mesh_or_request_gets_413(server, reference):
    """A 9 MiB upload (budget 8 MiB) is refused from its declared length, before its body
    is read (as curl sends it: ``Expect: 100-continue``); 400000 points (budget 300000)
    after decoding."""
    answer = declared_body(server[0].rest, "/v2/models/elastic/mesh", 9 << 20, token=TOKEN,
                           expect=True)
    assert answer.startswith("HTTP/1.1 413")
    assert "9437184 bytes, over this server's budget of 8388608 bytes" in answer
    x = points_of(np.random.default_rng(6), 400_000)
    with pytest.raises(InferenceServerException, match="holds 400000 points, over this "
                       "server's budget of 300000 points") as err:
        infer(http, server, "elastic", {"points": x, "conditions": np.ones(1, np.float32)})
    assert err.value.status() == "413"
    assert_still_serving(server, reference)


@pytest.mark.slow
def test_a_wrong_or_missing_token_gets_401(server, reference):
    x, c = points_of(np.random.default_rng(7), 10), np.ones(1, np.float32)
    for token, said in ((None, "this server needs a token"), ("nope", "the token is wrong")):
        with pytest.raises(InferenceServerException, match=said) as err:
            infer(http, server, "elastic", {"points": x, "conditions": c}, token=token)
        assert err.value.status() == "401"
        with pytest.raises(InferenceServerException, match=said) as err:
            infer(grpc_client, server, "elastic", {"points": x, "conditions": c}, token=token)
        assert "UNAUTHENTICATED" in err.value.status()
    assert request(server, "/v2/health/ready", headers={})[0] == 200
    assert request(server, "/metrics", headers={})[0] == 401
    assert_still_serving(server, reference)


@pytest.mark.slow
def test_a_model_that_does_not_exist_gets_404(server, reference):
    x, c = points_of(np.random.default_rng(8), 10), np.ones(1, np.float32)
    for client, status in ((http, "404"), (grpc_client, "StatusCode.NOT_FOUND")):
        with pytest.raises(InferenceServerException, match="Model with name nope does not "
                           "exist") as err:
            infer(client, server, "nope", {"points": x, "conditions": c})
        assert err.value.status() == status
    status, body, _ = upload(server, "nope", "a.vtu", b"x")
    assert status == 404 and "nope does not exist" in body.decode()
    status, body, _ = request(server, "/v2/repository/models/elastic/unload", data=b"",
                              method="POST")
    assert status == 403 and "repository management is off" in body.decode()
    assert_still_serving(server, reference)


@pytest.mark.slow
def test_a_slow_client_gets_408_while_others_are_served(server, reference):
    """A client that sends its headers and a few bytes, then nothing: 408 after the read
    timeout (2 s), and a good request made meanwhile is answered."""
    stalled = {}
    client = threading.Thread(target=lambda: stalled.update(answer=declared_body(
        server[0].rest, "/v2/models/elastic/infer", 1000, token=TOKEN)))
    client.start()
    assert_still_serving(server, reference)
    client.join()
    answer = stalled["answer"]
    assert answer.startswith("HTTP/1.1 408")
    assert "did not arrive within 2 s (--read-timeout): a slow or stalled client" in answer
    assert_still_serving(server, reference)


@pytest.mark.slow
def test_the_load_benchmark_runs_and_checks_every_answer(runs, tmp_path):
    """`flarepp bench serve` at a small scale on the surface run: a batched and an unbatched
    server, every answer checked (none lost or wrong), the large mesh streamed and equal to
    `flarepp infer`, every bad request refused with the server answering after it. (Its
    timings are the benchmark's to report, not this test's.)"""
    from flarepp.bench.serve import ServeBenchConfig, goals, run_serve_bench
    result = run_serve_bench(ServeBenchConfig(
        run=str(runs["car"]), clients=(1, 3), requests=12, large_points=20_000,
        chunk_size=4096, pool=4, work_dir=str(tmp_path)), progress=lambda line: None)
    assert [(r["mode"], r["clients"], r["answered"], r["errors"], r["wrong"])
            for r in result["load"]] == [
        ("batched", 1, 12, 0, 0), ("unbatched", 1, 12, 0, 0),
        ("batched", 3, 12, 0, 0), ("unbatched", 3, 12, 0, 0)]
    for row in result["load"]:            # where the time went, from the servers' counters
        assert 0 < row["loop_cpu_ms"] <= row["server_cpu_ms"] and row["forward_ms"] > 0, row
        assert row["client_cpu_ms"] > 0, row
        assert row["per_forward"] == 1.0 if row["mode"] == "unbatched" else \
            1.0 <= row["per_forward"] <= row["clients"], row
    assert result["large"]["deviation"] <= 1e-6
    assert [b["request"] for b in result["bad"]] == [
        "wrong shape", "NaN", "unknown model", "wrong token", "body over budget",
        "stalled client"]
    for bad, status in zip(result["bad"], ("400", "400", "NOT_FOUND", "401", "413", "408")):
        assert status in bad["answer"] and bad["alive"], bad
    met = dict((what, ok) for what, _, ok in goals(result))
    assert met["requests lost or answered wrongly == 0"]
    assert met["every bad request refused, the server alive after each"]
    assert list(tmp_path.iterdir()) == []                    # its work directory is gone


def test_request_costs_are_per_answered_request_and_the_ceiling_compares_cpu():
    """The load benchmark's breakdown: counters' differences over the answered requests, in
    milliseconds, and requests per forward; batching's ceiling is the CPU a request costs
    (server and client) unbatched over batched at the most clients."""
    from flarepp.bench.serve import batching_ceiling, request_costs
    before = {"server": 1.0, "loop": 0.5, "client": 2.0, "forwards": 3.0, "batched": 3.0,
              "forward_seconds": 0.1}
    after = {"server": 3.0, "loop": 0.7, "client": 2.4, "forwards": 8.0, "batched": 43.0,
             "forward_seconds": 1.7}
    costs = request_costs(before, after, 40)
    assert costs == pytest.approx({"server_cpu_ms": 50.0, "loop_cpu_ms": 5.0,
                                   "forward_ms": 40.0, "client_cpu_ms": 10.0,
                                   "per_forward": 8.0})
    rows = [{"mode": m, "clients": c, "server_cpu_ms": s, "client_cpu_ms": 1.0}
            for m, c, s in (("batched", 1, 15.0), ("unbatched", 1, 15.0),
                            ("batched", 16, 9.0), ("unbatched", 16, 17.0))]
    assert batching_ceiling({"load": rows}) == (16, pytest.approx(1.8))


@pytest.mark.slow
def test_connections_without_a_request_head_are_closed(server, reference):
    """uvicorn waited for a request head forever: 400 connections with a partial head (no
    token needed) were all still open 35 s later, each holding a file descriptor, so
    enough of them shut everyone out. Now each is closed once --read-timeout (2 s here)
    passes without a head, and the server answers on."""
    import socket
    import time
    host, port = server[0].rest.rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(20)]
    for k, sock in enumerate(held):
        if k % 2:
            sock.sendall(b"POST /v2/models/elastic/infer HTTP/1.1\r\nHost: x\r\n")
    time.sleep(3.5)
    for sock in held:
        assert sock.recv(100) == b""          # closed by the server
        sock.close()
    assert_still_serving(server, reference)


@pytest.mark.slow
def test_the_server_stops_cleanly_and_wrote_nothing_outside_its_temporary_directory(server):
    """SIGTERM: exit 143 after a graceful stop; its working directory and TMPDIR are as
    empty as they started (its own temporary directory, uploads included, is gone) and HOME
    holds what importing flarepp put there before it served (matplotlib's font cache)."""
    process, dirs = server
    assert request(server, "/v2/health/live", headers={})[0] == 200
    assert process.stop() == 143
    for name in ("cwd", "tmp"):
        assert sorted(p.name for p in dirs[name].rglob("*")) == [], name
    assert _tree(dirs["home"]) == dirs["home_at_start"]
