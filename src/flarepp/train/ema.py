"""The exponential moving average of the weights (the FLARE study's EMA, decay 0.999).

:class:`WeightAverage` is ``torch.optim.swa_utils.AveragedModel`` (same state dict, same
arithmetic: ``get_ema_multi_avg_fn`` over parameters and buffers) with one difference:
torch's ``update_parameters`` compares its device counter ``n_averaged`` on the host twice
per call, which on a GPU makes the host wait for every queued kernel at every training step.
Here the count is mirrored on the host (0 at construction, read from the loaded state in
``load_state_dict``), and the device counter is only incremented.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class WeightAverage(AveragedModel):
    """EMA of ``model``'s parameters and buffers with decay ``decay``; no host sync per update."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self._host_count = 0

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._host_count = int(self.n_averaged.item())  # once per load, not per step
        return result

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        averaged = [p.detach() for p in itertools.chain(self.module.parameters(),
                                                        self.module.buffers())]
        current = [p.detach().to(a.device)
                   for a, p in zip(averaged, itertools.chain(model.parameters(),
                                                             model.buffers()))]
        if self._host_count == 0:
            torch._foreach_copy_(averaged, current)
        else:
            groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
            for a, p in zip(averaged, current):
                mine, theirs = groups.setdefault((a.device, a.dtype), ([], []))
                mine.append(a)
                theirs.append(p)
            for (device, _), (mine, theirs) in groups.items():
                self.multi_avg_fn(mine, theirs, self.n_averaged.to(device))
        self.n_averaged += 1
        self._host_count += 1
