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
