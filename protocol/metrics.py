"""Step figures (invariant 8): what every training step reports, by name.

The trainer fills them, the health rules read them, the store and the web page show them, and
the client prints them. A figure a step cannot measure stays None (an SFT step has no reward).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# How the step warning that suspects a collapse begins (server/training/health.py): the client's
# verdict on a run that cannot learn passes that warning on (client/loop/patience.py).
COLLAPSE_WARNING_OPENING = "Reward fell from "


class StepMetrics(BaseModel):
    # Older checkpoints may hold figures this version no longer reports: kept, not refused.
    model_config = ConfigDict(extra="allow")

    trained: bool = False
    # what was submitted
    groups_total: int = 0
    groups_trainable: int = 0
    groups_dropped_constant: int = 0  # two or more rollouts, every one scored the same
    # Of those, the groups whose every rollout scored the top reward (solved: good news, nothing left
    # to learn there) or the bottom one (failed); the rest scored the same value in between.
    # Top: the batch's best reward, or 1.0 when none is higher; bottom: its worst, or 0.0 (health.py).
    groups_constant_solved: int = 0
    groups_constant_failed: int = 0
    groups_dropped_single: int = 0  # one rollout: group-relative advantages need two
    groups_dropped_failed: int = 0  # every rollout failed (exceptions only)
    # Off-policy (protocol/staleness.py): how many steps each group's sampler was behind the
    # weights this step started from, over the groups within the submission's bound; those past it
    # were dropped. None where no choice carried a sampling record of this run.
    staleness_mean: float | None = None
    staleness_max: int | None = None
    groups_dropped_stale: int = 0
    staleness_bound: int | None = None  # the submission's max_steps_off_policy
    trajectories_total: int = 0
    trajectories_excluded: int = 0  # rollouts that failed for infrastructure reasons (never scored)
    reward_mean: float | None = None
    reward_std: float | None = None
    # advantages (server/training/advantages.py): how they were made, and what they were
    loss_name: str | None = None  # TrainConfig.loss
    baseline: str | None = None  # group_mean, leave_one_out or given (A*-PO's V*(x))
    value_mean: float | None = None  # mean given value over the trained groups
    advantage_mean: float | None = None  # over the trained trajectories
    advantage_positive_fraction: float | None = None  # 0: no sample beat its baseline
    # Per domain of a batch that mixes task families (protocol/domains.py): rollouts submitted and
    # excluded, mean reward, and the mean of each trajectory metric its trajectories all report.
    domains: dict[str, dict[str, float | int | None]] = Field(default_factory=dict)
    conversations: int | None = None  # SFT
    # assembly (invariants 1 and 7)
    choices: int = 0
    trained_choices: int = 0
    prompt_mismatches: int = 0
    prompt_mismatches_trained: int = 0  # of those, trained anyway: TrainConfig.skip_mismatched_prompts=False
    recovered_choices: int = 0  # choices sent without token ids, matched to what this server sampled
    unsampled_choices: int = 0  # choices this server never sampled: context only
    truncated_choices: int = 0
    truncated_fraction: float = 0.0
    context_only_assistant_messages: int = 0
    trajectories_without_choices: int = 0
    sequences: int = 0
    # turns whose next prompt does not extend it (the template rewrote history): own sequences
    non_extending_turns: int = 0
    rewritten_turns: int = 0  # sampled turns the chat template renders differently in later prompts
    additional_histories: int = 0
    trainable_tokens: int = 0
    signal_share: float | None = None
    # optimisation
    loss: float | None = None
    logprob_gap: float | None = None  # sampler vs trainer on the first pass; ~0 on-policy
    clip_fraction: float | None = None
    entropy: float | None = None
    kl_to_base: float | None = None
    # distillation: the student's reverse KL to its teacher on the sampled tokens (mean of
    # log p_student - log p_teacher), measured before the step; it falls as the student learns
    teacher_kl: float | None = None
    grad_norm: float | None = None
    optimizer_steps: int = 0
    skipped_optimizer_steps: int = 0
    padding_fraction: float | None = None
    # The share of the step's sequence tokens its forward passes did not encode, each encoded once
    # for all the sequences that begin with it (art-server --share-prefix).
    prefix_shared_fraction: float | None = None
    lora_update_norm: float | None = None
    # The optimizer's moments were started afresh: the run's previous step was of the other kind
    # (SFT before RL, as after a warm start), whose gradients they estimated.
    optimizer_reset: bool = False
    learning_rate: float | None = None
    step_seconds: float | None = None
    # Where the step's time went, on the trainer: the batch built from the groups (tokens spliced,
    # advantages), the forward passes (the reference's included, and any wait for the model while
    # the engine samples on it), the backward passes, the optimizer updates (gradient clipping
    # included). A data-parallel step reports its slowest rank's.
    assembly_seconds: float | None = None
    forward_seconds: float | None = None
    backward_seconds: float | None = None
    optimizer_seconds: float | None = None
    # Waiting at the server between the job's submission and the start of its training (other
    # runs' jobs ahead of it at the trainer).
    queue_seconds: float | None = None
    # Loading the new adapter into the engine once the checkpoint is written (the job's result only:
    # the checkpoint is written before it is known).
    publish_seconds: float | None = None
    checkpoint_seconds: float | None = None  # writing the step's checkpoint (the job's result only, as above)
    tokens_per_second: float | None = None  # of the sequences' tokens, shared ones counted for each sequence
