"""``flarepp serve`` from the outside: the server as a child process (started, waited for,
measured, stopped) and the calls a client makes (what the load benchmark and the tests do;
no KServe import on this side, whose gRPC protos clash with ``tritonclient``'s).

The child prints one line once it answers (``flarepp serve: REST http://HOST:PORT gRPC
HOST:PORT page ... models ...``); :func:`start_server` reads the addresses from it, on ports
the child chose (``--port 0 --grpc-port 0``: no two servers race for one port).
:func:`call_model` is one v2 infer through ``tritonclient`` (HTTP or gRPC);
:func:`declared_body` a raw request whose body never comes (a stalled client, or one that
waits for ``100 Continue`` as curl does before a large body).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READY = re.compile(r"flarepp serve: REST http://(?P<rest>\S+)(?: gRPC (?P<grpc>\S+))? page")


@dataclass
class ServerProcess:
    """A running ``flarepp serve``: its process, REST and gRPC ``host:port``, the file its
    stderr goes to (closed when it stops)."""

    process: subprocess.Popen
    rest: str
    grpc: str | None
    log: Any = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def peak_memory_bytes(self) -> int:
        """The child's peak resident memory so far (``VmHWM``, Linux), 0 where unknown."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return 0
        found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
        return int(found.group(1)) * 1024 if found else 0

    def cpu_seconds(self) -> tuple[float, float]:
        """``(all threads, main thread)``: the child's CPU seconds (user + system) so far,
        Linux; its main thread runs the event loop (the protocols' decoding and encoding,
        KServe's and flarepp's per-request work), the forwards run on another. ``(0, 0)``
        where unknown."""
        ticks = os.sysconf("SC_CLK_TCK")

        def seconds(path: str) -> float:
            fields = Path(path).read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / ticks    # utime, stime

        pid = self.process.pid
        try:
            return seconds(f"/proc/{pid}/stat"), seconds(f"/proc/{pid}/task/{pid}/stat")
        except (OSError, IndexError, ValueError):
            return 0.0, 0.0

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (the server finishes what it answers, then exits), SIGKILL past
        ``timeout``; the exit status."""
        try:
            if self.alive():
                self.process.send_signal(signal.SIGTERM)
                try:
                    return self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.process.kill()
            return self.process.wait()
        finally:
            if self.log is not None:
                self.log.close()


def start_server(runs: list[str], options: list[str] | tuple[str, ...] = (), *,
                 env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 log: str | Path | None = None, timeout: float = 180.0) -> ServerProcess:
    """``flarepp serve RUNS --port 0 --grpc-port 0 OPTIONS`` started and answering (or a
    RuntimeError with why not: it exited, or said nothing within ``timeout`` seconds);
    its stderr goes to the file ``log`` (default nowhere)."""
    command = [sys.executable, "-m", "flarepp", "serve", *runs, "--port", "0",
               "--grpc-port", "0", *options]
    stderr = open(log, "w") if log is not None else subprocess.DEVNULL
    try:
        return _wait_ready(subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True,
            env=env if env is not None else dict(os.environ), cwd=cwd), timeout,
            None if log is None else stderr)
    except BaseException:
        if log is not None:
            stderr.close()
        raise


def _wait_ready(process: subprocess.Popen, timeout: float, log: Any) -> ServerProcess:
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as wait:
        wait.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not wait.select(max(0.0, deadline - time.monotonic())):
                break
            line = process.stdout.readline()
            if not line:                       # the child closed stdout: it exited
                process.wait()
                raise RuntimeError(f"flarepp serve exited with status {process.returncode} "
                                   "before it answered")
            found = READY.search(line)
            if found:
                return ServerProcess(process, found["rest"], found["grpc"], log)
    process.kill()
    process.wait()
    raise RuntimeError(f"flarepp serve did not answer within {timeout:g} s")


def call_model(protocol: str, url: str, model: str, arrays: dict[str, Any], *,
               token: str | None = None, client: Any = None) -> Any:
    """``fields`` of one v2 infer of ``arrays`` (name -> NumPy array: BOOL for bool, else
    FP32) by ``tritonclient`` over ``protocol`` (``http`` or ``grpc``) at ``url``, with the
    token (if any) as ``Authorization: Bearer``; ``client``: a ``(module, client)`` pair to
    reuse."""
    if client is None:
        if protocol == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
        client = module, module.InferenceServerClient(url)
    module, connection = client
    inputs = []
    for name, value in arrays.items():
        tensor = module.InferInput(name, list(value.shape),
                                   "BOOL" if value.dtype == bool else "FP32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    key = "authorization" if protocol == "grpc" else "Authorization"
    headers = {} if token is None else {key: f"Bearer {token}"}
    return connection.infer(model, inputs, headers=headers).as_numpy("fields")


def declared_body(rest: str, path: str, length: int, *, token: str | None = None,
                  expect: bool = False, timeout: float = 60.0) -> str:
    """The server's answer (status line, headers, body) to a POST of ``path`` at ``rest``
    that declares ``length`` bytes of body and sends one (``expect``: with ``Expect:
    100-continue``)."""
    host, port = rest.rsplit(":", 1)
    lines = [f"POST {path} HTTP/1.1", "Host: flarepp", f"Content-Length: {length}"]
    lines += [f"Authorization: Bearer {token}"] * (token is not None)
    lines += ["Expect: 100-continue"] * expect
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n{").encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(4096) or b"\r\n\r\n"
        head, _, body = data.partition(b"\r\n\r\n")
        found = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
        while found and len(body) < int(found.group(1)):
            body += sock.recv(4096) or b" " * int(found.group(1))
    return (head + b"\r\n\r\n" + body).decode(errors="replace")


__all__ = ["READY", "ServerProcess", "call_model", "declared_body", "start_server"]
