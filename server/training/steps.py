"""A training step computed, from submitted groups (RL) or conversations (SFT) to an updated
adapter and the figures that say how it went; committing it is server/training/commit.py's.

RL, as a pipeline of named steps: count what was submitted; drop the groups sampled by a policy
more steps behind than the submission allows (protocol/staleness.py); drop the groups that carry
no signal (every rollout failed, one rollout, constant rewards) and give the rest group-relative
advantages; assemble token-exact sequences; optimise; measure. A step with nothing to train
comes back untrained and says why. A step whose update is not finite raises StepFailed; the
caller restores the run's last checkpoint, so it is never served.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from protocol.choices import choice_token_ids
from protocol.config import SFTConfig, TrainConfig
from protocol.domains import domain_figures
from protocol.jobs import RLJob, SFTJob
from protocol.metrics import StepMetrics
from protocol.staleness import sampled_step, split_by_staleness, staleness
from protocol.trajectory import Conversation, TrajectoryGroup
from server.runs.run import Run
from server.training.advantages import (GroupAdvantages, awr_weights, given_value_advantages, group_advantages,
                                        leave_one_out_advantages)
from server.training import bounds, distill
from server.training.assemble import AssemblyStats, TrainSequence, assemble_history, assemble_sft
from server.training.health import NON_FINITE_UPDATE, constant_split, step_warnings
from server.training.hyperparams import default_learning_rate
from server.training.losses import signal_share
from server.training.optimize import OptimizeStats, OptimPlan, optimize, rl_loss, sft_loss


@dataclass
class Hooks:
    """How a step talks to the job running it, and where its optimisation pass runs."""

    progress: Callable[[str, dict[str, Any]], None] = lambda stage, data: None
    should_stop: Callable[[], bool] = lambda: False  # cancelled, or past the job's time limit
    # The optimisation pass: in this process, or dealt to data-parallel training processes
    # (server/training/data_parallel.py); the same arguments and result either way.
    optimize: Callable[..., OptimizeStats] = optimize
    max_optimizer_steps: int | None = None  # the server's bound per job (server/training/bounds.py)
    teacher: distill.Teacher | None = None  # scores the student's tokens for TrainConfig.distill


@dataclass
class ComputedStep:
    """A step optimised and measured but not committed: the run's adapter holds the update (when
    it trained), its step number and checkpoints do not yet."""

    kind: str  # "rl" or "sft"
    metrics: StepMetrics
    warnings: list[str]

    @property
    def trained(self) -> bool:
        return self.metrics.trained


class StepFailed(RuntimeError):
    """The step ran but its result must not be served; the run keeps its last good adapter. Carries
    the figures measured up to the failure, which explain it."""

    def __init__(self, message: str, metrics: StepMetrics):
        super().__init__(message)
        self.metrics = metrics


@dataclass
class Batch:
    """What an RL step trains on, and what it dropped."""

    sequences: list[TrainSequence] = field(default_factory=list)
    stats: AssemblyStats = field(default_factory=AssemblyStats)
    groups_trainable: int = 0
    groups_dropped: dict[str, int] = field(default_factory=lambda: {"empty": 0, "single": 0, "constant": 0})
    histories: int = 0
    dropped_tokens: int = 0  # completion tokens of dropped groups (for the loss normaliser)
    dropped_sequences: int = 0
    advantages: list[float] = field(default_factory=list)  # of the trained trajectories
    values: list[float] = field(default_factory=list)  # the given values of the trained groups
    constant_rewards: list[float] = field(default_factory=list)  # the reward of each group dropped as constant


def advantages_for(g: TrajectoryGroup, cfg: TrainConfig) -> GroupAdvantages:
    """The group's advantages under the submission's baseline (protocol/config.py: Baseline).
    Distilling, a group without reward signal still trains (at reward advantage 0: the teacher's
    KL is its signal), and without `with_reward` every reward advantage is 0."""
    adv = _reward_advantages(g, cfg)
    if cfg.distill is None or adv.dropped == "empty":
        return adv
    if adv.advantages is None or not cfg.distill.with_reward:
        return GroupAdvantages([0.0] * len(g.trajectories), adv.mean, adv.std, adv.spread)
    return adv


def _reward_advantages(g: TrajectoryGroup, cfg: TrainConfig) -> GroupAdvantages:
    rewards = [t.reward for t in g.trajectories]
    if cfg.baseline == "given":
        # RLJob refuses a "given" submission with a group that lacks its value: never None here.
        return given_value_advantages(rewards, g.value, keep_zero=cfg.loss == "apo",
                                      min_spread=cfg.min_group_reward_spread)
    if cfg.baseline == "leave_one_out":
        return leave_one_out_advantages(rewards, cfg.min_group_reward_spread)
    return group_advantages(rewards, cfg.scale_rewards, cfg.min_group_reward_spread)


def submission_figures(groups: list[TrajectoryGroup]) -> StepMetrics:
    rewards = [t.reward for g in groups for t in g.trajectories]
    mean = sum(rewards) / len(rewards) if rewards else None
    return StepMetrics(groups_total=len(groups), trajectories_total=len(rewards), domains=domain_figures(groups),
                       trajectories_excluded=sum(len(g.exceptions) for g in groups), reward_mean=mean,
                       reward_std=math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else None)


def build_batch(run: Run, groups: list[TrajectoryGroup], cfg: TrainConfig,
                should_stop: Callable[[], bool] = lambda: False) -> Batch:
    """Advantages per group (groups without signal dropped, counted by why), then every history of
    every trajectory assembled into sequences that carry their trajectory's advantage."""
    batch = Batch()
    for gi, g in enumerate(groups):
        adv = advantages_for(g, cfg)
        if adv.advantages is None:
            batch.groups_dropped[adv.dropped] += 1
            if adv.dropped == "constant":
                batch.constant_rewards.append(adv.mean)
            batch.dropped_sequences += len(g.trajectories)
            batch.dropped_tokens += sum(len(choice_token_ids(c) or []) for t in g.trajectories
                                        for h in t.histories() for c in h.choices())
            continue
        weights = awr_weights(adv.advantages) if cfg.loss == "awr" else [1.0] * len(adv.advantages)
        before = len(batch.sequences)
        for ti, (traj, a, w) in enumerate(zip(g.trajectories, adv.advantages, weights)):
            batch.histories += len(traj.additional_histories)
            first = len(batch.sequences)
            for history in traj.histories():
                seqs, st = assemble_history(history, run.host.chat, cfg.mask_truncated, should_stop,
                                            train_mismatched=not cfg.skip_mismatched_prompts)
                batch.stats.add(st)
                for s in seqs:
                    s.advantage, s.weight, s.group = a, w, gi
                batch.sequences += seqs
            if cfg.loss == "apo" and len(batch.sequences) - first > 1:
                # Each piece would be pulled to the whole r - V*: the response's log-ratio to k times it.
                raise ValueError(
                    f"loss 'apo' regresses one log-ratio per response, and trajectory {ti} of group {gi} "
                    f"assembles into {len(batch.sequences) - first} sequences (additional histories, or turns "
                    f"whose prompt does not extend the previous one): train multi-sequence agents with grpo")
        batch.groups_trainable += len(batch.sequences) > before
        if len(batch.sequences) > before:
            batch.advantages += adv.advantages
            if g.value is not None and cfg.baseline == "given":
                batch.values.append(g.value)
    return batch


def advantage_figures(batch: Batch, cfg: TrainConfig) -> dict[str, Any]:
    """What the trained advantages were: a run whose advantages are never positive (every sample
    at or below its baseline, as when V* came from reference samples that all failed) has nothing
    to move towards, and says so (server/training/health.py)."""
    adv = batch.advantages
    return {"baseline": cfg.baseline, "loss_name": cfg.loss,
            "advantage_mean": sum(adv) / len(adv) if adv else None,
            "advantage_positive_fraction": sum(a > 0 for a in adv) / len(adv) if adv else None,
            "value_mean": sum(batch.values) / len(batch.values) if batch.values else None}


def compute(run: Run, request: RLJob | SFTJob, hooks: Hooks = Hooks()) -> ComputedStep:
    if isinstance(request, RLJob):
        return rl_step(run, request.groups, request.config, hooks)
    return sft_step(run, request.conversations, request.config, hooks)


def fresh_enough(run: Run, groups: list[TrajectoryGroup], cfg: TrainConfig
                 ) -> tuple[list[TrajectoryGroup], dict[str, Any]]:
    """The groups within the submission's staleness bound, and the staleness figures of the step.
    Staleness is measured against the weights this step starts from (the run's current step)."""
    split = split_by_staleness([staleness(run.step, sampled_step(g, run.name)) for g in groups],
                               cfg.max_steps_off_policy)
    return [groups[i] for i in split.kept], {
        "staleness_mean": split.mean, "staleness_max": split.max, "groups_dropped_stale": len(split.dropped),
        "staleness_bound": cfg.max_steps_off_policy}


def rl_step(run: Run, groups: list[TrajectoryGroup], cfg: TrainConfig, hooks: Hooks = Hooks()) -> ComputedStep:
    t0 = time.time()
    m = submission_figures(groups)
    groups, stale_figures = fresh_enough(run, groups, cfg)
    m = m.model_copy(update=stale_figures)
    batch = build_batch(run, groups, cfg, hooks.should_stop)
    dropped = batch.groups_dropped
    solved, failed = constant_split(batch.constant_rewards, [t.reward for g in groups for t in g.trajectories])
    m = m.model_copy(update={**vars(batch.stats), "groups_trainable": batch.groups_trainable,
                             "groups_constant_solved": solved, "groups_constant_failed": failed,
                             "groups_dropped_constant": dropped["constant"], "groups_dropped_single": dropped["single"],
                             "groups_dropped_failed": dropped["empty"], "additional_histories": batch.histories,
                             "trainable_tokens": sum(s.n_loss_tokens for s in batch.sequences),
                             **advantage_figures(batch, cfg)})
    m.truncated_fraction = m.truncated_choices / m.choices if m.choices else 0.0
    m.assembly_seconds = time.time() - t0
    hooks.progress("assembled", {"sequences": len(batch.sequences), "trainable_tokens": m.trainable_tokens})
    if m.trainable_tokens == 0:
        m.step_seconds = time.time() - t0
        return _measured(run, "rl", m)
    if cfg.distill is not None:
        if hooks.teacher is None:
            raise ValueError("this server cannot distill: its job worker has no teacher")
        hooks.progress("teacher", {"teacher": cfg.distill.teacher})
        m.teacher_kl = distill.apply(run.host, batch.sequences, cfg.distill, hooks.teacher)
    m.signal_share = 1.0
    if cfg.count_dropped_groups:
        m.signal_share = signal_share(cfg.loss_aggregation, m.trainable_tokens, len(batch.sequences),
                                      batch.dropped_tokens, batch.dropped_sequences)
    plan = OptimPlan.for_rl(cfg, cfg.learning_rate or default_learning_rate(run.host))
    _within_bound(plan, len(batch.sequences), hooks)
    m.optimizer_reset = moments_for(run, "rl")
    fit(run, plan, m, t0, batch.sequences[0], lambda: hooks.optimize(
        run, batch.sequences, plan, rl_loss(cfg), loss_scale=m.signal_share, should_stop=hooks.should_stop))
    return _measured(run, "rl", m)


def sft_step(run: Run, conversations: list[Conversation], cfg: SFTConfig, hooks: Hooks = Hooks()) -> ComputedStep:
    t0 = time.time()
    sequences = [s for c in conversations for s in assemble_sft(c, run.host.chat, hooks.should_stop)]
    m = StepMetrics(conversations=len(conversations), sequences=len(sequences),
                    trainable_tokens=sum(s.n_loss_tokens for s in sequences), assembly_seconds=time.time() - t0)
    hooks.progress("assembled", {"sequences": len(sequences), "trainable_tokens": m.trainable_tokens})
    if m.trainable_tokens == 0:
        m.step_seconds = time.time() - t0
        return _measured(run, "sft", m)
    plan = OptimPlan.for_sft(cfg, cfg.learning_rate or default_learning_rate(run.host), len(sequences))
    _within_bound(plan, len(sequences), hooks)
    m.optimizer_reset = moments_for(run, "sft")
    fit(run, plan, m, t0, sequences[0], lambda: hooks.optimize(
        run, sequences, plan, sft_loss, measure_gap=False, measure_kl=False, should_stop=hooks.should_stop))
    return _measured(run, "sft", m)


def _within_bound(plan: OptimPlan, n_sequences: int, hooks: Hooks) -> None:
    """The bound checked at submission, on the sequences assembly made (it can make more than one
    per trajectory)."""
    steps = bounds.optimizer_steps(plan.epochs, min(plan.num_minibatches, n_sequences))
    bounds.check_steps(steps, hooks.max_optimizer_steps, "would take")


def moments_for(run: Run, kind: str) -> bool:
    """Clear the optimizer's moments when the run's last step was of another kind; whether it did.

    Adam's moments are running estimates of one objective's gradients. After an SFT warm start the
    second moment holds the likelihood's gradients (leg_lookup's: norm 0.37, against 0.014-0.05 for
    its GRPO steps), and with beta2 0.99 it divides the RL updates by them for tens of steps, while
    the first moment carries the SFT direction into the first few: there, greedy success rose +0.06
    in 8 GRPO steps with the moments kept and +0.19 with fresh ones. A new objective starts from
    fresh moments, as it would in a trainer of its own (TRL's GRPOTrainer after its SFTTrainer)."""
    if not run.optimizer.state or run.last_kind() in (None, kind):
        return False
    run.optimizer.state.clear()
    return True


def _measured(run: Run, kind: str, m: StepMetrics) -> ComputedStep:
    """The step with its warnings; the rules that compare steps read the run's last one of this kind."""
    return ComputedStep(kind, m, step_warnings(m, run.last_metrics(kind)))


def fit(run: Run, plan: OptimPlan, m: StepMetrics, t0: float, probe: TrainSequence,
        run_optimizer: Callable[[], Any]) -> None:
    """The optimisation pass and the figures only it can give (update norm, throughput). An update
    that leaves the adapter, or what it computes on `probe`, non-finite raises StepFailed with the
    figures that show it (the caller restores the last checkpoint)."""
    before = [p.detach().clone() for p in run.params]
    stats = run_optimizer()
    for k, v in stats.figures().items():
        setattr(m, k, v)
    m.lora_update_norm = math.sqrt(sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(run.params, before)))
    m.learning_rate = plan.learning_rate
    m.step_seconds = time.time() - t0
    m.tokens_per_second = stats.sequence_tokens * plan.epochs / max(m.step_seconds, 1e-9)
    if stats.optimizer_steps and not _finite(run, probe.ids[:256]):
        raise StepFailed(NON_FINITE_UPDATE, m)
    m.trained = stats.optimizer_steps > 0


def _finite(run: Run, ids: list[int]) -> bool:
    if not all(bool(torch.isfinite(p).all()) for p in run.params):
        return False
    host = run.host
    with host.lock, torch.no_grad():
        host.model.set_adapter(run.adapter)
        logits = host.model(input_ids=torch.tensor([ids], device=host.device)).logits
    return bool(torch.isfinite(logits).all())
