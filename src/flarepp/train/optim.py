"""The optimiser and learning-rate schedule of a run (paper Table 7; the FLARE study).

AdamW with ``(beta1, beta2) = config.betas``, ``eps`` and ``weight_decay``; a one-cycle
schedule stepped once per optimiser step (cosine annealing, ``pct_start``, ``div_factor``,
``final_div_factor``).

Where the paper is silent the FLARE study's code decides (github.com/vpuri3/FLARE.py):

* **Weight decay groups** (``config.weight_decay_groups``, :data:`WEIGHT_DECAY_GROUPS`).
  The study's ``split_params_adamw`` (``pdebench/utils.py``) puts biases, the parameters of
  norm and embedding layers, and parameters whose names mention a norm or an embedding in a
  group without decay. It also meant to spare free latent parameters (``nn.Parameter``
  tensors named ``*latent*``), but its test looks for them among ``model.modules()``, where
  a parameter never is, so FLARE's latent queries are in fact decayed there. ``reference``
  reproduces that split as it acts; ``weights`` (the preset default) keeps the intent:
  decay only on the weight matrices of linear maps, none on biases, norm scales,
  embeddings and free parameters -- FLARE's latent queries, FLARE++'s fixed queries,
  synthesis seeds and gate logits (decay would pull a gate logit to 0, i.e. the gate to
  0.5, which regularises nothing); ``all`` decays every parameter (flarepp's original).
* **Momentum cycling** (``config.momentum_cycle``): the study's one-cycle schedule cycles
  AdamW's beta1 against the learning rate, from 0.95 down to 0.85 at the peak and back to
  0.95 (``torch.optim.lr_scheduler.OneCycleLR``'s ``cycle_momentum``, which the study's
  ``mlutils/trainer.py`` leaves on); ``None`` keeps Table 7's fixed beta1.

The parameter groups of a run are written to ``param_groups.json`` in its directory
(:func:`write_param_groups`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from flarepp.registry import Registry
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import RunDir

DecayRule = Callable[[str, nn.Parameter, nn.Module], bool]
"""``rule(name, parameter, owner) -> decayed?``; ``owner`` the module holding it directly."""

WEIGHT_DECAY_GROUPS: Registry = Registry("weight_decay_groups rule")

LINEAR_MAPS = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)
STUDY_NO_DECAY_MODULES = (nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm,
                          nn.modules.batchnorm._BatchNorm,
                          nn.modules.instancenorm._InstanceNorm)


@WEIGHT_DECAY_GROUPS.register("weights", doc="decay the weight matrices of linear maps only")
def decay_linear_weights(name: str, param: nn.Parameter, owner: nn.Module) -> bool:
    return isinstance(owner, LINEAR_MAPS) and name.rsplit(".", 1)[-1] == "weight"


@WEIGHT_DECAY_GROUPS.register("reference", doc="the FLARE study's split_params_adamw as it acts")
def decay_as_the_study(name: str, param: nn.Parameter, owner: nn.Module) -> bool:
    lowered = name.lower()
    return not (isinstance(owner, STUDY_NO_DECAY_MODULES) or name.endswith("bias")
                or "layernorm" in lowered or "rmsnorm" in lowered or "embed" in lowered
                or "cls_token" in name)


@WEIGHT_DECAY_GROUPS.register("all", doc="decay every parameter")
def decay_everything(name: str, param: nn.Parameter, owner: nn.Module) -> bool:
    return True


def split_decay(model: nn.Module, rule: str) -> tuple[list[str], list[str]]:
    """``(decayed, not decayed)`` trainable parameter names of ``model`` under ``rule``."""
    decide: DecayRule = WEIGHT_DECAY_GROUPS.get(rule)
    owners = {}
    for module_name, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), module)
    decayed, spared = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decayed if decide(name, param, owners[id(param)]) else spared).append(name)
    return decayed, spared


def parameter_groups(model: nn.Module, config: RunConfig) -> list[dict]:
    """AdamW parameter groups: with decay ``config.weight_decay``, then without.

    Rule ``all`` gives one group of ``model.parameters()`` (the layout of runs stored before
    the groups existed, so they resume); the others the two groups, empty ones left out.
    """
    if config.weight_decay_groups == "all":
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    params = dict(model.named_parameters())
    decayed, spared = split_decay(model, config.weight_decay_groups)
    groups = [{"params": [params[n] for n in decayed], "weight_decay": config.weight_decay},
              {"params": [params[n] for n in spared], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameter_groups(model, config), lr=config.lr,
                             betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, config: RunConfig, total_steps: int
                    ) -> torch.optim.lr_scheduler.LRScheduler:
    if config.pct_start * total_steps == 1.0:  # torch divides by the warm-up length - 1
        raise ValueError(f"the one-cycle warm-up is pct_start x steps = {config.pct_start} x "
                         f"{total_steps} = 1 step, which OneCycleLR cannot schedule; change "
                         "epochs, batch_size or pct_start")
    cycle = config.momentum_cycle
    base, top = cycle if cycle is not None else (0.85, 0.95)  # unused without cycling
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config.lr, total_steps=total_steps, pct_start=config.pct_start,
        anneal_strategy="cos", div_factor=config.div_factor,
        final_div_factor=config.final_div_factor, cycle_momentum=cycle is not None,
        base_momentum=base, max_momentum=top)


def describe_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer
                          ) -> list[dict]:
    """Per optimiser group: its weight decay, tensor and scalar counts, parameter names."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [{"weight_decay": group["weight_decay"], "tensors": len(group["params"]),
             "parameters": sum(p.numel() for p in group["params"]),
             "names": [names.get(id(p), "?") for p in group["params"]]}
            for group in optimizer.param_groups]


def write_param_groups(out_dir: str | Path, model: nn.Module,
                       optimizer: torch.optim.Optimizer) -> Path:
    """The run's ``param_groups.json``: :func:`describe_param_groups` of the run."""
    return RunDir(out_dir).write_param_groups(describe_param_groups(model, optimizer))


__all__ = ["WEIGHT_DECAY_GROUPS", "build_optimizer", "build_scheduler",
           "describe_param_groups", "parameter_groups", "split_decay", "write_param_groups"]
