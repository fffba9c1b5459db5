"""``flarepp serve``: trained runs behind KServe's model server (the Open Inference Protocol,
REST and gRPC), so that standard clients (``tritonclient``, ``curl``, KServe itself) call
them.

Shape letters: B samples, N points, G coordinate and F feature channels, K conditioning
tokens of C features, O outputs.

**KServe's part** (the protocol): the v2 REST routes (server and model health, readiness,
metadata, ``infer`` with JSON or binary tensors), the gRPC ``GRPCInferenceService``, the
Prometheus metrics at ``/metrics`` (pre-process, predict and post-process latency per
model), its ``Model``, ``ModelRepository`` and ``DataPlane``, and its mapping of errors to
status codes. **flarepp's part**:

* one model per run (:class:`SurrogateModel`): inputs ``points [B, N, G]`` (or one mesh
  ``[N, G]``), ``features [B, N, F]``, ``mask [B, N]`` (BOOL, True at real points),
  ``conditions [B, K, C]``; output ``fields [B, N, O]`` in physical units. Its metadata
  lists them with the run's G, F, K, C and O and, over REST, the run's layout
  (``parameters.layout``: channel and field names, units, condition names, association);
* the mesh endpoint ``POST /v2/models/NAME/mesh`` (multipart: the file as ``mesh``, an
  optional JSON object ``conditions``; ``?surface=true`` for the outer surface): the mesh
  as VTK XML with ``pred_<field>`` arrays (:mod:`flarepp.serve.meshes`), and the header
  ``Flarepp-Summary`` (JSON: rows, fields and their ranges, a surface run's force, seconds);
* the page at ``/page/`` (``static/``: vtk.js);
* batching and streaming (:mod:`flarepp.serve.batching`), the request budget and the token
  (:mod:`flarepp.serve.limits`; on gRPC by :class:`TokenInterceptor`).

``kserve.ModelServer.start`` binds REST to 0.0.0.0 and gRPC to [::] (fixed in its code) and
has no hook for a token, so :func:`serve` assembles the same components on the host and
ports asked: 127.0.0.1 by default, another address only with a token. The process writes
only into its own temporary directory (uploads, returned meshes, the multipart parser's
spooled files: ``tempfile.tempdir`` and ``TMPDIR`` point there), removed when it stops.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flarepp.data.meshes import MeshTooLarge
from flarepp.serve.batching import MicroBatcher, make_job
from flarepp.serve.extra import require_kserve
from flarepp.serve.limits import Guard, Limits, Refused, check_listen
from flarepp.serve.meshes import field_names, integrated_force, mesh_request, write_prediction
from flarepp.serve.run import ServedRun, load_run

kserve = require_kserve()
from grpc import StatusCode, aio, stream_stream_rpc_method_handler  # noqa: E402
from grpc import unary_unary_rpc_method_handler  # noqa: E402
from kserve.errors import InvalidInput, ModelNotFound  # noqa: E402
from kserve.protocol.infer_type import InferOutput, InferResponse  # noqa: E402
from prometheus_client import Histogram  # noqa: E402
from starlette.requests import Request  # noqa: E402

STATIC = Path(__file__).with_name("static")
INPUTS = ("points", "features", "mask", "conditions")
BATCH_REQUESTS = Histogram("flarepp_batch_requests", "requests predicted in one forward",
                           ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128))
FORWARD_SECONDS = Histogram("flarepp_forward_seconds", "seconds of one batched forward",
                            ["model"])


class Refusal(InvalidInput):
    """A refused request as KServe's errors carry it: 400-class over gRPC
    (INVALID_ARGUMENT), its own ``status`` over REST."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class ServeSettings:
    """Where and how the server listens: ``host``, ``http_port`` and ``grpc_port`` (0: any
    free port; ``grpc_port`` None: no gRPC), the ``token`` required of every call but
    health and the page (None: none; required off loopback), the ``device`` and the
    request budget ``limits``."""

    host: str = "127.0.0.1"
    http_port: int = 8080
    grpc_port: int | None = 8081
    token: str | None = None
    device: str = "auto"
    limits: Limits = field(default_factory=Limits)


class SurrogateModel(kserve.Model):
    """One served run as a KServe model (module docstring)."""

    def __init__(self, name: str, run: ServedRun, limits: Limits) -> None:
        super().__init__(name)
        self.run, self.limits = run, limits
        self.batcher = MicroBatcher(run.predict, chunk_size=limits.chunk_size,
                                    max_batch=limits.max_batch, max_queue=limits.max_queue,
                                    streams=run.streaming is None, observe=self._observe)
        self.ready = True

    def _observe(self, requests: int, seconds: float) -> None:
        BATCH_REQUESTS.labels(self.name).observe(requests)
        FORWARD_SECONDS.labels(self.name).observe(seconds)

    def get_input_types(self) -> list[dict[str, Any]]:
        g = self.run.coordinates
        f = self.run.layout.channels - g
        tensors = [{"name": "points", "datatype": "FP32", "shape": [-1, -1, g]}]
        if f:
            tensors.append({"name": "features", "datatype": "FP32", "shape": [-1, -1, f]})
        tensors.append({"name": "mask", "datatype": "BOOL", "shape": [-1, -1]})
        if self.run.layout.conditions is not None:
            tensors.append({"name": "conditions", "datatype": "FP32",
                            "shape": [-1, *self.run.layout.conditions]})
        return tensors

    def get_output_types(self) -> list[dict[str, Any]]:
        return [{"name": "fields", "datatype": "FP32",
                 "shape": [-1, -1, self.run.layout.outputs]}]

    async def submit(self, *arrays: Any) -> np.ndarray:
        """The fields of ``(points, features, conditions, mask)`` (module docstring)."""
        job = make_job(*arrays, tokens=self.run.layout.conditions,
                       deadline=time.monotonic() + self.limits.max_seconds)
        try:
            self.limits.check_points(job.points_count)
            fields = await self.batcher.submit(job)
        except Refused as err:
            raise Refusal(err.status, str(err)) from None
        except InvalidInput:
            raise
        except ValueError as err:
            raise InvalidInput(str(err)) from None
        mask = arrays[3]
        bad = ~np.isfinite(fields).all(axis=-1) & (True if mask is None else np.asarray(mask))
        if bad.any():   # finite inputs the model overflows on (e.g. 3e38): no NaN answered
            raise InvalidInput(f"the prediction is NaN or infinite at {int(bad.sum())} of "
                               f"{bad.size} point(s): the inputs lie too far outside the "
                               "run's data for its model")
        return fields

    async def predict(self, payload: Any, headers: Any = None,
                      response_headers: Any = None) -> Any:
        arrays = request_arrays(payload, self.name, self.get_input_types())
        fields = await self.submit(arrays["points"], arrays.get("features"),
                                   arrays.get("conditions"), arrays.get("mask"))
        fields = np.ascontiguousarray(fields, np.float32)
        output = InferOutput("fields", list(fields.shape), "FP32", fields)
        # gRPC answers raw bytes either way; KServe's to_grpc fails on an array when told
        # to (it tests the array's truth), so only REST passes the request's choice on
        binary = payload.use_binary_outputs and not payload.from_grpc
        return InferResponse(payload.id or uuid.uuid4().hex, self.name, [output],
                             use_binary_outputs=binary, requested_outputs=payload.request_outputs)

    async def predict_mesh(self, path: Path, conditions: dict[str, float], *,
                           surface: bool) -> tuple[Path, dict[str, Any]]:
        """The mesh file ``path`` predicted and written back (:mod:`flarepp.serve.meshes`):
        the file written beside it and the summary."""
        started = time.perf_counter()
        try:
            request = await asyncio.to_thread(mesh_request, self.run, path, conditions,
                                              max_rows=self.limits.max_points)
        except MeshTooLarge as err:
            raise Refusal(413, f"{err} (--max-points)") from None
        except MemoryError:
            raise Refusal(413, "the mesh's inputs do not fit in this server's memory") from None
        except ValueError as err:
            raise InvalidInput(str(err)) from None
        points, features = self.run.split_inputs(request.x)
        fields = await self.submit(points, features, request.conditions, None)
        force = integrated_force(request, fields)
        names = field_names(self.run, fields.shape[-1])
        written = await asyncio.to_thread(write_prediction, path, request, fields, names,
                                          path.with_name("prediction"), force=force,
                                          surface=surface)
        summary = {"model": self.name, "rows": len(fields),
                   "association": request.association, "units": self.run.layout.units,
                   "fields": {n: [float(fields[:, k].min()), float(fields[:, k].max())]
                              for k, n in enumerate(names)},
                   "force": None if force is None else [float(v) for v in force],
                   "seconds": time.perf_counter() - started}
        return written, summary


def request_arrays(payload: Any, model: str, expected: list[dict[str, Any]]
                   ) -> dict[str, np.ndarray]:
    """The request's tensors by name, each one of the model's inputs, given once."""
    names = [t["name"] for t in expected]
    arrays: dict[str, np.ndarray] = {}
    for tensor in payload.inputs:
        if tensor.name not in names or tensor.name in arrays:
            raise InvalidInput(f"input {tensor.name!r} " + (
                "is given twice" if tensor.name in arrays else "is unknown")
                + f": model {model!r} takes {', '.join(names)}")
        try:
            arrays[tensor.name] = tensor.as_numpy()
        except ValueError as err:
            raise InvalidInput(f"input {tensor.name!r}: its data do not make the shape "
                               f"{list(tensor.shape)} it declares ({err})") from None
    if "points" not in arrays:
        raise InvalidInput(f"the request has no input 'points': model {model!r} takes "
                           f"{', '.join(names)}")
    return arrays


class TokenInterceptor(aio.ServerInterceptor):
    """gRPC's guard: the token (metadata ``authorization: Bearer <token>``) on every call,
    the repository's load and unload refused (:mod:`flarepp.serve.limits`)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        method = details.method
        if "RepositoryModel" in method:
            return _deny(method, StatusCode.PERMISSION_DENIED, "model repository management "
                         "is off: the served models are those given to `flarepp serve`")
        if self.token is not None:
            given = dict(details.invocation_metadata or ()).get("authorization", "")
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(),
                                                                     self.token.encode()):
                return _deny(method, StatusCode.UNAUTHENTICATED, (
                    "the token is wrong" if given else "this server needs a token")
                    + ": send the metadata 'authorization: Bearer <token>'")
        return await continuation(details)


def _deny(method: str, code: StatusCode, message: str) -> Any:
    async def abort(request: Any, context: Any) -> None:
        await context.abort(code, message)

    async def abort_stream(requests: Any, context: Any) -> None:
        await context.abort(code, message)

    if method.endswith("StreamInfer"):
        return stream_stream_rpc_method_handler(abort_stream)
    return unary_unary_rpc_method_handler(abort)


class Routes:
    """flarepp's REST routes beside KServe's (module docstring)."""

    def __init__(self, models: dict[str, SurrogateModel], dataplane: Any, workdir: Path):
        self.models, self.dataplane, self.workdir = models, dataplane, workdir

    def model(self, name: str) -> SurrogateModel:
        if name not in self.models:
            raise ModelNotFound(name)
        return self.models[name]

    async def metadata(self, model_name: str) -> dict[str, Any]:
        """KServe's model metadata with the run's layout as ``parameters.layout``."""
        model = self.model(model_name)
        metadata = await self.dataplane.model_metadata(model_name)
        return {**metadata, "platform": "flarepp",
                "parameters": {"layout": model.run.describe()}}

    async def mesh(self, request: Request, model_name: str, surface: bool = False) -> Any:
        """The mesh endpoint (module docstring)."""
        from fastapi.responses import Response
        model = self.model(model_name)
        form = await request.form(max_files=1, max_fields=2)
        upload, conditions = form.get("mesh"), _conditions(form.get("conditions"))
        if upload is None or isinstance(upload, str) or not upload.filename:
            raise InvalidInput("send the mesh file as the multipart field 'mesh' (curl -F "
                               "mesh=@FILE); its suffix names its format")
        folder = self.workdir / uuid.uuid4().hex
        folder.mkdir()
        try:
            suffix = "".join(c for c in Path(upload.filename).suffix.lower() if c.isalnum())
            path = folder / f"mesh.{suffix}"
            path.write_bytes(await upload.read())
            written, summary = await model.predict_mesh(path, conditions, surface=surface)
            stem = "".join(c if c.isalnum() or c in "-_" else "_"
                           for c in Path(upload.filename).stem) or "mesh"
            return Response(written.read_bytes(), media_type="application/octet-stream",
                            headers={"Content-Disposition": f'attachment; filename="{stem}-'
                                     f'{model_name}{written.suffix}"',
                                     "Flarepp-Summary": json.dumps(summary)})
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = [name for name, _ in pairs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"{twice} given twice")
    return dict(pairs)


def _conditions(text: Any) -> dict[str, float]:
    """The multipart field ``conditions``: a JSON object of numbers by name (a name given
    twice, a string or a boolean is refused, as a condition table's are)."""
    if text is None or text == "":
        return {}
    try:
        values = json.loads(text, object_pairs_hook=_pairs)
        if not isinstance(values, dict):
            raise ValueError("not an object")
        wrong = [k for k, v in values.items()
                 if isinstance(v, bool) or not isinstance(v, (int, float))]
        if wrong:
            raise ValueError(f"{wrong[0]!r} is {values[wrong[0]]!r}, not a number")
        return {str(k): float(v) for k, v in values.items()}
    except (ValueError, TypeError, RecursionError) as err:
        reason = "nested too deeply" if isinstance(err, RecursionError) else err
        raise InvalidInput(f"conditions must be a JSON object of numbers by name, e.g. "
                           f'{{"load": 2.5}}, got {str(text)[:80]!r} ({reason})') from None


def build_app(models: dict[str, SurrogateModel], dataplane: Any, extension: Any,
              workdir: Path) -> Any:
    """The REST app: flarepp's routes, KServe's v2 routes, metrics, the page."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException
    from fastapi.staticfiles import StaticFiles
    from kserve import errors
    from kserve.protocol.rest.server import metrics_handler
    from kserve.protocol.rest.v2_endpoints import register_v2_endpoints
    routes = Routes(models, dataplane, workdir)
    app = FastAPI(title="flarepp serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/v2/models/{model_name}", routes.metadata, methods=["GET"])
    app.add_api_route("/v2/models/{model_name}/mesh", routes.mesh, methods=["POST"])
    register_v2_endpoints(app, dataplane, extension)
    app.add_api_route("/", dataplane.live, methods=["GET"])
    app.add_api_route("/metrics", metrics_handler, methods=["GET"])
    app.mount("/page", StaticFiles(directory=STATIC, html=True), name="page")

    def answer(status: int):
        async def handler(_: Any, exc: Exception) -> Any:
            return JSONResponse({"error": str(exc)}, status_code=getattr(exc, "status", status))
        return handler

    async def malformed(_: Any, exc: Exception) -> Any:   # FastAPI's own {"detail": [...]}
        status = getattr(exc, "status_code", 400)
        errors = getattr(exc, "errors", lambda: [])()
        what = errors[0].get("msg", "") if errors else str(getattr(exc, "detail", ""))
        return JSONResponse({"error": f"the request body is not a v2 inference request "
                                      f"({what})" if status in (400, 422) else what},
                            status_code=400 if status == 422 else status)

    app.add_exception_handler(RequestValidationError, malformed)
    app.add_exception_handler(HTTPException, malformed)
    app.add_exception_handler(InvalidInput, answer(400))
    app.add_exception_handler(ModelNotFound, answer(404))
    app.add_exception_handler(errors.ModelNotReady, answer(503))
    app.add_exception_handler(NotImplementedError, answer(501))
    app.add_exception_handler(Exception, errors.generic_exception_handler)
    return app


def head_timeout_protocol(seconds: float) -> type:
    """uvicorn's HTTP/1.1 protocol closing a connection whose request head has not arrived
    within ``seconds`` of its opening or of the previous answer (the keep-alive time, if
    longer): uvicorn itself waits for a head forever, so a client that opens connections
    and sends a partial head (or nothing) held each one, and enough of them every file
    descriptor the server has (a slow-headers attack, which needs no token)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeout(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def _arm(self, wait: float) -> None:
            self._disarm()
            self.head_timer = self.loop.call_later(wait, self._expired)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _expired(self) -> None:
            if (self.cycle is None or self.cycle.response_complete) \
                    and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm(seconds)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm(max(seconds, self.timeout_keep_alive))

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeadTimeout


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def grpc_server(dataplane: Any, extension: Any, settings: ServeSettings) -> tuple[Any, int]:
    """KServe's gRPC servicer behind :class:`TokenInterceptor`, bound; and its port."""
    from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc
    from kserve.protocol.grpc.interceptors import ExceptionToStatusInterceptor
    from kserve.protocol.grpc.servicer import InferenceServicer
    size = settings.limits.max_body_bytes
    server = aio.server(interceptors=(TokenInterceptor(settings.token),
                                      ExceptionToStatusInterceptor()),
                        options=[("grpc.max_send_message_length", size),
                                 ("grpc.max_receive_message_length", size)])
    grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
        InferenceServicer(dataplane, extension), server)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    port = server.add_insecure_port(f"{host}:{settings.grpc_port}")
    if port == 0:
        raise OSError(f"gRPC: cannot listen on {host}:{settings.grpc_port} (in use?)")
    return server, port


async def _serve(runs: dict[str, ServedRun], settings: ServeSettings, workdir: Path) -> None:
    import uvicorn
    from kserve.model_repository import ModelRepository
    from kserve.protocol.dataplane import DataPlane
    from kserve.protocol.model_repository_extension import ModelRepositoryExtension
    models = {name: SurrogateModel(name, run, settings.limits) for name, run in runs.items()}
    repository = ModelRepository()
    for model in models.values():
        repository.update(model)
    dataplane = DataPlane(model_registry=repository)
    extension = ModelRepositoryExtension(model_registry=repository)
    app = Guard(build_app(models, dataplane, extension, workdir), token=settings.token,
                limits=settings.limits)
    sock = bind(settings.host, settings.http_port)
    http = uvicorn.Server(uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", timeout_keep_alive=65,
        http=head_timeout_protocol(settings.limits.read_timeout)))
    grpc, grpc_port = (None, None) if settings.grpc_port is None else grpc_server(
        dataplane, extension, settings)
    workers = [asyncio.create_task(m.batcher.work()) for m in models.values()]
    if grpc is not None:
        await grpc.start()
    announce = asyncio.create_task(_announce(http, sock, grpc_port, settings, list(models)))
    try:
        await http.serve(sockets=[sock])
    finally:
        for task in (*workers, announce):
            task.cancel()
        if grpc is not None:
            await grpc.stop(grace=1.0)


async def _announce(http: Any, sock: socket.socket, grpc_port: int | None,
                    settings: ServeSettings, names: list[str]) -> None:
    """One line on stdout once the server answers: its addresses and models."""
    while not http.started:
        await asyncio.sleep(0.01)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    url = f"http://{host}:{sock.getsockname()[1]}"
    grpc = f" gRPC {host}:{grpc_port}" if grpc_port is not None else ""
    print(f"flarepp serve: REST {url}{grpc} page {url}/page/ models {', '.join(names)}",
          flush=True)


class _ClientErrors(logging.Filter):
    """Keeps KServe's log to the server's own failures (not a client's bad request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (InvalidInput, ModelNotFound))


def serve(runs: dict[str, str | Path], settings: ServeSettings) -> None:
    """Load ``runs`` (name -> run directory or checkpoint) and serve them until the process
    is stopped (module docstring)."""
    check_listen(settings.host, settings.token)
    logging.getLogger("kserve").addFilter(_ClientErrors())
    workdir = Path(tempfile.mkdtemp(prefix="flarepp-serve-"))
    saved = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = str(workdir), str(workdir)
    try:
        loaded = {name: load_run(path, device=settings.device) for name, path in runs.items()}
        asyncio.run(_serve(loaded, settings, workdir))
    finally:
        tempfile.tempdir = saved[0]
        if saved[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[1]
        shutil.rmtree(workdir, ignore_errors=True)


__all__ = ["Refusal", "Routes", "ServeSettings", "SurrogateModel", "TokenInterceptor", "bind",
           "build_app", "grpc_server", "head_timeout_protocol", "request_arrays", "serve"]
