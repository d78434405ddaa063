"""What a user imports: the data model, TrainableModel, and gather. Never imports torch."""

from client.gather import TooManyExceptions, gather_trajectory_groups
from client.model import ServerError, TrainableModel
from client.types import (
    Conversation,
    SFTConfig,
    TrainConfig,
    TrainResult,
    Trajectory,
    TrajectoryGroup,
)

__all__ = [
    "Conversation", "SFTConfig", "ServerError", "TrainConfig", "TrainResult", "TrainableModel", "Trajectory",
    "TrajectoryGroup", "TooManyExceptions", "gather_trajectory_groups",
]
