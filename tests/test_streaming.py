"""Exact block-wise streaming inference (chunked encodes merged by log-sum-exp) vs the
plain forward.

Shape letters: B batch, N tokens, K chunk size, C channels. float64 results must match the
unchunked forward to 1e-10 (relative to max(1, |y|)).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from flarepp.distributed import (SHARDABLE_MIXERS, StreamingBackend, gather_tokens,
                                 run_on_ranks, shard_slice, stream_forward)
from flarepp.distributed.streaming import _EncodeReached
from flarepp.mixers import build_mixer, list_mixers
from flarepp.models import build_model
from flarepp.ops import FUSED, AttentionBackend, set_backend

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
@pytest.mark.parametrize("chunk_size", [1, 7, N // 3, 100])  # K=1, not dividing N, N/3, K>N
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


@pytest.mark.parametrize("chunk_size", [1, 7, N // 3])
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
    with pytest.raises(_EncodeReached):  # compared on the device, no host sync per chunk
        backend.encode(q + 1.0, k, v)
    with pytest.raises(RuntimeError, match="different queries in different chunks"):
        backend.check_queries()  # once per block (stream_forward calls it)


def test_streaming_query_check_at_once_under_the_debug_switch(monkeypatch):
    """FLAREPP_DEBUG_CHECKS=1 compares the queries on the host at the chunk itself."""
    monkeypatch.setenv("FLAREPP_DEBUG_CHECKS", "1")
    backend = StreamingBackend()
    q = torch.randn(1, 2, 4, 8)
    k = v = torch.randn(1, 2, 5, 8)
    backend.start_chunk()
    with pytest.raises(_EncodeReached):
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


@pytest.mark.slow
def test_streaming_peak_memory_is_hidden_state_plus_chunk():
    """Peak memory of a streamed forward at a fixed chunk (K=1024) as N grows 32x
    (2048 -> 65536): what it adds beyond the hidden state h [B, N, C] must stay within 20%
    of the small run's whole peak, while the unchunked forward at 65536 needs several
    times more (which shows the measurement can see growth). Each N runs in a fresh
    interpreter and reads the kernel's resident-set high-water mark; a failure points at
    an O(N) buffer in the streaming driver beyond h (a second copy of the hidden state,
    outputs collected in a list, cached activations)."""
    from flarepp.bench.cp import measure_forward_memory
    settings = dict(mixer="flarepp", in_dim=3, out_dim=1, dim=64, heads=4, latents=16,
                    blocks=2)
    small = measure_forward_memory(settings, 2048, [1024])[0]
    large, unchunked = measure_forward_memory(settings, 65536, [1024, None])
    hidden_bytes = 65536 * settings["dim"] * 4  # float32 h [1, N, C]
    assert large["peak_bytes"] - hidden_bytes <= 1.2 * small["peak_bytes"], (small, large)
    assert unchunked["peak_bytes"] >= 3 * large["peak_bytes"], (large, unchunked)


class CountingBackend(AttentionBackend):
    """The fused backend, counting encodes."""

    def __init__(self) -> None:
        self.encodes = 0

    def encode(self, q, k, v, mask=None, *, scale=None):
        self.encodes += 1
        return super().encode(q, k, v, mask, scale=scale)


def encodes_per_block(model: torch.nn.Module, x, mask) -> int:
    """E: the encodes one block runs in the unchunked forward."""
    counter = CountingBackend()
    set_backend(model, counter)
    with torch.no_grad():
        model(x, mask)
    set_backend(model, FUSED)
    return counter.encodes // len(model.blocks)


@pytest.mark.parametrize("mixer", SHARDABLE)
def test_each_stage_runs_once_per_token_and_each_block_in_e_plus_1_passes(mixer, capsys):
    """Block-wise streaming never replays the model from its input: over 3 chunks the input
    and output projections and every FFN run once per chunk, and a block with E encodes
    runs its pre-norm in E + 1 passes per chunk; a block's last pass and the next block's
    first share one sweep over the chunks (as do the input projection and block 0's first
    pass, the last block's last pass and the output projection), so the progress bar counts
    1 + L E sweeps. A failure points at a pass structure that recomputes earlier blocks or
    reads the hidden state once more per block than it needs."""
    model = tiny_model(mixer)
    x, mask = batch(True)
    encodes = encodes_per_block(model, x, mask)
    calls: dict[str, int] = {}

    def count(name):
        def hook(module, args, output):
            calls[name] = calls.get(name, 0) + 1
        return hook

    hooks = [model.in_proj.register_forward_hook(count("in_proj")),
             model.out_proj.register_forward_hook(count("out_proj"))]
    for i, block in enumerate(model.blocks):
        hooks.append(block.mixer_norm.register_forward_hook(count(f"mixer_norm{i}")))
        hooks.append(block.ffn.register_forward_hook(count(f"ffn{i}")))
    got = stream_forward(model, x, mask, chunk_size=N // 3, progress=True)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        want = model(x, mask)
    assert (got - want).abs().max() <= 1e-10 * max(1.0, want.abs().max().item())
    expected = {"in_proj": 3, "out_proj": 3}
    for i in range(len(model.blocks)):
        expected |= {f"mixer_norm{i}": 3 * (encodes + 1), f"ffn{i}": 3}
    assert calls == expected
    sweeps = 1 + len(model.blocks) * encodes
    assert f"{sweeps}/{sweeps}" in capsys.readouterr().err


@pytest.mark.parametrize("mixer,per_pass", [
    ("flare", [[0, 1], [0]]),                          # [W_K | W_V]; then W_K for the decode
    ("flarepp", [[0], [1, 2], [1]]),                   # W~_K; W_K, W_V; W_K for the decode
    ("flarepp-simple", [[0, 1], [2, 3], [2]]),         # [W~_K | W~_V]; [W_K | W_V]; W_K
])
def test_each_pass_projects_only_what_its_encode_and_the_decode_read(mixer, per_pass,
                                                                      monkeypatch):
    """A streaming pass that stops at an encode computes only the projections that encode
    reads, and a later pass skips those of encodes the backend already holds
    (``held_encode``); the unchunked forward computes each projection once. A failure points
    at a mixer that projects before asking the backend, or at a backend that no longer
    reports the encodes it holds (streaming then recomputes every projection per pass)."""
    from flarepp.mixers.flare import LowRankRouting
    model = tiny_model(mixer)
    x, mask = batch(True)
    seen: list[int] = []
    original = LowRankRouting.project

    def spy(self, x_BNC, first, count=1):
        seen.extend(range(first, first + count))
        return original(self, x_BNC, first, count)

    monkeypatch.setattr(LowRankRouting, "project", spy)
    with torch.no_grad():
        want = model(x, mask)
    assert sorted(seen) == sorted([i for p in per_pass[:-1] for i in p] * len(model.blocks))
    seen.clear()
    got = stream_forward(model, x, mask, chunk_size=N // 3)
    assert (got - want).abs().max() <= 1e-10 * max(1.0, want.abs().max().item())
    one_block = [i for p in per_pass for i in p for _ in range(3)]   # 3 chunks per pass
    assert sorted(seen) == sorted(one_block * len(model.blocks))


@pytest.mark.parametrize("mixer", SHARDABLE)
def test_inference_path_equals_the_training_path(mixer):
    """Without autograd a FLARE-family mixer projects on demand (what streaming relies on);
    with autograd FLARE++ keeps its one fused projection GEMM. Both are the same function
    (float64, with padding). A failure points at the two paths of ``route`` drifting apart,
    which the streaming-vs-unchunked tests cannot see (both sides run without autograd)."""
    model = tiny_model(mixer)
    x, mask = batch(True)
    with torch.no_grad():
        inference = model(x, mask)
    training = model(x, mask).detach()
    assert (inference - training).abs().max() <= 1e-12 * max(1.0, training.abs().max().item())


@pytest.mark.parametrize("hidden_on", ["device", "host", "memmap"])
def test_hidden_state_placements_agree(hidden_on, tmp_path):
    """The hidden state in device memory, host memory or a memory-mapped file gives the
    unchunked outputs, and the file's temporary directory is removed afterwards; a
    failure points at the storage (e.g. a memmap view with wrong strides or offset)."""
    model = tiny_model("flarepp")
    x, mask = batch(True)
    with torch.no_grad():
        want = model(x, mask)
    got = stream_forward(model, x, mask, chunk_size=7, hidden_on=hidden_on,
                         memmap_dir=tmp_path)
    assert (got - want).abs().max() <= 1e-10 * max(1.0, want.abs().max().item())
    assert os.listdir(tmp_path) == []


def test_auto_placement_spills_to_a_memory_mapped_file(tmp_path, monkeypatch):
    """``hidden_on="auto"`` with a budget smaller than h [B, N, C] writes h to a file in
    ``memmap_dir`` (seen while its space is reserved, gone once it is mapped) and still
    gives the unchunked outputs."""
    import flarepp.distributed.streaming as streaming
    seen, reserving = [], []
    original, reserve = streaming._hidden_storage, streaming._reserve

    def spy(kind, *args, **kwargs):
        out = original(kind, *args, **kwargs)
        seen.append((kind, os.listdir(tmp_path)))
        return out

    def spy_reserve(fd, nbytes, *args):
        reserving.append((nbytes, os.listdir(tmp_path)))
        return reserve(fd, nbytes, *args)

    monkeypatch.setattr(streaming, "_hidden_storage", spy)
    monkeypatch.setattr(streaming, "_reserve", spy_reserve)
    model = tiny_model("flare")
    x, mask = batch(True)
    with torch.no_grad():
        want = model(x, mask)
    got = stream_forward(model, x, mask, chunk_size=5, memory_budget=100,
                         memmap_dir=tmp_path)
    assert seen == [("memmap", [])]
    [(nbytes, names)] = reserving
    assert nbytes == x.shape[0] * x.shape[1] * model.config.dim * 8   # float64 h [B, N, C]
    assert len(names) == 1 and names[0].startswith("flarepp-hidden-")
    assert (got - want).abs().max() <= 1e-10 * max(1.0, want.abs().max().item())
    assert os.listdir(tmp_path) == []
    stream_forward(model, x, mask, chunk_size=5, memory_budget=2 ** 40)
    assert seen[-1][0] == "host"


def test_padded_chunks_and_an_all_padding_sample():
    """A chunk with no real token in any sample (every L_c = -inf) and a sample that is
    padding throughout (Z = 0 in every block) stream exactly, outputs zero at padding."""
    model = tiny_model("flarepp")
    x, _ = batch(False)
    x = torch.cat([x, x[:1]], dim=0)  # B = 3
    mask = torch.ones(3, N, dtype=torch.bool)
    mask[:, 8:16] = False             # chunk [8, 16) of K=8 holds no real token at all
    mask[2] = False                   # sample 2: no real token anywhere
    with torch.no_grad():
        want = model(x, mask)
    got = stream_forward(model, x, mask, chunk_size=8)
    assert torch.isfinite(got).all() and (got[~mask] == 0).all()
    assert (got - want).abs().max() <= 1e-10 * max(1.0, want.abs().max().item())


def test_autocast_bf16_with_a_memory_mapped_bf16_hidden_state(tmp_path):
    """Under bf16 autocast the residual stream is bf16 (stored as bf16 bytes in the file)
    and the partials are merged in float32: the streamed outputs match the unchunked
    autocast forward up to bf16 rounding (3e-2 of the output scale); a failure far above
    that points at the byte view of the memory-mapped state or at merging in bf16."""
    model = tiny_model("flarepp").float()
    x, mask = batch(True)
    x = x.float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x, mask)
        got = stream_forward(model, x, mask, chunk_size=7, hidden_on="memmap",
                             memmap_dir=tmp_path)
    assert got.dtype == want.dtype
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max() <= 3e-2 * scale


def test_model_without_a_plan_and_bad_options_are_refused():
    """A model whose mixers are shardable but which declares no streaming plan, and an
    unknown ``hidden_on``, raise errors that say what is missing."""
    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = build_mixer("flare", dim=16, heads=2, latents=4)

        def forward(self, x, mask=None):
            return self.mixer(x, mask)

    with pytest.raises(ValueError, match="declares no streaming_plan"):
        stream_forward(Bare(), torch.randn(1, 8, 16), chunk_size=4)
    with pytest.raises(ValueError, match="hidden_on must be one of"):
        stream_forward(tiny_model("flare"), torch.randn(1, 8, 3), chunk_size=4,
                       hidden_on="disk")


CP_MODELS = [("flare", "surrogate"), ("flarepp", "surrogate"),
             ("flarepp-simple", "surrogate"), ("luna", "luna")]


def stream_on_ranks(group) -> dict:
    """Rank r streams its shard of a 23-token batch (shards of 15 and 8 tokens) for every
    model of ``CP_MODELS`` and chunk sizes 1 and 7; returns the gathered outputs."""
    rank = torch.distributed.get_rank(group)
    x, mask = batch(True)
    x, mask = x[:, :23], mask[:, :23]
    sl = shard_slice(23, rank, 2, [15, 8])
    out = {}
    for mixer, arch in CP_MODELS:
        model = tiny_model(mixer, arch=arch)
        for chunk_size in (1, 7):
            y_r = stream_forward(model, x[:, sl], mask[:, sl], chunk_size=chunk_size,
                                 group=group)
            out[f"{mixer}/{chunk_size}"] = gather_tokens(y_r, group).numpy()
    return out


@pytest.mark.slow
def test_block_wise_streaming_composes_with_2_rank_context_parallelism():
    """Each of 2 gloo ranks streams its own token shard block by block, every encode pass
    merged across the ranks: the gathered outputs equal the unchunked single-process
    forward. A failure points at the cross-rank merge in ``StreamingBackend.finish_pass``
    or at ranks running different numbers of passes."""
    ranks = run_on_ranks(stream_on_ranks, 2, timeout_s=120)
    x, mask = batch(True)
    x, mask = x[:, :23], mask[:, :23]
    for mixer, arch in CP_MODELS:
        with torch.no_grad():
            want = tiny_model(mixer, arch=arch)(x, mask).numpy()
        for chunk_size in (1, 7):
            for r in ranks:
                got = r[f"{mixer}/{chunk_size}"]
                assert np.abs(got - want).max() <= 1e-10 * max(1.0, np.abs(want).max()), \
                    (mixer, chunk_size)


@pytest.mark.slow
def test_bench_stream_measures_both_forwards_and_their_difference():
    """``flarepp bench stream``'s measurements on a tiny model: the worker's timed forward,
    unchunked and streamed, and the exactness job run through a fresh interpreter, which
    finds float32 agreement; a failure points at flarepp.bench.streaming."""
    from flarepp.bench.streaming import _measure, stream_exactness
    settings = dict(mixer="flarepp", in_dim=6, out_dim=4, dim=16, heads=2, latents=4,
                    blocks=2)
    for chunk_size in (None, 1000):
        record = _measure({"settings": settings, "n_tokens": 6000, "chunk_size": chunk_size,
                           "threads": 1})
        assert record["chunk_size"] == chunk_size and record["time_s"] > 0
        assert record["output_bytes"] == 6000 * 4 * 4
    exact = stream_exactness(settings, 6000, 1000, threads=1)
    assert exact["dtype"] == "torch.float32"
    assert exact["max_abs_diff"] <= 1e-5 * max(1.0, exact["max_abs_output"])
    for key in ("streamed_vs_float64", "unchunked_vs_float64"):
        assert exact[key] <= 1e-5 * max(1.0, exact["max_abs_output"])


@pytest.mark.slow
def test_bench_stream_times_each_precision_against_the_first():
    """``flarepp bench stream --precision fp32,bf16``: every (chunk, precision) variant is
    measured in a fresh interpreter each round, the bf16 ones under autocast, and each
    ratio is to the unchunked fp32 forward of the same round (1 for that one itself)."""
    from flarepp.bench.streaming import stream_vs_unchunked
    settings = dict(mixer="flarepp", in_dim=6, out_dim=4, dim=16, heads=2, latents=4,
                    blocks=1)
    out = stream_vs_unchunked(settings, 6000, [2000], rounds=1, threads=1,
                              precisions=("fp32", "bf16"))
    assert [(r["chunk_size"], r["precision"]) for r in out["summary"]] == [
        (None, "fp32"), (2000, "fp32"), (None, "bf16"), (2000, "bf16")]
    assert sorted((r["chunk_size"] or 0, r["precision"]) for r in out["records"]) == [
        (0, "bf16"), (0, "fp32"), (2000, "bf16"), (2000, "fp32")]
    by = {(r["chunk_size"], r["precision"]): r for r in out["records"]}
    for row in out["summary"]:
        mine = by[(row["chunk_size"], row["precision"])]
        assert row["time_ratio"] == pytest.approx(mine["time_s"] / by[(None, "fp32")]["time_s"])
    assert out["summary"][0]["time_ratio"] == 1.0


@pytest.mark.parametrize("scheme", ["concat", "adaln"])
def test_a_conditioned_model_streams_exactly(scheme):
    """A conditioned model whose conditions act on each point alone (concat: appended to
    every point's inputs; adaln: one modulation per sample) streams in chunks of 37 to its
    unchunked output, and ``stream_above`` streams only a mesh larger than it. A failure
    points to ConditionedSurrogate.streaming_plan or stream_forward's conditioning."""
    from flarepp.inference.execution import Execution, predict_tokens
    torch.manual_seed(0)
    model = build_model(arch="conditioned", conditioning=scheme, mixer="flarepp", in_dim=3,
                        out_dim=2, cond_dim=2, cond_tokens=1, dim=16, heads=2, latents=4,
                        blocks=2).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))   # AdaLN's zero init would hide the conditions
    batch = {"x": torch.randn(2, 300, 3), "mask": torch.arange(300)[None] < torch.tensor(
        [[300], [211]]), "conditioning": torch.randn(2, 1, 2)}
    whole = predict_tokens(model, batch, Execution())
    for execution in (Execution(chunk_size=37), Execution(stream_above=50)):
        torch.testing.assert_close(predict_tokens(model, batch, execution), whole,
                                   rtol=1e-5, atol=1e-5)
    other = dict(batch, conditioning=batch["conditioning"] + 1)
    assert not torch.allclose(predict_tokens(model, other, Execution(chunk_size=37)), whole)


def test_cross_conditioning_is_refused_saying_why():
    """Cross FLARE gathers the conditioning tokens in every encode beside the mesh's, so a
    chunk's partial would count them once per chunk: streaming is refused in a sentence
    naming that, and ``stream_above`` runs such a model whole instead."""
    from flarepp.inference.execution import Execution, predict_tokens
    torch.manual_seed(0)
    model = build_model(arch="conditioned", conditioning="cross", mixer="flare-cross",
                        in_dim=3, out_dim=2, cond_dim=2, cond_tokens=1, dim=16, heads=2,
                        latents=4, blocks=1).eval()
    batch = {"x": torch.randn(1, 120, 3), "conditioning": torch.randn(1, 1, 2)}
    with pytest.raises(ValueError, match="would count them once per part"):
        predict_tokens(model, batch, Execution(chunk_size=40))
    torch.testing.assert_close(predict_tokens(model, batch, Execution(stream_above=40)),
                               predict_tokens(model, batch, Execution()))

