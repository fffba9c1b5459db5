"""The public API promised to users (README) and its error messages."""

import pytest
import torch

import flarepp


def test_list_mixers_names_the_paper_mixers():
    assert {"attention", "flare", "flarepp", "flarepp-simple", "flarepp-v1"} <= set(
        flarepp.list_mixers())


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="known mixers: .*flarepp"):
        flarepp.build_mixer("flarepp2")
    with pytest.raises(ValueError, match="known mixers"):
        flarepp.build_model(mixer="nope", in_dim=2, out_dim=1)
    with pytest.raises(ValueError, match="known models"):
        flarepp.build_model(arch="nope", in_dim=2, out_dim=1)


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match="gate_init"):
        flarepp.build_mixer("flarepp", gate_init=0.1)


def test_bad_shapes_say_what_was_expected():
    model = flarepp.build_model(mixer="flarepp", in_dim=2, out_dim=1, dim=16, heads=2,
                                blocks=1, latents=4)
    with pytest.raises(ValueError, match=r"\[B, N, 2\]"):
        model(torch.randn(1, 10, 3))
    with pytest.raises(ValueError, match=r"mask must have shape \[B, N\] = \[1, 10\]"):
        model(torch.randn(1, 10, 2), mask=torch.ones(1, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        model(torch.randn(1, 10, 2), mask=torch.ones(1, 10))
    with pytest.raises(ValueError, match="divisible"):
        flarepp.build_mixer("flare", dim=30, heads=4)


def test_model_round_trips_through_its_config():
    model = flarepp.build_model(mixer="flare", in_dim=3, out_dim=2, dim=16, heads=2,
                                blocks=2, latents=4, norm="rmsnorm")
    clone = flarepp.model_from_config(model.config.to_dict())
    clone.load_state_dict(model.state_dict())
    x = torch.randn(1, 7, 3)
    torch.testing.assert_close(model(x), clone(x))


def test_readme_example_runs():
    mixer = flarepp.build_mixer("flarepp", dim=128, heads=8, latents=64)
    assert mixer(torch.randn(1, 50, 128)).shape == (1, 50, 128)
    model = flarepp.build_model(mixer="flarepp", in_dim=2, out_dim=1, dim=128, heads=8,
                                blocks=8, latents=64)
    assert model(torch.randn(2, 100, 2), mask=None).shape == (2, 100, 1)
