"""Training, evaluation and checkpoints under the paper's protocol, for every task."""

from flarepp.storage.checkpoint import (CheckpointError, TrainedModel, load_trained_model,
                                        read_checkpoint)
from flarepp.storage.config import RunConfig
from flarepp.inference.engine import Engine
from flarepp.inference.evaluate import evaluate_checkpoint, load_for_evaluation
from flarepp.train.checkpoint import CheckpointManager, latest_checkpoint
from flarepp.train.checks import apply_overrides, validate
from flarepp.train.loop import Trainer, train
from flarepp.train.presets import PRESETS, get_preset

__all__ = ["CheckpointError", "CheckpointManager", "Engine", "PRESETS", "RunConfig",
           "TrainedModel", "Trainer", "apply_overrides", "evaluate_checkpoint", "get_preset",
           "latest_checkpoint", "load_for_evaluation", "load_trained_model",
           "read_checkpoint", "train", "validate"]
