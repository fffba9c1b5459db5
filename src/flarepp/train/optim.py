"""The optimiser and learning-rate schedule of a run (paper Table 7; the FLARE study).

AdamW with ``(beta1, beta2) = config.betas``, ``eps`` and ``weight_decay``; a one-cycle
schedule stepped once per optimiser step (cosine annealing, ``pct_start``, ``div_factor``,
``final_div_factor``).
"""

from __future__ import annotations

import torch
from torch import nn

from flarepp.train.config import RunConfig


def build_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                             eps=config.eps, weight_decay=config.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, config: RunConfig, total_steps: int
                    ) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config.lr, total_steps=total_steps, pct_start=config.pct_start,
        anneal_strategy="cos", div_factor=config.div_factor,
        final_div_factor=config.final_div_factor, cycle_momentum=False)
