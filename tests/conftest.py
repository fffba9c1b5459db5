import functools
import multiprocessing.process
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py

# Two xdist workers share two cores: one intra-op thread each, in this process and in the
# processes tests start (a user's setting, so no run measures its threads: flarepp.threads).
os.environ["OMP_NUM_THREADS"] = "1"
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


# Cost tier. ``slow`` marks a test that trains a model (runs an epoch of the trainer),
# starts a Python process, or takes more than about a second; ``make test-fast`` deselects
# it. A test that starts a Python process or runs a training epoch without the mark fails
# at teardown, naming what it did, so the fast tier stays fast as tests are added.
_UNMARKED_COST = pytest.StashKey[list]()
_running: list[pytest.Item] = []


def _note_cost(what: str) -> None:
    if _running and _running[-1].get_closest_marker("slow") is None \
            and _running[-1].get_closest_marker("cuda") is None:
        _running[-1].stash.setdefault(_UNMARKED_COST, []).append(what)


def _watch(owner: type, name: str, describe) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def watched(self, *args, **kwargs):
        what = describe(self, *args, **kwargs)
        if what:
            _note_cost(what)
        return original(self, *args, **kwargs)

    setattr(owner, name, watched)


def _python_command(self, args, *rest, **kwargs) -> str | None:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    program = os.path.basename(str(argv[0])) if argv else ""
    if "python" in program or program in ("torchrun", "flarepp", "make") \
            or str(argv[0]) == sys.executable:
        return "starts a process: " + " ".join(map(str, argv)).replace("\n", " ")[:100]
    return None


def pytest_configure(config):
    from flarepp.train import Trainer

    _watch(subprocess.Popen, "__init__", _python_command)
    _watch(multiprocessing.process.BaseProcess, "start",
           lambda self: f"starts a process: {self.name}")
    _watch(Trainer, "train_epoch", lambda self: "runs a training epoch")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)  # fixture setup (module-scoped ones too), call and teardown
    try:
        yield
    finally:
        _running.pop()


@pytest.fixture(autouse=True)
def _cost_is_marked(request):
    yield
    done = request.node.stash.get(_UNMARKED_COST, [])
    if done:
        more = f" (and {len(done) - 1} more)" if len(done) > 1 else ""
        pytest.fail(f"{request.node.nodeid} {done[0]}{more}, so it belongs to the slow "
                    "tier: mark it @pytest.mark.slow", pytrace=False)


@pytest.fixture(scope="module")
def darcy_dir(tmp_path_factory):
    """Tiny generated Darcy data (12 train / 4 test at 15 x 15, seed 3), made once per test
    module: the trainer tests' data."""
    from flarepp.data.generators.darcy import make_darcy
    root = tmp_path_factory.mktemp("darcy")
    make_darcy(root, n_train=12, n_test=4, resolution=15, seed=3, progress=False)
    return root
