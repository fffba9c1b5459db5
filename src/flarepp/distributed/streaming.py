"""Exact block-wise streaming inference: a mesh of any size through one device in chunks.

Shape letters: B batch, N tokens, K chunk size, C channels, H heads, M latents, D head width.

A streamable model declares its forward as a
:class:`~flarepp.models.backbone.StreamingPlan` (``model.streaming_plan()``)::

    h_0 = embed(x)                        pointwise in the tokens, [B, N, C]
    (h_{l+1}, p_{l+1}) = block_l(h_l, p_l)   l = 0 .. L-1
    y = head(h_L)                         pointwise

where block ``l`` mixes tokens only through its encodes ``Z_{l,1} .. Z_{l,E_l}`` (each
``softmax_N(s Q K^T) V``, ``[B, H, M, D]``; FLARE has one per block, FLARE++, simplified
FLARE++ and v1 two, Luna one) and ``p`` is state that is the same for every token (Luna's
packed stream ``[B, M, C]``; none for the backbone). Encode ``e`` of a block depends on the
tokens only through pointwise maps of ``h_l`` and the block's earlier encodes. So the
hidden state ``h_l`` of all N tokens is kept between blocks, and each block runs as
``E_l + 1`` passes over chunks of K tokens:

* pass ``e = 1 .. E_l``: for every chunk ``c``, run the block on ``h_l[c]`` with the
  finished latents ``Z_{l,1} .. Z_{l,e-1}`` served for its earlier encodes; at encode ``e``
  take the chunk's partial ``(Z_c, L_c)`` from the fused kernel (``L_c`` the row-wise
  log-sum-exp) and merge it into a running ``(Z, L)`` by eq. 33 (Appendix B.2-B.3)::

      L <- logsumexp(L, L_c),    Z <- exp(L_old - L) Z + exp(L_c - L) Z_c,

  then stop that chunk's block. A chunk with no real token has ``L_c = -inf`` and weighs
  zero. FLARE++'s synthesis encode is thus complete over all chunks before its routing
  encode starts;
* last pass: run the block on every chunk with all its latents served (decode, output
  projection, residuals, FFN) and write ``h_{l+1}[c]`` over ``h_l[c]``; ``p_{l+1}``, a
  function of ``p_l`` and the latents alone, is the same from every chunk.

``embed`` runs once per chunk before the first block and ``head`` once after the last.

Sweeps. The passes are run as sweeps over the chunks, each a chunk at a time through as
many passes as need nothing more: the last pass of block ``l`` and the first pass of block
``l + 1`` share a sweep (the chunk's ``h_{l+1}[c]`` goes straight on to the next block's
first encode), as do ``embed`` and block 0's first pass, and block ``L - 1``'s last pass
and ``head``. So ``1 + sum_l E_l`` sweeps read the hidden state (17 for 8 FLARE++ blocks,
against ``2 + sum_l (E_l + 1) = 26`` passes when each pass is its own sweep), it is written
once per block, and every chunk of a sweep must stop at the same encode. Sweeps alternate
their direction over the chunks, so each starts on the chunks the last one touched: with
the state in a memory-mapped file larger than the page cache, those are the pages the
cache still holds (a sweep in the same direction would find none of them, the cache's
least recently used pages being the next sweep's first). In the file, the kernel is asked
to read the next chunk ahead while this one computes (:class:`_HiddenState`).

Cost. No block is ever replayed from the model's input: every token goes once through
``embed``, ``head`` and each block's decode, output projection and FFN; the ``E_l`` encode
passes of a block recompute only the pre-norm and the projections that the encode they
stop at reads, besides computing the encode itself. A FLARE-family mixer asks the backend
whether an encode is already held (:meth:`~flarepp.ops.AttentionBackend.held_encode`)
before projecting that encode's keys and values, so a pass computes no projection that only
an earlier pass's encode reads. Per token and block, with C=128, M=64 that is
``C^2`` recomputed on top of ``9C^2`` for FLARE (pass 1: ``W_K, W_V``; last pass:
``W_K``), 1.11x the multiply-adds of the unchunked block, and ``C^2`` on top of ``11C^2``
for FLARE++ (pass 1: ``W~_K``; pass 2: ``W_K, W_V``; last pass: ``W_K``), 1.09x; against
``E/2 + 1`` whole forwards for ``E`` encodes when each pass replays the model from its
input. Chunks of 16K tokens also keep a pass's working set in cache, which an unchunked
forward over a large mesh does not. With a process group each pass's merged partial is
further merged across the ranks (:func:`~flarepp.distributed.merge_across_ranks`): every
rank streams its own token shard, exactly over the whole mesh.

Memory. The hidden state ``h [B, N, C]`` in the residual stream's dtype (float32, or the
autocast dtype; the layout of the input, so a chunk of a sample is one contiguous run),
stored where ``hidden_on`` says: on the compute device, in host memory, or
in a memory-mapped file whose disk space is reserved first and that is deleted once mapped
(:func:`memmap_scratch`); the latents of the two blocks a sweep runs; the inputs ``[B, N, I]`` and outputs
``[B, N, O]`` where the caller keeps them; per chunk one block's activations on K tokens,
``O(K C)``; per encode ``O(B H M D)``. Nothing grows with N but ``h`` and the in- and outputs.
Under autocast the partials are accumulated in float32 (float64 for float64 models).

The driver swaps in :class:`StreamingBackend` for the duration of the call and restores the
mixers' backends afterwards; the model code is not touched. Inference only (no autograd).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from flarepp.device import HOST, available_memory
from flarepp.distributed.encoder import debug_checks, merge_across_ranks
from flarepp.distributed.shardable import (check_token_shardable, install_backend,
                                            restore_backends)
from flarepp.ops import AttentionBackend, encode_with_lse, merge_partials

HIDDEN_ON = ("auto", "device", "host", "memmap")
"""Where :func:`stream_forward` keeps the hidden state ``[B, N, C]`` between blocks."""
HIDDEN_BUDGET_FRACTION = 0.5
"""``hidden_on="auto"``: the share of the memory available at the call that ``h`` may take."""


class _EncodeReached(Exception):
    """Raised by the streaming backend to end a chunk's block once its partial is taken."""


@dataclass
class _BlockEncodes:
    """One block's encodes while it streams: the finished latents ``Z`` in forward order,
    the queries each was computed with, and the running partial ``(Z, L)`` of the next."""

    latents: list[torch.Tensor] = field(default_factory=list)
    queries: list[torch.Tensor] = field(default_factory=list)
    partial: tuple[torch.Tensor, torch.Tensor] | None = None
    partial_query: torch.Tensor | None = None
    partial_dtype: torch.dtype | None = None   # the dtype encode() would return


class StreamingBackend(AttentionBackend):
    """Serves a block's finished latents for its earlier encodes, accumulates the next one.

    Each block has its own encodes (:class:`_BlockEncodes`); per chunk and block,
    :meth:`enter` selects the block, then the block's forward ends with
    :class:`_EncodeReached` at its first unfinished encode (its partial taken), or runs to
    its end when all are finished; per sweep over the chunks, :meth:`finish_pass` turns the
    partial of the block the chunks stopped at into its next latents.
    """

    name = "streaming"

    def __init__(self, blocks: int = 1) -> None:
        self.blocks = [_BlockEncodes() for _ in range(max(blocks, 1))]
        self.block = 0                          # the block the chunk is in
        self.calls = 0                          # encodes seen in the current chunk's block
        self.query_drift: dict[tuple[int, int], torch.Tensor] = {}  # on the device

    @property
    def encodes(self) -> _BlockEncodes:
        return self.blocks[self.block]

    @property
    def target(self) -> int:
        """The encode (in the block's forward order) the current block accumulates."""
        return len(self.encodes.latents)

    def enter(self, block: int) -> None:
        """The next forward is block ``block``'s, on a new chunk."""
        self.block, self.calls = block, 0

    def start_chunk(self) -> None:
        self.calls = 0

    def _check_query(self, q: torch.Tensor, reference: torch.Tensor, index: int) -> None:
        # The latents of encode `index` are only valid for the queries they were computed
        # with; queries that vary between chunks mean the model is not streamable. The
        # comparison stays on the device (no host sync per chunk) and is read once per
        # sweep by check_queries(); FLAREPP_DEBUG_CHECKS=1 reads it at once.
        if q.shape != reference.shape:
            self._queries_differ((self.block, index))
        if debug_checks():
            if not torch.allclose(q, reference, rtol=1e-5, atol=1e-6):
                self._queries_differ((self.block, index))
            return
        drift = ~torch.isclose(q, reference, rtol=1e-5, atol=1e-6).all()
        previous = self.query_drift.get((self.block, index))
        self.query_drift[(self.block, index)] = drift if previous is None else previous | drift

    def check_queries(self) -> None:
        """Raise if an encode received different queries in different chunks (one sync)."""
        if not self.query_drift:
            return
        keys = sorted(self.query_drift)
        flags = torch.stack([self.query_drift[k] for k in keys]).tolist()
        self.query_drift = {}
        for key, differs in zip(keys, flags):
            if differs:
                self._queries_differ(key)

    @staticmethod
    def _queries_differ(key: tuple[int, int]) -> None:
        raise RuntimeError(f"streaming: encode {key[1]} of block {key[0]} received different "
                           "queries in different chunks; its queries depend on the chunk's "
                           "tokens outside the latent encodes, so the model cannot be "
                           "streamed")

    def held_encode(self, q):
        """The latents of the next encode when an earlier pass finished them, else ``None``;
        the mixer then skips that encode's keys and values."""
        if self.calls < len(self.encodes.latents):
            return self.encode(q, None, None)
        return None

    def encode(self, q, k, v, mask=None, *, scale=None):
        index, mine = self.calls, self.encodes
        self.calls += 1
        if index < len(mine.latents):
            self._check_query(q, mine.queries[index], index)
            return mine.latents[index]
        z_c, lse_c = encode_with_lse(q, k, v, mask, scale=scale)
        mine.partial_dtype = z_c.dtype
        z_c = z_c.to(lse_c.dtype)  # accumulate in float32 (float64) across chunks
        if mine.partial is None:
            mine.partial, mine.partial_query = (z_c, lse_c), q
        else:
            self._check_query(q, mine.partial_query, index)
            z, lse = mine.partial
            mine.partial = merge_partials(torch.stack([z, z_c]), torch.stack([lse, lse_c]))
        raise _EncodeReached

    def finish_pass(self, group: dist.ProcessGroup | None, block: int | None = None) -> None:
        """Turn the running partial of ``block`` (default the current one) into its next
        latents, merged over ``group``."""
        mine = self.blocks[self.block if block is None else block]
        z, lse = mine.partial
        if group is not None:
            z, lse = merge_across_ranks(z, lse, group)
        mine.latents.append(z.to(mine.partial_dtype))
        mine.queries.append(mine.partial_query)
        mine.partial, mine.partial_query = None, None

    def release(self, block: int) -> None:
        """Block ``block`` ran its last pass: its latents are not needed again."""
        self.blocks[block] = _BlockEncodes()

    def self_attention(self, q, k, v, mask=None, *, scale=None):
        raise ValueError("streaming: full self-attention cannot be computed chunk by chunk "
                         "exactly; use a FLARE-family mixer or the unchunked forward")


def _chunks(n_tokens: int, chunk_size: int) -> list[slice]:
    """Slices of at most ``chunk_size`` tokens; one empty slice when there are no tokens."""
    count = max(1, math.ceil(n_tokens / chunk_size))
    return [slice(i * chunk_size, min(n_tokens, (i + 1) * chunk_size)) for i in range(count)]


def hidden_state_bytes(samples: int, tokens: int, width: int,
                       dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the hidden state ``h [B, N, C]`` that :func:`stream_forward` keeps between
    blocks for ``samples`` x ``tokens`` of residual width ``width`` in ``dtype`` (module
    docstring, Memory): with the in- and outputs, all that grows with N."""
    return samples * tokens * width * torch.empty((), dtype=dtype).element_size()


def _storage_kind(hidden_on: str, nbytes: int, device: torch.device,
                  memory_budget: int | None) -> str:
    """Resolve ``hidden_on="auto"``: the compute device if it is not the host and ``h`` fits
    its budget, else host memory if it fits there, else a memory-mapped file."""
    if hidden_on != "auto":
        return hidden_on
    if device != HOST:
        budget = (memory_budget if memory_budget is not None
                  else HIDDEN_BUDGET_FRACTION * available_memory(device))
        if nbytes <= budget:
            return "device"
    budget = (memory_budget if memory_budget is not None
              else HIDDEN_BUDGET_FRACTION * available_memory(HOST))
    return "host" if nbytes <= budget else "memmap"


def _hidden_storage(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, memmap_dir: str | os.PathLike | None
                    ) -> tuple[torch.Tensor, mmap.mmap | None]:
    """An uninitialised ``[B, N, C]`` buffer on ``device``, in host memory or in a file
    (then with its mapping)."""
    if kind == "device":
        return torch.empty(shape, dtype=dtype, device=device), None
    if kind == "host":
        return torch.empty(shape, dtype=dtype), None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = _map_scratch(memmap_dir, max(1, nbytes), f"the hidden state {list(shape)} "
                                                       f"{str(dtype).removeprefix('torch.')}")
    # A byte file viewed as `dtype`: numpy has no bfloat16, torch reinterprets the bytes.
    array = np.frombuffer(mapping, np.uint8)
    return torch.from_numpy(array)[:nbytes].view(dtype).view(shape), mapping


class _HiddenState:
    """``h [B, N, C]`` between sweeps, where ``kind`` says (:func:`_hidden_storage`).

    In a memory-mapped file, the kernel is asked to read the next chunk of the sweep ahead
    (``madvise(MADV_WILLNEED)``) while this one computes. (Copying each chunk out of the
    mapping before its block, its page faults all at once, measured 2-4% slower than the
    block reading the mapping itself.)"""

    def __init__(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, memmap_dir: str | os.PathLike | None) -> None:
        self.kind, self.device = kind, device
        self.tensor, self.mapping = _hidden_storage(kind, shape, dtype, device, memmap_dir)
        self.row_bytes = shape[-1] * self.tensor.element_size()

    def load(self, sl: slice) -> torch.Tensor:
        chunk = self.tensor[:, sl]
        return chunk.to(self.device)

    def store(self, sl: slice, h: torch.Tensor) -> None:
        self.tensor[:, sl] = h

    def prefetch(self, sl: slice | None) -> None:
        if self.mapping is not None and sl is not None:
            for start, length in self.file_ranges(sl):
                self.mapping.madvise(mmap.MADV_WILLNEED, start, length)

    def file_ranges(self, sl: slice) -> list[tuple[int, int]]:
        """``(offset, length)`` in the file of the chunk ``sl`` of each sample, from a page
        boundary."""
        batch, n = self.tensor.shape[:2]
        ranges = []
        for b in range(batch if sl.stop > sl.start else 0):
            start = (b * n + sl.start) * self.row_bytes
            aligned = start - start % mmap.PAGESIZE
            ranges.append((aligned, (sl.stop - sl.start) * self.row_bytes + start - aligned))
        return ranges


MEMMAP_PREFIX = "flarepp-hidden-"
_MEMMAP_NAME = re.compile(re.escape(MEMMAP_PREFIX)
                          + r"(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+\.bin")
"""``flarepp-hidden-<host>-<pid>-<random>.bin``: who made a :func:`memmap_scratch` file."""


def memmap_scratch(directory: str | os.PathLike | None, nbytes: int, what: str) -> np.ndarray:
    """A writable ``uint8`` array of ``nbytes`` mapped from a file in ``directory`` (default
    the system's temporary directory) whose disk space is reserved and that is already
    deleted (:func:`_map_scratch`)."""
    return np.frombuffer(_map_scratch(directory, nbytes, what), np.uint8)


def _map_scratch(directory: str | os.PathLike | None, nbytes: int, what: str) -> mmap.mmap:
    """A shared writable mapping of ``nbytes`` of a file in ``directory`` (default the
    system's temporary directory) whose disk space is reserved and that is already
    deleted: the kernel frees it when the mapping goes, however the process ends.

    Space first: a sparse file on a full file system maps fine and then kills the process
    with SIGBUS at the first page that cannot be stored. ``os.posix_fallocate`` reserves
    every block (glibc writes them where the file system has no fallocate); without it
    (macOS) the free space is compared with ``nbytes``, which another writer can still
    take. No room, a quota or a file-size limit is an ``OSError`` naming ``directory``,
    the bytes needed and the bytes free.

    The file is unlinked as soon as it is mapped, so an exception, Ctrl-C, SIGTERM and
    SIGKILL all leave nothing. Only a SIGKILL between its creation and the mapping (while
    the space is reserved) can leave ``flarepp-hidden-<host>-<pid>-*.bin``: each call removes
    such files of this host whose process no longer runs (:func:`remove_stale_scratch`).
    """
    folder = Path(tempfile.gettempdir() if directory is None else directory)
    remove_stale_scratch(folder)
    owner = f"{socket.gethostname()}-{os.getpid()}-"
    fd, name = tempfile.mkstemp(prefix=MEMMAP_PREFIX + owner, suffix=".bin", dir=folder)
    try:
        _reserve(fd, nbytes, folder, what)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(name)


def _reserve(fd: int, nbytes: int, folder: Path, what: str) -> None:
    """Allocate ``nbytes`` of disk to the open file ``fd`` (:func:`memmap_scratch`)."""
    if hasattr(os, "posix_fallocate"):   # not on macOS
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise _no_room(folder, nbytes, what, err) from None
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    # No reservation to be had: compare the free space, then extend the (sparse) file.
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        raise _no_room(folder, nbytes, what, None)
    os.ftruncate(fd, nbytes)


def _no_room(folder: Path, nbytes: int, what: str, err: OSError | None) -> OSError:
    free = shutil.disk_usage(folder).free
    why = ("the file-size limit (ulimit -f) refuses a file that large"
           if err is not None and err.errno == errno.EFBIG else
           "a disk quota refuses it" if err is not None and err.errno == errno.EDQUOT else
           f"its file system has {free:,} bytes ({_mib(free)}) free")
    return OSError(errno.ENOSPC, f"no room for {what} as a memory-mapped file: it needs "
                                 f"{nbytes:,} bytes ({_mib(nbytes)}) and {why}; "
                                 "free space there or give another directory (--memmap-dir)",
                   str(folder))


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def remove_stale_scratch(folder: Path) -> list[Path]:
    """Delete the :func:`memmap_scratch` files in ``folder`` left by processes of this host
    that no longer run (a SIGKILL while their space was reserved); returns them. Another
    host's files, or a running process's, are kept: whether they are in use cannot be told
    from here."""
    removed = []
    host = socket.gethostname()
    for path in folder.glob(f"{MEMMAP_PREFIX}*.bin"):
        match = _MEMMAP_NAME.fullmatch(path.name)
        if match is None or match["host"] != host or _process_runs(int(match["pid"])):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _process_runs(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # it exists, as another user's
        return True
    return True


def _to(x: torch.Tensor | None, sl: slice, device: torch.device) -> torch.Tensor | None:
    return None if x is None else x[:, sl].to(device)


def streaming_refusal(model: nn.Module, *, conditioned: bool = False) -> str | None:
    """Why :func:`stream_forward` cannot stream ``model`` (a mixer or architecture that is
    not token-shardable, or no ``streaming_plan()``; ``conditioned``: with conditioning
    tokens, a model whose own ``streaming_refusal()`` gives a reason, or one that takes
    none: its ``takes_conditioning``, else whether it declares ``streaming_refusal()``), as
    its error says it; None when it can."""
    own = getattr(model, "streaming_refusal", None)
    if own is not None and own() is not None:
        return f"stream_forward: {own()}"
    if conditioned and not getattr(model, "takes_conditioning", own is not None):
        return (f"stream_forward: {type(model).__name__} takes no conditioning tokens, so it "
                "cannot be streamed with them")
    try:
        check_token_shardable(model, "stream_forward")
    except ValueError as err:
        return str(err)
    if getattr(model, "streaming_plan", None) is None:
        return (f"stream_forward: {type(model).__name__} declares no streaming_plan() (its "
                "forward as pointwise stages around residual blocks, flarepp.models.backbone."
                "StreamingPlan), so it cannot be streamed block by block; run it unchunked "
                "or declare the plan")
    return None


def stream_forward(model: nn.Module, x_BNI: torch.Tensor, mask_BN: torch.Tensor | None = None,
                   *, chunk_size: int, device: torch.device | str | None = None,
                   group: dist.ProcessGroup | None = None, hidden_on: str = "auto",
                   memmap_dir: str | os.PathLike | None = None,
                   memory_budget: int | None = None, progress: bool = False,
                   conditioning: torch.Tensor | None = None) -> torch.Tensor:
    """``model(x, mask)`` computed exactly, block by block, in chunks of ``chunk_size`` tokens
    (``model(x, mask, conditioning=...)`` with ``conditioning`` tokens ``[B, K, F]``, for a
    model whose ``streaming_plan(conditioning)`` takes them: a conditioned model of the
    ``concat`` or ``adaln`` scheme, :mod:`flarepp.models.conditioned`).

    ``x`` and ``mask`` may stay on the host; each chunk is moved to ``device`` (default:
    the model's) and the outputs are written back to ``x``'s device. With ``group``, ``x``
    is this rank's token shard and the encodes are merged across the group as well (call
    it on every rank). ``hidden_on`` places the hidden state ``[B, N, C]`` between sweeps:
    ``"device"``, ``"host"``, ``"memmap"`` (a file in ``memmap_dir``, default the
    system's temporary directory, with its space reserved and deleted once mapped: a full
    disk is an ``OSError`` sentence and no exit leaves the file, :func:`memmap_scratch`) or
    ``"auto"``: the device if it is an accelerator and the state fits ``memory_budget``
    bytes there, else host memory if it fits ``memory_budget`` bytes, else a memory-mapped
    file; the default budget is half the memory available at the call (free device memory
    / the host's ``MemAvailable``). ``progress`` shows a progress bar over the sweeps.

    Raises ``ValueError`` for a model with a mixer that cannot stream or without a
    ``streaming_plan()`` (see :class:`~flarepp.models.backbone.StreamingPlan`).
    """
    _check_streaming(model, chunk_size, hidden_on, conditioned=conditioning is not None)
    plan = (model.streaming_plan() if conditioning is None
            else model.streaming_plan(conditioning=conditioning))
    device = next(model.parameters()).device if device is None else torch.device(device)
    backend = StreamingBackend(len(plan.blocks))
    previous = install_backend(model, backend)
    run = _Sweeps(plan, backend, x_BNI, mask_BN, _chunks(x_BNI.shape[1], chunk_size), device,
                  group, (hidden_on, memmap_dir, memory_budget))
    bar = tqdm(total=None, unit="sweep", desc="stream_forward", disable=not progress)
    try:
        with torch.no_grad():
            while run.y_BNO is None:
                run.sweep()
                bar.total = run.sweeps_expected
                bar.set_postfix_str(run.placement, refresh=False)
                bar.update()
            return run.y_BNO
    finally:
        bar.close()
        restore_backends(previous)


def _check_streaming(model: nn.Module, chunk_size: int, hidden_on: str, *,
                     conditioned: bool = False) -> None:
    refusal = streaming_refusal(model, conditioned=conditioned)
    if refusal is not None:
        raise ValueError(refusal)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if hidden_on not in HIDDEN_ON:
        raise ValueError(f"hidden_on must be one of {', '.join(HIDDEN_ON)}, got {hidden_on!r}")


class _Sweeps:
    """The sweeps of :func:`stream_forward` over the chunks (module docstring).

    A sweep starts every chunk at block ``first`` (the first sweep from ``embed``) and runs
    it through the blocks whose encodes are all finished until one raises
    :class:`_EncodeReached` at its next unfinished encode; every chunk must stop at the same
    encode, whose merged partial then becomes latents. The hidden state is written back
    only where a chunk advanced, and a chunk that passes every block goes through ``head``.
    Sweeps alternate their direction over the chunks, so each begins with the chunks the
    last one touched (the ones a page cache still holds when the state is on disk)."""

    def __init__(self, plan, backend: StreamingBackend, x_BNI: torch.Tensor,
                 mask_BN: torch.Tensor | None, chunks: list[slice], device: torch.device,
                 group: dist.ProcessGroup | None, placement: tuple) -> None:
        self.plan, self.backend, self.x_BNI, self.mask_BN = plan, backend, x_BNI, mask_BN
        self.chunks, self.device, self.group, self.where = chunks, device, group, placement
        self.first, self.sweeps, self.sweeps_expected = -1, 0, None
        self.carries = {0: plan.initial_carry(x_BNI.shape[0])}
        self.hidden: _HiddenState | None = None
        self.y_BNO: torch.Tensor | None = None
        self.placement = ""

    def sweep(self) -> None:
        order = self.chunks if self.sweeps % 2 == 0 else self.chunks[::-1]
        stops = []
        for i, sl in enumerate(order):
            if self.hidden is not None:
                self.hidden.prefetch(order[i + 1] if i + 1 < len(order) else None)
            mask = _to(self.mask_BN, sl, self.device)
            h = (self.plan.embed(_to(self.x_BNI, sl, self.device), mask) if self.first < 0
                 else self.hidden.load(sl))
            stop, h = self._blocks(h, mask)
            stops.append(stop)
            if stop == len(self.plan.blocks):
                self._output(sl, self.plan.head(h, mask))
            elif stop > self.first:
                self._store(sl, h)
        self._finish(stops)

    def _blocks(self, h: torch.Tensor, mask: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        """``(b, h_b)``: the chunk through the blocks from ``first`` to the block ``b``
        whose forward stopped at an unfinished encode (``b = L``: none did)."""
        for b in range(max(self.first, 0), len(self.plan.blocks)):
            self.backend.enter(b)
            try:
                h_next, carry = self.plan.blocks[b](h, mask, self.carries[b])
            except _EncodeReached:
                return b, h
            if h_next.dtype != h.dtype:
                raise RuntimeError(f"streaming: a block turned the hidden state from "
                                   f"{h.dtype} into {h_next.dtype}; the stored state keeps "
                                   "one dtype, so this model cannot be streamed exactly")
            self.carries.setdefault(b + 1, carry)
            h = h_next
        return len(self.plan.blocks), h

    def _store(self, sl: slice, h: torch.Tensor) -> None:
        if self.hidden is None:
            shape = (self.x_BNI.shape[0], self.x_BNI.shape[1], h.shape[-1])
            nbytes = hidden_state_bytes(*shape, h.dtype)
            hidden_on, memmap_dir, budget = self.where
            kind = _storage_kind(hidden_on, nbytes, self.device, budget)
            self.hidden = _HiddenState(kind, shape, h.dtype, self.device, memmap_dir)
            self.placement = f"hidden state: {kind}, {nbytes / 2**30:.2f} GiB"
        self.hidden.store(sl, h)

    def _output(self, sl: slice, y: torch.Tensor) -> None:
        if self.y_BNO is None:
            self.y_BNO = y.new_empty((*self.x_BNI.shape[:2], *y.shape[2:]),
                                     device=self.x_BNI.device)
        self.y_BNO[:, sl] = y

    def _finish(self, stops: list[int]) -> None:
        """After a sweep: the stopped encode's latents, the queries checked (one sync)."""
        stop = stops[0]
        if any(s != stop for s in stops):
            raise RuntimeError(f"streaming: the chunks of one sweep stopped in different "
                               f"blocks ({sorted(set(stops))}); a block's control flow "
                               "depends on the chunk")
        self.sweeps += 1
        self.backend.check_queries()
        for done in range(max(self.first, 0), stop):
            self.backend.release(done)
        if stop < len(self.plan.blocks):
            self.backend.finish_pass(self.group, stop)
        if self.first <= 0 < stop and self.sweeps_expected is None:
            # block 0 took `sweeps - 1` encodes; the registered models' blocks all take as many
            self.sweeps_expected = 1 + len(self.plan.blocks) * (self.sweeps - 1)
        self.first = stop
