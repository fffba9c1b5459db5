"""``flarepp bench serve``: ``flarepp serve`` under load, on this machine (loopback only,
bounded in requests and in time).

Shape letters: N points, G coordinate and F feature channels, O outputs.

* **Load** (:func:`load_phase`): a fresh server (a child process, :mod:`flarepp.serve.
  process`) per mode: batched (``--max-batch``) and unbatched (``--max-batch 1``). For each
  client count, each client (a thread with its own ``tritonclient``) sends meshes of
  ``points`` points one after another, drawn from a pool of distinct meshes whose answers
  this process computed beforehand with ``flarepp.load(run).predict``; every answer is
  checked against its mesh's (1e-5 of the fields' scale). Each server first answers a few
  requests that are not counted (its first forward, the clients' first connection). Per
  phase: requests answered, throughput (requests/s over the phase's wall time), latency
  p50 and p99, the server's peak resident memory so far (``VmHWM``), errors (no answer)
  and wrong answers; and where a request's time goes (:func:`request_costs`): the
  server's CPU per request, that of its event loop alone (the protocol's decoding and
  encoding, KServe's and flarepp's per-request work), the forwards' seconds per request
  and requests per forward (the server's own metrics), and the clients' CPU per request
  (this process: they share the machine with the server).
* **Large** (:func:`large_request`): one mesh of ``large_points`` points over gRPC to the
  batched server, streamed by it in chunks, compared with what ``flarepp infer --chunk-size``
  writes for the same points (max difference over the fields' scale), with the server's
  peak memory before and after.
* **Bad requests** (:func:`bad_requests`): one of each class the server refuses (a wrong
  shape, NaN, an unknown model, a wrong token, a body over the budget, a stalled client);
  each must get its 4xx, and the server must answer a good request exactly after each.

Without ``run`` the benchmark makes one: elasticity meshes (about 1K points each) converted
to a store and the ``store-tiny`` preset (its model as it is: width 64, 3 blocks, 32
latents) trained for one epoch; the accuracy does not matter to the load.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flarepp.data.convert import convert
from flarepp.data.generators.elasticity import make_elasticity_mesh
from flarepp.data.spec import parse_spec
from flarepp.inference.predictor import load_predictor
from flarepp.serve.process import ServerProcess, call_model, declared_body, start_server
from flarepp.train import Trainer, get_preset

TOKEN = "flarepp-bench-serve"
BODY_MB = 64          # the servers' body budget (a 1M-point mesh of 6 channels is 24 MiB)
WARM = 4              # requests each server answers before the phases (not counted)
CHECK = 1e-5          # an answer is right within this share of the fields' scale


@dataclass(frozen=True)
class ServeBenchConfig:
    """What :func:`run_serve_bench` measures (module docstring)."""

    run: str | None = None
    clients: tuple[int, ...] = (1, 4, 16)
    points: int = 1024
    requests: int = 320           # per phase, shared among its clients
    seconds: float = 60.0         # per phase at most
    max_batch: int = 16
    large_points: int = 1 << 20
    chunk_size: int = 1 << 16
    protocol: str = "grpc"
    pool: int = 32
    server_threads: int | None = None
    work_dir: str | None = None


def make_run(root: Path) -> Path:
    """A ``store-tiny`` run of one epoch on elasticity meshes (module docstring)."""
    make_elasticity_mesh(root / "cases", n_train=8, n_test=2, progress=False)
    spec = parse_spec({"targets": ["von_mises"], "split": {"test": "test/*"}})
    convert(root / "cases", root / "store", spec, progress=False)
    config = get_preset("store-tiny", ["epochs=1", "device=cpu"])
    Trainer(config, root / "run", data_root=root / "store", progress=False).fit()
    return root / "run"


@dataclass
class Pool:
    """Distinct meshes (``x [N, I]``) and their answers (``y [N, O]``)."""

    x: list[np.ndarray]
    y: list[np.ndarray]
    coordinates: int
    requests: list[dict[str, np.ndarray]] = field(init=False, repr=False)

    def __post_init__(self) -> None:          # built once: the clients only send them
        self.requests = [tensors(x, self.coordinates) for x in self.x]

    def check(self, k: int, got: np.ndarray) -> bool:
        want = self.y[k]
        return got.shape == want.shape and bool(
            np.abs(got - want).max() <= CHECK * max(1.0, float(np.abs(want).max())))

    def inputs(self, k: int) -> dict[str, np.ndarray]:
        """Mesh ``k``'s request tensors (shared: not to be written to)."""
        return self.requests[k]


def tensors(x: np.ndarray, coordinates: int) -> dict[str, np.ndarray]:
    """The request's tensors of inputs ``x [N, I]``: ``points``, and ``features`` if any."""
    out = {"points": np.ascontiguousarray(x[:, :coordinates])}
    if x.shape[1] > coordinates:
        out["features"] = np.ascontiguousarray(x[:, coordinates:])
    return out


def make_pool(run: str | Path, size: int, points: int, seed: int = 0) -> Pool:
    """``size`` random meshes of ``points`` points in the unit box and their answers."""
    predictor = load_predictor(run, device="cpu")
    layout = predictor.layout
    if layout.conditions is not None:
        raise ValueError(f"{run}: a conditioned run; the load benchmark compares the large "
                         "answer with `flarepp infer`, which takes no per-case conditions "
                         "for an .npz: give an unconditioned run")
    g = layout.channels if layout.coordinates is None else layout.coordinates
    rng = np.random.default_rng(seed)
    xs = [rng.random((points, layout.channels), dtype=np.float32) for _ in range(size)]
    ys = [predictor.predict(x[:, :g], features=x[:, g:] if x.shape[1] > g else None)
          for x in xs]
    return Pool(xs, ys, g)


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wrong: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def load_phase(server: ServerProcess, model: str, pool: Pool, clients: int, requests: int,
               seconds: float, protocol: str) -> dict[str, Any]:
    """``clients`` concurrent clients sending ``requests`` meshes in all (module docstring)."""
    url = server.grpc if protocol == "grpc" else server.rest
    tally, counter = _Tally(), iter(range(requests))
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        import tritonclient.grpc
        import tritonclient.http
        module = tritonclient.grpc if protocol == "grpc" else tritonclient.http
        connection = module, module.InferenceServerClient(url)
        for k in counter:
            if time.monotonic() > deadline:
                return
            mesh = (k * 7 + index) % len(pool.x)
            started = time.perf_counter()
            try:
                got = call_model(protocol, url, model, pool.inputs(mesh), token=TOKEN,
                                 client=connection)
            except Exception as err:                  # a lost request: counted, reported
                with tally.lock:
                    tally.errors.append(f"{type(err).__name__}: {err}")
                continue
            with tally.lock:
                tally.latencies.append(time.perf_counter() - started)
                tally.wrong += not pool.check(mesh, got)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    before = _counters(server)
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    costs = request_costs(before, _counters(server), len(tally.latencies))
    lat = np.asarray(tally.latencies) if tally.latencies else np.full(1, np.nan)
    return {"clients": clients, "answered": len(tally.latencies), "seconds": wall, **costs,
            "throughput": len(tally.latencies) / wall,
            "p50_ms": 1e3 * float(np.percentile(lat, 50)),
            "p99_ms": 1e3 * float(np.percentile(lat, 99)), "errors": len(tally.errors),
            "error_examples": tally.errors[:3], "wrong": tally.wrong,
            "peak_mib": server.peak_memory_bytes() / 2 ** 20}


def _counters(server: ServerProcess) -> dict[str, float]:
    """The running totals :func:`request_costs` takes differences of."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total, loop = server.cpu_seconds()
    return {"server": total, "loop": loop, "client": usage.ru_utime + usage.ru_stime,
            **forward_totals(server)}


def forward_totals(server: ServerProcess) -> dict[str, float]:
    """The server's totals so far, from its Prometheus metrics (``/metrics``), summed over
    its models: ``forwards``, ``batched`` (requests in them) and ``forward_seconds``."""
    import urllib.request
    request = urllib.request.Request(f"http://{server.rest}/metrics",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        text = answer.read().decode()
    names = {"flarepp_batch_requests_count": "forwards", "flarepp_batch_requests_sum":
             "batched", "flarepp_forward_seconds_sum": "forward_seconds"}
    out = dict.fromkeys(names.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(None, 1)[1])
    return out


def request_costs(before: dict[str, float], after: dict[str, float], answered: int
                  ) -> dict[str, float]:
    """Where a phase's requests spent their time, per answered request (milliseconds):
    ``server_cpu_ms`` (all the server's threads), ``loop_cpu_ms`` (its event loop alone),
    ``forward_ms`` (wall time in the model's forwards), ``client_cpu_ms`` (this process);
    and ``per_forward``, the requests each forward predicted."""
    per = 1e3 / max(answered, 1)
    delta = {k: after[k] - before[k] for k in before}
    return {"server_cpu_ms": per * delta["server"], "loop_cpu_ms": per * delta["loop"],
            "forward_ms": per * delta["forward_seconds"],
            "client_cpu_ms": per * delta["client"],
            "per_forward": delta["batched"] / max(delta["forwards"], 1.0)}


def large_request(server: ServerProcess, model: str, run: str | Path, pool: Pool,
                  points: int, chunk: int, work: Path) -> dict[str, Any]:
    """One ``points``-point mesh over gRPC against ``flarepp infer`` (module docstring)."""
    rng = np.random.default_rng(7)
    x = rng.random((points, pool.x[0].shape[1]), dtype=np.float32)
    before = server.peak_memory_bytes()
    started = time.perf_counter()
    got = call_model("grpc", server.grpc, model, tensors(x, pool.coordinates), token=TOKEN)
    seconds = time.perf_counter() - started
    after = server.peak_memory_bytes()
    np.savez(work / "large.npz", x=x[None])
    subprocess.run([sys.executable, "-m", "flarepp", "infer", str(run), "--data",
                    str(work / "large.npz"), "--out", str(work / "large-infer.npz"),
                    "--chunk-size", str(chunk), "--device", "cpu"], check=True,
                   capture_output=True)
    with np.load(work / "large-infer.npz") as inferred:
        want = inferred["pred"][0]
    deviation = float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))
    return {"points": points, "chunk_size": chunk, "seconds": seconds,
            "deviation": deviation, "peak_mib_before": before / 2 ** 20,
            "peak_mib_after": after / 2 ** 20, "answer_mib": got.nbytes / 2 ** 20}


def bad_requests(server: ServerProcess, model: str, pool: Pool,
                 read_timeout: float) -> list[dict[str, Any]]:
    """Each refused class once, each followed by a good request (module docstring)."""
    from tritonclient.utils import InferenceServerException
    good = pool.inputs(0)
    nan = {k: v.copy() for k, v in good.items()}
    nan["points"][3, 0] = np.nan
    wide = {"points": np.zeros((10, pool.coordinates + 1), np.float32)}

    def http(arrays: dict, token: str = TOKEN) -> Any:
        return call_model("http", server.rest, model, arrays, token=token)

    def grpc(arrays: dict, name: str = model) -> Any:
        return call_model("grpc", server.grpc, name, arrays, token=TOKEN)

    cases = [("wrong shape", lambda: http(wide)), ("NaN", lambda: http(nan)),
             ("unknown model", lambda: grpc(good, "no-such-model")),
             ("wrong token", lambda: http(good, token="wrong")),
             ("body over budget", lambda: declared_body(
                 server.rest, f"/v2/models/{model}/infer", (BODY_MB + 1) << 20, token=TOKEN,
                 expect=True).split("\r\n", 1)[0]),
             ("stalled client", lambda: declared_body(
                 server.rest, f"/v2/models/{model}/infer", 100, token=TOKEN,
                 timeout=read_timeout + 30).split("\r\n", 1)[0])]
    out = []
    for name, send in cases:
        try:
            answer = send()
            status = answer if isinstance(answer, str) else "200 (not refused)"
        except InferenceServerException as err:
            status = f"{err.status()}: {err.message()[:120]}"
        try:
            alive = pool.check(0, grpc(good))
        except Exception as err:                      # the server no longer answers
            alive, status = False, f"{status}; then {type(err).__name__}"
        out.append({"request": name, "answer": status, "alive": alive})
    return out


def run_serve_bench(config: ServeBenchConfig, progress: Any = print) -> dict[str, Any]:
    """Every measurement of the module docstring; ``progress(line)`` as they come. The
    batched and the unbatched server run side by side, their phases interleaved per client
    count, so that a load that drifts on a shared machine meets both alike."""
    import tempfile
    with tempfile.TemporaryDirectory(dir=config.work_dir) as tmp:
        work = Path(tmp)
        run = config.run or make_run(work / "made")
        pool = make_pool(run, config.pool, config.points)
        (work / "token").write_text(TOKEN)
        result: dict[str, Any] = {"run": str(config.run or "store-tiny, 1 epoch"),
                                  "load": [], "load_average": os.getloadavg()}
        servers = {}
        try:
            for mode, batch in (("batched", config.max_batch), ("unbatched", 1)):
                servers[mode] = _serve(run, work, config, batch)
            for server in servers.values():         # warm: not counted
                load_phase(server, "bench", pool, 1, WARM, config.seconds, config.protocol)
            for clients in config.clients:
                for mode, server in servers.items():
                    row = {"mode": mode, **load_phase(server, "bench", pool, clients,
                                                      config.requests, config.seconds,
                                                      config.protocol)}
                    result["load"].append(row)
                    progress(f"{mode}, {clients} client(s): {row['throughput']:.1f} req/s, "
                             f"p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms")
            batched = servers["batched"]
            result["large"] = large_request(batched, "bench", run, pool, config.large_points,
                                            config.chunk_size, work)
            progress(f"large: {result['large']}")
            result["bad"] = bad_requests(batched, "bench", pool, 2.0)
            result["alive"] = {mode: server.alive() for mode, server in servers.items()}
        finally:
            for server in servers.values():
                server.stop()
        result["load_average_after"] = os.getloadavg()
    return result


def _serve(run: str | Path, work: Path, config: ServeBenchConfig, batch: int
           ) -> ServerProcess:
    return start_server([f"bench={run}"], [
        "--token-file", str(work / "token"), "--device", "cpu", "--max-batch", str(batch),
        "--chunk-size", str(config.chunk_size), "--read-timeout", "2",
        "--max-body-mb", str(BODY_MB),
        *(["--threads", str(config.server_threads)] if config.server_threads else [])],
        log=work / f"server-{batch}.log", cwd=work)


def batching_ceiling(result: dict[str, Any]) -> tuple[int, float]:
    """``(clients, ratio)`` at the most clients: the CPU a request costs the machine (the
    server's and its client's) unbatched over batched. Where the CPU is the bottleneck (the
    server, its clients and whatever else runs there share the cores), batching cannot
    raise the throughput by more than this; unlike the latencies, it hardly moves with the
    machine's other load."""
    rows = {(r["mode"], r["clients"]): r for r in result["load"]}
    most = max(r["clients"] for r in result["load"])
    cost = {mode: rows[(mode, most)]["server_cpu_ms"] + rows[(mode, most)]["client_cpu_ms"]
            for mode in ("batched", "unbatched")}
    return most, cost["unbatched"] / cost["batched"] if cost["batched"] else float("nan")


def goals(result: dict[str, Any]) -> list[tuple[str, float, bool]]:
    """The issue's goals: ``(what, measured, met)``."""
    rows = {(r["mode"], r["clients"]): r for r in result["load"]}
    most = max(r["clients"] for r in result["load"])
    speedup = rows[("batched", most)]["throughput"] / rows[("unbatched", most)]["throughput"]
    tail = rows[("batched", most)]["p99_ms"] / rows[("batched", 1)]["p50_ms"]
    lost = sum(r["errors"] + r["wrong"] for r in result["load"])
    alive = all(b["alive"] and not b["answer"].startswith("200") for b in result["bad"])
    return [(f"batched / unbatched throughput at {most} clients >= 2", speedup, speedup >= 2),
            (f"p99 at {most} clients / p50 at 1 client < 5", tail, tail < 5),
            ("large answer's deviation from flarepp infer <= 1e-6",
             result["large"]["deviation"], result["large"]["deviation"] <= 1e-6),
            ("requests lost or answered wrongly == 0", lost, lost == 0),
            ("every bad request refused, the server alive after each", float(alive), alive)]


__all__ = ["Pool", "ServeBenchConfig", "bad_requests", "batching_ceiling", "forward_totals",
           "goals", "large_request", "load_phase", "make_pool", "make_run", "request_costs",
           "run_serve_bench", "tensors"]
