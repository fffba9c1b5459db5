"""Code-health refactors of issue 10, each pinned by behaviour.

One model-config base; one latent self-attention block for LNO and PerceiverIO; one source
for the paper's Tables 7-10; the FLARE family on a common base instead of skipped
``__init__``s; token-shardability as a class attribute; ``set_backend`` reporting what it
replaced; FLOP formulas for every registered mixer, cross-checked with
``torch.utils.flop_counter.FlopCounterMode``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import flarepp
from flarepp.bench.flops import MIXER_FLOPS, model_flops
from flarepp.distributed.shardable import (SHARDABLE_MIXERS, SHARDABLE_MODELS, ShardableNames,
                                           install_backend, restore_backends)
from flarepp.mixers import MIXERS, list_mixers
from flarepp.mixers.flare import FLARE, LowRankRouting
from flarepp.models import MODELS, model_from_config
from flarepp.models.backbone import ModelConfig
from flarepp.models.latent import LatentSelfAttentionBlock
from flarepp.ops import FUSED, AttentionBackend, set_backend
from flarepp.paper import (DATASETS, INPUT_CHANNELS, TABLE7, TABLE8, TABLE9, TABLE10,
                           TABLE10_FLARE_STUDY)
from flarepp.registry import Registry
from reference import ExplicitBackend

# ---------------------------------------------------------------------------------------------
# one model-config base

# ``model.config.to_dict()`` as checkpoints written before the refactor hold them.
STORED_MODEL_CONFIGS = [
    {"arch": "surrogate", "in_dim": 3, "out_dim": 2, "mixer": "flare", "dim": 32, "heads": 4,
     "blocks": 2, "latents": 16, "norm": "layernorm", "ffn_ratio": 2.0, "io_layers": 2,
     "attn_scale": None, "mixer_options": {}},
    {"arch": "set-transformer", "in_dim": 3, "out_dim": 2, "dim": 32, "heads": 4, "blocks": 2,
     "latents": 8, "norm": "layernorm", "ffn_ratio": 2.0, "io_layers": 2, "attn_scale": None},
    {"arch": "perceiver-io", "in_dim": 3, "out_dim": 2, "dim": 32, "heads": 4, "blocks": 2,
     "latents": 16, "mlp_ratio": 4.0, "norm": "layernorm", "io_layers": 2,
     "attn_scale": None},
    {"arch": "gnot", "in_dim": 3, "out_dim": 2, "dim": 32, "heads": 4, "blocks": 2,
     "experts": 3, "mlp_ratio": 2.0, "space_dim": 2, "norm": "layernorm"},
    {"arch": "lno", "in_dim": 3, "out_dim": 2, "dim": 32, "heads": 4, "blocks": 2,
     "latents": 16, "projector_layers": 1, "mlp_ratio": 2.0, "norm": "layernorm",
     "attn_scale": None},
    {"arch": "luna", "in_dim": 3, "out_dim": 2, "mixer": "luna", "dim": 32, "heads": 4,
     "blocks": 2, "latents": 8, "norm": "layernorm", "ffn_ratio": 2.0, "io_layers": 2,
     "attn_scale": None, "mixer_options": {"learned_packed": False}},
]


@pytest.mark.parametrize("stored", STORED_MODEL_CONFIGS, ids=lambda d: d["arch"])
def test_stored_model_configs_still_rebuild(stored):
    """A model config from an existing checkpoint rebuilds the same architecture and writes
    back the same dict, key for key. A failure means old checkpoints no longer load."""
    model = model_from_config(stored)
    assert type(model) is MODELS.get(stored["arch"])
    assert model.config.to_dict() == stored
    x = torch.randn(2, 5, 3)
    assert model(x).shape == (2, 5, 2)


@pytest.mark.parametrize("arch", ["surrogate", "set-transformer", "perceiver-io", "gnot",
                                  "lno"])
def test_model_configs_share_one_base(arch):
    """The five point-cloud architectures' configs derive from ModelConfig, which alone
    writes ``to_dict`` and validates the shared fields (messages name the architecture).
    Fails before the change: five dataclasses repeated in_dim, out_dim, dim, heads, blocks
    and norm, each with its own ``to_dict`` and checks."""
    cls = MODELS.get(arch).config_cls
    assert issubclass(cls, ModelConfig) and cls.arch == arch
    assert "to_dict" not in vars(cls)
    with pytest.raises(ValueError, match=f"{arch}: dim=30 must be divisible by heads=4"):
        flarepp.build_model(arch, in_dim=2, out_dim=1, dim=30, heads=4)
    with pytest.raises(ValueError, match=f"{arch}: blocks must be positive, got 0"):
        flarepp.build_model(arch, in_dim=2, out_dim=1, blocks=0)


def test_sequence_model_configs_share_the_stack_base():
    """The decoder LM's and the LRA classifier's configs derive from SequenceStackConfig
    (C, H, B, norm, mixer, latents, FFN ratio, SDPA scale), which writes ``to_dict`` and
    checks the shared fields. Fails before the change: both repeated those fields."""
    from flarepp.models.backbone import SequenceStackConfig, StackConfig
    from flarepp.models.causal_lm import CausalLMConfig
    from flarepp.models.sequence import SequenceClassifierConfig
    for cls in (CausalLMConfig, SequenceClassifierConfig):
        assert issubclass(cls, SequenceStackConfig) and "to_dict" not in vars(cls)
        assert not set(vars(cls).get("__annotations__", {})) & set(
            SequenceStackConfig.__annotations__) - {"mixer", "blocks", "latents", "ffn_ratio"}
    assert issubclass(ModelConfig, StackConfig)
    with pytest.raises(ValueError, match="causal-lm: dim=30 must be divisible by heads=4"):
        CausalLMConfig(dim=30, heads=4)
    with pytest.raises(ValueError, match="sequence-classifier: ffn_ratio must be positive"):
        SequenceClassifierConfig(vocab_size=4, num_classes=2, max_length=8, ffn_ratio=0)
    assert CausalLMConfig().to_dict()["arch"] == "causal-lm"


# ---------------------------------------------------------------------------------------------
# one latent self-attention block

def _explicit_latent_block(block: LatentSelfAttentionBlock, z: torch.Tensor) -> torch.Tensor:
    """``Z + softmax(s Q K^T) V W_O``, then ``Z + MLP(norm(Z))``, written out per head."""
    B, L, C = z.shape
    H = block.heads
    D = C // H
    q, k, v = block.qkv_proj(block.attn_norm(z)).split(C, dim=-1)
    q, k, v = (t.reshape(B, L, H, D).permute(0, 2, 1, 3) for t in (q, k, v))
    scale = 1.0 / math.sqrt(D) if block.attn_scale is None else block.attn_scale
    y = torch.softmax(scale * q @ k.transpose(-1, -2), dim=-1) @ v
    z = z + block.out_proj(y.permute(0, 2, 1, 3).reshape(B, L, C))
    return z + block.mlp(block.mlp_norm(z))


def test_lno_and_perceiver_io_share_one_latent_block():
    """LNO and PerceiverIO run the same block class, differing only in the QKV bias and the
    GELU; the block equals its explicit float64 form, forward and gradients. Fails before
    the change: each model carried its own near-copy of the block."""
    lno = flarepp.build_model("lno", in_dim=2, out_dim=1, dim=16, heads=2, latents=8)
    pio = flarepp.build_model("perceiver-io", in_dim=2, out_dim=1, dim=16, heads=2, latents=8)
    assert type(lno.blocks[0]) is type(pio.blocks[0]) is LatentSelfAttentionBlock
    assert lno.blocks[0].qkv_proj.bias is not None and pio.blocks[0].qkv_proj.bias is None
    assert lno.blocks[0].mlp[1].approximate == "none" and pio.blocks[0].mlp[1].approximate == "tanh"
    for block in (lno.blocks[0].double(), pio.blocks[0].double()):
        z = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
        got, want = block(z), _explicit_latent_block(block, z)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        params = [z] + list(block.parameters())
        cot = torch.cos(torch.arange(got.numel(), dtype=got.dtype)).view_as(got)
        for a, b in zip(torch.autograd.grad(got, params, cot),
                        torch.autograd.grad(want, params, cot)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# one source for each paper table

def test_paper_presets_follow_tables_7_and_8():
    """The paper presets, the comparison's settings and the run defaults read Tables 7-8
    from flarepp.paper. Before the change Table 8 was written three times, so one copy
    could drift from the others unnoticed."""
    from flarepp.experiments.comparison import PAPER_BACKBONE, PAPER_SETTINGS
    from flarepp.train import RunConfig, get_preset
    assert tuple(TABLE8) == DATASETS
    for dataset, row in TABLE8.items():
        preset = get_preset(dataset)
        assert (preset.model["blocks"], preset.model["latents"], preset.batch_size,
                preset.weight_decay, preset.epochs) == (row.blocks, row.latents,
                                                        row.batch_size, row.weight_decay,
                                                        row.epochs)
        assert (preset.model["dim"], preset.model["heads"]) == (TABLE7["dim"], TABLE7["heads"])
        assert PAPER_SETTINGS[dataset] == (INPUT_CHANNELS[dataset], row.blocks, row.latents)
    assert PAPER_BACKBONE == {"dim": TABLE7["dim"], "heads": TABLE7["heads"]}
    defaults = RunConfig(name="t", dataset="darcy")
    assert (defaults.lr, defaults.betas, defaults.eps, defaults.precision) == (
        TABLE7["lr"], TABLE7["betas"], TABLE7["eps"], TABLE7["precision"])
    backbone = flarepp.build_model(in_dim=2, out_dim=1).config
    assert (backbone.dim, backbone.heads, backbone.io_layers, backbone.ffn_ratio,
            backbone.norm) == tuple(TABLE7[k] for k in ("dim", "heads", "io_layers",
                                                        "ffn_ratio", "norm"))


def test_table9_deviations_are_what_the_comparison_builds():
    """Table 9's fixed settings reach the comparison models and AB-UPT's anchor default."""
    from flarepp.experiments.comparison import comparison_model_kwargs
    from flarepp.mixers import mixer_config
    assert mixer_config("abupt").anchors == TABLE9["abupt"].fixed["anchors"]
    for name in ("perceiver-io", "lno", "gnot"):
        for dataset in DATASETS:
            kwargs = comparison_model_kwargs(name, dataset)
            assert TABLE9[name].on(dataset).items() <= kwargs.items(), (name, dataset)
    assert set(TABLE10_FLARE_STUDY) == {"perceiver-io", "lno", "gnot"}
    assert all(set(row) == set(DATASETS) for row in TABLE10.values())


# ---------------------------------------------------------------------------------------------
# the FLARE family

FLARE_FAMILY_KEYS = {
    "flare": ["fixed_queries", "key_value_proj.weight", "key_value_proj.bias",
              "out_proj.weight", "out_proj.bias"],
    "flarepp": ["synthesis_seeds", "fixed_queries", "gate_logit", "key_value_proj.weight",
                "key_value_proj.bias", "out_proj.weight", "out_proj.bias",
                "seed_norm.norm.weight", "seed_norm.norm.bias",
                "routing_key_norm.norm.weight", "routing_key_norm.norm.bias"],
    "flarepp-simple": ["synthesis_seeds", "key_value_proj.weight", "key_value_proj.bias",
                       "out_proj.weight", "out_proj.bias", "seed_norm.norm.weight",
                       "seed_norm.norm.bias", "synthesis_key_norm.norm.weight",
                       "synthesis_key_norm.norm.bias"],
    "flarepp-v1": ["synthesis_seeds", "key_value_proj.weight", "key_value_proj.bias",
                   "out_proj.weight", "out_proj.bias"],
}


@pytest.mark.parametrize("name", sorted(FLARE_FAMILY_KEYS))
def test_flare_family_runs_its_own_init_on_a_common_base(name):
    """Every FLARE-family mixer derives from LowRankRouting and runs its base __init__; no
    member is a FLARE that skipped FLARE.__init__; state-dict keys are those of existing
    checkpoints. Fails before the change: FLAREPP and SynthesizedQueryFLARE subclassed FLARE
    and called Mixer.__init__ directly."""
    cls = MIXERS.get(name)
    assert issubclass(cls, LowRankRouting)
    assert cls is FLARE or not issubclass(cls, FLARE)
    mixer = flarepp.build_mixer(name, dim=16, heads=2, latents=4)
    assert list(mixer.state_dict()) == FLARE_FAMILY_KEYS[name]


# ---------------------------------------------------------------------------------------------
# token-shardability and backends

def test_token_shardable_is_a_class_attribute():
    """Mixers and models declare ``token_shardable = True``; SHARDABLE_MIXERS and
    SHARDABLE_MODELS are read-only views derived from it, including classes registered
    later. Fails before the change: a separate registry of flags kept by name."""
    # the names the flag registry held before the change, and nothing non-local
    assert {"flare", "flarepp", "flarepp-simple", "flarepp-v1", "luna"} <= set(SHARDABLE_MIXERS)
    assert {"luna", "surrogate"} <= set(SHARDABLE_MODELS)
    assert not {"attention", "abupt", "transolver"} & set(SHARDABLE_MIXERS)
    assert not {"set-transformer", "perceiver-io", "gnot", "lno"} & set(SHARDABLE_MODELS)
    for name in list_mixers():
        assert (name in SHARDABLE_MIXERS) == getattr(MIXERS.get(name), "token_shardable", False)
    assert "attention" not in SHARDABLE_MIXERS and "nonexistent" not in SHARDABLE_MIXERS
    assert not hasattr(SHARDABLE_MIXERS, "add")

    class Shardable(LowRankRouting):
        token_shardable = True

    registry = Registry("mixer")
    view = ShardableNames(registry)
    assert list(view) == []
    registry.add("late", Shardable)
    registry.add("attention", MIXERS.get("attention"))
    assert list(view) == ["late"] and len(view) == 1


def test_set_backend_returns_what_it_replaced():
    """``set_backend`` routes every attention-calling module through a backend and returns
    the (module, previous backend) pairs; install/restore are that call and its undo.
    Fails before the change: set_backend returned the module and install_backend was a
    second copy of its loop."""
    model = flarepp.build_model(mixer="flarepp", in_dim=2, out_dim=1, dim=16, heads=2,
                                blocks=2, latents=4)
    explicit = ExplicitBackend()
    previous = set_backend(model, explicit)
    users = [m for m in model.modules() if isinstance(getattr(m, "backend", None),
                                                       AttentionBackend)]
    assert [m for m, _ in previous] == users and len(users) == 2
    assert all(b is FUSED for _, b in previous) and all(m.backend is explicit for m in users)
    restore_backends(previous)
    assert all(m.backend is FUSED for m in users)
    restore_backends(install_backend(model, explicit))
    assert all(m.backend is FUSED for m in users)


# ---------------------------------------------------------------------------------------------
# FLOP formulas against torch's counter

def _flop_cases() -> list[tuple[str, dict]]:
    cases = [(name, {}) for name in list_mixers()]
    return cases + [("abupt", {"anchors": 4})]  # fewer anchors than tokens


@pytest.mark.parametrize("mixer, options", _flop_cases(),
                         ids=lambda v: v if isinstance(v, str) else str(v or ""))
def test_flop_formula_equals_flop_counter(mixer, options):
    """For every registered mixer with a formula, the analytic forward count of a small
    backbone equals FlopCounterMode's, with every attention call computed by explicit
    matmuls (FlopCounterMode has no formula for the CPU SDPA kernel and counts it as 0).
    A mixer without a formula is refused by name. Fails before the change: 5 of 10 mixers
    had formulas and none was checked against an independent counter."""
    settings = dict(mixer=mixer, in_dim=3, out_dim=2, dim=16, heads=2, blocks=2, latents=4,
                    mixer_options=options)
    if mixer not in MIXER_FLOPS:
        with pytest.raises(ValueError, match=f"no FLOP formula for mixer {mixer!r}"):
            model_flops(settings, 10, 3)
        return
    model = flarepp.build_model(**settings).eval()
    set_backend(model, ExplicitBackend())
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(3, 10, 3))
    assert model_flops(settings, 10, 3)["forward"] == counter.get_total_flops()


def test_flop_formulas_cover_the_papers_mixers():
    """Every mixer of Table 1's matched backbone has a formula (the other registered ones,
    LRA baselines and variants, may be refused)."""
    table1 = {"attention", "flare", "flarepp", "flarepp-simple", "flarepp-v1", "abupt",
              "luna", "transolver", "transolver++", "transolver3"}
    assert table1 <= set(MIXER_FLOPS.names())
