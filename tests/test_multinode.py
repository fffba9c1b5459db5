"""Two torchrun "nodes" on the loopback interface train as one job (gloo, CPU).

Each node is its own ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` agent,
as on two machines (the launch line of the README, with ``--rdzv-endpoint`` and
``--local-addr`` on 127.0.0.1 and gloo bound to ``lo``); the four ranks meet through the c10d
rendezvous, join one process group in :func:`flarepp.distributed.mesh.launch` and train
one epoch of tests/test_parallel_training.py's configuration: DDP over all four ranks, and
a 2 x 2 (dp, cp) mesh. Both must end at the single-process losses and weights. A failure
points at the multi-node launch (rendezvous, ranks or local ranks across nodes, the mesh
built over two nodes), the rest being covered on one node by test_parallel_training.py.
"""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from test_parallel_training import config, make_data

HERE = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not TORCHRUN.exists() and shutil.which("torchrun") is None,
                                 reason="needs torchrun")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(data: str, out: Path) -> list[dict]:
    """Start both nodes' agents, wait for them, return the four ranks' saved states."""
    out.mkdir(parents=True)
    port = _free_port()
    torchrun = str(TORCHRUN) if TORCHRUN.exists() else shutil.which("torchrun")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    command = [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "flarepp-test",
               "--local-addr", "127.0.0.1", "--max-restarts", "0",
               str(HERE / "multinode_worker.py"), data, str(out)]
    nodes = [subprocess.Popen(command, env=env, cwd=out, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = []
    try:
        for node in nodes:
            logs.append(node.communicate(timeout=400)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, log in zip(nodes, logs):
        assert node.returncode == 0, log[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from flarepp.train import Trainer
    root = tmp_path_factory.mktemp("multinode")
    data = make_data(root)
    trainer = Trainer(config(data), root / "single", progress=False)
    trainer.train_epoch()
    state = {"losses": list(trainer.step_losses),
             "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}
    trainer.close()
    return state, _two_nodes(data, root / "nodes")


@pytest.mark.parametrize("mode,plan", [("dp", "mesh dp=4 x cp=1"), ("dpcp", "mesh dp=2 x cp=2")])
def test_two_nodes_on_loopback_equal_single_process(runs, mode, plan):
    """DDP and the dp x cp mesh across two torchrun nodes: the same step losses and
    weights (1e-5) as one process; every rank says which mesh it ran, and the ranks sit
    two per node (group ranks 0 and 1, local ranks 0 and 1 on each)."""
    ref, ranks = runs
    assert sorted((r["group_rank"], r["local_rank"]) for r in ranks) == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    states = [r[mode] for r in ranks]
    for rank, s in enumerate(states):
        assert s["plan"].startswith(plan), s["plan"]
        np.testing.assert_allclose(s["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        for name, value in ref["params"].items():
            torch.testing.assert_close(s["params"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
