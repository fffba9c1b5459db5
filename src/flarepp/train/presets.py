"""Named runs: the paper's (Tables 7-8, 500 epochs) and CPU-sized ``-tiny`` ones.

Paper settings: C=128, H=8, FFN ratio 2, peak LR 1e-3, one-cycle, EMA, FP32 (Table 7,
``flarepp.paper.TABLE7``); per dataset blocks B, latents M, batch size, weight decay and
epochs (Table 8, ``flarepp.paper.TABLE8``).

Training protocol where the paper is silent: the FLARE study's (github.com/vpuri3/FLARE.py),
written out per dataset in every preset so that a run's ``config.json`` states it:
``loss`` (relative L2 of the de-normalised outputs; on Darcy plus 0.1 x that of the grid
gradients), ``input_norm`` (the study's per-dataset rule), weight decay on the weight
matrices only, beta1 cycled 0.95 -> 0.85 -> 0.95, ``attn_scale="reference"`` (SDPA
scale 1.0 for FLARE as in the study's runs, the paper's 1/sqrt(D) for the others; see
:class:`flarepp.storage.config.RunConfig`), and the headline errors from the raw weights
(``eval_weights`` ``raw``; the EMA weights' are reported beside them). ``--set loss=mse
--set input_norm=standard --set weight_decay_groups=all --set momentum_cycle=None --set
attn_scale=sqrt --set eval_weights=ema`` gives flarepp's earlier protocol.

``npz`` is the run for a user's own data (``flarepp train --data my.npz``): a small model,
standardised inputs, relative L2 loss.
"""

from __future__ import annotations

from typing import Any

from flarepp.data.lra import LRA_DATASETS
from flarepp.paper import DRIVAERML_FULL, TABLE7, TABLE8
from flarepp.registry import Registry
from flarepp.storage.config import RunConfig
from flarepp.tasks.fields import REFERENCE_INPUT_NORM, REFERENCE_LOSS
from flarepp.tasks.language import default_text_root
from flarepp.train.checks import apply_overrides
from flarepp.train.lra_benchmarks import LRA_BENCHMARKS

PRESETS: Registry = Registry("preset")


def reference_protocol(dataset: str) -> dict[str, Any]:
    """The FLARE study's loss and input normalisation on ``dataset``, spelled out."""
    norm = REFERENCE_INPUT_NORM.get(dataset, "standard")
    return {"loss": REFERENCE_LOSS.get(dataset, "rel_l2"),
            "input_norm": norm if isinstance(norm, str) else list(norm)}


for _name, _row in TABLE8.items():
    PRESETS.add(_name, RunConfig(
        name=_name, dataset=_name, data_root=f"data/{_name}",
        model=dict(mixer="flarepp", dim=TABLE7["dim"], heads=TABLE7["heads"],
                   blocks=_row.blocks, latents=_row.latents),
        epochs=_row.epochs, batch_size=_row.batch_size, weight_decay=_row.weight_decay,
        checkpoint_every=10, **reference_protocol(_name)),
        doc=f"paper run on {_name} (Tables 7-8)")

# CPU-sized runs: the same loss, optimiser and schedule shape, a small model, sub-sampled
# meshes, few samples and epochs. With ~1000 optimizer steps in all, the EMA decay is 0.99
# (0.999 would still weigh the initial weights by ~0.4 at the end) and the peak learning
# rate 3e-3. darcy-tiny's settings were chosen by a study on a validation split (docs/
# results.md, `presets-darcy`: peak lr 1e-3 / 3e-3 x warm-up 10% / 30% x input
# normalisation reference / standard; FLARE, FLARE++ and simplified FLARE++, 3 seeds x 2
# data draws; the best mean over the mixers): lr 3e-3, warm-up 10%, every input channel
# standardised (mean validation error 7.6%, against 18.7% with the reference inputs at the
# same rate, where simplified FLARE++ did not fit in 5 of 6 runs). elasticity-tiny's by the
# same study on Elasticity (`presets-elasticity`): the same setting (mean validation error
# 18.6%; with the reference inputs at that rate FLARE did not fit in 5 of 6 runs and
# simplified FLARE++ in 6 of 6, mean 45.0%).
_TINY = {
    # Minutes on 2 CPU cores; its measured errors are in docs/results.md.
    "darcy-tiny": dict(dataset="darcy", dataset_options=dict(resolution=22, n_train=200,
                                                             n_test=100),
                       model=dict(dim=64, heads=4, blocks=3, latents=32), epochs=20,
                       batch_size=4, pct_start=0.1, input_norm="standard"),
    "elasticity-tiny": dict(dataset="elasticity", dataset_options=dict(n_train=200,
                                                                       n_test=50),
                            model=dict(dim=64, heads=4, blocks=3, latents=32), epochs=25,
                            batch_size=4, pct_start=0.1, input_norm="standard"),
    "airfoil-tiny": dict(dataset="airfoil", dataset_options=dict(n_train=100, n_test=20),
                         model=dict(dim=32, heads=4, blocks=2, latents=16), epochs=10,
                         batch_size=2),
    "pipe-tiny": dict(dataset="pipe", dataset_options=dict(n_train=100, n_test=20),
                      model=dict(dim=32, heads=4, blocks=2, latents=16), epochs=10,
                      batch_size=2),
    "drivaerml-40k-tiny": dict(dataset="drivaerml-40k", dataset_options=dict(),
                               model=dict(dim=32, heads=4, blocks=2, latents=16), epochs=5,
                               batch_size=1, weight_decay=1e-2),
}
for _name, _kw in _TINY.items():
    _kw["model"] = {"mixer": "flarepp", **_kw["model"]}
    _kw.setdefault("lr", 3e-3)
    _kw.setdefault("ema_decay", 0.99)
    PRESETS.add(_name, RunConfig(name=_name, data_root=f"data/{_kw['dataset']}",
                                 checkpoint_every=5,
                                 **{**reference_protocol(_kw["dataset"]), **_kw}),
                doc=f"CPU-sized run on {_kw['dataset']}")

PRESETS.add("npz", RunConfig(
    name="npz", dataset="npz", data_root="data/my.npz",
    model=dict(mixer="flarepp", dim=64, heads=4, blocks=4, latents=32), epochs=100,
    batch_size=4, lr=1e-3, ema_decay=0.99, checkpoint_every=10, **reference_protocol("npz")),
    doc="your own data (flarepp train --data my.npz): a small FLARE++, 100 epochs")


# A store (`flarepp data convert`, dataset ``store``, docs/data.md): elasticity-tiny's
# model and schedule. ``store-conditioned-tiny`` feeds the store's per-sample conditions to
# the same backbone through the ``conditioned`` architecture's ``concat`` scheme (each
# sample's K standardised conditions appended to every point's inputs): for a few global
# scalars it is the same model as ``store-tiny`` but for K input columns, so the two
# measure what the conditions add (docs/data.md).
_STORE_MODEL = dict(mixer="flarepp", dim=64, heads=4, blocks=3, latents=32)
for _name, _model, _doc in (
        ("store-tiny", _STORE_MODEL, "a store from `flarepp data convert` (CPU-sized)"),
        ("store-conditioned-tiny", dict(arch="conditioned", conditioning="concat",
                                        **_STORE_MODEL),
         "a store with per-sample conditions: concatenated to every point's inputs")):
    PRESETS.add(_name, RunConfig(
        name=_name, dataset="store", data_root="data/store", model=_model, epochs=25,
        batch_size=4, lr=3e-3, ema_decay=0.99, pct_start=0.1, input_norm="standard",
        loss="rel_l2", checkpoint_every=5), doc=_doc)


def get_preset(name: str, overrides: list[str] | None = None) -> RunConfig:
    return apply_overrides(PRESETS.get(name), list(overrides or []))


# Byte-level language model on the Python standard library's sources (task ``lm``,
# flarepp.tasks.language): a 2-block decoder of width 64, windows of 128 bytes, 8 epochs of
# 1024 windows (512 optimizer steps; minutes on a CPU core). One preset per causal mixer.
def _language_preset(name: str, mixer: str, doc: str) -> None:
    PRESETS.add(name, RunConfig(
        name=name, task="lm", dataset="text-files", data_root=default_text_root(),
        dataset_options=dict(context=128, n_train=1024, n_test=256),
        model=dict(arch="causal-lm", mixer=mixer, dim=64, heads=4, blocks=2, latents=32),
        epochs=8, batch_size=16, lr=3e-3, weight_decay=1e-2, ema_decay=0.99,
        checkpoint_every=4), doc=doc)


_language_preset("lm-tiny", "flare-causal",
                 "byte LM on the Python stdlib sources, causal FLARE (CPU minutes)")
_language_preset("lm-tiny-flarepp", "flarepp-causal",
                 "byte LM on the Python stdlib sources, causal FLARE++ (CPU minutes)")
_language_preset("lm-tiny-attention", "attention-causal",
                 "byte LM on the Python stdlib sources, causal attention (CPU minutes)")


# Long Range Arena (task ``sequence``, paper Sec. 4.3 and D.5): one preset per task and size,
# read from the task table flarepp.data.lra.LRA_BENCHMARKS (FLARE++ as the mixer; `flarepp lra
# train TASK --mixer NAME` builds the same config for any other mixer).
def lra_run_config(task: str, size: str = "tiny", mixer: str = "flarepp", *,
                   steps: int | None = None, split_limits: dict[str, int] | None = None,
                   train_samples: int | None = None, batch_size: int | None = None,
                   data_root: str | None = None) -> RunConfig:
    """The run config of LRA task ``task`` at ``size`` ("paper" or "tiny") with ``mixer``.

    Everything comes from the task's :class:`~flarepp.data.lra.LRARunSettings`: the model
    (``model_options(mixer)``: FLARE-family overrides for FLARE and FLARE++, LayerNorm as
    the reference), batch, learning rate, weight decay, betas, clipping, the one-cycle
    schedule, EMA off (``ema_decay`` 0: the averaged weights are the weights, so the raw and
    EMA errors are one evaluation and ``eval_weights`` keeps its ``raw``), mixed
    precision as bf16. A run bounded by steps trains ``ceil(steps / steps per epoch)``
    whole epochs of ``train_samples`` samples (:meth:`LRARunSettings.run_epochs`; default:
    the table's count, capped by a ``train`` split limit; ``flarepp lra train`` and ``lra
    compare`` pass the size of the data actually read). ``steps``, ``split_limits`` and
    ``batch_size`` shorten a run, cap splits or change the batch (the steps are counted in
    batches of that size); weight decay applies to the weight matrices of linear maps
    (``weight_decay_groups="weights"``, as the other presets).
    """
    spec = LRA_BENCHMARKS.get(task)
    s = spec.settings(size)
    tiny = size == "tiny" and spec.tiny_dataset is not None
    dataset = spec.tiny_dataset if tiny else spec.dataset
    limits = {**s.split_limits, **(split_limits or {})}
    options: dict[str, Any] = dict(spec.tiny_load) if tiny else {}
    if limits:
        options["split_limits"] = limits
    train = train_samples or s.train_samples
    if train_samples is None and train and "train" in limits:
        train = min(train, limits["train"])
    default_root = LRA_DATASETS.entry(dataset).defaults.get("root")
    root = data_root or (str(default_root) if default_root is not None
                         else f"data/lra/{task}" + ("-tiny" if size == "tiny" else ""))
    if s.schedule != "onecycle":
        raise ValueError(f"LRA task {task!r} ({size}): schedule {s.schedule!r} is not "
                         "available (the trainer's schedule is one-cycle)")
    name = f"lra-{task}" + ("-tiny" if size == "tiny" else "") + \
        ("" if mixer == "flarepp" else f"-{mixer}")
    return RunConfig(
        name=name, task="sequence", dataset=dataset, dataset_options=options,
        data_root=root,
        model={"arch": "sequence-classifier", "norm": "layernorm", **s.model_options(mixer)},
        epochs=s.run_epochs(train, steps, batch_size), batch_size=batch_size or s.batch_size,
        lr=s.lr,
        weight_decay=s.weight_decay, betas=s.betas, eps=s.eps, pct_start=s.pct_start,
        div_factor=s.div_factor, final_div_factor=s.final_div_factor,
        momentum_cycle=s.momentum_cycle, grad_clip=s.clip_grad_norm, ema_decay=s.ema_decay,
        precision="bf16" if s.mixed_precision else "fp32", weight_decay_groups="weights",
        checkpoint_every=1, eval_every=1)


def _lra_presets() -> None:
    for task in LRA_BENCHMARKS.names():
        for size, what in (("paper", "the FLARE study's LRA settings"),
                           ("tiny", "CPU-sized, offline data where there is some")):
            config = lra_run_config(task, size)
            PRESETS.add(config.name, config, doc=f"LRA {task}, FLARE++: {what}")


_lra_presets()


# Transient advection-diffusion rollouts (task ``rollout``, flarepp.tasks.rollout) on
# `flarepp data make advection-diffusion --resolution 16` data: the three conditioning
# schemes of flarepp.models.conditioned at about the same parameter count (cross 130.2K,
# concat 131.6K at C=64; AdaLN-Zero's per-block modulation is paid for with C=48: 127.4K).
# One-step training (unroll=1); the SDPA scale is 1/sqrt(D) for all three.
def _rollout_preset(name: str, conditioning: str, mixer: str, dim: int, doc: str) -> None:
    PRESETS.add(name, RunConfig(
        name=name, task="rollout", dataset="advection-diffusion",
        data_root="data/advection-diffusion",
        dataset_options=dict(n_train=64, n_test=32, history=2, patches=4, unroll=1),
        model=dict(arch="conditioned", conditioning=conditioning, mixer=mixer, dim=dim,
                   heads=4, blocks=3, latents=16),
        epochs=12, batch_size=16, lr=3e-3, weight_decay=1e-4, ema_decay=0.99,
        attn_scale="sqrt", eval_every=2, checkpoint_every=4), doc=doc)


_rollout_preset("rollout-tiny", "cross", "flare-cross", 64,
                "advection-diffusion rollout, Cross FLARE conditioning (CPU minutes)")
_rollout_preset("rollout-tiny-concat", "concat", "flare", 64,
                "advection-diffusion rollout, conditioning concatenated to every point's inputs")
_rollout_preset("rollout-tiny-adaln", "adaln", "flare", 48,
                "advection-diffusion rollout, AdaLN-Zero conditioning")


# Full-surface DrivAerML (task ``surface``, flarepp.tasks.surface; paper Sec. 4.2 and C.1):
# one FLARE++ preset per depth B and latent budget M of the paper's grid (Table 7's backbone,
# FP16 with RMSNorm, weight decay 1e-4, one geometry and 100K fresh cells per step, 500
# epochs; the test value on every cell of every test car, scored every 100 epochs and at the
# end). `--set model.mixer=flare` gives FLARE; `flarepp drivaerml pareto` trains the grid of
# both and AB-UPT with 512 anchors (Figure 5).
def _surface_presets() -> None:
    full = DRIVAERML_FULL
    for blocks in full.blocks:
        for latents in full.latents:
            name = f"drivaerml-b{blocks}-m{latents}"
            PRESETS.add(name, RunConfig(
                name=name, task="surface", dataset="drivaerml", data_root="data/drivaerml",
                dataset_options=dict(cells_per_step=full.cells_per_step),
                model=dict(mixer="flarepp", dim=TABLE7["dim"], heads=TABLE7["heads"],
                           blocks=blocks, latents=latents, norm=full.norm),
                epochs=full.epochs, batch_size=full.batch_size,
                weight_decay=full.weight_decay, precision=full.precision, eval_every=100,
                checkpoint_every=10),
                doc=f"full-surface DrivAerML, FLARE++ B={blocks} M={latents} (Sec. 4.2, C.1)")
    # CPU-sized: `flarepp data make surface-flow --out data/surface-flow --train 32 --test 8
    # --resolution 3000` surfaces, 1024 fresh cells per step, a 2-block C=64 FLARE++ in FP32
    # with RMSNorm (the paper's norm; 16-bit autocast is slow on CPUs); minutes on 2 cores.
    PRESETS.add("drivaerml-tiny", RunConfig(
        name="drivaerml-tiny", task="surface", dataset="drivaerml",
        data_root="data/surface-flow",
        dataset_options=dict(split_file="split.json", cells_per_step=1024),
        model=dict(mixer="flarepp", dim=64, heads=4, blocks=2, latents=16, norm="rmsnorm"),
        epochs=60, batch_size=1, lr=3e-3, weight_decay=full.weight_decay, ema_decay=0.99,
        eval_every=10, checkpoint_every=10),
        doc="full-surface task on generated surface-flow surfaces (CPU minutes)")


_surface_presets()
