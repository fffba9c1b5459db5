"""Exact streaming inference (chunked encodes merged by log-sum-exp) vs the plain forward.

Shape letters: B batch, N tokens, K chunk size. float64 results must match the unchunked
forward to 1e-10 (relative to max(1, |y|)).
"""

from __future__ import annotations

import pytest
import torch

from flarepp.distributed import SHARDABLE_MIXERS, StreamingBackend, stream_forward
from flarepp.distributed.streaming import _EncodeReached
from flarepp.mixers import list_mixers
from flarepp.models import build_model
from flarepp.ops import FUSED

SHARDABLE = [name for name in list_mixers() if name in SHARDABLE_MIXERS]
NOT_SHARDABLE = [name for name in list_mixers() if name not in SHARDABLE_MIXERS]
N = 24


def tiny_model(mixer: str, **overrides) -> torch.nn.Module:
    """Tiny float64 model, every parameter perturbed away from its structured init."""
    torch.manual_seed(0)
    model = build_model(**{**dict(mixer=mixer, in_dim=3, out_dim=2, dim=16, heads=2,
                                  latents=4, blocks=2), **overrides}).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def batch(masked: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, N, 3, generator=g, dtype=torch.float64)
    if not masked:
        return x, None
    mask = torch.rand(2, N, generator=g) > 0.3
    mask[1, N // 3:] = False  # sample 1: most chunks hold no real token (L_c = -inf)
    mask[:, 0] = True
    return x, mask


@pytest.mark.parametrize("mixer", SHARDABLE)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 6, 7, 100])  # divides N, does not, K=1, K > N
def test_streaming_equals_unchunked(mixer, masked, chunk_size):
    """Every token-shardable mixer, chunk sizes that divide N and that do not, with padding:
    a failure points at the chunk merge or at the pass order (FLARE++'s synthesis encode
    must be complete over all chunks before the value-gathering encode starts)."""
    model = tiny_model(mixer)
    x, mask = batch(masked)
    with torch.no_grad():
        want = model(x, mask)
    got = stream_forward(model, x, mask, chunk_size=chunk_size)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert (got - want).abs().max() <= 1e-10 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("chunk_size", [6, 7])
def test_streaming_luna_with_carried_packed_stream(chunk_size):
    """Luna's backbone carries a packed stream [B, M, C] across blocks, updated only by
    encodes: streaming must replay it exactly (a failure points at the pass order)."""
    model = tiny_model("luna", arch="luna")
    x, mask = batch(True)
    with torch.no_grad():
        want = model(x, mask)
    got = stream_forward(model, x, mask, chunk_size=chunk_size)
    assert (got - want).abs().max() <= 1e-10 * max(1.0, want.abs().max().item())


def test_streaming_restores_backends_and_handles_float32_and_empty_mesh():
    """After streaming (and after a failure inside it) every mixer is back on its original
    backend; float32 matches to 1e-5; N=0 gives an empty output rather than an error."""
    model = tiny_model("flarepp").float()
    x, mask = batch(True)
    x = x.float()
    with torch.no_grad():
        want = model(x, mask)
    got = stream_forward(model, x, mask, chunk_size=5)
    assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
    assert all(m.backend is FUSED for m in model.modules() if hasattr(m, "backend"))
    with pytest.raises(ValueError, match="must have shape"):
        stream_forward(model, x[..., :2], chunk_size=5)
    assert all(m.backend is FUSED for m in model.modules() if hasattr(m, "backend"))
    assert stream_forward(model, x[:, :0], chunk_size=5).shape == (2, 0, 2)


def test_streaming_detects_chunk_dependent_queries():
    """The backend must refuse to reuse a latent whose queries changed between chunks (a
    model that is not streamable), instead of returning a wrong result."""
    backend = StreamingBackend()
    q = torch.randn(1, 2, 4, 8)
    k = v = torch.randn(1, 2, 5, 8)
    backend.start_chunk()
    with pytest.raises(_EncodeReached):  # first chunk: partial taken, forward stopped
        backend.encode(q, k, v)
    backend.start_chunk()
    with pytest.raises(RuntimeError, match="different queries in different chunks"):
        backend.encode(q + 1.0, k, v)


@pytest.mark.parametrize("mixer", NOT_SHARDABLE)
def test_unstreamable_mixers_are_refused(mixer):
    """Full attention (and any mixer not declared token-shardable) cannot stream exactly:
    it must raise a clear error instead of attending within each chunk."""
    model = build_model(mixer=mixer, in_dim=3, out_dim=2, dim=16, heads=2, latents=4,
                        blocks=1)
    with pytest.raises(ValueError, match="cannot be split exactly"):
        stream_forward(model, torch.randn(1, 8, 3), chunk_size=4)


def test_streaming_peak_memory_is_flat_in_n():
    """Peak memory of a streamed forward at a fixed chunk (K=1024) must stay within 20% as
    N grows 16x (2048 -> 32768), while the unchunked forward at 32768 needs several times
    more (which shows the measurement can see growth). Each N runs in a fresh interpreter
    and reads the kernel's resident-set high-water mark; a failure points at an O(N)
    buffer in the streaming driver (e.g. outputs collected in a list, cached activations)."""
    from flarepp.bench.cp import measure_forward_memory
    settings = dict(mixer="flarepp", in_dim=3, out_dim=1, dim=64, heads=4, latents=16,
                    blocks=2)
    small = measure_forward_memory(settings, 2048, [1024])[0]
    large, unchunked = measure_forward_memory(settings, 32768, [1024, None])
    assert large["peak_bytes"] <= 1.2 * small["peak_bytes"], (small, large)
    assert unchunked["peak_bytes"] >= 3 * large["peak_bytes"], (large, unchunked)
