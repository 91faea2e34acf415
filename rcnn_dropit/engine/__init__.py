"""Training and evaluation loops and the run setup around them."""

from rcnn_dropit.engine.evaluator_loop import evaluate
from rcnn_dropit.engine.optim import build_optimizer_and_scheduler, lr_factor_fn
from rcnn_dropit.engine.runner import TrainResult, test, train
from rcnn_dropit.engine.step import StepOptions
from rcnn_dropit.engine.trainer import Schedule, Trainer

__all__ = [
    "Schedule",
    "StepOptions",
    "TrainResult",
    "Trainer",
    "build_optimizer_and_scheduler",
    "evaluate",
    "lr_factor_fn",
    "test",
    "train",
]
