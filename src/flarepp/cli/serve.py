"""``flarepp serve RUN [RUN ...]``: trained runs behind an Open Inference Protocol server
(KServe's, REST and gRPC), with a mesh endpoint and a page (:mod:`flarepp.serve.server`)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from flarepp.cli import CLIError, add_threads_argument, at_least

TOKEN_ENV = "FLAREPP_SERVE_TOKEN"


def _runs(specs: list[str]) -> dict[str, Path]:
    """``NAME=PATH`` or ``PATH`` (named after its folder) -> ``{name: path}``."""
    runs: dict[str, Path] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        path = Path(path)
        if not path.exists():
            raise CLIError(f"{str(path)!r} (from {spec!r}): no such run directory or "
                           "checkpoint")
        name = name or (path.name if path.is_dir() else path.parent.parent.name)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise CLIError(f"model name {name!r} (from {spec!r}): use letters, digits, '.', "
                           "'_', '-' (give NAME=PATH)")
        if name in runs:
            raise CLIError(f"two runs are named {name!r}: give NAME=PATH for one of them")
        runs[name] = path
    return runs


def _token(path: str | None) -> str | None:
    """``--token-file``'s or ``$FLAREPP_SERVE_TOKEN``'s token, stripped; a blank one refused."""
    where = f"--token-file {path!r}" if path is not None else f"${TOKEN_ENV}"
    try:
        token = (os.environ.get(TOKEN_ENV) if path is None
                 else Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise CLIError(f"{where}: {err.strerror}") from None
    if token is None or (path is None and token == ""):
        return None
    if not token.strip():
        raise CLIError(f"{where} is empty")
    return token.strip()


def _serve(args: argparse.Namespace) -> int:
    # imported here, as the server below: ~10 ms of every `flarepp` start otherwise
    from flarepp.serve.extra import ServeUnavailable
    from flarepp.serve.limits import Limits, check_listen
    token = _token(args.token_file)
    check_listen(args.host, token)
    runs = _runs(args.runs)
    try:
        from flarepp.serve.server import ServeSettings, serve
    except ServeUnavailable as err:
        raise CLIError(str(err)) from None
    limits = Limits(max_body_bytes=args.max_body_mb << 20, **{
        name: getattr(args, name) for name in ("max_points", "max_seconds", "read_timeout",
                                               "chunk_size", "max_batch", "max_queue")})
    serve(runs, ServeSettings(host=args.host, http_port=args.port,
                              grpc_port=None if args.grpc_port < 0 else args.grpc_port,
                              token=token, device=args.device, limits=limits))
    return 0


def _seconds(text: str) -> float:
    if not float(text) > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return float(text)


BUDGET = [  # option, type, default, help: the request budget (flarepp.serve.limits.Limits)
    ("--chunk-size", at_least(1), 1 << 16, "requests above this many points stream in "
     "chunks of it (exact); a batch holds at most this many padded points"),
    ("--max-batch", at_least(1), 16, "requests per batched forward (1: no batching)"),
    ("--max-queue", at_least(1), 256, "requests waiting per model before 429"),
    ("--max-points", at_least(1), 4 << 20, "points per request before 413"),
    ("--max-body-mb", at_least(1), 256, "MiB per request body before 413"),
    ("--max-seconds", _seconds, 300.0, "seconds a request may wait in the queue before 429"),
    ("--read-timeout", _seconds, 30.0, "seconds to receive a request body before 408")]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve trained runs over the Open Inference Protocol "
                       "(REST and gRPC, KServe), with a mesh endpoint and a page",
                       description="Serves each run as a model: tensors in and fields out "
                       "(v2 infer), a mesh file in and the mesh with its predicted fields out "
                       "(POST /v2/models/NAME/mesh), a page at /page/. docs/serve.md.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run directory or checkpoint, "
                   "or NAME=PATH (default name: the run's folder)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; another needs a token)")
    p.add_argument("--port", type=at_least(0, most=65535), default=8080, help="REST port (0: any free)")
    p.add_argument("--grpc-port", type=at_least(-1, most=65535), default=8081,
                   help="gRPC port (0: any free; -1: no gRPC)")
    p.add_argument("--token-file", help=f"a file holding the token every call must send "
                   f"('Authorization: Bearer TOKEN'); default ${TOKEN_ENV}")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:K")
    for option, kind, default, text in BUDGET:
        p.add_argument(option, type=kind, default=default, help=f"{text} (default {default})")
    add_threads_argument(p)
    p.set_defaults(func=_serve)
