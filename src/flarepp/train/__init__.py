"""Training, evaluation and checkpoints under the paper's protocol."""

from flarepp.train.checkpoint import (CheckpointError, TrainedModel, load_trained_model,
                                      read_checkpoint)
from flarepp.train.config import RunConfig, apply_overrides
from flarepp.train.evaluate import evaluate, predict, relative_l2
from flarepp.train.loop import Trainer, autocast, latest_checkpoint, train
from flarepp.train.presets import PRESETS, get_preset

__all__ = ["CheckpointError", "PRESETS", "RunConfig", "TrainedModel", "Trainer",
           "apply_overrides", "autocast", "evaluate", "get_preset", "latest_checkpoint",
           "load_trained_model", "predict", "read_checkpoint", "relative_l2", "train"]
