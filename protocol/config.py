"""How a run is set up and how a step turns scored groups into a gradient.

Every field is bounded: a value no sane run uses (a learning rate of 1e308, 10**9 epochs) is a
400 naming the field, not a poisoned adapter or a trainer that never finishes. Defaults are the
safe ones.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# "apo" is A*-PO's least-squares regression (Brantley et al. 2025, "Accelerating RL for LLM
# Reasoning with Optimal Advantage Regression"), not TinyZero's advantage-weighted SFT, which is "awr".
LossName = Literal["ppo", "cispo", "importance_sampling", "awr", "apo"]
# What a reward is compared with to make its advantage (server/training/advantages.py):
# - group_mean:    the mean reward of its group (GRPO's; the default)
# - leave_one_out: the mean reward of the rest of its group (RLOO, REINFORCE with an unbiased baseline)
# - given:         the group's own `value`, estimated by the client (A*-PO's V*(x)); a group of one trains
Baseline = Literal["group_mean", "leave_one_out", "given"]
Aggregation = Literal["token_mean", "seq_mean", "constant"]
RUN_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
PROJECT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_.]{0,127}$"


def _finite(**kw) -> dict:
    return {"allow_inf_nan": False, **kw}


class LoraSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=8, ge=1, le=1024)
    alpha: float = Field(default=16.0, **_finite(gt=0, le=4096))
    # None: every linear layer of the decoder blocks (what the model's architecture has).
    target_modules: list[str] | None = Field(default=None, min_length=1, max_length=64)
    seed: int = Field(default=0, ge=0, le=2**32 - 1)

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            if not re.match(MODULE_NAME, name):
                raise ValueError(f"{name!r} is not a module name")
        return v


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=RUN_NAME, description="1-64 letters, digits, '_', '-' or '.', starting with a letter or digit")
    project: str = Field(default="default", pattern=PROJECT_NAME)
    base_model: str | None = Field(default=None, max_length=500)
    lora: LoraSettings = Field(default_factory=LoraSettings)


class Distill(BaseModel):
    """On-policy distillation: each sampled token of the student is pushed towards a teacher by
    the per-token reverse KL, log p_teacher(x) - log p_student(x), as its advantage (far denser
    than one reward per episode). The teacher is a model this server serves: its base model, or
    a run or `run@step` of that base (the same tokenizer: it scores the student's exact tokens)."""

    model_config = ConfigDict(extra="forbid")

    teacher: str = Field(min_length=1, max_length=200)
    coef: float = Field(default=1.0, **_finite(gt=0, le=100))  # the KL advantage's weight
    # False: the KL alone (rewards are not read); True: added to the group-relative reward advantage.
    with_reward: bool = False


class TrainConfig(BaseModel):
    """How one RL step turns scored groups into a gradient."""

    model_config = ConfigDict(extra="forbid")

    # None: derived from the base model (see server/training/hyperparams.py).
    learning_rate: float | None = Field(default=None, **_finite(gt=0, le=1.0))
    loss: LossName = "ppo"
    epsilon_low: float = Field(default=0.2, **_finite(ge=0, le=10))
    epsilon_high: float = Field(default=0.28, **_finite(ge=0, le=10))
    is_truncation_cap: float = Field(default=2.0, **_finite(gt=0, le=1000))  # for loss="importance_sampling"
    scale_rewards: bool = False  # divide advantages by the group's reward std
    # None: "given" for loss="apo" (it regresses on r - V*(x)), else "group_mean".
    baseline: Baseline | None = None
    # A*-PO's beta_2: the regression target of beta * log(pi/pi_ref) summed over a sequence is r - V*(x).
    apo_beta: float = Field(default=1e-3, **_finite(gt=0, le=100))
    loss_aggregation: Aggregation = "token_mean"
    constant_normalizer: int = Field(default=1024, gt=0, le=2**20)  # tokens per sequence for "constant"
    kl_coef: float = Field(default=0.0, **_finite(ge=0, le=100))
    mask_truncated: bool = False  # drop completions cut by max_tokens from the loss
    num_minibatches: int = Field(default=1, ge=1, le=1024)
    epochs: int = Field(default=1, ge=1, le=100)
    max_tokens_per_microbatch: int = Field(default=4096, ge=16, le=2**20)
    max_grad_norm: float = Field(default=1.0, **_finite(gt=0, le=1e6))
    weight_decay: float = Field(default=0.0, **_finite(ge=0, le=1e4))  # AdamW's, decoupled: lr * wd per step
    # A group whose reward spread (max - min) is below this has no signal and is dropped.
    min_group_reward_spread: float = Field(default=1e-6, **_finite(ge=0, le=1e6))
    # Dropped groups still count in the loss normaliser, as they would at advantage 0 (see
    # server/training/losses.py:signal_share); False normalises over the trained groups alone.
    count_dropped_groups: bool = True
    # A choice whose prompt, rebuilt from the trajectory, differs from the one it was sampled after
    # (edited or truncated history, a client that rendered it otherwise) is counted
    # (prompt_mismatches) and, by default, not trained. False trains it anyway after the rebuilt
    # prompt, counted as prompt_mismatches_trained: off-context, its sampler logprobs belong to
    # another prompt (server/training/assemble.py).
    skip_mismatched_prompts: bool = True
    # The most steps a group's sampler may be behind the weights this step starts from (its
    # staleness, read from each choice's sampling record); staler groups are dropped and counted.
    # None: no bound (a group is trained however old its sampler).
    max_steps_off_policy: int | None = Field(default=None, ge=0, le=10_000)
    distill: Distill | None = None

    @model_validator(mode="after")
    def _apo(self) -> "TrainConfig":
        if self.distill is not None and self.loss in ("apo", "awr"):
            raise ValueError(f"distill gives every token its own advantage; loss {self.loss!r} weighs whole "
                             f"sequences: use ppo, cispo or importance_sampling")
        if self.baseline is None:
            self.baseline = "given" if self.loss == "apo" else "group_mean"
        if self.scale_rewards and self.baseline != "group_mean":
            # Only GRPO's group-mean advantages are divided by the group's std; silently training
            # unscaled advantages would not be the run that was asked for.
            raise ValueError(f"scale_rewards divides GRPO's group-mean advantages by the group's reward std; "
                             f"baseline {self.baseline!r} does not scale: drop scale_rewards or use baseline "
                             f"'group_mean'")
        if self.loss == "apo":
            if self.baseline != "given":
                raise ValueError("loss 'apo' (A*-PO) regresses on r - V*(x): its baseline is 'given' (each group's "
                                 f"value), not {self.baseline!r}")
            # A*-PO's loss is one squared residual per sequence: every sequence weighs the same.
            if "loss_aggregation" in self.model_fields_set and self.loss_aggregation != "seq_mean":
                raise ValueError("loss 'apo' (A*-PO) is a squared residual per sequence: use loss_aggregation "
                                 "'seq_mean' (its default)")
            self.loss_aggregation = "seq_mean"
        return self


class SFTConfig(BaseModel):
    """Supervised fine-tuning on demonstrations: loss on assistant tokens only."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | None = Field(default=None, **_finite(gt=0, le=1.0))
    epochs: int = Field(default=1, ge=1, le=100)
    batch_size: int = Field(default=16, ge=1, le=4096)  # conversations per optimizer step
    max_tokens_per_microbatch: int = Field(default=4096, ge=16, le=2**20)
    max_grad_norm: float = Field(default=1.0, **_finite(gt=0, le=1e6))

