"""What the server refuses before any model sees a request: its budget and its guard.

* :class:`Limits`: the request budget (body size, points, time in the queue, time to
  receive the body), the streaming chunk and the batching bounds.
* :class:`Guard`: an ASGI middleware in front of the REST app. It answers, each with a
  4xx and a sentence in ``{"error": ...}``: a missing or wrong token (401, constant-time
  comparison; the health endpoints and the page's static files stay open, so that probes
  and a browser can reach them), the model repository's load/unload endpoints (403: the
  served models are fixed at start), a body over the budget (413, before or while it is
  read), and a body that does not arrive within ``read_timeout`` seconds (408: a slow or
  stalled client). The app then receives the body already read.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

OPEN_PATHS = ("/", "/v2/health/live", "/v2/health/ready")
OPEN_PREFIXES = ("/page",)
REPOSITORY_PREFIX = "/v2/repository"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
TOO_MANY_REQUESTS = 429


class Refused(Exception):
    """A request the server will not serve: its HTTP ``status`` (4xx) and a sentence."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """``max_body_bytes`` per request body; ``max_points`` per request (samples x points);
    ``max_seconds`` a request may wait in the queue; ``read_timeout`` seconds to receive a
    body; requests above ``chunk_size`` points stream in chunks of it, and batches hold at
    most ``chunk_size`` padded points and ``max_batch`` requests; ``max_queue`` requests
    wait per model."""

    max_body_bytes: int = 256 << 20
    max_points: int = 4 << 20
    max_seconds: float = 300.0
    read_timeout: float = 30.0
    chunk_size: int = 1 << 16
    max_batch: int = 16
    max_queue: int = 256

    def check_points(self, count: int) -> None:
        if count > self.max_points:
            raise Refused(413, f"the request holds {count} points, over this server's budget "
                               f"of {self.max_points} points per request (--max-points)")


def check_listen(host: str, token: str | None) -> None:
    """Refuse to listen beyond this machine without a token (one sentence)."""
    if host not in LOOPBACK and not token:
        raise ValueError(f"--host {host} listens beyond this machine: give a token "
                         "(--token-file or FLAREPP_SERVE_TOKEN), or listen on 127.0.0.1")


Send = Callable[[dict[str, Any]], Awaitable[None]]


async def reply(send: Send, status: int, message: str, headers: list | None = None) -> None:
    """A JSON error response ``{"error": message}``."""
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


class Guard:
    """The REST app behind the token and the budget (module docstring)."""

    def __init__(self, app: Any, *, token: str | None, limits: Limits) -> None:
        self.app, self.limits = app, limits
        self.token = None if token is None else token.encode()

    def _authorised(self, scope: dict[str, Any]) -> bool:
        given = _header(scope, b"authorization") or b""
        scheme, _, value = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(value.strip(), self.token)

    async def _refusal(self, scope: dict[str, Any]) -> tuple[int, str, list] | None:
        path = scope["path"]
        if path.startswith(REPOSITORY_PREFIX):
            return 403, ("model repository management is off: the served models are those "
                         "given to `flarepp serve` at start"), []
        open_path = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        if self.token is not None and not open_path and not self._authorised(scope):
            said = _header(scope, b"authorization") is not None
            return 401, (("the token is wrong" if said else "this server needs a token")
                         + ": send the header 'Authorization: Bearer <token>'"), \
                [(b"www-authenticate", b"Bearer")]
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            return 413, self._too_large(int(length)), []
        return None

    def _too_large(self, size: int) -> str:
        return (f"the request body is {size} bytes, over this server's budget of "
                f"{self.limits.max_body_bytes} bytes (--max-body-mb)")

    async def _read_body(self, receive: Callable) -> tuple[bytes, tuple[int, str] | None]:
        parts, size = [], 0
        deadline = time.monotonic() + self.limits.read_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                return b"", (408, f"the request body did not arrive within "
                                  f"{self.limits.read_timeout:g} s (--read-timeout): a slow "
                                  "or stalled client")
            if message["type"] == "http.disconnect":
                return b"", (400, "the client disconnected before sending the whole body")
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limits.max_body_bytes:
                return b"", (413, self._too_large(size))
            if not message.get("more_body", False):
                return b"".join(parts), None

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = await self._refusal(scope)
        if refusal is not None:
            return await reply(send, *refusal)
        body, failed = await self._read_body(receive)
        if failed is not None:
            return await reply(send, *failed)
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


__all__ = ["Guard", "LOOPBACK", "Limits", "OPEN_PATHS", "OPEN_PREFIXES", "Refused",
           "TOO_MANY_REQUESTS", "check_listen", "reply"]
