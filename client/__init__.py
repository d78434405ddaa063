"""What a user imports: TrainableModel, gather, and the shared data model. Never imports torch."""

from client.errors import ConfigError, RunCannotLearn, RunInUse, ServerError, ServerUnreachable
from client.gather import TooManyExceptions, gather_trajectory_groups
from client.model import TrainableModel
from protocol import (Conversation, History, SFTConfig, StepMetrics, TrainConfig, TrainResult, Trajectory,
                      TrajectoryGroup)

__all__ = [
    "ConfigError", "Conversation", "History", "RunCannotLearn", "RunInUse", "SFTConfig", "ServerError", "ServerUnreachable",
    "StepMetrics", "TrainConfig", "TrainResult", "TrainableModel", "Trajectory", "TrajectoryGroup",
    "TooManyExceptions", "gather_trajectory_groups",
]
