"""One optimisation pass over assembled sequences: the path from tokens to a gradient step.

Reads like nanoGPT's train loop: split into minibatches, pack each into micro-batches, forward
at each token's sampling temperature, loss, backward, clip, step. Everything a health report
needs (logprob gap, clip fraction, entropy, KL to base, grad and update norms) is measured here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from client.types import TrainConfig
from server.training import losses
from server.training.assemble import TrainSequence
from server.training.batching import make_microbatch, plan


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

    def metrics(self) -> dict[str, float | None]:
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


def _token_losses(kind: str, cfg: TrainConfig, lp, mb):
    if kind == "sft":
        return -lp, torch.zeros_like(lp, dtype=torch.bool)
    if cfg.loss == "ppo":
        return losses.ppo_loss(lp, mb.old_logprobs, mb.advantages, cfg.epsilon_low, cfg.epsilon_high)
    if cfg.loss == "cispo":
        return losses.cispo_loss(lp, mb.old_logprobs, mb.advantages, cfg.epsilon_low, cfg.epsilon_high)
    if cfg.loss == "importance_sampling":
        return losses.truncated_is_loss(lp, mb.old_logprobs, mb.advantages, cfg.is_truncation_cap)
    if cfg.loss == "awr":
        return losses.awr_loss(lp, mb.weights)
    raise ValueError(f"unknown loss {cfg.loss!r}")


def _forward_logprobs(host: Any, mb, grad: bool):
    """Logprobs of the targets at each token's own sampling temperature, and the full
    distributions (for entropy). The output head runs only on loss positions: with a 150k
    vocabulary, logits for every position would dwarf the rest of the step's memory."""
    lm = host.model.get_base_model() if host.has_adapters else host.model
    with torch.set_grad_enabled(grad):
        hidden = lm.get_decoder()(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)[0]
        logits = lm.get_output_embeddings()(hidden[mb.rows, mb.logit_positions]).float()
        lp_all = torch.log_softmax(logits / mb.temperatures[:, None], dim=-1)
        return lp_all.gather(-1, mb.targets[:, None]).squeeze(-1), lp_all


def optimize(host: Any, adapter: str, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
             sequences: list[TrainSequence], cfg: TrainConfig, lr: float, kind: str = "rl",
             measure_kl: bool = True, loss_scale: float = 1.0) -> OptimizeStats:
    stats = OptimizeStats()
    for group in optimizer.param_groups:
        group["lr"] = lr
        group["weight_decay"] = cfg.weight_decay
    n_mini = min(cfg.num_minibatches, len(sequences))
    minibatches = [sequences[i::n_mini] for i in range(n_mini)]
    for epoch in range(cfg.epochs):
        for mi, mini in enumerate(minibatches):
            first_pass = epoch == 0 and mi == 0  # the policy is still the one that sampled
            n_tokens = sum(s.n_loss_tokens for s in mini)
            seq_lengths = torch.tensor([max(s.n_loss_tokens, 1) for s in mini], dtype=torch.float32, device=host.device)
            optimizer.zero_grad(set_to_none=True)
            for r, row in enumerate(plan([len(s.ids) for s in mini], cfg.max_tokens_per_microbatch)):
                mb = make_microbatch([mini[i] for i in row], row, host.device, host.tokenizer.pad_token_id or 0)
                ref_lp = None
                with host.lock:
                    host.model.set_adapter(adapter)
                    want_kl = cfg.kl_coef > 0 or (measure_kl and first_pass and r == 0)
                    if want_kl:
                        with host.model.disable_adapter(), torch.no_grad():
                            ref_lp, _ = _forward_logprobs(host, mb, grad=False)
                    lp, lp_all = _forward_logprobs(host, mb, grad=True)
                token_loss, clipped = _token_losses(kind, cfg, lp, mb)
                if ref_lp is not None:
                    kl = losses.kl_k3(lp, ref_lp)
                    if cfg.kl_coef > 0:
                        token_loss = token_loss + cfg.kl_coef * kl
                    stats.kl_sum += float(kl.detach().sum())
                    stats.kl_tokens += mb.n_loss_tokens
                loss = loss_scale * losses.aggregate(token_loss, mb.seq_index, cfg.loss_aggregation, n_tokens,
                                                     len(mini), cfg.constant_normalizer, seq_lengths)
                loss.backward()
                with torch.no_grad():
                    if epoch == 0:
                        stats.loss += float(loss) / n_mini
                        stats.loss_tokens += mb.n_loss_tokens
                        stats.row_tokens += mb.n_tokens
                        stats.padding_tokens += mb.n_padding
                        stats.clipped += int(clipped.sum())
                        stats.entropy_sum += float(-(lp_all.exp() * lp_all).sum(-1).sum())
                    if first_pass and kind == "rl":
                        stats.gap_sum += float((lp - mb.old_logprobs).abs().sum())
                        stats.gap_tokens += mb.n_loss_tokens
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            if not math.isfinite(grad_norm):
                optimizer.zero_grad(set_to_none=True)  # a NaN step would poison the adapter for good
                stats.skipped_steps += 1
                continue
            stats.grad_norms.append(grad_norm)
            with host.lock:
                optimizer.step()
            stats.optimizer_steps += 1
    return stats
