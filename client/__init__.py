"""What a user imports: TrainableModel, gather, and the shared data model. Never imports torch."""

from client.gather import TooManyExceptions, gather_trajectory_groups
from client.model import ServerError, TrainableModel
from protocol import (Conversation, History, SFTConfig, StepMetrics, TrainConfig, TrainResult, Trajectory,
                      TrajectoryGroup)

__all__ = [
    "Conversation", "History", "SFTConfig", "ServerError", "StepMetrics", "TrainConfig", "TrainResult",
    "TrainableModel", "Trajectory", "TrajectoryGroup", "TooManyExceptions", "gather_trajectory_groups",
]
