"""A memory budget a user can state, and nothing lost when an evaluation runs out of memory
(issue 38 items 2 and 3): the budget's discovery (a cgroup or an rlimit), the sizes a run
chooses within it, the sentence that refuses a budget too small, the line that says what
was chosen, and an evaluation killed by a failed allocation resumed to its end."""

import json
import resource

import pytest
import torch

from flarepp.allocator import OutOfMemory
from flarepp.cli import main as cli
from flarepp.models import build_model
from flarepp.storage.config import RunConfig
from flarepp.tasks.fields import FieldTask
from flarepp.train import Trainer, get_preset
from flarepp.train import budget
from flarepp.inference.execution import STREAM_CHUNK
from flarepp.train.budget import (CHUNK_MIN, PARAMETER_COPIES, DataExtent, MemoryBudgetTooSmall,
                                  MemoryPlan, limit_budget)
from flarepp.train.callbacks import TrainerCallback

MIB, GIB = 2 ** 20, 2 ** 30
HELD = 100 * MIB
SMALL = ["model.dim=16", "model.heads=2", "model.blocks=2", "model.latents=4", "device=cpu",
         "batch_size=2"]
TORCH_ALLOCATOR = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                   "allocate memory: you tried to allocate 490733568 bytes. Error code 12 "
                   "(Cannot allocate memory)")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tiny store: 4 training and 2 test samples of 600 points, one target field."""
    from flarepp.data.generators.laplace import make_laplace_store
    root = tmp_path_factory.mktemp("store") / "store"
    make_laplace_store(root, n_train=4, n_test=2, resolution=600, progress=False)
    return root


@pytest.fixture
def held(monkeypatch):
    """The process holds 100 MiB when a run is set up (so the plan does not depend on what
    the test process happens to hold)."""
    monkeypatch.setattr(budget, "resident_bytes", lambda proc="/proc": HELD)
    return HELD


# -- discovery -------------------------------------------------------------------------------
def _proc(tmp_path, membership: str, rss_kib: int = 51200, size_kib: int = 1048576):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "status").write_text(f"VmSize:\t{size_kib} kB\nVmData:\t{size_kib} kB\n"
                                          f"VmRSS:\t{rss_kib} kB\n")
    (proc / "self" / "cgroup").write_text(membership)
    (proc / "meminfo").write_text("MemAvailable:\t67108864 kB\n")
    return proc


def test_the_budget_defaults_to_the_cgroup_or_address_space_limit(tmp_path, monkeypatch):
    """Issue 38 item 3: a run under a cgroup memory limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) or ``RLIMIT_AS`` plans within it: the budget is what the
    process holds (VmRSS) plus the headroom the tightest limit leaves; with no limit (only
    free memory) there is no budget. A failure here points to ``limit_budget``."""
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    cgroups = tmp_path / "cgroup"
    proc = _proc(tmp_path, "0::/job\n")
    assert limit_budget(cgroup_root=cgroups, proc=proc) is None      # no limit file
    (cgroups / "job").mkdir(parents=True)
    (cgroups / "job" / "memory.max").write_text(f"{2 * GIB}\n")
    (cgroups / "job" / "memory.current").write_text(f"{GIB}\n")
    (cgroups / "job" / "memory.stat").write_text(f"inactive_file {256 * MIB}\n")
    found, what = limit_budget(cgroup_root=cgroups, proc=proc)
    assert found == 50 * MIB + (2 * GIB - (GIB - 256 * MIB))
    assert what == f"the cgroup memory limit ({cgroups / 'job' / 'memory.max'})"

    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    (v1 / "memory" / "job" / "memory.usage_in_bytes").write_text(f"{512 * MIB}\n")
    found, what = limit_budget(cgroup_root=v1, proc=_proc(tmp_path / "b", "4:memory:/job\n"))
    assert (found, what) == (50 * MIB + 512 * MIB,
                             f"the cgroup memory limit ({v1 / 'memory/job/memory.limit_in_bytes'})")

    limits = {resource.RLIMIT_AS: (3 * GIB, 3 * GIB)}
    monkeypatch.setattr(resource, "getrlimit",
                        lambda which: limits.get(which, (resource.RLIM_INFINITY,) * 2))
    found, what = limit_budget(cgroup_root=tmp_path / "none", proc=proc)
    assert found == 50 * MIB + int(budget.ADDRESS_SPACE_RESIDENT * (3 * GIB - GIB))
    # VmRSS + (limit - VmSize) at the resident share of mapped memory
    assert what == f"the address-space limit (RLIMIT_AS {3 * GIB})"


# -- the choices -----------------------------------------------------------------------------
def _plan(budget_gib: float, train_points: int = 400_000, eval_points: int = 400_000):
    return MemoryPlan(int(budget_gib * GIB), "--memory-budget",
                      DataExtent(train_points, eval_points, in_dim=3, out_dim=37), HELD)


def _model(config: RunConfig) -> torch.nn.Module:
    return build_model(in_dim=3, out_dim=37, **config.model_kwargs())


def test_a_budget_chooses_points_per_step_chunk_and_workers(held):
    """Issue 38 item 3: within a stated budget the run chooses an unset ``points_per_step``
    (the largest power of two whose step fits; whole samples when they fit; the stored
    value on --resume; never over the user's), ``eval_chunk_size`` (each mesh whole when it
    fits, else the largest power of two that fits; a given one kept) and the automatic
    loader workers. The figures follow the documented estimate of flarepp.train.budget."""
    config = get_preset("store-tiny")
    plan = _plan(2)
    planned = plan.plan_training(config)
    points = planned.dataset_options["points_per_step"]
    assert points & (points - 1) == 0 and points < 400_000
    assert HELD + plan.step_bytes(config, points) <= 2 * GIB < HELD + plan.step_bytes(config,
                                                                                      2 * points)
    assert _plan(64).plan_training(config).dataset_options.get("points_per_step") is None
    stored = get_preset("store-tiny", ["dataset_options.points_per_step=1024"])
    assert _plan(2).plan_training(config, stored).dataset_options["points_per_step"] == 1024
    given = get_preset("store-tiny", ["dataset_options.points_per_step=4096"])
    assert _plan(2).plan_training(given).dataset_options["points_per_step"] == 4096
    assert "dataset_options.points_per_step" not in _plan(2).chosen

    evaluated = plan.plan_evaluation(planned, _model(config), 4, torch.device("cuda"))
    # unset, a 400K-point mesh streams in STREAM_CHUNK (the engine's default), which fits
    assert evaluated.eval_chunk_size is None and "eval_chunk_size" not in plan.chosen
    room = plan.budget - plan.held
    streamed = plan.evaluation_bytes(evaluated, 4, None)
    assert streamed == plan.evaluation_bytes(evaluated, 4, STREAM_CHUNK) <= room
    assert plan.evaluation_bytes(evaluated, 4, None, streams=False) > 2 * streamed
    assert evaluated.loader_workers in (0, 1, 2)   # of CUDA's default 2, those that fit
    # where the default chunk does not fit, the largest power of two that does is chosen
    small = get_preset("store-tiny", ["dataset_options.points_per_step=1024"])
    model = _model(config)
    held_after = HELD + (PARAMETER_COPIES - 1) * sum(p.numel() * p.element_size()
                                                      for p in model.parameters())
    between = (plan.evaluation_bytes(small, 4, 4096) + plan.evaluation_bytes(small, 4, 8192)) // 2
    tight = MemoryPlan(held_after + between, "--memory-budget",
                       DataExtent(400_000, 400_000, in_dim=3, out_dim=37), HELD)
    assert tight.plan_evaluation(small, model, 4, torch.device("cpu")).eval_chunk_size == 4096
    assert tight.chosen["eval_chunk_size"] == 4096
    assert plan.peak() <= plan.budget
    whole = _plan(64, eval_points=1000).plan_evaluation(config, _model(config), 4,
                                                         torch.device("cpu"))
    assert whole.eval_chunk_size is None and whole.loader_workers == 0
    kept = get_preset("store-tiny", ["eval_chunk_size=8192",
                                     f"dataset_options.points_per_step={points}"])
    assert _plan(2).plan_evaluation(kept, _model(config), 4,
                                    torch.device("cpu")).eval_chunk_size == 8192


def test_a_budget_too_small_for_one_step_is_a_sentence():
    """Issue 38 item 3: a budget below what the process holds plus one training step at
    the smallest subset is refused before training, in one sentence naming the budget, the
    estimate and the options that change it."""
    config = get_preset("store-tiny", ["dataset_options.points_per_step=4096"])
    plan = _plan(0.1)
    with pytest.raises(MemoryBudgetTooSmall) as info:
        plan.plan_training(config)
    step = plan.step_bytes(config, 4096)
    assert str(info.value) == (
        f"the memory budget of 102 MiB (--memory-budget) is too small for one training step "
        f"(4 x 4,096 points: {step / MIB:.3g} MiB): the estimate is "
        f"{(HELD + step) / MIB:.3g} MiB with the 100 MiB the process holds; raise "
        "--memory-budget (memory_budget_gib) or lower batch_size or "
        "dataset_options.points_per_step")


def test_loader_workers_given_beyond_the_budget_are_named(held):
    """Issue 38 item 3: loader workers the user gave count against the budget (a forked
    worker's resident set counts the trainer's pages again): a step that fits alone but not
    beside them is refused naming them and ``loader_workers``."""
    config = get_preset("store-tiny", ["dataset_options.points_per_step=256",
                                       "loader_workers=2"])
    plan = _plan(0.25)
    plan.plan_training(config)               # fits without the workers
    with pytest.raises(MemoryBudgetTooSmall) as info:
        plan.plan_evaluation(config, _model(config), 4, torch.device("cpu"))
    text = str(info.value)
    assert text.startswith("the memory budget of 256 MiB (--memory-budget) is too small for "
                           "one training step (4 x 256 points: ")
    assert "of its 2 loader workers;" in text
    assert text.endswith("or lower batch_size or dataset_options.points_per_step or "
                         "loader_workers")


@pytest.mark.slow
def test_a_stated_budget_is_said_recorded_and_refused_by_the_cli(store, tmp_path, held,
                                                                    capsys):
    """Issue 38 item 3: ``--memory-budget`` reaches the run: its choices are one console
    line and ``memory_plan`` in metrics.json and provenance.json, the chosen
    ``points_per_step`` is in the stored config (so --resume trains the same steps); a
    budget too small for one step exits 2 with the sentence, before any training."""
    out = tmp_path / "run"
    sets = [a for item in SMALL + ["epochs=1"] for a in ("--set", item)]
    # by the estimate a step takes 6960 bytes a point (2 samples): 4.2 MB for whole samples,
    # 1.8 MB for 256 points, the largest power of two within 2 MiB of room
    gib = (HELD + 2 * MIB) / GIB
    assert cli(["train", "store-tiny", "--data", str(store), "--out", str(out),
                "--memory-budget", f"{gib:.9f}", *sets]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("memory budget")]
    assert len(lines) == 1, lines
    assert ("(--memory-budget): estimated peak" in lines[0]
            and "dataset_options.points_per_step=256 (chosen)" in lines[0]
            and "eval_chunk_size=unset: a mesh whole up to 65,536 points, streamed in "
                "16,384 above (default)" in lines[0]
            and "loader_workers=0 (chosen)" in lines[0]), lines[0]
    metrics = json.loads((out / "metrics.json").read_text())
    plan = metrics["memory_plan"]
    assert plan["source"] == "--memory-budget" and plan["budget_bytes"] == int(gib * GIB)
    assert plan["chosen"]["dataset_options.points_per_step"] == 256
    assert plan["estimated_peak_bytes"] <= plan["budget_bytes"]
    session = json.loads((out / "provenance.json").read_text())["sessions"][-1]
    assert session["memory_plan"]["chosen"] == plan["chosen"]
    stored = RunConfig.from_stored(json.loads((out / "config.json").read_text()))
    assert stored.dataset_options["points_per_step"] == 256
    assert stored.memory_budget_gib == pytest.approx(gib)

    assert cli(["train", "store-tiny", "--data", str(store), "--out", str(tmp_path / "no"),
                "--memory-budget", "0.01", *sets]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flarepp train: error: the memory budget of 10.2 MiB "
                          "(--memory-budget) is too small for one training step"), err
    assert err.count("\n") == 1 and not (tmp_path / "no" / "checkpoints").exists()


# -- an evaluation that runs out of memory ----------------------------------------------------
class _Arm(TrainerCallback):
    """Arms the failure right before the stage under test: the validation after epoch 1,
    or the end-of-run evaluation (after the last epoch's end)."""

    def __init__(self, stage: str, armed: list) -> None:
        self.stage, self.armed = stage, armed

    def on_epoch_trained(self, epoch, record):
        if self.stage == "validation" and epoch == 1:
            self.armed.append(True)

    def on_epoch_end(self, epoch, record):
        if self.stage == "end-of-run evaluation" and epoch == 2:
            self.armed.append(True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["validation", "end-of-run evaluation"])
def test_an_evaluation_killed_by_a_failed_allocation_resumes_to_the_end(store, tmp_path,
                                                                        monkeypatch, stage):
    """Issue 38 item 2: torch's host allocator failing in the evaluation of a store run (the
    validation after an epoch, or the end-of-run evaluation) lost the epoch and printed a
    traceback. Now the epoch's checkpoint is on disk, the error is one sentence naming the
    stage, the bytes asked for and the options that bound it, and ``--resume`` finishes the
    run with its metrics.json. A failure points to the order of ``Trainer._end_epoch`` or to
    ``flarepp.train.stages``."""
    config = get_preset("store-tiny", SMALL + ["epochs=2", "checkpoint_every=1",
                                               "dataset_options.points_per_step=128"])
    armed: list = []
    real = FieldTask.eval_records

    def failing(self, pred, batch):
        if armed:
            armed.clear()
            raise RuntimeError(TORCH_ALLOCATOR)
        return real(self, pred, batch)
    monkeypatch.setattr(FieldTask, "eval_records", failing)
    out = tmp_path / "run"
    with pytest.raises(OutOfMemory) as info:
        Trainer(config, out, data_root=store, progress=False,
                callbacks=[_Arm(stage, armed)]).fit()
    epoch = 1 if stage == "validation" else 2
    checkpoint = out / "checkpoints" / f"epoch_{epoch:04d}.pt"
    assert torch.load(checkpoint, weights_only=True)["epoch"] == epoch
    what = "the validation after epoch 1" if stage == "validation" else \
        "the end-of-run evaluation"
    assert str(info.value) == (
        f"out of memory in {what} (an allocation of 468 MiB failed): bound it with "
        "eval_chunk_size (now unset: a mesh whole up to 65536 points, streamed above) or "
        "batch_size (now 2); the run "
        f"continues from {str(checkpoint)!r} with the same command and --resume")
    assert not (out / "metrics.json").exists()

    metrics = Trainer(config, out, data_root=store, resume=True, progress=False).fit()
    assert metrics["epochs"] == 2
    stored = json.loads((out / "metrics.json").read_text())
    assert stored["test_rel_l2"] == metrics["test_rel_l2"]
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2] and all("test_rel_l2" in r for r in log)
