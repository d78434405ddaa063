"""A training step from submitted groups (RL) or conversations (SFT) to a published adapter.

RL: drop failed rollouts (counted) and constant-reward groups (counted), compute group-relative
advantages, assemble token-exact sequences, optimise, measure, checkpoint, publish. A step with
nothing to train does not advance the step number and says why.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from client.types import Conversation, SFTConfig, TrainConfig, TrainResult, TrajectoryGroup, choice_token_ids
from server.model_host import ModelHost
from server.store import json_safe
from server.training import checkpoints
from server.training.advantages import awr_weights, group_advantages
from server.training.assemble import AssemblyError, AssemblyStats, assemble_sft, assemble_trajectory, validate_choice
from server.training.health import step_warnings
from server.training.hyperparams import default_learning_rate
from server.training.losses import signal_share
from server.training.optimize import optimize
from server.training.runs import Run, RunManager

Progress = Callable[[str, dict[str, Any]], None]


def validate_groups(host: ModelHost, groups: list[TrajectoryGroup]) -> None:
    """Everything that makes a submission unusable, found before it is queued (a 400)."""
    if not groups:
        raise AssemblyError("groups must not be empty")
    vocab = len(host.tokenizer)
    for gi, g in enumerate(groups):
        if not g.trajectories and not g.exceptions:
            raise AssemblyError(f"groups[{gi}] is empty: it has no trajectories and no exceptions")
        for ti, t in enumerate(g.trajectories):
            where = f"groups[{gi}].trajectories[{ti}]"
            if not math.isfinite(t.reward):
                raise AssemblyError(f"{where}.reward is {t.reward}: rewards must be finite numbers")
            for ci, item in enumerate(t.choices()):
                validate_choice(item, vocab, host.fingerprint, f"{where} choice {ci}")


def _lr(host: ModelHost, configured: float | None) -> float:
    return configured if configured is not None else default_learning_rate(host.config.hidden_size)


def _last_rl_metrics(run: Run) -> dict[str, Any]:
    """The figures of the run's latest step, when it was an RL step (the latest checkpoint always exists)."""
    meta = checkpoints.read_meta(run.checkpoint_dir, run.step)
    return meta.get("metrics", {}) if meta.get("kind") == "rl" else {}


def _update_norm(params: list[torch.nn.Parameter], before: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(params, before)))


def _finish(runs: RunManager, run: Run, kind: str, metrics: dict[str, Any], warnings: list[str],
            meta: dict[str, Any]) -> None:
    run.step += 1
    runs.save_checkpoint(run, {"kind": kind, "metrics": metrics, "warnings": warnings, "created": time.time(), **meta})
    runs.publish(run)


def rl_step(host: ModelHost, runs: RunManager, run: Run, groups: list[TrajectoryGroup], cfg: TrainConfig,
            meta: dict[str, Any], progress: Progress = lambda *_: None) -> TrainResult:
    t0 = time.time()
    rewards = [t.reward for g in groups for t in g.trajectories]
    m: dict[str, Any] = {
        "groups_total": len(groups), "groups_trainable": 0, "groups_dropped_constant": 0,
        "trajectories_total": len(rewards),
        "trajectories_excluded": sum(len(g.exceptions) for g in groups),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "reward_std": float(torch.tensor(rewards).std(unbiased=False)) if rewards else None,
    }
    stats = AssemblyStats()
    sequences = []
    dropped_tokens = dropped_seqs = 0
    for gi, g in enumerate(groups):
        adv = group_advantages([t.reward for t in g.trajectories], cfg.scale_rewards, cfg.min_group_reward_spread)
        if adv.advantages is None:
            m["groups_dropped_constant"] += 1
            dropped_seqs += len(g.trajectories)
            dropped_tokens += sum(len(choice_token_ids(c) or []) for t in g.trajectories for c in t.choices())
            continue
        weights = awr_weights(adv.advantages) if cfg.loss == "awr" else [1.0] * len(adv.advantages)
        group_seqs = []
        for traj, a, w in zip(g.trajectories, adv.advantages, weights):
            seqs, st = assemble_trajectory(traj, host.renderer, host.turns.lookup, cfg.mask_truncated)
            stats.add(st)
            for s in seqs:
                s.advantage, s.weight, s.group = a, w, gi
            group_seqs += seqs
        m["groups_trainable"] += bool(group_seqs)
        sequences += group_seqs
    m.update({k: getattr(stats, k) for k in stats.__dataclass_fields__})
    m["truncated_fraction"] = stats.truncated_choices / stats.choices if stats.choices else 0.0
    m["trainable_tokens"] = sum(s.n_loss_tokens for s in sequences)
    progress("assembled", {"sequences": len(sequences), "trainable_tokens": m["trainable_tokens"]})

    if m["trainable_tokens"] == 0:
        m.update(trained=False, step_seconds=time.time() - t0)
        warnings = step_warnings(m, _last_rl_metrics(run))
        return TrainResult(step=run.step, trained=False, metrics=_clean(m), warnings=warnings)

    share = 1.0
    if cfg.count_dropped_groups:
        share = signal_share(cfg.loss_aggregation, m["trainable_tokens"], len(sequences), dropped_tokens, dropped_seqs)
    m["signal_share"] = share
    m.update(_optimize_and_measure(host, run, sequences, cfg, cfg.learning_rate, "rl", t0, share))
    return _conclude(runs, run, "rl", m, meta)


def sft_step(host: ModelHost, runs: RunManager, run: Run, conversations: list[Conversation], cfg: SFTConfig,
             meta: dict[str, Any], progress: Progress = lambda *_: None) -> TrainResult:
    t0 = time.time()
    sequences = [assemble_sft(c.messages, c.tools, host.renderer) for c in conversations]
    n_mini = max(1, math.ceil(len(sequences) / cfg.batch_size))
    as_train = TrainConfig(learning_rate=cfg.learning_rate, num_minibatches=n_mini, epochs=cfg.epochs,
                           max_tokens_per_microbatch=cfg.max_tokens_per_microbatch, max_grad_norm=cfg.max_grad_norm)
    m: dict[str, Any] = {"conversations": len(sequences), "trainable_tokens": sum(s.n_loss_tokens for s in sequences)}
    m.update(_optimize_and_measure(host, run, sequences, as_train, cfg.learning_rate, "sft", t0))
    return _conclude(runs, run, "sft", m, meta)


def _optimize_and_measure(host: ModelHost, run: Run, sequences: list, cfg: TrainConfig, learning_rate: float | None,
                          kind: str, t0: float, loss_scale: float = 1.0) -> dict[str, Any]:
    """The optimisation pass and the figures only it can give (update norm, throughput)."""
    lr = _lr(host, learning_rate)
    before = [p.detach().clone() for p in run.params]
    ost = optimize(host, run.train_adapter, run.params, run.optimizer, sequences, cfg, lr, kind=kind,
                   measure_kl=kind == "rl", loss_scale=loss_scale)
    m = ost.metrics()
    m["lora_update_norm"] = _update_norm(run.params, before)
    m["learning_rate"] = lr
    m["step_seconds"] = time.time() - t0
    m["tokens_per_second"] = ost.row_tokens * cfg.epochs / max(m["step_seconds"], 1e-9)
    m["trained"] = ost.optimizer_steps > 0
    return m


def _conclude(runs: RunManager, run: Run, kind: str, m: dict[str, Any], meta: dict[str, Any]) -> TrainResult:
    """Warnings, and for a step that trained: checkpoint, publish, advance the step number."""
    warnings = step_warnings(m)
    if m["trained"]:
        _finish(runs, run, kind, _clean(m), warnings, meta)
    return TrainResult(step=run.step, trained=bool(m["trained"]), metrics=_clean(m), warnings=warnings)


def _clean(m: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe figures: bools as ints, non-finite floats as None (the store's convention)."""
    return json_safe({k: int(v) if isinstance(v, bool) else v for k, v in m.items()})
