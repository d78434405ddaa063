"""The floor: the protocol the client, rollouts, rewards, exporters and the server all share.

Wire types (trajectories, configs, jobs, step figures), the helpers that read what the server
attaches to a sampled turn, and the one retry policy. Imports nothing from the packages above it,
and never torch.
"""

from protocol.choices import (Message, MessageOrChoice, SamplingInfo, as_message, choice_logprobs,
                              choice_sampling, choice_token_ids, is_choice_dict, malformed_tool_call)
from protocol.config import LoraSettings, RunSpec, SFTConfig, TrainConfig
from protocol.jobs import TERMINAL_EVENTS, JobEvent, JobRequest, RLJob, SFTJob, TrainResult
from protocol.metrics import StepMetrics
from protocol.retry import RetryPolicy, is_transient
from protocol.trajectory import Conversation, History, Trajectory, TrajectoryGroup

__all__ = [
    "TERMINAL_EVENTS", "Conversation", "History", "JobEvent", "JobRequest", "LoraSettings", "Message",
    "MessageOrChoice", "RLJob", "RetryPolicy", "RunSpec", "SFTConfig", "SFTJob", "SamplingInfo", "StepMetrics",
    "TrainConfig", "TrainResult", "Trajectory", "TrajectoryGroup", "as_message", "choice_logprobs",
    "choice_sampling", "choice_token_ids", "is_choice_dict", "is_transient", "malformed_tool_call",
]
