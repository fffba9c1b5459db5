import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py

# Two xdist workers share two cores: one intra-op thread each.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path_factory, monkeypatch):
    """Each test runs in a fresh, empty working directory of its own, so nothing it does
    depends on what the checkout holds (a `make demo`'s data/darcy, an earlier run's runs/)
    and nothing it writes by a relative path lands in the checkout. Files of the test tree
    are found from ``__file__``, never from the working directory."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
