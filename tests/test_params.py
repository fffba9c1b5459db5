"""Parameter counts: Table 10 (whole models) and Table 2's formulas (mixers)."""

import pytest

import flarepp

# dataset: (in_dim, blocks, latents); out_dim = 1 everywhere (Table 8, FACTS.md 1).
SETTINGS = {"elasticity": (2, 8, 64), "darcy": (3, 8, 128), "airfoil": (2, 8, 64),
            "pipe": (2, 2, 64), "drivaerml-40k": (3, 4, 64)}
TABLE10 = {
    "attention": [1.16, 1.16, 1.16, 0.36, 0.63],
    "flare": [1.09, 1.16, 1.09, 0.35, 0.60],
    "flarepp": [1.29, 1.42, 1.29, 0.40, 0.70],
}


def count(module, skip_bias_and_norms=False):
    total = 0
    for name, p in module.named_parameters():
        if skip_bias_and_norms and (name.endswith("bias") or "norm" in name):
            continue
        total += p.numel()
    return total


@pytest.mark.parametrize("mixer", sorted(TABLE10))
def test_table10_total_parameters(mixer):
    """Millions, two decimals, biases and norms included, C=128, H=8 (Tables 7, 8, 10)."""
    got = []
    for in_dim, blocks, latents in SETTINGS.values():
        model = flarepp.build_model(mixer=mixer, in_dim=in_dim, out_dim=1, dim=128, heads=8,
                                    blocks=blocks, latents=latents)
        got.append(round(count(model) / 1e6, 2))
    assert got == TABLE10[mixer]


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
