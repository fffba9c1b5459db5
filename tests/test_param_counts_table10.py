"""Parameter counts of every Table 1 model at the Table 7/8 settings against Table 10.

Counts include biases and norm parameters, C=128, H=8, out_dim=1, per-dataset input width,
depth and latent budget (flarepp.experiments.comparison.PAPER_SETTINGS); the model
keywords are those ``flarepp compare`` trains, so the table and the comparison agree.
"""

import pytest

from flarepp.experiments.comparison import PAPER_SETTINGS, parameter_table
from flarepp.paper import TABLE1_DATASETS, TABLE10, TABLE10_FLARE_STUDY

# The module's fixture builds every Table 1 model at paper size on five datasets (~15 s).
pytestmark = pytest.mark.slow

assert tuple(PAPER_SETTINGS) == TABLE1_DATASETS
# PerceiverIO and GNOT are reproduced within 5% of the FLARE study's own counts (Table 10
# caption); LNO's quoted 0.92M does not follow from its equations (see the LNO test).
FLARE_STUDY = {name: TABLE10_FLARE_STUDY[name] for name in ("perceiver-io", "gnot")}


@pytest.fixture(scope="module")
def counts():
    return parameter_table(list(TABLE10) + list(FLARE_STUDY) + ["lno"], list(TABLE1_DATASETS))


@pytest.mark.parametrize("name", sorted(TABLE10))
def test_author_run_models_equal_table10(counts, name):
    """Rounded to 0.01M on all five datasets; a mismatch means a projection, bias, norm or
    latent tensor differs from the paper's implementation of that model."""
    got = [round(counts[name][d] / 1e6, 2) for d in TABLE1_DATASETS]
    assert got == [TABLE10[name][d] for d in TABLE1_DATASETS], f"{name}: {dict(zip(TABLE1_DATASETS, got))}"


@pytest.mark.parametrize("name", sorted(FLARE_STUDY))
def test_flare_study_models_within_5_percent(counts, name):
    """PerceiverIO and GNOT use fixed configurations (Table 9), so one count per model."""
    for d in TABLE1_DATASETS:
        assert abs(counts[name][d] / 1e6 / FLARE_STUDY[name] - 1) < 0.05, (name, d,
                                                                             counts[name][d])


def lno_formula(in_dim, C, L, B, R=256, ratio=2):
    """LNO from its equations: trunk and branch MLPs (in -> C, L residual C x C layers,
    -> C), mode projector (C -> C, L layers, -> R), output MLP (-> 1), B latent blocks of
    Q/K/V/O projections with bias, two norms and a ratio-2 MLP."""
    def linear(a, b):
        return a * b + b

    def mlp(a, b):
        return linear(a, C) + L * linear(C, C) + linear(C, b)
    block = 4 * linear(C, C) + 2 * 2 * C + linear(C, ratio * C) + linear(ratio * C, C)
    return 2 * mlp(in_dim, C) + mlp(C, R) + mlp(C, 1) + B * block


def test_lno_counts_follow_its_equations(counts):
    """LNO at the FLARE study's configurations (C=192 and 3 projector layers on Elasticity,
    C=128 with 2 elsewhere, 8 latent blocks on Airfoil and Pipe, 4 otherwise). These give
    0.76-1.83M, not the study's quoted 0.92M: no L in {0..4}, B in {1..8}, C
    of this structure comes within 2% of 0.92M (C in {64, 96, 128, 144, 160, 192, 256})."""
    want = {"elasticity": lno_formula(2, 192, 3, 4), "darcy": lno_formula(3, 128, 2, 4),
            "airfoil": lno_formula(2, 128, 2, 8), "pipe": lno_formula(2, 128, 2, 8),
            "drivaerml-40k": lno_formula(3, 128, 2, 4)}
    assert counts["lno"] == want
