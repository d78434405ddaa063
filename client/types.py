"""The data model both sides share: what a rollout produces and what a training step consumes.

Names follow OpenPipe ART so that its users feel at home. Everything here is plain pydantic and
must stay importable on a laptop without torch.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal, Union

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Message = dict[str, Any]
MessageOrChoice = Union[Choice, Message]


def is_choice_dict(item: Any) -> bool:
    """A serialised Choice (as it travels over HTTP) has `message` and `finish_reason` keys."""
    return isinstance(item, dict) and "message" in item and "finish_reason" in item


class SamplingInfo(BaseModel):
    """What the server records on every choice so a trainer can verify it later (invariants 1-2).

    Travels as `choice.sampling`; the token ids travel as `choice.token_ids` (vLLM's convention).
    """

    model_config = ConfigDict(extra="allow")

    temperature: float
    top_p: float
    # Logprobs are of softmax(logits / logprob_temperature); equals temperature unless greedy.
    logprob_temperature: float
    policy: str  # the served model name that produced it: base name, run name or run@step
    step: int  # policy step (0 = the base model / untrained adapter)
    prompt_fingerprint: str  # sha256 of the prompt token ids, truncated
    prompt_len: int
    model_fingerprint: str  # identifies base weights + tokenizer; a choice from another model is refused


def choice_token_ids(choice: Choice) -> list[int] | None:
    ids = getattr(choice, "token_ids", None)
    return list(ids) if ids is not None else None


def choice_logprobs(choice: Choice) -> list[float] | None:
    if choice.logprobs is None or choice.logprobs.content is None:
        return None
    return [t.logprob for t in choice.logprobs.content]


def choice_sampling(choice: Choice) -> SamplingInfo | None:
    raw = getattr(choice, "sampling", None)
    if raw is None:
        return None
    return raw if isinstance(raw, SamplingInfo) else SamplingInfo.model_validate(raw)


class Trajectory(BaseModel):
    """One rollout: context messages (dicts) interleaved with the model's sampled turns (Choices)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    reward: float = 0.0
    metrics: dict[str, float | int | bool | None] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    start_time: float = Field(default_factory=time.time)
    end_time: float | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _revive_choices(cls, items: Any) -> Any:
        # Over HTTP a Choice arrives as a dict; bring it back so training sees a trainable turn.
        if not isinstance(items, list):
            return items
        return [Choice.model_validate(i) if is_choice_dict(i) else i for i in items]

    @field_validator("messages_and_choices")
    @classmethod
    def _check_items(cls, items: list[MessageOrChoice]) -> list[MessageOrChoice]:
        for i, item in enumerate(items):
            if isinstance(item, dict) and "role" not in item:
                raise ValueError(f"messages_and_choices[{i}] is neither a message (no 'role') nor a Choice")
        return items

    def finish(self) -> "Trajectory":
        """Stamp the end time and duration; call once the reward is known, not before."""
        self.end_time = time.time()
        self.metrics["duration"] = self.end_time - self.start_time
        return self

    def messages(self) -> list[Message]:
        """The conversation as plain OpenAI message dicts (Choices turned into assistant messages)."""
        out: list[Message] = []
        for item in self.messages_and_choices:
            if isinstance(item, Choice):
                out.append(item.message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"}))
            else:
                out.append(item)
        return out

    def choices(self) -> list[Choice]:
        return [i for i in self.messages_and_choices if isinstance(i, Choice)]


class TrajectoryGroup(BaseModel):
    """The rollouts of one task. Exceptions are rollouts that failed for infrastructure reasons:
    recorded and counted, never scored (a zero reward there would teach the model a lie)."""

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("exceptions", mode="before")
    @classmethod
    def _stringify(cls, items: Any) -> Any:
        if isinstance(items, list):
            return [i if isinstance(i, str) else f"{type(i).__name__}: {i}" for i in items]
        return items


LossName = Literal["ppo", "cispo", "importance_sampling", "awr"]
Aggregation = Literal["token_mean", "seq_mean", "constant"]


class TrainConfig(BaseModel):
    """How one training step turns scored groups into a gradient. Defaults are the safe ones."""

    model_config = ConfigDict(extra="forbid")

    # None: derived from the base model's hidden size for a LoRA (see server/training/hyperparams.py).
    learning_rate: float | None = Field(default=None, gt=0)
    loss: LossName = "ppo"
    epsilon_low: float = Field(default=0.2, ge=0)
    epsilon_high: float = Field(default=0.28, ge=0)
    is_truncation_cap: float = Field(default=2.0, gt=0)  # for loss="importance_sampling"
    scale_rewards: bool = False  # divide advantages by the group's reward std
    loss_aggregation: Aggregation = "token_mean"
    constant_normalizer: int = Field(default=1024, gt=0)  # tokens per sequence for "constant"
    kl_coef: float = Field(default=0.0, ge=0)
    mask_truncated: bool = False  # drop completions cut by max_tokens from the loss
    num_minibatches: int = Field(default=1, ge=1)
    epochs: int = Field(default=1, ge=1)
    max_tokens_per_microbatch: int = Field(default=4096, ge=16)
    max_grad_norm: float = Field(default=1.0, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    # A group whose reward spread (max - min) is below this has no signal and is dropped.
    min_group_reward_spread: float = Field(default=1e-6, ge=0)
    # Dropped groups still count in the loss normaliser, as they would at advantage 0 (see
    # server/training/losses.py:signal_share); False normalises over the trained groups alone.
    count_dropped_groups: bool = True
    # A rebuilt context that differs from what the sampler saw is never trained silently.
    skip_mismatched_prompts: bool = True

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.learning_rate is not None and not math.isfinite(self.learning_rate):
            raise ValueError("learning_rate must be finite")
        return self


class TrainResult(BaseModel):
    step: int
    trained: bool
    metrics: dict[str, float | int | None] = Field(default_factory=dict)
    warnings: list[str] = Field(default_factory=list)
    job_id: str | None = None


class SFTConfig(BaseModel):
    """Supervised fine-tuning on demonstrations: loss on assistant tokens only."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | None = Field(default=None, gt=0)
    epochs: int = Field(default=1, ge=1)
    batch_size: int = Field(default=16, ge=1)  # conversations per optimizer step
    max_tokens_per_microbatch: int = Field(default=4096, ge=16)
    max_grad_norm: float = Field(default=1.0, gt=0)


class Conversation(BaseModel):
    """A demonstration for SFT: every assistant message is a target."""

    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
