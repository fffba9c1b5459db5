"""One rank of tests/test_multinode.py, started by torchrun (not a test module).

``torchrun ... tests/multinode_worker.py DATA OUT`` joins the job through
:func:`flarepp.distributed.mesh.launch`, as ``flarepp train --data-parallel`` does, and
trains one epoch of the configuration of tests/test_parallel_training.py twice: DDP over
every rank (the launch's mesh), then on a 2 x 2 (dp, cp) mesh built over the same process
group. Saves each run's losses and weights to ``OUT/rank<RANK>.pt``.
"""

import os
import sys

import torch

from flarepp.distributed.mesh import build_mesh, launch, plan_for_mesh
from flarepp.train import Trainer
from test_parallel_training import config


def _train(data: str, out: str, plan) -> dict:
    trainer = Trainer(config(data), out, progress=False, parallel=plan)
    trainer.train_epoch()
    state = {"losses": list(trainer.step_losses),
             "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
             "plan": plan.describe()}
    trainer.close()
    return state


def main(data: str, out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    with launch(device, data_parallel=True, timeout_s=120) as plan:
        states = {"dp": _train(data, os.path.join(out, "dp"), plan),
                  "dpcp": _train(data, os.path.join(out, "dpcp"),
                                 plan_for_mesh(build_mesh(device, 2, 2)))}
    states.update(group_rank=int(os.environ["GROUP_RANK"]),
                  local_rank=int(os.environ["LOCAL_RANK"]))
    torch.save(states, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
