"""Growing the number of latents M during training without changing the model's function.

Shape letters: H heads, M latents (M' after growth), D head width.

The talk ("FLARE + high order attention ideas", Aim 1(a)): FLARE's cost is ``O(2 M N)``
and its accuracy grows with M, so train with few latents first and add more on a schedule
(e.g. 16 -> 32 -> 64), without loss spikes. Here:

* :func:`grow_latents` splits latents: new latent ``j >= M`` copies latent ``j mod M``
  (16 -> 32 splits every latent in two). The copies share their query parameters
  (``Q_f`` and, for FLARE++, the seed ``Q~``) and each gets the decode-logit offset
  ``o_m - log c_m`` (``c_m`` copies of latent m), which keeps the output the same function
  to rounding (:mod:`flarepp.mixers.rank_adaptive` proves why; the tests check 1e-12 in
  float64). Plain ``flare`` / ``flarepp`` mixers are converted to their rank-adaptive
  forms (offsets 0: the same function) and the model config is updated -- mixer name and
  ``latents`` -- so a checkpoint rebuilds the grown model.
* **Gradients at the split.** Each copy of latent m receives exactly ``1/c_m`` of the
  gradient the latent had before (its decode weight and its share of the output are
  ``1/c_m``); every other parameter's gradient is unchanged.
* **Optimizer state** (:func:`extend_optimizer_state`) follows: second moments
  (``exp_avg_sq``, ``max_exp_avg_sq``) become ``v_m / c_m^2`` for every copy, first moments
  (``exp_avg``, SGD's ``momentum_buffer``) ``m_m / c_m`` for the original row; ``step`` is
  kept. Adam's update ``m / sqrt(v)`` is scale-free, so the original row continues the
  step it would have taken.
* **Symmetry.** Identical copies receive identical gradients; with identical optimizer
  state they would stay identical forever and the growth would add nothing. The split is
  made asymmetric without touching the function: the *new* copies start with a zero
  first moment (a fresh momentum, second moment as above), so the very next optimizer
  step moves them differently from the original and their gradients separate from then
  on. With no optimizer state to differ in (``optimizer=None``, or plain SGD without
  momentum) the copies only separate if ``perturbation > 0``: each copy's fixed query
  ``Q_f`` gets ``delta * rms(Q_f,m) * (u_j - mean_j u)``, ``u ~ N(0, I)`` per copy: a
  relative size ``delta``, perturbations that sum to zero over the copies of a latent. The first-order change of the output then
  cancels (the function is symmetric in the copies, so all copies have the same gradient),
  leaving an ``O(delta^2)`` change, which the tests measure. The default is 0: exact.
* Train and EMA copies of a model must grow alike: same ``new_m`` and, when perturbing,
  CPU generators in the same state (the noise is drawn on the CPU, then moved).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flarepp.mixers.flare import FLARE, FLAREPP
from flarepp.mixers.rank_adaptive import RankAdaptiveFLARE, RankAdaptiveFLAREPP

#: mixer class -> its rank-adaptive form and that form's registered name
GROWABLE: dict[type, tuple[type, str]] = {
    FLARE: (RankAdaptiveFLARE, "flare-rank-adaptive"),
    RankAdaptiveFLARE: (RankAdaptiveFLARE, "flare-rank-adaptive"),
    FLAREPP: (RankAdaptiveFLAREPP, "flarepp-rank-adaptive"),
    RankAdaptiveFLAREPP: (RankAdaptiveFLAREPP, "flarepp-rank-adaptive"),
}

FIRST_MOMENTS = ("exp_avg", "momentum_buffer")
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
LATENT_DIM = 1  # latent parameters are [H, M, D], offsets [H, M]


@dataclass(frozen=True)
class LatentSplit:
    """Which old latent every new latent copies: ``sources [M']`` (``sources[j] = j`` for
    ``j < M``) and ``copies [M]``, how many latents each old one became."""

    sources: torch.Tensor
    copies: torch.Tensor

    @classmethod
    def round_robin(cls, old_m: int, new_m: int) -> "LatentSplit":
        if new_m < old_m:
            raise ValueError(f"latents can only grow: M = {old_m} -> {new_m} was asked for")
        sources = torch.arange(new_m) % old_m
        return cls(sources, torch.bincount(sources, minlength=old_m))

    @property
    def old_m(self) -> int:
        return self.copies.numel()

    def copies_per_new(self) -> torch.Tensor:
        """``c_{source(j)}`` for every new latent j, ``[M']``."""
        return self.copies[self.sources]


@dataclass
class ParameterGrowth:
    """A latent parameter replaced by its grown version (for the optimizer)."""

    old: nn.Parameter
    new: nn.Parameter
    split: LatentSplit


def _index(t: torch.Tensor, split: LatentSplit) -> torch.Tensor:
    return t.index_select(LATENT_DIM, split.sources.to(t.device))


def _per_new(split: LatentSplit, like: torch.Tensor) -> torch.Tensor:
    """``c_{source(j)}`` shaped to broadcast along the latent dim of ``like``."""
    shape = [1] * like.dim()
    shape[LATENT_DIM] = -1
    return split.copies_per_new().to(device=like.device, dtype=like.dtype).view(shape)


def grow_mixer(mixer: nn.Module, new_m: int, *, perturbation: float = 0.0,
               generator: torch.Generator | None = None
               ) -> tuple[nn.Module, list[ParameterGrowth], str]:
    """The rank-adaptive form of ``mixer`` with ``new_m`` latents, the same function.

    Every non-latent parameter and submodule is the *same object* as in ``mixer`` (their
    optimizer state stays valid); latent parameters are new tensors. Returns the mixer,
    the replaced parameters and the mixer's registered name.
    """
    try:
        cls, name = GROWABLE[type(mixer)]
    except KeyError:
        known = ", ".join(sorted({n for _, n in GROWABLE.values()} | {"flare", "flarepp"}))
        raise ValueError(f"cannot grow the latents of a {type(mixer).__name__}; growable "
                         f"mixers: {known}") from None
    old_m = mixer.config.latents
    split = LatentSplit.round_robin(old_m, new_m)
    with torch.device("meta"):  # the structure only; every tensor is replaced below
        grown = cls(dataclasses.replace(mixer.config, latents=new_m))
    for child_name, child in mixer.named_children():
        setattr(grown, child_name, child)
    growth = []
    for param_name, param in mixer.named_parameters(recurse=False):
        if param_name not in cls.latent_parameters:
            setattr(grown, param_name, param)
            continue
        new = nn.Parameter(_index(param.detach(), split).clone(),
                           requires_grad=param.requires_grad)
        setattr(grown, param_name, new)
        growth.append(ParameterGrowth(param, new, split))
    reference = getattr(mixer, cls.latent_parameters[0])
    offset = getattr(mixer, "decode_logit_offset", None)
    if offset is None:
        offset = torch.zeros(mixer.config.heads, old_m, device=reference.device,
                             dtype=reference.dtype)
    grown.decode_logit_offset = _index(offset, split) - torch.log(_per_new(split, offset))
    grown.backend = mixer.backend
    grown.train(mixer.training)
    if perturbation:
        _perturb_copies(grown, split, perturbation, generator)
    left = [n for n, t in list(grown.named_parameters()) + list(grown.named_buffers())
            if t.is_meta]
    if left:
        raise RuntimeError(f"grow_mixer left {left} of {cls.__name__} unset; the list of "
                           f"latent parameters or submodules is out of date")
    return grown, growth, name


def _perturb_copies(mixer: nn.Module, split: LatentSplit, delta: float,
                    generator: torch.Generator | None) -> None:
    """``Q_f`` of the copies of latent m += ``delta rms(Q_f,m) (u_j - mean u)``: relative to
    the row's size, zero sum over the copies of a latent."""
    queries = mixer.fixed_queries
    noise = torch.randn(queries.shape, generator=generator, dtype=torch.float64)
    sources = split.sources
    mean = torch.zeros(queries.shape[0], split.old_m, queries.shape[2], dtype=torch.float64)
    mean.index_add_(LATENT_DIM, sources, noise)
    mean = mean / split.copies.view(1, -1, 1).to(torch.float64)
    noise = noise - mean.index_select(LATENT_DIM, sources)
    noise[:, (split.copies[sources] == 1)] = 0.0         # latents that were not split
    with torch.no_grad():
        rms = queries.detach().pow(2).mean(dim=-1, keepdim=True).sqrt()      # per row
        queries.add_(delta * rms * noise.to(device=queries.device, dtype=queries.dtype))


def extend_optimizer_state(optimizer: torch.optim.Optimizer,
                           growth: list[ParameterGrowth]) -> None:
    """Swap the grown parameters into ``optimizer`` and extend their state (module doc).

    A state tensor shaped like the old parameter must be a known first or second moment;
    any other raises (it would otherwise be silently wrong). Scalars (``step``) are kept.
    """
    for g in growth:
        found = False
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if p is g.old:
                    group["params"][i] = g.new
                    found = True
        if not found:
            raise ValueError(f"a grown latent parameter of shape {list(g.old.shape)} is not "
                             f"in the optimizer; build the optimizer on this model")
        state = optimizer.state.pop(g.old, None)
        if state:
            optimizer.state[g.new] = {key: _grow_state(key, value, g)
                                      for key, value in state.items()}


def _grow_state(key: str, value: Any, g: ParameterGrowth) -> Any:
    if not torch.is_tensor(value) or value.shape != g.old.shape:
        return value
    split = g.split
    grown = _index(value, split)
    copies = _per_new(split, value)
    if key in SECOND_MOMENTS:
        return grown / copies ** 2
    if key in FIRST_MOMENTS:
        grown = grown / copies
        # new copies (j >= M) start without momentum: the asymmetry between copies
        new_rows = torch.arange(grown.shape[LATENT_DIM], device=grown.device) >= split.old_m
        shape = [1] * grown.dim()
        shape[LATENT_DIM] = -1
        return grown.masked_fill(new_rows.view(shape), 0.0)
    raise ValueError(f"optimizer state {key!r} has the parameter's shape {list(value.shape)} "
                     f"but is neither a first moment {FIRST_MOMENTS} nor a second moment "
                     f"{SECOND_MOMENTS}; its growth rule is unknown")


def growable_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, mixer)`` of every FLARE / FLARE++ mixer in ``model``."""
    return [(n, m) for n, m in model.named_modules() if type(m) in GROWABLE]


def grow_latents(model: nn.Module, new_m: int, optimizer: torch.optim.Optimizer | None = None,
                 *, perturbation: float = 0.0, generator: torch.Generator | None = None
                 ) -> nn.Module:
    """Grow every FLARE / FLARE++ mixer of ``model`` to ``new_m`` latents, in place.

    The function is unchanged (``perturbation = 0``); ``model.config`` gets ``latents =
    new_m`` and the rank-adaptive mixer name; ``optimizer``'s parameters and state follow
    (:func:`extend_optimizer_state`). Returns ``model``.
    """
    mixers = growable_mixers(model)
    if not mixers:
        raise ValueError(f"{type(model).__name__} has no flare / flarepp mixer to grow")
    config = getattr(model, "config", None)
    if config is None or not {"latents", "mixer"} <= {f.name for f in dataclasses.fields(config)}:
        raise ValueError(f"{type(model).__name__}.config must have 'latents' and 'mixer' "
                         f"fields so that a checkpoint rebuilds the grown model")
    growth, names = [], set()
    for qualified, mixer in mixers:
        grown, replaced, name = grow_mixer(mixer, new_m, perturbation=perturbation,
                                           generator=generator)
        parent_name, _, child_name = qualified.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, grown)
        growth += replaced
        names.add(name)
    if len(names) != 1:
        raise ValueError(f"the model mixes growable mixer types {sorted(names)}; its config "
                         f"names one mixer")
    model.config = dataclasses.replace(config, latents=new_m, mixer=names.pop())
    if optimizer is not None:
        extend_optimizer_state(optimizer, growth)
    return model


@dataclass(frozen=True)
class LatentSchedule:
    """M as a function of the epoch: ``milestones = ((0, 16), (10, 32), (20, 64))`` means
    16 latents from epoch 0, 32 from epoch 10, 64 from epoch 20.

    Stateless, so a run resumed from a checkpoint (which rebuilds at the grown M) asks it
    again and grows only when the model is behind: :meth:`grow_if_due`.
    """

    milestones: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        ms = tuple((int(e), int(m)) for e, m in self.milestones)
        object.__setattr__(self, "milestones", ms)
        if not ms or ms[0][0] != 0:
            raise ValueError(f"a latent schedule starts at epoch 0, got {ms}")
        for (e0, m0), (e1, m1) in zip(ms, ms[1:]):
            if e1 <= e0 or m1 <= m0:
                raise ValueError(f"epochs and latents must both increase, got {ms}")
        if ms[0][1] <= 0:
            raise ValueError(f"latents must be positive, got {ms}")

    @classmethod
    def parse(cls, text: str) -> "LatentSchedule":
        """``"16,32@10,64@20"``: M, then ``M@epoch`` for every growth."""
        milestones = []
        for i, item in enumerate(text.split(",")):
            latents, _, epoch = item.strip().partition("@")
            if not latents.isdigit() or (epoch and not epoch.isdigit()) or (i and not epoch):
                raise ValueError(f"latent schedule {text!r}: expected 'M0,M1@E1,M2@E2,...' "
                                 f"with integers, got item {item!r}")
            milestones.append((int(epoch or 0), int(latents)))
        return cls(tuple(milestones))

    def latents_at(self, epoch: int) -> int:
        return [m for e, m in self.milestones if e <= epoch][-1]

    def grow_if_due(self, model: nn.Module, epoch: int,
                    optimizer: torch.optim.Optimizer | None = None, **options: Any) -> bool:
        """Grow ``model`` (and ``optimizer``) to :meth:`latents_at` ``(epoch)`` if it has
        fewer latents; ``options`` go to :func:`grow_latents`. True if it grew."""
        target, current = self.latents_at(epoch), model.config.latents
        if target < current:
            raise ValueError(f"the model has {current} latents, more than the schedule's "
                             f"{target} at epoch {epoch}; latents never shrink")
        if target == current:
            return False
        grow_latents(model, target, optimizer, **options)
        return True

    def to_dict(self) -> dict[str, Any]:
        return {"milestones": [list(m) for m in self.milestones]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LatentSchedule":
        return cls(tuple(tuple(m) for m in data["milestones"]))

