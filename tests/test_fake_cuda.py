"""The CUDA code paths, run on a CPU-only build with fake CUDA tensors (tests/fake_cuda/).

flarepp's CUDA branches (the memory-efficient log-sum-exp kernel behind ``encode_with_lse``,
CUDA autocast in every mixer, context parallelism and streaming with CUDA tensors, the
trainer on ``cuda``) are executed here with real autograd and real CUDA autocast on tensors
that carry shapes, dtypes and strides but no data. Every call of the CUDA efficient-attention
kernel, forward and backward, goes through a checker of that kernel's input rules
(:class:`fake_cuda.EfficientAttentionRules`): a failure names the rule the wrapper broke.

Covered: the CUDA ``encode_with_lse`` (both cotangents, one cotangent, masks, D not a
multiple of 8, M not a multiple of 32, N = 1, float64's explicit path, under autocast);
every registered mixer in the surrogate, forward and backward under CUDA autocast in
fp32/bf16/fp16; the context-parallel model (a 1-rank gloo group) and streaming with inputs
and hidden state on the device or the host; one trainer step of the fields, rollout,
sequence and surface tasks in the three precisions, EMA included; the trainer's checkpoint
written on CUDA and resumed on the CPU. A host read of a device value (``.item()``,
``bool()``, a shape check by ``torch.equal``) or a copy of a Python list or scalar to the
device inside a step fails on fake tensors, so these tests also catch such a host sync
put back into the encoder's path or the training step.

What this tier cannot see: numbers (every result is a fake tensor; kernel numerics are
checked against float64 by tests/test_cuda.py on a GPU, and by the CPU emulation in
tests/test_kernels_cpu_emulation.py), which fused kernel F.scaled_dot_product_attention picks
on a GPU (it runs its math decomposition here), NCCL, CUDA streams and memory, Inductor on
CUDA. Mixers whose control flow depends on tensor values (``abupt``'s anchor selection and
the causal scans' chunking read data) cannot run on fake tensors: VALUE_DEPENDENT lists them
with the reason, and a test checks that each fails for exactly that reason. The
language-model task's step runs with causal attention.

Skipped, with the reason, where no C++ compiler (or ninja) is available to build the
extension, and on CUDA builds of torch. Shape letters: B batch, H heads, M latents, N tokens,
D head width, C channels.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import fake_cuda
import flarepp
from fake_cuda import EfficientAttentionRules, KernelRuleError
from flarepp.mixers import MIXERS
from flarepp.ops import _kernels
from flarepp.ops.attention import encode_with_lse

_REASON = fake_cuda.unavailable_reason()
pytestmark = [pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
              pytest.mark.xdist_group("fake_cuda")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def _built():
    """Build (or load from the cache) the extension once; a build error is a failure."""
    fake_cuda.load()


def _inputs(B, H, M, N, D, dtype, *, masked, keyless=False):
    q, k, v = (torch.randn(*s, device="cuda", dtype=dtype).requires_grad_(True)
               for s in ((B, H, M, D), (B, H, N, D), (B, H, N, D)))
    mask = None
    if masked:
        mask = torch.ones(B, N, dtype=torch.bool, device="cuda")
        if keyless:
            mask[-1] = False
    return q, k, v, mask


def test_fake_cuda_installs_and_uninstalls():
    """Inside: CUDA tensors, CUDA autocast active, autograd on them; outside: the CPU build
    again (no accelerator), so the rest of the worker's tests see what they always saw."""
    with fake_cuda.fake_cuda():
        x = torch.randn(3, 4, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = x @ x.T
        assert y.device.type == "cuda" and y.dtype == torch.bfloat16
        (g,) = torch.autograd.grad(y.float().sum(), x)
        assert g.device.type == "cuda" and g.shape == x.shape
    assert torch._C._get_accelerator().type == "cpu"
    assert not torch.cuda.is_available()


def test_checker_rejects_what_the_kernel_rejects():
    """The checker is only worth its name if it refuses what the kernel refuses: a head
    width not a multiple of 8, a compact [B, 1, 1, N] bias, unpadded bias rows, a sliced
    log-sum-exp, an output in [B, H, M, D] memory layout."""
    aten = torch.ops.aten
    with fake_cuda.fake_cuda(), EfficientAttentionRules():
        q, k, v = (torch.randn(2, 2, 5, 13, device="cuda") for _ in range(3))
        with pytest.raises(KernelRuleError, match="head width 13"):
            aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
        q, k, v = (torch.randn(2, 2, x, 16, device="cuda") for x in (5, 20, 20))
        with pytest.raises(KernelRuleError, match="wrong shape"):
            aten._scaled_dot_product_efficient_attention(q, k, v, torch.zeros(2, 1, 1, 20,
                                                                              device="cuda"), True)
        rows = torch.zeros(2, 24, device="cuda")[:, None, None, :20].expand(2, 2, 5, 20)
        with pytest.raises(KernelRuleError, match="padded to 16"):
            aten._scaled_dot_product_efficient_attention(q, k, v, rows, True)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None,
                                                                              True)
        assert lse.shape == (2, 2, 32)
        with pytest.raises(KernelRuleError, match="padded one"):
            aten._scaled_dot_product_efficient_attention_backward(
                out, q, k, v, None, out, lse[..., :5], seed, offset, 0.0,
                [True, True, True, False], False)
        with pytest.raises(KernelRuleError, match="laid out"):
            aten._scaled_dot_product_efficient_attention_backward(
                out, q, k, v, None, out.contiguous(), lse, seed, offset, 0.0,
                [True, True, True, False], False)


CASES = {  # (B, H, M, N, D): the awkward sizes of the issue
    "D13-M37-N45": (2, 3, 37, 45, 13),   # D not a multiple of 8, M not of 32, N not of 16
    "D16-M32-N1": (2, 2, 32, 1, 16),     # a single token
    "D64-M1-N33": (1, 2, 1, 33, 64),     # one latent, the next kernel tier's width
    "D5-M64-N16": (3, 1, 64, 16, 5),     # one head
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("used", ["both", "z", "lse"])
def test_cuda_encode_with_lse_keeps_the_kernel_rules(dtype, case, masked, used):
    """encode_with_lse on CUDA runs the efficient-attention kernel, forward and backward,
    within its input rules, for every cotangent combination; Z and the gradients come back
    in the input dtype, L in float32; the backward runs once, with the dL value column
    (v widened to round_up(D + 1, 8)) only when L is used."""
    B, H, M, N, D = CASES[case]
    with fake_cuda.fake_cuda(), EfficientAttentionRules() as rules:
        q, k, v, mask = _inputs(B, H, M, N, D, dtype, masked=masked, keyless=masked)
        assert _kernels.lse_kernel(q.device, dtype) is _kernels.CUDA_MEMORY_EFFICIENT
        z, lse = encode_with_lse(q, k, v, mask)
        assert z.shape == (B, H, M, D) and z.dtype == dtype and z.device.type == "cuda"
        assert lse.shape == (B, H, M) and lse.dtype == torch.float32
        outputs = {"both": (z.float().sum() + lse.sum(),), "z": (z.float().sum(),),
                   "lse": (lse.sum(),)}[used]
        grads = torch.autograd.grad(outputs, (q, k, v), allow_unused=True)
        assert rules.count("forward") == 1 and rules.count("backward") == 1
        (_, backward), = [c for c in rules.calls if c[0] == "backward"]
        pad = -(-D // 8) * 8
        widened = -(-(D + 1) // 8) * 8
        assert backward["v"][-1] == (pad if used == "z" else widened), backward
        for g, t in zip(grads, (q, k, v)):
            if g is not None:
                assert g.shape == t.shape and g.dtype == dtype and g.device.type == "cuda"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_encode_with_lse_under_autocast(dtype):
    """Called with float32 inputs inside CUDA autocast (as the mixers do), the kernel sees
    the autocast dtype; gradients come back float32 to the float32 leaves."""
    with fake_cuda.fake_cuda(), EfficientAttentionRules() as rules:
        q, k, v, mask = _inputs(2, 2, 8, 40, 16, torch.float32, masked=True)
        with torch.autocast("cuda", dtype=dtype):
            z, lse = encode_with_lse(q, k, v, mask)
        grads = torch.autograd.grad(z.float().sum() + lse.sum(), (q, k, v))
        assert all(call["dtype"] == dtype for _, call in rules.calls)
        assert all(g.dtype == torch.float32 for g in grads)


def test_cuda_float64_takes_the_explicit_path():
    """float64 on CUDA has no fused kernel: the explicit fallback runs, in float64."""
    with fake_cuda.fake_cuda(), EfficientAttentionRules() as rules:
        q, k, v, mask = _inputs(2, 2, 8, 40, 16, torch.float64, masked=True)
        z, lse = encode_with_lse(q, k, v, mask)
        assert z.dtype == lse.dtype == torch.float64 and rules.calls == []
        torch.autograd.grad(z.sum() + lse.sum(), (q, k, v))


# ----------------------------------------------------------------------------- mixers

VALUE_DEPENDENT = {
    "abupt": ("its anchor selection reads the number of real tokens (int(n_real.max()))",
              "flarepp/mixers/abupt.py"),
    "flare-causal": ("the chunked causal scan branches on whether a chunk overflows "
                     "(c.unsafe.any())", "flarepp/ops/causal.py"),
    "flarepp-causal": ("the chunked causal scan branches on whether a chunk overflows "
                       "(c.unsafe.any())", "flarepp/ops/causal.py"),
}
"""Mixers that cannot run on fake tensors: their control flow reads tensor values (the
reason, and the file where the value is read). Not skipped: checked below to fail for
exactly that reason, so a mixer that stops reading values fails that check and must join
the tier."""

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _surrogate(name, precision):
    torch.manual_seed(0)
    norm = "layernorm" if precision == "fp32" else "rmsnorm"
    model = flarepp.build_model(mixer=name, in_dim=3, out_dim=2, blocks=1, dim=16, heads=2,
                                latents=8, norm=norm)
    mixer = model.blocks[0].mixer
    if getattr(mixer, "stochastic_in_training", False):
        model.eval()
    return model, getattr(mixer, "supports_mask", True)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", [n for n in MIXERS.names() if n not in VALUE_DEPENDENT])
def test_every_mixer_in_the_surrogate_on_cuda(name, precision):
    """The surrogate around each registered mixer, its weights moved to CUDA, forward and
    backward under CUDA autocast (fp32: none) with a padding mask: output on CUDA, every
    parameter gets a CUDA float32 gradient, and every efficient-attention call keeps the
    kernel's rules. A failure here is a
    CUDA-only shape, dtype, device or autocast defect in that mixer."""
    dtype = PRECISIONS[precision]
    model, masks = _surrogate(name, precision)
    with fake_cuda.fake_cuda(), EfficientAttentionRules():
        fake_cuda.to_fake_cuda(model)
        x = torch.randn(2, 24, 3, device="cuda")
        mask = torch.ones(2, 24, dtype=torch.bool, device="cuda") if masks else None
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            y = model(x, mask=mask)
        assert y.device.type == "cuda" and y.shape == (2, 24, 2)
        y.float().square().mean().backward()
        for pname, p in model.named_parameters():
            if p.requires_grad:
                assert p.grad is not None, f"{pname} got no gradient"
                assert p.grad.device.type == "cuda" and p.grad.dtype == torch.float32, pname


@pytest.mark.parametrize("name", sorted(VALUE_DEPENDENT))
def test_value_dependent_mixers_read_a_value_where_stated(name):
    """Each mixer left out of the tier above fails on fake CUDA by reading a tensor value
    (``DataDependentOutputException``) in the file VALUE_DEPENDENT names, and nowhere
    earlier. A failure here means the stated reason is stale: if the mixer ran, delete it
    from VALUE_DEPENDENT so the tier covers it; if it failed elsewhere, that is a CUDA-path
    defect of its own."""
    import traceback

    from torch._subclasses.fake_tensor import DataDependentOutputException
    reason, where = VALUE_DEPENDENT[name]
    model, masks = _surrogate(name, "fp32")
    with pytest.raises(DataDependentOutputException) as err:
        with fake_cuda.fake_cuda(), EfficientAttentionRules():
            fake_cuda.to_fake_cuda(model)
            x = torch.randn(2, 24, 3, device="cuda")
            mask = torch.ones(2, 24, dtype=torch.bool, device="cuda") if masks else None
            model(x, mask=mask)
    frames = [f.filename for f in traceback.extract_tb(err.value.__traceback__)]
    flarepp_frames = [f for f in frames if "/flarepp/" in f.replace("\\", "/")]
    assert flarepp_frames and flarepp_frames[-1].endswith(where), (reason, flarepp_frames)


# ----------------------------------------------------------------------------- distributed

@pytest.fixture(scope="module")
def gloo_group(tmp_path_factory):
    """A 1-rank gloo group in this process: collectives on fake CUDA tensors run their
    shape functions only (no NCCL here; tests/test_cuda.py runs a 1-rank NCCL group)."""
    import torch.distributed as dist
    if dist.is_initialized():   # another test left its group: a leak, never a reason to skip
        pytest.fail(f"a process group ({dist.get_backend()}, {dist.get_world_size()} "
                    "rank(s)) is still initialised in this worker: the test that made it "
                    "must destroy it")
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("mixer", ["flare", "flarepp"])
def test_context_parallel_model_on_cuda(gloo_group, mixer, precision):
    """The context-parallel surrogate on CUDA under autocast: every encode goes through the
    fused CUDA kernel inside the exact merge (forward and both-cotangent backward within
    the kernel's rules), no host read of a device value on the way (a fake tensor cannot
    be read: a per-encode shape check or sync would fail here), gradients reduced."""
    from flarepp.distributed import context_parallel
    dtype = PRECISIONS[precision]
    model, _ = _surrogate(mixer, precision)
    with context_parallel(model, gloo_group) as cp:
        with fake_cuda.fake_cuda(), EfficientAttentionRules() as rules:
            fake_cuda.to_fake_cuda(model)
            x = torch.randn(2, 24, 3, device="cuda")
            mask = torch.ones(2, 24, dtype=torch.bool, device="cuda")
            with torch.autocast("cuda", dtype=dtype or torch.float32,
                                enabled=dtype is not None):
                y = model(cp.shard(x), cp.shard(mask))
            y.float().square().mean().backward()
            cp.all_reduce_gradients()
            encodes = {"flare": 1, "flarepp": 2}[mixer]  # per block (1 block)
            assert rules.count("forward") == encodes and rules.count("backward") == encodes
            assert all(call["dtype"] == (dtype or torch.float32) for _, call in rules.calls)
            assert all(p.grad is not None and p.grad.device.type == "cuda"
                       for p in model.parameters())


@pytest.mark.parametrize("hidden_on", ["device", "host"])
@pytest.mark.parametrize("inputs_on", ["cuda", "cpu"])
def test_streaming_on_cuda(monkeypatch, hidden_on, inputs_on):
    """stream_forward with the model on CUDA, inputs on the host or the device and the
    hidden state [B, N, C] on the device or the host: every chunk's encode runs the fused
    CUDA kernel within its rules, the output comes back to the inputs' device. The check
    that queries agree across chunks reads a device value once per block; fake tensors
    have none, so it is recorded here instead (tests/test_streaming.py checks it)."""
    from flarepp.distributed import stream_forward
    from flarepp.distributed.streaming import StreamingBackend
    checks = []
    monkeypatch.setattr(StreamingBackend, "check_queries", lambda self: checks.append(1))
    model, _ = _surrogate("flarepp", "fp32")
    model.eval()
    with fake_cuda.fake_cuda(), EfficientAttentionRules() as rules:
        fake_cuda.to_fake_cuda(model)
        x = torch.randn(2, 50, 3, device=inputs_on)
        mask = torch.ones(2, 50, dtype=torch.bool, device=inputs_on)
        y = stream_forward(model, x, mask, chunk_size=16, hidden_on=hidden_on)
        assert y.shape == (2, 50, 2) and y.device.type == inputs_on
        assert rules.count("forward") >= 4 and rules.count("backward") == 0
    assert checks



# ----------------------------------------------------------------------------- the trainer

def _task_configs(root):
    """A tiny run of the fields, rollout, sequence and language-model tasks, with their
    data (the language model with causal attention: the causal FLARE scans read values)."""
    from flarepp.data.generators.advection_diffusion import make_advection_diffusion
    from flarepp.data.generators.darcy import make_darcy
    from flarepp.data.lra import make_listops
    from flarepp.train import apply_overrides, get_preset
    from flarepp.train.presets import lra_run_config
    small = ["model.dim=16", "model.heads=2", "model.blocks=1", "model.latents=4",
             "device=cpu", "loader_workers=0"]
    make_darcy(root / "darcy", n_train=4, n_test=2, resolution=15, seed=3, progress=False)
    make_advection_diffusion(root / "rollout", n_train=3, n_test=2, resolution=8, seed=1,
                             progress=False)
    make_listops(root / "listops", n_train=16, n_val=4, n_test=4, min_length=10,
                 max_length=40, progress=False)
    rollout_options = {"n_train": 3, "n_test": 2, "history": 2, "patches": 2, "unroll": 2,
                       "horizon": 5}
    text = root / "text"
    text.mkdir()
    for i in range(8):   # files held out by the hash of their name: both splits non-empty
        (text / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 4)
    text_options = {"context": 16, "n_train": 8, "n_test": 4, "test_fraction": 0.5}
    return {
        "fields": get_preset("darcy-tiny", small + [
            "batch_size=2", "dataset_options={'resolution': 8, 'n_train': 4, 'n_test': 2}",
            f"data_root={str(root / 'darcy')!r}"]),
        "rollout": get_preset("rollout-tiny", small + [
            "batch_size=2", f"dataset_options={rollout_options!r}",
            f"data_root={str(root / 'rollout')!r}"]),
        "sequence": apply_overrides(lra_run_config(
            "listops", "tiny", "flarepp", steps=9, data_root=str(root / "listops"),
            split_limits={"train": 16, "val": 4, "test": 4}), small + ["batch_size=4"]),
        "lm": get_preset("lm-tiny-attention", small + [
            "batch_size=4", f"dataset_options={text_options!r}", f"data_root={str(text)!r}"]),
    }


def _surface_config(root):
    """The full-surface task on two generated surfaces of 1,500 cells (needs VTK)."""
    pytest.importorskip("vtkmodules", reason="the surface task reads .vtp files with VTK")
    from flarepp.data.generators import make_surface_flow
    from flarepp.train import RunConfig, validate
    make_surface_flow(root, n_train=2, n_test=2, resolution=1500, seed=3, progress=False)
    return validate(RunConfig(
        name="surface-fake-cuda", task="surface", dataset="drivaerml", data_root=str(root),
        dataset_options={"split_file": "split.json", "cells_per_step": 256},
        model={"mixer": "flarepp", "dim": 16, "heads": 2, "blocks": 1, "latents": 4},
        epochs=1, batch_size=1, device="cpu", loader_workers=0))


class _TaskConfigs(dict):
    """The tasks' configs, the surface task's data generated on first use only."""

    def __init__(self, root):
        super().__init__(_task_configs(root))
        self.root = root

    def __missing__(self, key):
        if key != "surface":
            raise KeyError(key)
        self[key] = _surface_config(self.root / "surface-flow")
        return self[key]


@pytest.fixture(scope="module")
def task_configs(tmp_path_factory):
    return _TaskConfigs(tmp_path_factory.mktemp("tasks"))


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("task", ["fields", "rollout", "sequence", "lm", "surface"])
def test_trainer_step_on_cuda(task_configs, tmp_path, monkeypatch, task, precision):
    """One Trainer.train_step of each task kind (PDE fields, rollout, LRA sequence
    classification, byte language model, car surfaces) on CUDA in fp32/bf16/fp16: the batch moved
    to the device, the task's forward under CUDA autocast, its loss and count, backward
    through GradScaler (fp16), gradient clipping, AdamW and the scheduler; the step's loss
    comes back as a CUDA tensor, and the EMA is updated on the device. No step reads a
    device value on the host (a fake tensor has none; nor can the fake mode copy a Python
    list or scalar to the device: the rollout task's per-step copy of its constants
    failed here). A failure is a device or dtype mix in the task or the loop (a CPU tensor
    in a CUDA loss, a float64 constant under autocast) or a host sync per step.

    One host read of torch's own is replaced, as a fake tensor cannot be read: the
    GradScaler's decision to skip a step with non-finite gradients (fp16) steps
    unconditionally. The language-model task runs with causal attention: its causal FLARE
    mixers read values (VALUE_DEPENDENT)."""
    from flarepp.train import Trainer, apply_overrides
    config = apply_overrides(task_configs[task], [f"precision={precision}"])
    trainer = Trainer(config, tmp_path / "run", progress=False)
    try:
        with _on_fake_cuda(trainer, monkeypatch) as micro_weight:
            loss = trainer.train_step(*micro_weight)
            assert loss.device.type == "cuda" and loss.dim() == 0
            assert trainer.ema._host_count == 1
            assert all(p.device.type == "cuda" for p in trainer.ema.parameters())
            grads = [p.grad for p in trainer.model.parameters() if p.requires_grad]
            assert grads and all(g is not None and g.device.type == "cuda" for g in grads)
            assert all(s["exp_avg"].device.type == "cuda"
                       for s in trainer.optimizer.state.values())
    finally:
        trainer.close()


@contextlib.contextmanager
def _on_fake_cuda(trainer, monkeypatch):
    """``trainer`` (built on the CPU) moved to fake CUDA the way it would have been built
    there: model, EMA, a fresh optimiser, scheduler and scaler, the engine on ``cuda:0``;
    yields its first training batch ``(micro-batches, weight)`` on the device."""
    from flarepp.device import grad_scaler
    from flarepp.inference.batching import epoch_keys, make_loader
    from flarepp.inference.engine import Engine
    from flarepp.inference.execution import Execution
    from flarepp.train.optim import build_optimizer, build_scheduler
    config = trainer.config
    keys = epoch_keys(torch.arange(trainer.n_train).numpy(), config.batch_size, 0, 1, 0)
    micro, weight = next(iter(make_loader(trainer.task, "train", keys[:1], training=True,
                                          workers=0, pin_memory=False)))
    monkeypatch.setattr(torch.amp.GradScaler, "_maybe_opt_step",
                        lambda self, optimizer, state, *a, **k: optimizer.step(*a, **k))
    with fake_cuda.fake_cuda(), EfficientAttentionRules():
        dev = torch.device("cuda", 0)
        fake_cuda.to_fake_cuda(trainer.model)
        fake_cuda.to_fake_cuda(trainer.ema)
        trainer.device = dev
        trainer.engine = Engine(trainer.task, Execution(dev, config.precision))
        trainer.optimizer = build_optimizer(trainer.model, config)
        trainer.scheduler = build_scheduler(trainer.optimizer, config, 100)
        trainer.scaler = grad_scaler(config.precision, dev)
        trainer.checkpoints = trainer.checkpoint_manager()  # owns the states swapped in
        yield ([{k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                for b in micro], weight)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_checkpoint_written_on_cuda_resumes_on_the_cpu(task_configs, tmp_path, monkeypatch,
                                                       precision):
    """The trainer's checkpoint after a step on CUDA (model, EMA, AdamW moments, scheduler,
    the fp16 scaler, the CUDA RNG state), written by flarepp's writer with the tensors'
    bytes left empty (torch.serialization.skip_data: fake tensors have none), resumes on
    the CPU through the weights-only reader: every tensor lands on the CPU with its shape
    and dtype. A failure is a device-specific object in the checkpoint or a restore that
    does not map to the host.

    skip_data empties the host RNG states too, which the resume then refuses (they are
    real generator states): they are put back into the file before resuming. The fp16
    scaler's state_dict reads its scale and growth tracker on the host (once per save);
    those two reads return the initial values here."""
    from flarepp.storage.checkpoint import read_checkpoint, save_checkpoint
    from flarepp.train import Trainer, apply_overrides
    from flarepp.train.checkpoint import checkpoint_path
    config = apply_overrides(task_configs["fields"], [f"precision={precision}"])
    trainer = Trainer(config, tmp_path / "run", progress=False)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in trainer.model.state_dict().items()}
    monkeypatch.setattr(torch.cuda, "get_rng_state",  # a host byte tensor, as on a GPU
                        lambda device=None: torch.zeros(16, dtype=torch.uint8, device="cpu"))
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", lambda self: 2.0 ** 16)
    monkeypatch.setattr(torch.amp.GradScaler, "_get_growth_tracker", lambda self: 0)
    path = checkpoint_path(tmp_path / "run", 1)
    try:
        with _on_fake_cuda(trainer, monkeypatch) as micro_weight:
            trainer.train_step(*micro_weight)
            trainer.epoch = 1
            state = trainer.state()
            assert all(v.device.type == "cuda" for v in state["model"].values())
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                save_checkpoint(path, state)
    finally:
        trainer.close()
    loaded = read_checkpoint(path)
    assert {k: (tuple(v.shape), v.dtype) for k, v in loaded["model"].items()} == shapes
    moments = [t for s in loaded["optimizer"]["state"].values() for t in s.values()
               if isinstance(t, torch.Tensor)]
    assert moments and all(t.device.type == "cpu" for t in moments)
    assert loaded["rng"]["cuda"].device.type == "cpu"
    loaded["rng"]["torch"] = torch.get_rng_state()  # emptied by skip_data (see above)
    loaded["rng"]["shuffle"] = torch.Generator().get_state()
    loaded.pop("format_version")
    save_checkpoint(path, loaded)
    resumed = Trainer(config, tmp_path / "run", progress=False, resume=True, device="cpu")
    try:
        assert resumed.epoch == 1 and resumed.device.type == "cpu"
        assert all(p.device.type == "cpu" for p in resumed.model.parameters())
    finally:
        resumed.close()
