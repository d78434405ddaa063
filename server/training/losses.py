"""Per-token policy losses and their aggregation. Small pure functions over tensors.

All functions take, per loss token: `logprobs` (trainer, with grad), `old_logprobs` (the
sampler's, from the choice), `advantages` (the token's sequence advantage). They return the
per-token loss (to be aggregated) and the per-token clip indicator.
"""

from __future__ import annotations

import torch


def ppo_loss(logprobs, old_logprobs, advantages, eps_low: float, eps_high: float):
    """PPO's clipped surrogate with separate low/high bounds (DAPO's clip-higher)."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    is_clipped = ((ratio < 1 - eps_low) & (advantages < 0)) | ((ratio > 1 + eps_high) & (advantages > 0))
    return loss, is_clipped


def cispo_loss(logprobs, old_logprobs, advantages, eps_low: float, eps_high: float):
    """CISPO: REINFORCE weighted by the clipped, stop-gradient importance ratio, so clipped
    tokens still contribute gradient (PPO zeroes theirs)."""
    ratio = torch.exp(logprobs - old_logprobs)
    weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    is_clipped = (ratio < 1 - eps_low) | (ratio > 1 + eps_high)
    return -(weight * advantages * logprobs), is_clipped


def truncated_is_loss(logprobs, old_logprobs, advantages, cap: float):
    """REINFORCE with a truncated importance weight min(ratio, cap) (stop-gradient)."""
    ratio = torch.exp(logprobs - old_logprobs)
    weight = ratio.clamp(max=cap).detach()
    return -(weight * advantages * logprobs), ratio > cap


def awr_loss(logprobs, weights):
    """Advantage-weighted SFT: cross-entropy weighted by positive per-sequence weights."""
    return -(weights * logprobs), torch.zeros_like(logprobs, dtype=torch.bool)


def apo_loss(logprobs, ref_logprobs, advantages, seq_index, beta: float):
    """A*-PO's least-squares regression (Brantley et al. 2025): (beta * log pi(y|x)/pi_ref(y|x) -
    (r - V*(x)))^2 per sequence, with log pi(y|x) the sum of the sequence's token logprobs.

    Returned per token as its sequence's residual squared, so that seq_mean aggregation (each
    token's share 1/len) makes each sequence's loss its squared residual exactly. A sequence must
    lie in one micro-batch (batching.plan puts one sequence in one row). `advantages` per token is
    its sequence's r - V*(x). The reference is the base model (the adapter disabled)."""
    n = int(seq_index.max()) + 1 if seq_index.numel() else 0
    log_ratio = torch.zeros(n, dtype=logprobs.dtype, device=logprobs.device).index_add(
        0, seq_index, logprobs - ref_logprobs)
    residual = beta * log_ratio[seq_index] - advantages
    return residual ** 2, torch.zeros_like(logprobs, dtype=torch.bool)


def kl_k3(logprobs, ref_logprobs):
    """Schulman's k3 estimator of KL(policy || reference), per token; >= 0 and unbiased."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def aggregate(token_loss, seq_index, mode: str, n_tokens: int, n_seqs: int, constant: int, seq_lengths=None):
    """Sum this micro-batch's share of the minibatch loss.

    Normalisers are minibatch-wide (`n_tokens`, `n_seqs`), so summing micro-batch results gives
    the same gradient however the minibatch was cut into micro-batches.
    - token_mean: every loss token weighs the same.
    - seq_mean:   every sequence weighs the same (its tokens share 1/n_seqs).
    - constant:   sum / (n_seqs * constant), no length bias (Dr. GRPO).
    """
    if mode == "token_mean":
        return token_loss.sum() / max(n_tokens, 1)
    if mode == "seq_mean":
        return (token_loss / seq_lengths[seq_index]).sum() / max(n_seqs, 1)
    if mode == "constant":
        return token_loss.sum() / (max(n_seqs, 1) * constant)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def signal_share(mode: str, trained_tokens: int, trained_seqs: int, dropped_tokens: int, dropped_seqs: int) -> float:
    """The share of a step's loss normaliser that carries signal.

    Dropping constant-reward groups saves compute; it must not change the step. Plain GRPO keeps
    them at advantage 0, where they add nothing to the loss but count in its normaliser. Scaling
    the loss by this share gives that gradient back, so a step where most groups already agree
    (late in training) moves the adapter less instead of amplifying its few noisy groups.
    """
    if mode == "token_mean":
        return trained_tokens / max(trained_tokens + dropped_tokens, 1)
    return trained_seqs / max(trained_seqs + dropped_seqs, 1)
