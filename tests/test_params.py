"""Parameter counts: Table 10 (whole models) and Table 2's formulas (mixers)."""

import pytest

import flarepp
from flarepp.paper import TABLE1_DATASETS, INPUT_CHANNELS, TABLE7, TABLE8, TABLE10


def count(module, skip_bias_and_norms=False):
    total = 0
    for name, p in module.named_parameters():
        if skip_bias_and_norms and (name.endswith("bias") or "norm" in name):
            continue
        total += p.numel()
    return total


@pytest.mark.parametrize("mixer", ["attention", "flare", "flarepp"])
def test_table10_total_parameters(mixer):
    """Millions, two decimals, biases and norms included, C=128, H=8 (Tables 7, 8, 10),
    built straight from ``flarepp.build_model``; out_dim = 1 on every dataset."""
    got = []
    for dataset in TABLE1_DATASETS:
        row = TABLE8[dataset]
        model = flarepp.build_model(mixer=mixer, in_dim=INPUT_CHANNELS[dataset], out_dim=1,
                                    dim=TABLE7["dim"], heads=TABLE7["heads"],
                                    blocks=row.blocks, latents=row.latents)
        got.append(round(count(model) / 1e6, 2))
    assert got == [TABLE10[mixer][d] for d in TABLE1_DATASETS]


FORMULAS = {
    "flare": lambda C, M, H: 3 * C * C + M * C,
    "flarepp": lambda C, M, H: 4 * C * C + 2 * M * C + H,
    "flarepp-simple": lambda C, M, H: 5 * C * C + M * C,
    "flarepp-v1": lambda C, M, H: 5 * C * C + M * C,
    "attention": lambda C, M, H: 4 * C * C,
}


@pytest.mark.parametrize("C,M,H", [(128, 64, 8), (128, 128, 8), (96, 32, 6), (64, 16, 4)])
@pytest.mark.parametrize("mixer", sorted(FORMULAS))
def test_table2_mixer_parameter_formula(mixer, C, M, H):
    """Mixer-only counts without biases and norm scales equal Table 2 exactly."""
    m = flarepp.build_mixer(mixer, dim=C, heads=H, latents=M)
    assert count(m, skip_bias_and_norms=True) == FORMULAS[mixer](C, M, H)
