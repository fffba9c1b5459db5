"""GPU-only risks, each reproduced on the CPU by imitating what the GPU does differently.

Each test names the defect a failure points to. Shape letters: B batch, H heads, M latents,
N tokens, D head width.
"""

from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.nn.functional as F

import flarepp
from flarepp.ops import _kernels
from flarepp.ops.attention import _encode_with_lse, default_scale, encode, self_attention

# ----------------------------------------------------------------------------- empty rows

_SDPA = F.scaled_dot_product_attention


def _kernel_like_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      **kw):
    """SDPA as CUDA's memory-efficient kernel behaves on a row whose keys are all masked:
    ``exp(s - lse)`` with ``lse = -inf`` is NaN there, forward and backward (the CPU kernel
    returns zeros instead, which hid the defect)."""
    s = (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale) * q @ k.transpose(-1, -2)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - lse) @ v


@pytest.mark.parametrize("mixer", ["flare", "flarepp", "attention"])
def test_keyless_sample_gives_finite_gradients_on_a_nan_kernel(monkeypatch, mixer):
    """A batch with one sample that has no real token (all padding), through encode (FLARE,
    FLARE++) or full attention, on an SDPA that returns NaN for rows without a key, as the
    CUDA memory-efficient kernel does: every parameter gradient must stay finite and the
    padded sample's output zero. NaN here means encode/self_attention handed the kernel a
    fully masked row, which only the forward's masked_fill hid."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", _kernel_like_sdpa)
    torch.manual_seed(0)
    model = flarepp.build_model(mixer=mixer, in_dim=3, out_dim=2, blocks=1, dim=16, heads=2,
                                latents=4)
    x = torch.randn(2, 10, 3)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1] = False
    y = model(x, mask=mask)
    (y * mask[..., None]).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name}: {p.grad}"


def test_no_sdpa_call_sees_a_row_without_keys(monkeypatch):
    """The contract behind the test above, at the primitives: encode and self_attention
    never pass a boolean mask with a query row whose keys are all False."""
    seen = []

    def spy(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None:
            seen.append(bool(attn_mask.expand(*q.shape[:-1], k.shape[-2]).any(-1).all()))
        return _SDPA(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0] = False
    z = encode(q, k, v, mask)
    y = self_attention(k, k, v, mask)
    assert seen == [True, True]
    assert (z[0] == 0).all() and (y[0] == 0).all()


# ----------------------------------------------------------------------------- copies

def test_kernel_gets_head_first_views_of_projections_without_a_copy():
    """K and V as mixers make them (a [B, N, H*D] projection viewed [B, N, H, D] and
    transposed to [B, H, N, D]) already suit the CUDA kernel when D is a multiple of 8:
    the wrapper must hand them over as they are, not copy them every encode."""
    seen = {}

    def forward(q, k, v, bias, scale):
        seen["k"], seen["v"] = k, v
        B, H, M, _ = q.shape
        out = torch.zeros(B, M, H, v.shape[-1], dtype=q.dtype).transpose(1, 2)
        lse = torch.zeros(B, H, -(-M // 32) * 32)
        return out, lse, ()

    recording = _kernels.LSEKernel(name="recording", forward=forward, backward=None,
                                   head_multiple=8, equal_head_widths=False,
                                   dtypes=(torch.float32,))
    B, N, H, D = 2, 20, 2, 16
    k = torch.randn(B, N, H * D).view(B, N, H, D).transpose(1, 2)
    v = torch.randn(B, N, H * D).view(B, N, H, D).transpose(1, 2)
    q = torch.randn(B, H, 8, D)
    with torch.no_grad():
        _encode_with_lse(q, k, v, None, default_scale(D, None), recording)
    assert seen["k"].data_ptr() == k.data_ptr() and seen["v"].data_ptr() == v.data_ptr()


# ----------------------------------------------------------------------------- devices

def test_single_process_on_cuda_k_sets_the_current_device(monkeypatch):
    """A single process on cuda:K, K > 0, must make cuda:K the current device (cuBLAS
    handles, autocast, `torch.cuda.synchronize()` and new tensors without an index use the
    current device, cuda:0 otherwise); the CPU changes nothing."""
    from flarepp import device as device_mod
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    device_mod.use_device(torch.device("cuda", 3))
    device_mod.use_device(torch.device("cpu"))
    assert calls == [torch.device("cuda", 3)]


def test_trainer_makes_its_device_current(monkeypatch, tmp_path):
    """The trainer calls use_device on the device it resolved (the single-process path;
    the torchrun path sets it in flarepp.distributed.mesh.launch)."""
    from flarepp.train import Trainer, get_preset
    from flarepp.train import loop
    used = []
    monkeypatch.setattr(loop, "use_device", lambda d: used.append(d))
    config = get_preset("darcy-tiny", ["epochs=1", "device=cpu", "batch_size=4",
                                       "dataset_options={'resolution': 8, 'n_train': 4, "
                                       "'n_test': 2}", "model.dim=8", "model.heads=2",
                                       "model.blocks=1", "model.latents=2"])
    from flarepp.data.generators.darcy import make_darcy
    make_darcy(tmp_path / "d", n_train=4, n_test=2, resolution=15, seed=3, progress=False)
    trainer = Trainer(config, tmp_path / "run", data_root=tmp_path / "d", progress=False)
    trainer.close()
    assert used == [torch.device("cpu")]


# ----------------------------------------------------------------------------- host syncs

def _one_step_per_sample_trainer(data, tmp_path):
    """A tiny darcy-tiny trainer taking one step per training sample (12 per epoch)."""
    from flarepp.train import Trainer, get_preset
    config = get_preset("darcy-tiny", ["epochs=1", "device=cpu", "batch_size=1",
                                       "dataset_options={'resolution': 8, 'n_train': 12, "
                                       "'n_test': 4}", "model.dim=8", "model.heads=2",
                                       "model.blocks=1", "model.latents=2"])
    return Trainer(config, tmp_path / "run", data_root=data, progress=False)


@pytest.mark.slow
def test_training_steps_queue_without_host_syncs(monkeypatch, tmp_path, darcy_dir):
    """An epoch of 12 steps reads device values on the host only every HOST_SYNC_EVERY
    steps (set to 4 here: 3 reads) and never per step: on a GPU each `.item()`, `float()`
    or `bool()` of a device tensor waits for every queued kernel, so a read per step
    serialises the host with the device. Reads per step here mean a per-step `.item()`
    came back into the loop (loss bookkeeping, the stop flag). Counted: reads made by
    flarepp's code (torch's own, e.g. AdamW's step counter on the host, are not syncs)."""
    from flarepp.train import loop
    trainer = _one_step_per_sample_trainer(darcy_dir, tmp_path)
    monkeypatch.setattr(loop, "HOST_SYNC_EVERY", 4)
    reads = []
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original):
            caller = traceback.extract_stack(limit=2)[0]
            if "/flarepp/" in caller.filename:  # flarepp's own reads, not torch's internals
                reads.append(f"{_name} at {caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}")
            return _original(self, *args)
        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        loss = trainer.train_epoch()
    finally:
        monkeypatch.undo()
        trainer.close()
    assert len(trainer.step_losses) == 12 and all(math.isfinite(v) for v in trainer.step_losses)
    assert loss == pytest.approx(sum(trainer.step_losses) / 12)
    assert [r.split()[0] for r in reads] == ["tolist"] * 3, reads


@pytest.mark.slow
def test_non_finite_loss_still_stops_training(monkeypatch, tmp_path, darcy_dir):
    """The loss check moved from every step to the host reads: a NaN loss still raises
    FloatingPointError naming its step."""
    from flarepp.train import loop
    trainer = _one_step_per_sample_trainer(darcy_dir, tmp_path)
    monkeypatch.setattr(loop, "HOST_SYNC_EVERY", 4)
    step, calls = trainer.train_step, []

    def nan_at_step_3(*args):
        calls.append(1)
        loss = step(*args)
        return loss * float("nan") if len(calls) == 3 else loss
    trainer.train_step = nan_at_step_3
    try:
        with pytest.raises(FloatingPointError, match="step 3"):
            trainer.train_epoch()
    finally:
        trainer.close()


def test_weight_average_equals_torch_ema_without_host_reads(monkeypatch):
    """flarepp's EMA (train/ema.py) gives torch's AveragedModel EMA bit for bit (parameters,
    float and integer buffers, a resume through load_state_dict) while its updates read no
    tensor on the host: torch's compares the device counter n_averaged on the host twice
    per update, i.e. two waits for the GPU in every training step."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from flarepp.train.ema import WeightAverage

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)
            self.register_buffer("running", torch.zeros(3))
            self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    torch.manual_seed(0)
    net = Net()
    ours = WeightAverage(net, 0.9)
    ref = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)

    def step():
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
            net.running.add_(1.0)
            net.seen.add_(3)

    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original):
            reads.append(_name)
            return _original(self, *args)
        monkeypatch.setattr(torch.Tensor, name, counted)
    for _ in range(3):
        step()
        reads.clear()
        ours.update_parameters(net)
        assert reads == [], reads
        ref.update_parameters(net)
        assert reads  # torch's own reads its counter: the counting is live
    monkeypatch.undo()
    for (name, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name
    resumed = WeightAverage(Net(), 0.9)
    resumed.load_state_dict(ours.state_dict())
    step()
    resumed.update_parameters(net)
    ref.update_parameters(net)
    for (name, a), (_, b) in zip(resumed.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name
