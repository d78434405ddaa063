"""One optimisation pass over assembled sequences: the path from tokens to a gradient step.

Reads like nanoGPT's train loop: split into minibatches, pack each into micro-batches, forward
at each token's sampling temperature, loss, backward, clip, step. Everything a health report
needs (logprob gap, clip fraction, entropy, KL to base, grad norms) is measured on the way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from protocol.config import SFTConfig, TrainConfig
from server.training import losses
from server.training.assemble import Cancelled, TrainSequence
from server.training.batching import Microbatch, make_microbatch, plan

# (trainer logprobs with grad, micro-batch) -> (per-token loss, per-token clipped)
TokenLoss = Callable[[torch.Tensor, Microbatch], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class OptimPlan:
    """How the optimizer walks one batch, for RL and SFT alike."""

    learning_rate: float
    epochs: int = 1
    num_minibatches: int = 1
    max_tokens_per_microbatch: int = 4096
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    loss_aggregation: str = "token_mean"
    constant_normalizer: int = 1024
    kl_coef: float = 0.0
    needs_reference: bool = False  # the loss itself reads the base model's logprobs (A*-PO)

    @classmethod
    def for_rl(cls, cfg: TrainConfig, lr: float) -> "OptimPlan":
        return cls(lr, cfg.epochs, cfg.num_minibatches, cfg.max_tokens_per_microbatch, cfg.max_grad_norm,
                   cfg.weight_decay, cfg.loss_aggregation, cfg.constant_normalizer, cfg.kl_coef,
                   needs_reference=cfg.loss == "apo")

    @classmethod
    def for_sft(cls, cfg: SFTConfig, lr: float, n_sequences: int) -> "OptimPlan":
        return cls(lr, cfg.epochs, max(1, math.ceil(n_sequences / cfg.batch_size)), cfg.max_tokens_per_microbatch,
                   cfg.max_grad_norm)


def rl_loss(cfg: TrainConfig) -> TokenLoss:
    if cfg.loss == "ppo":
        return lambda lp, mb: losses.ppo_loss(lp, mb.old_logprobs, mb.advantages, cfg.epsilon_low, cfg.epsilon_high)
    if cfg.loss == "cispo":
        return lambda lp, mb: losses.cispo_loss(lp, mb.old_logprobs, mb.advantages, cfg.epsilon_low, cfg.epsilon_high)
    if cfg.loss == "importance_sampling":
        return lambda lp, mb: losses.truncated_is_loss(lp, mb.old_logprobs, mb.advantages, cfg.is_truncation_cap)
    if cfg.loss == "awr":
        return lambda lp, mb: losses.awr_loss(lp, mb.weights)
    if cfg.loss == "apo":
        return lambda lp, mb: losses.apo_loss(lp, mb.ref_logprobs, mb.advantages, mb.seq_index, cfg.apo_beta)
    raise ValueError(f"unknown loss {cfg.loss!r}")


def sft_loss(lp: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
    return -lp, torch.zeros_like(lp, dtype=torch.bool)


@dataclass
class OptimizeStats:
    loss: float = 0.0
    loss_tokens: int = 0
    row_tokens: int = 0
    padding_tokens: int = 0
    gap_sum: float = 0.0
    gap_tokens: int = 0
    clipped: int = 0
    entropy_sum: float = 0.0
    kl_sum: float = 0.0
    kl_tokens: int = 0
    grad_norms: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    optimizer_steps: int = 0

    def figures(self) -> dict[str, Any]:
        n = max(self.loss_tokens, 1)
        return {
            "loss": self.loss,
            "logprob_gap": self.gap_sum / self.gap_tokens if self.gap_tokens else None,
            "clip_fraction": self.clipped / n,
            "entropy": self.entropy_sum / n,
            "kl_to_base": self.kl_sum / self.kl_tokens if self.kl_tokens else None,
            "grad_norm": sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else None,
            "optimizer_steps": self.optimizer_steps,
            "skipped_optimizer_steps": self.skipped_steps,
            "padding_fraction": self.padding_tokens / max(self.row_tokens + self.padding_tokens, 1),
        }


def _forward_logprobs(host: Any, mb: Microbatch, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of the targets at each token's own sampling temperature, and the full
    distributions (for entropy). The output head runs only on loss positions: with a 150k
    vocabulary, logits for every position would dwarf the rest of the step's memory."""
    lm = host.model.get_base_model() if host.has_adapters else host.model
    with torch.set_grad_enabled(grad), host.training_forward():
        hidden = lm.get_decoder()(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)[0]
        logits = lm.get_output_embeddings()(hidden[mb.rows, mb.logit_positions]).float()
        lp_all = torch.log_softmax(logits / mb.temperatures[:, None], dim=-1)
        return lp_all.gather(-1, mb.targets[:, None]).squeeze(-1), lp_all


def optimize(run: Any, sequences: list[TrainSequence], p: OptimPlan, token_loss: TokenLoss,
             measure_gap: bool = True, measure_kl: bool = True, loss_scale: float = 1.0,
             should_stop: Callable[[], bool] = lambda: False) -> OptimizeStats:
    host, stats = run.host, OptimizeStats()
    for group in run.optimizer.param_groups:
        group["lr"], group["weight_decay"] = p.learning_rate, p.weight_decay
    n_mini = min(p.num_minibatches, len(sequences))
    minibatches = [sequences[i::n_mini] for i in range(n_mini)]
    for epoch in range(p.epochs):
        for mi, mini in enumerate(minibatches):
            first_pass = epoch == 0 and mi == 0  # the policy is still the one that sampled
            run.optimizer.zero_grad(set_to_none=True)
            _accumulate(run, mini, p, token_loss, stats, epoch == 0, n_mini, loss_scale, should_stop,
                        measure_gap=measure_gap and first_pass, measure_kl=measure_kl and first_pass)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, p.max_grad_norm))
            if not math.isfinite(grad_norm):
                run.optimizer.zero_grad(set_to_none=True)  # a NaN step would poison the adapter for good
                stats.skipped_steps += 1
                continue
            stats.grad_norms.append(grad_norm)
            with host.lock:
                run.optimizer.step()
            stats.optimizer_steps += 1
    return stats


def _accumulate(run: Any, mini: list[TrainSequence], p: OptimPlan, token_loss: TokenLoss, stats: OptimizeStats,
                count: bool, n_mini: int, loss_scale: float, should_stop: Callable[[], bool], measure_gap: bool,
                measure_kl: bool) -> None:
    """Forward and backward every micro-batch of one minibatch into the gradients."""
    host = run.host
    n_tokens = sum(s.n_loss_tokens for s in mini)
    seq_lengths = torch.tensor([max(s.n_loss_tokens, 1) for s in mini], dtype=torch.float32, device=host.device)
    for r, row in enumerate(plan([len(s.ids) for s in mini], p.max_tokens_per_microbatch)):
        if should_stop():
            raise Cancelled()
        mb = make_microbatch([mini[i] for i in row], row, host.device, host.tokenizer.pad_token_id or 0)
        ref_lp = None
        kl_here = p.kl_coef > 0 or (measure_kl and r == 0)
        with host.lock:
            host.model.set_adapter(run.adapter)
            if kl_here or p.needs_reference:
                with host.model.disable_adapter(), torch.no_grad():
                    ref_lp, _ = _forward_logprobs(host, mb, grad=False)
                mb.ref_logprobs = ref_lp
            lp, lp_all = _forward_logprobs(host, mb, grad=True)
        tok_loss, clipped = token_loss(lp, mb)
        if kl_here:
            kl = losses.kl_k3(lp, ref_lp)
            if p.kl_coef > 0:
                tok_loss = tok_loss + p.kl_coef * kl
            stats.kl_sum += float(kl.detach().sum())
            stats.kl_tokens += mb.n_loss_tokens
        loss = loss_scale * losses.aggregate(tok_loss, mb.seq_index, p.loss_aggregation, n_tokens, len(mini),
                                             p.constant_normalizer, seq_lengths)
        loss.backward()
        with torch.no_grad():
            if count:
                stats.loss += float(loss) / n_mini
                stats.loss_tokens += mb.n_loss_tokens
                stats.row_tokens += mb.n_tokens
                stats.padding_tokens += mb.n_padding
                stats.clipped += int(clipped.sum())
                stats.entropy_sum += float(-(lp_all.exp() * lp_all).sum(-1).sum())
            if measure_gap:
                stats.gap_sum += float((lp - mb.old_logprobs).abs().sum())
                stats.gap_tokens += mb.n_loss_tokens

