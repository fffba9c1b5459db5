"""Concurrent small requests batched into one forward; large ones streamed alone.

Shape letters: B samples, N points, G coordinate and F feature channels, K conditioning
tokens of C features, O outputs.

A request is a :class:`Job`: its samples ``points [B, N, G]`` (one mesh ``[N, G]`` is B = 1)
with ``features [B, N, F]``, ``conditions [B, K, C]`` and ``mask [B, N]``. One worker per
model (:meth:`MicroBatcher.work`) takes the jobs in arrival order:

* a job of more than ``chunk_size`` points runs alone, streamed ``chunk_size`` points at a
  time (exact: the encoder's partial sums merge by the log-sum-exp rule, paper App. B), or
  whole for a model that cannot be streamed (``streams`` False: its memory then grows with
  the points, up to the request budget);
* otherwise the worker takes with it every job already waiting whose channels match, while
  their padded points (samples x longest N) stay within ``chunk_size`` and their count
  within ``max_batch``; the samples are padded to the longest N with a mask (False at
  padding), predicted in one forward, and each job gets its own rows back. A masked key
  takes no part in any softmax and padded rows are dropped, so a batched answer equals the
  job predicted alone up to float rounding. Nothing waits for more jobs to arrive: while a
  batch computes, the next one gathers (continuous batching).

A job still queued after its deadline, or one arriving at a full queue, is refused (HTTP
429, a sentence); a batch whose prediction raises an input error is predicted again job by
job, so that each error reaches its own request and no other.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from flarepp.serve.limits import TOO_MANY_REQUESTS, Refused


@dataclass
class Job:
    """One request's samples (module docstring). ``stacked``: the arrays are in the batch
    form ``[B, N, ...]`` and may join a batch; otherwise they are kept as the request gave
    them and run alone (the predictor names what is wrong with them). ``single``: the
    request gave one mesh, so its answer is ``[N, O]``."""

    points: Any
    features: Any = None
    conditions: Any = None
    mask: Any = None
    single: bool = False
    stacked: bool = False
    deadline: float = float("inf")
    future: asyncio.Future | None = field(default=None, repr=False)

    @property
    def points_count(self) -> int:
        shape = np.shape(self.points)
        return int(np.prod(shape[:-1])) if len(shape) > 1 else 0

    def signature(self) -> tuple:
        """What must match for two jobs to share a forward."""
        width = (lambda a: None if a is None else a.shape[2:])
        return (self.points.shape[2], width(self.features), width(self.conditions))


def make_job(points: Any, features: Any = None, conditions: Any = None, mask: Any = None, *,
             tokens: tuple[int, int] | None = None, deadline: float = float("inf")) -> Job:
    """A :class:`Job` of a request's arrays; ``tokens`` ``(K, C)``: the conditions the
    model takes (one token may be given as ``[C]`` or ``[B, C]``)."""
    points = np.asarray(points)
    single = points.ndim == 2

    def batched(a: Any, rank: int) -> Any:
        if a is None:
            return None
        a = np.asarray(a)
        return a[None] if single and a.ndim == rank - 1 else a

    p, f, m = batched(points, 3), batched(features, 3), batched(mask, 2)
    c = None
    if conditions is not None:
        c = np.asarray(conditions)
        if tokens is not None and tokens[0] == 1 and c.ndim == (1 if single else 2):
            c = c[..., None, :]
        c = c[None] if single and c.ndim == 2 else c
    stacked = (p.ndim == 3 and p.dtype.kind == "f" and (f is None or (
        f.ndim == 3 and f.shape[:2] == p.shape[:2] and f.dtype.kind == "f"))
        and (m is None or m.shape == p.shape[:2])
        and (c is None or (c.ndim == 3 and len(c) == len(p) and c.dtype.kind == "f")))
    if not stacked:
        return Job(points, features, conditions, mask, single, False, deadline)
    return Job(p, f, c, m, single, True, deadline)


def predict_jobs(predict: Callable[..., np.ndarray], jobs: list[Job], chunk_size: int,
                 streams: bool = True) -> list[Any]:
    """Each job's fields (or the exception its prediction raised), the jobs predicted in one
    padded forward when there are several (module docstring)."""
    if len(jobs) == 1:
        job = jobs[0]
        large = job.points_count > chunk_size        # its samples one at a time, streamed
        try:
            out = predict(job.points, features=job.features, conditions=job.conditions,
                          mask=job.mask, chunk_size=chunk_size if large and streams else None,
                          batch_size=1 if large or not job.stacked else len(job.points))
        except ValueError as err:
            return [err]
        return [out[0] if job.stacked and job.single else out]
    n = max(j.points.shape[1] for j in jobs)
    sizes = [len(j.points) for j in jobs]
    mask = np.zeros((sum(sizes), n), bool)

    def stack(name: str) -> np.ndarray | None:
        parts = [getattr(j, name) for j in jobs]
        if parts[0] is None:
            return None
        if name == "conditions":
            return np.concatenate(parts).astype(np.float32)
        out = np.zeros((sum(sizes), n, parts[0].shape[2]), np.float32)
        for start, a in zip(np.cumsum([0] + sizes), parts):
            out[start:start + len(a), :a.shape[1]] = a
        return out

    for start, j in zip(np.cumsum([0] + sizes), jobs):
        mask[start:start + len(j.points), :j.points.shape[1]] = (
            True if j.mask is None else j.mask)
    padded = not mask.all()
    try:
        out = predict(stack("points"), features=stack("features"),
                      conditions=stack("conditions"), mask=mask if padded else None,
                      batch_size=len(mask))
    except ValueError:
        return [predict_jobs(predict, [j], chunk_size, streams)[0] for j in jobs]
    results = []
    for start, j in zip(np.cumsum([0] + sizes), jobs):
        rows = out[start:start + len(j.points), :j.points.shape[1]]
        results.append(rows[0] if j.single else rows)
    return results


class MicroBatcher:
    """One model's queue and worker (module docstring). ``predict`` is the run's
    (physical units in and out); ``streams``: its model can be streamed in chunks;
    ``observe(jobs, seconds)`` is told of each forward."""

    def __init__(self, predict: Callable[..., np.ndarray], *, chunk_size: int,
                 max_batch: int, max_queue: int, streams: bool = True,
                 observe: Callable[[int, float], None] | None = None) -> None:
        self.predict, self.chunk_size, self.streams = predict, chunk_size, streams
        self.max_batch, self.max_queue = max_batch, max_queue
        self.observe = observe
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self._held: Job | None = None

    async def submit(self, job: Job) -> np.ndarray:
        """The job's fields, once the worker has predicted them."""
        if self.queue.qsize() >= self.max_queue:
            raise Refused(TOO_MANY_REQUESTS, f"the server is busy: {self.queue.qsize()} "
                          f"requests are queued for this model (at most {self.max_queue}, "
                          "--max-queue); retry later")
        job.future = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(job)
        return await job.future

    def _gather(self, first: Job) -> list[Job]:
        batch = [first]
        if not first.stacked or first.points_count > self.chunk_size:
            return batch
        while len(batch) < self.max_batch and not self.queue.empty():
            job = self.queue.get_nowait()
            trial = batch + [job]
            padded = sum(len(j.points) for j in trial) * max(j.points.shape[1] for j in trial)
            if (job.stacked and job.signature() == first.signature()
                    and padded <= self.chunk_size):
                batch.append(job)
            else:
                self._held = job
                break
        return batch

    def _live(self, batch: list[Job]) -> list[Job]:
        now, live = time.monotonic(), []
        for job in batch:
            if job.future.done():                   # the client went away
                continue
            if now > job.deadline:
                job.future.set_exception(Refused(TOO_MANY_REQUESTS, (
                    "the server is busy: this request waited in the queue past its time "
                    "budget (--max-seconds) before it could start; retry later")))
                continue
            live.append(job)
        return live

    async def work(self) -> None:
        """Predict the queued jobs for ever (one task per model)."""
        while True:
            first, self._held = self._held or await self.queue.get(), None
            batch = self._live(self._gather(first))
            if not batch:
                continue
            started = time.perf_counter()
            try:
                results = await asyncio.to_thread(predict_jobs, self.predict, batch,
                                                  self.chunk_size, self.streams)
            except Exception as err:            # a failure of the model itself: 500 each
                results = [err] * len(batch)
            if self.observe is not None:
                self.observe(len(batch), time.perf_counter() - started)
            for job, result in zip(batch, results):
                if job.future.done():
                    continue
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)


__all__ = ["Job", "MicroBatcher", "make_job", "predict_jobs"]
