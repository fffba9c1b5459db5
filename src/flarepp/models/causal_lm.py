"""A small decoder-only model around a causal mixer, and sampling from it.

Shape letters: B batch, N tokens, C width, V vocabulary (256: bytes).

::

    h_0 = Embed(ids)                         [B, N, C]   (or Linear(features) in feature mode)
    h_l = h + mixer(norm(h), mask); h + FFN(norm(h))      l = 1..L, a causal mixer
    logits = Head(norm(h_L))                 [B, N, V]   (or [B, N, out_dim])

* The mixer is any registered mixer that declares ``causal = True`` (``flare-causal``,
  ``flarepp-causal``, ``attention-causal``); blocks are the backbone's pre-norm residual
  blocks with a GELU FFN of width ``ffn_ratio * C``.
* No positional embedding: causal masking tells the model the order (Haviv et al., 2022,
  "Transformer Language Models without Positional Encodings Still Learn Positional
  Information"), and FLARE's decoding state then stays independent of the position.
* Two input kinds: token ids ``[B, N]`` (``vocab_size``, the language model) or, with
  ``in_dim`` / ``out_dim`` set, features ``[B, N, in_dim] -> [B, N, out_dim]`` (a causal
  sequence regressor, e.g. for time series; it is also how the registry's point-model
  contract tests exercise the architecture).
* Decoding: :meth:`CausalLM.prefill` runs the parallel form over a prompt and returns one
  state per block; :meth:`CausalLM.step` appends one token. With FLARE the state is
  ``O(H M D)`` per block whatever the length; with causal attention it is the KV cache.
  :func:`generate` samples with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from flarepp.mixers import MIXERS, build_mixer
from flarepp.mixers.base import check_tokens
from flarepp.models.registry import MODELS
from flarepp.models.backbone import Block, SequenceStackConfig, init_backbone_weights
from flarepp.ops import make_norm
from flarepp.validate import require_positive


def causal_mixers() -> list[str]:
    """Registered mixers that declare ``causal = True``."""
    return [n for n in MIXERS.names() if getattr(MIXERS.get(n), "causal", False)]


@dataclass(kw_only=True)
class CausalLMConfig(SequenceStackConfig):
    """Decoder settings; ``in_dim`` / ``out_dim`` switch to feature inputs / outputs."""

    arch = "causal-lm"
    positive = (*SequenceStackConfig.positive, "vocab_size")

    vocab_size: int = 256
    in_dim: int | None = None
    out_dim: int | None = None
    mixer: str = "flare-causal"
    blocks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("in_dim", "out_dim"):
            if getattr(self, name) is not None:
                require_positive(self, (name,), self.arch)
        known = causal_mixers()
        if self.mixer not in known:
            raise ValueError(f"causal-lm: mixer {self.mixer!r} is not a causal mixer; "
                             f"causal mixers: {', '.join(known)}")


class CausalBlock(Block):
    """The backbone's pre-norm block with the decoding API of its causal mixer."""

    def prefill(self, h: torch.Tensor, mask: torch.Tensor | None, capacity: int | None):
        y, state = self.mixer.prefill(self.mixer_norm(h), mask, capacity=capacity)
        h = h + y
        return h + self.ffn(self.ffn_norm(h)), state

    def step(self, h_t: torch.Tensor, state):
        y, state = self.mixer.step(self.mixer_norm(h_t), state)
        h_t = h_t + y
        return h_t + self.ffn(self.ffn_norm(h_t)), state


@MODELS.register("causal-lm", doc="decoder-only model around a causal mixer (byte LM)")
class CausalLM(nn.Module):
    """``ids [B, N] -> logits [B, N, V]`` (or features), causal in N; outputs at masked
    positions are zero, and masked tokens never reach real ones."""

    config_cls = CausalLMConfig
    permutation_equivariant = False

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        self.config = c = config
        if c.in_dim is None:
            self.embed = nn.Embedding(c.vocab_size, c.dim)
        else:
            self.embed = nn.Linear(c.in_dim, c.dim)
        self.blocks = nn.ModuleList(
            CausalBlock(build_mixer(c.mixer, dim=c.dim, heads=c.heads, latents=c.latents,
                                    norm=c.norm, attn_scale=c.attn_scale, **c.mixer_options),
                        c.dim, c.norm, c.ffn_ratio)
            for _ in range(c.blocks))
        self.out_norm = make_norm(c.norm, c.dim)
        self.head = nn.Linear(c.dim, c.out_dim or c.vocab_size, bias=False)
        init_backbone_weights(self)
        if isinstance(self.embed, nn.Embedding):
            nn.init.normal_(self.embed.weight, std=0.02)

    @property
    def takes_tokens(self) -> bool:
        return self.config.in_dim is None

    def _embed(self, inputs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        c = self.config
        if not self.takes_tokens:
            check_tokens(inputs, mask, c.in_dim)
            if mask is not None:
                inputs = inputs.masked_fill(~mask[..., None], 0.0)
            return self.embed(inputs)
        if inputs.dim() != 2 or inputs.dtype.is_floating_point or inputs.dtype == torch.bool:
            raise ValueError(f"causal-lm takes token ids, an integer tensor [B, N], got "
                             f"{inputs.dtype} of shape {list(inputs.shape)}")
        if mask is not None and mask.shape != inputs.shape:
            raise ValueError(f"mask must have shape [B, N] = {list(inputs.shape)}, got "
                             f"{list(mask.shape)}")
        if mask is not None:
            inputs = inputs.masked_fill(~mask, 0)
        return self.embed(inputs)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.out_norm(h))

    def forward(self, inputs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self._embed(inputs, mask)
        for block in self.blocks:
            h = block(h, mask)
        out = self._head(h)
        return out if mask is None else out.masked_fill(~mask[..., None], 0.0)

    def prefill(self, inputs: torch.Tensor, mask: torch.Tensor | None = None, *,
                capacity: int | None = None) -> tuple[torch.Tensor, list]:
        """Outputs of the parallel form and one decoding state per block, after the last
        real token (``capacity``: room to reserve in KV caches)."""
        h = self._embed(inputs, mask)
        states = []
        for block in self.blocks:
            h, state = block.prefill(h, mask, capacity)
            states.append(state)
        out = self._head(h)
        return (out if mask is None else out.masked_fill(~mask[..., None], 0.0)), states

    def initial_state(self, batch: int, *, capacity: int | None = None) -> list:
        """One empty-prefix state per block."""
        return [b.mixer.initial_state(batch, capacity=capacity) for b in self.blocks]

    def step(self, input_t: torch.Tensor, states: list) -> tuple[torch.Tensor, list]:
        """Append one token per sequence (ids ``[B]`` or features ``[B, in_dim]``);
        returns its outputs ``[B, V]`` and the new states."""
        h = self._embed(input_t[:, None], None)[:, 0]
        new_states = []
        for block, state in zip(self.blocks, states, strict=True):
            h, state = block.step(h, state)
            new_states.append(state)
        return self._head(h), new_states


def sampling_probabilities(logits_BV: torch.Tensor, temperature: float,
                           top_k: int | None = None) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the ``top_k`` largest logits (all by default),
    ``[B, V]`` in float64, for a temperature > 0.

    Computed as ``softmax((logits - max logits) / temperature)``, the same distribution
    (softmax is shift-invariant), so that every scaled logit is <= 0 and no temperature
    overflows: ``logits / 5e-324`` is ``inf`` and its softmax NaN, while a shifted logit
    below the maximum goes to ``-inf`` (probability 0) as the temperature shrinks, and the
    most likely byte's probability to 1, greedy decoding, as at 0. In float64, where every
    positive Python float is a positive number (float32 rounds 5e-324 to 0, and 0 / 0 is
    NaN)."""
    logits_BV = logits_BV.double()
    if top_k is not None:
        kth = logits_BV.topk(min(top_k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    shifted = logits_BV - logits_BV.amax(dim=-1, keepdim=True)
    return torch.softmax(shifted / temperature, dim=-1)


def _sample(logits_BV: torch.Tensor, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> torch.Tensor:
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs = sampling_probabilities(logits_BV, temperature, top_k)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def generate_stream(model: CausalLM, prompt_ids: torch.Tensor, max_new_tokens: int,
                    temperature: float = 1.0, top_k: int | None = None,
                    generator: torch.Generator | None = None):
    """Continue ``prompt_ids [B, N0]`` one token at a time: yields ``(token [B], states)``
    for each of ``max_new_tokens`` new tokens as soon as it is sampled, with the decoding
    states after it, and keeps nothing else, so a consumer can write each token out and
    stop at any point (an interrupt) with everything produced so far.

    The prompt runs through the parallel form once (:meth:`CausalLM.prefill`), then every
    new token is one recurrent :meth:`CausalLM.step`: ``O(H M D)`` work and state per layer
    for causal FLARE, whatever the context length; a KV cache reserves room for
    ``N0 + max_new_tokens`` tokens. ``temperature = 0`` is greedy decoding (the argmax of
    the parallel forward's logits at every position); otherwise sampling from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens.
    """
    if not model.takes_tokens:
        raise ValueError("generate needs a token model (in_dim=None); this one takes features")
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [B, N0] with N0 >= 1, got {list(prompt_ids.shape)}")
    if not (max_new_tokens >= 0 and temperature >= 0 and math.isfinite(temperature)) \
            or (top_k is not None and top_k <= 0):
        raise ValueError(f"need max_new_tokens >= 0, a finite temperature >= 0 and top_k > 0, "
                         f"got {max_new_tokens}, {temperature}, {top_k}")
    return _stream(model, prompt_ids, max_new_tokens, temperature, top_k, generator)


@torch.no_grad()
def _stream(model, prompt_ids, max_new_tokens, temperature, top_k, generator):
    if max_new_tokens == 0:
        return
    logits, states = model.prefill(prompt_ids, capacity=prompt_ids.shape[1] + max_new_tokens)
    token = _sample(logits[:, -1], temperature, top_k, generator)
    yield token, states
    for _ in range(max_new_tokens - 1):
        logits_t, states = model.step(token, states)
        token = _sample(logits_t, temperature, top_k, generator)
        yield token, states


def generate(model: CausalLM, prompt_ids: torch.Tensor, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue ``prompt_ids [B, N0]`` by ``max_new_tokens`` sampled tokens; ``[B, N0 + n]``
    (:func:`generate_stream`, collected)."""
    out = [prompt_ids] + [token[:, None] for token, _ in generate_stream(
        model, prompt_ids, max_new_tokens, temperature, top_k, generator)]
    return torch.cat(out, dim=1)
