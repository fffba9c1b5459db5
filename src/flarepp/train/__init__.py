"""Training, evaluation and checkpoints under the paper's protocol, for every task."""

from flarepp.train.checkpoint import (CheckpointError, TrainedModel, load_trained_model,
                                      read_checkpoint)
from flarepp.train.config import RunConfig, apply_overrides
from flarepp.train.engine import Engine
from flarepp.train.evaluate import evaluate_checkpoint, load_for_evaluation, relative_l2
from flarepp.train.loop import Trainer, latest_checkpoint, train
from flarepp.train.presets import PRESETS, get_preset

__all__ = ["CheckpointError", "Engine", "PRESETS", "RunConfig", "TrainedModel", "Trainer",
           "apply_overrides", "evaluate_checkpoint", "get_preset", "latest_checkpoint",
           "load_for_evaluation", "load_trained_model", "read_checkpoint", "relative_l2",
           "train"]
