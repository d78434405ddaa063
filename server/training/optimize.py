"""One optimisation pass over assembled sequences: the path from tokens to a gradient step.

Reads like nanoGPT's train loop: split into minibatches, pack each into micro-batches (as many
tokens as the server's memory budget leaves room for, server/training/memory.py), forward at each
token's sampling temperature, loss, backward, clip, step. Everything a health report needs
(logprob gap, clip fraction, entropy, KL to base, grad norms) is measured on the way.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, get_args

import torch
from torch.utils.checkpoint import checkpoint

from protocol.config import LossName, SFTConfig, TrainConfig
from server.model.architecture import decoder, output_logits
from server.model.memory import gb, trim
from server.training import losses, memory
from server.training.assemble import Cancelled, TrainSequence
from server.training.batching import Microbatch, deal, make_microbatch, plan
from server.training.packing import MAX_ROW, Pack, attention_weight, packable_length, packs, single

log = logging.getLogger("artisan.train")
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
    """The submission's token loss; a partial of a module function, so that it pickles to the
    data-parallel training processes (server/training/data_parallel.py)."""
    if cfg.loss not in get_args(LossName):
        raise ValueError(f"unknown loss {cfg.loss!r}")
    return functools.partial(_rl_token_loss, cfg)


def _rl_token_loss(cfg: TrainConfig, lp: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.loss == "ppo":
        return losses.ppo_loss(lp, mb.old_logprobs, mb.advantages, cfg.epsilon_low, cfg.epsilon_high)
    if cfg.loss == "cispo":
        return losses.cispo_loss(lp, mb.old_logprobs, mb.advantages, cfg.epsilon_low, cfg.epsilon_high)
    if cfg.loss == "importance_sampling":
        return losses.truncated_is_loss(lp, mb.old_logprobs, mb.advantages, cfg.is_truncation_cap)
    if cfg.loss == "awr":
        return losses.awr_loss(lp, mb.weights)
    return losses.apo_loss(lp, mb.ref_logprobs, mb.advantages, mb.seq_index, cfg.apo_beta)


def sft_loss(lp: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
    return -lp, torch.zeros_like(lp, dtype=torch.bool)


@dataclass(frozen=True)
class Shard:
    """One rank's part of a data-parallel step (server/training/data_parallel.py): it computes
    the micro-batches `batching.deal` gives it, then `reduce` sums every rank's gradients into
    its own in place and answers whether any rank was told to stop."""

    rank: int
    world: int
    reduce: Callable[[list[torch.nn.Parameter], bool], bool]


@dataclass
class OptimizeStats:
    loss: float = 0.0
    loss_tokens: int = 0
    row_tokens: int = 0  # encoded in the rows (a shared prefix once)
    sequence_tokens: int = 0  # in the sequences (a shared prefix once for each)
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
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    optimizer_seconds: float = 0.0

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
            "prefix_shared_fraction": 1 - self.row_tokens / self.sequence_tokens if self.sequence_tokens else None,
            "forward_seconds": self.forward_seconds,
            "backward_seconds": self.backward_seconds,
            "optimizer_seconds": self.optimizer_seconds,
        }

    @classmethod
    def merged(cls, ranks: list["OptimizeStats"]) -> "OptimizeStats":
        """The step's figures from its ranks': sums add up; grad norms and optimizer steps are
        taken after the all-reduce, the same on every rank, so rank 0's are the step's; the ranks
        run at once, so a phase took as long as its slowest rank."""
        total = cls(grad_norms=list(ranks[0].grad_norms), skipped_steps=ranks[0].skipped_steps,
                    optimizer_steps=ranks[0].optimizer_steps,
                    **{name: max(getattr(r, name) for r in ranks)
                       for name in ("forward_seconds", "backward_seconds", "optimizer_seconds")})
        for part in ranks:
            for name in ("loss", "loss_tokens", "row_tokens", "sequence_tokens", "padding_tokens", "gap_sum",
                         "gap_tokens", "clipped", "entropy_sum", "kl_sum", "kl_tokens"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
        return total


# Elements of one chunk's [positions x vocab] logits: 2**24 floats are 64 MiB a copy, and the
# chunk's log-softmax holds about four copies at once (logits, scaled, log-probs, probabilities).
LOGIT_CHUNK_ELEMENTS = 2**24


def logit_chunk(vocab: int) -> int:
    """Loss positions whose logits are computed together."""
    return max(1, LOGIT_CHUNK_ELEMENTS // max(vocab, 1))


def _chunk_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                    temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lp_all = torch.log_softmax(head(hidden).float() / temperatures[:, None], dim=-1)
    entropy = -(lp_all.exp() * lp_all).sum(-1)
    return lp_all.gather(-1, targets[:, None]).squeeze(-1), entropy.detach()


def token_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                   temperatures: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of `targets` [K] under `head(hidden)` [K, vocab] at each position's
    temperature, and each position's entropy (no gradient), `chunk` positions at a time.

    The full [K x vocab] float32 logits never exist at once: with a 262k vocabulary (Gemma 3) a
    thousand loss tokens are a GiB a copy. With gradients each chunk is a checkpoint: only its
    hidden states are kept for backward, which recomputes the chunk's logits (one more pass of the
    output head, a small share of the step), so the gradient is the unchunked one."""
    lps, entropies = [], []
    for i in range(0, targets.shape[0], chunk):
        part = (head, hidden[i:i + chunk], targets[i:i + chunk], temperatures[i:i + chunk])
        if torch.is_grad_enabled() and hidden.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs, *part, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*part)
        lps.append(lp)
        entropies.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(lps), torch.cat(entropies)


def _forward_logprobs(host: Any, mb: Microbatch, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of the targets at each token's own sampling temperature, and each loss token's
    entropy. The output head runs only on loss positions, a chunk at a time (token_logprobs)."""
    lm = host.model.get_base_model() if host.has_adapters else host.model
    with torch.set_grad_enabled(grad), host.training_forward():
        hidden = decoder(lm)(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                             position_ids=mb.position_ids, use_cache=False)[0]
        return token_logprobs(output_logits(lm), hidden[mb.rows, mb.logit_positions], mb.targets, mb.temperatures,
                              logit_chunk(lm.get_output_embeddings().weight.shape[0]))


def optimize(run: Any, sequences: list[TrainSequence], p: OptimPlan, token_loss: TokenLoss,
             measure_gap: bool = True, measure_kl: bool = True, loss_scale: float = 1.0,
             should_stop: Callable[[], bool] = lambda: False, shard: Shard | None = None) -> OptimizeStats:
    """`shard`: this process computes one rank's micro-batches of a data-parallel step; None: all."""
    if shard is None:  # data-parallel ranks keep the plan as given: all of them must cut the same micro-batches
        p = fit_memory(run, sequences, p)
    try:
        return _optimize(run, sequences, p, token_loss, measure_gap, measure_kl, loss_scale, should_stop, shard)
    finally:
        trim()  # the step's activations go back to the machine, not to this process's heaps


def fit_memory(run: Any, sequences: list[TrainSequence], p: OptimPlan) -> OptimPlan:
    """The plan with micro-batches that fit the server's memory budget (server/training/memory.py);
    raises TooLarge when the longest sequence alone would not."""
    host = run.host
    with host.lock:
        host.model.set_adapter(run.adapter)
        per_token = memory.token_bytes(host, run.adapter)
    trim()  # what the process holds, not what its heaps keep
    room = memory.room(host.device, getattr(host, "memory_budget", None))
    memory.check_longest(max(len(s.ids) for s in sequences), per_token, room, host.gradient_checkpointing)
    tokens = memory.microbatch_tokens(p.max_tokens_per_microbatch, room.free, per_token,
                                      memory.working_set(host.device, getattr(host, "memory_budget", None)))
    log.info("micro-batches of at most %d tokens (%.2f MB a token; the server holds %s of %s)", tokens,
             per_token / 1e6, gb(room.held), gb(room.limit))
    return dataclasses.replace(p, max_tokens_per_microbatch=tokens)


def _optimize(run: Any, sequences: list[TrainSequence], p: OptimPlan, token_loss: TokenLoss, measure_gap: bool,
              measure_kl: bool, loss_scale: float, should_stop: Callable[[], bool],
              shard: Shard | None) -> OptimizeStats:
    host, stats = run.host, OptimizeStats()
    for group in run.optimizer.param_groups:
        group["lr"], group["weight_decay"] = p.learning_rate, p.weight_decay
    n_mini = min(p.num_minibatches, len(sequences))
    minibatches = [sequences[i::n_mini] for i in range(n_mini)]
    for epoch in range(p.epochs):
        for mi, mini in enumerate(minibatches):
            first_pass = epoch == 0 and mi == 0  # the policy is still the one that sampled
            run.optimizer.zero_grad(set_to_none=True)
            stopped = _accumulate(run, mini, p, token_loss, stats, epoch == 0, n_mini, loss_scale, should_stop,
                                  measure_gap=measure_gap and first_pass, measure_kl=measure_kl and first_pass,
                                  shard=shard)
            if shard is not None:
                stopped = shard.reduce(run.params, stopped)  # every rank stops at the same point, or none does
            if stopped:
                raise Cancelled()
            updating = time.perf_counter()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, p.max_grad_norm))
            if not math.isfinite(grad_norm):
                run.optimizer.zero_grad(set_to_none=True)  # a NaN step would poison the adapter for good
                stats.skipped_steps += 1
                continue
            stats.grad_norms.append(grad_norm)
            with host.lock:
                run.optimizer.step()
            stats.optimizer_steps += 1
            stats.optimizer_seconds += time.perf_counter() - updating
    return stats


def _rows(host: Any, mini: list[TrainSequence], max_tokens: int) -> list[Pack]:
    """The minibatch's rows: its sequences packed by shared prefix where the server shares them
    (art-server --share-prefix) and the model's attention takes a tree mask, else one a row."""
    lengths = [len(s.ids) for s in mini]
    longest = packable_length(host.config) if host.share_prefix and host.takes_tree_mask else None
    if longest is None or max(lengths) > longest:
        return [single(i, n) for i, n in enumerate(lengths)]
    return packs([s.ids for s in mini], min(max_tokens, MAX_ROW), attention_weight(host.config))


def _accumulate(run: Any, mini: list[TrainSequence], p: OptimPlan, token_loss: TokenLoss, stats: OptimizeStats,
                count: bool, n_mini: int, loss_scale: float, should_stop: Callable[[], bool], measure_gap: bool,
                measure_kl: bool, shard: Shard | None = None) -> bool:
    """Forward and backward every micro-batch of one minibatch (or of this rank's share of it)
    into the gradients. Returns True when told to stop before it was done."""
    host = run.host
    n_tokens = sum(s.n_loss_tokens for s in mini)
    seq_lengths = torch.tensor([max(s.n_loss_tokens, 1) for s in mini], dtype=torch.float32, device=host.device)
    rows = _rows(host, mini, p.max_tokens_per_microbatch)
    microbatches = plan([pk.length for pk in rows], p.max_tokens_per_microbatch)  # longest row first
    # Micro-batches keep their minibatch-wide index r, so the figure measured on the first one
    # (KL to base) is measured once, by the rank that has it.
    mine = range(len(microbatches)) if shard is None else \
        deal([len(mb_rows) * rows[mb_rows[0]].length for mb_rows in microbatches], shard.world)[shard.rank]
    for r in mine:
        if should_stop():
            return True
        started = time.perf_counter()
        mb = make_microbatch(mini, list(range(len(mini))), host.device, host.tokenizer.pad_token_id or 0,
                             packs=[rows[i] for i in microbatches[r]], mask_dtype=host.base_model.dtype)
        ref_lp = None
        kl_here = p.kl_coef > 0 or (measure_kl and r == 0)
        with host.lock:
            host.model.set_adapter(run.adapter)
            if kl_here or p.needs_reference:
                with host.model.disable_adapter(), torch.no_grad():
                    ref_lp, _ = _forward_logprobs(host, mb, grad=False)
                mb.ref_logprobs = ref_lp
            lp, entropy = _forward_logprobs(host, mb, grad=True)
        tok_loss, clipped = token_loss(lp, mb)
        if kl_here:
            kl = losses.kl_k3(lp, ref_lp)
            if p.kl_coef > 0:
                tok_loss = tok_loss + p.kl_coef * kl
            stats.kl_sum += float(kl.detach().sum())
            stats.kl_tokens += mb.n_loss_tokens
        loss = loss_scale * losses.aggregate(tok_loss, mb.seq_index, p.loss_aggregation, n_tokens, len(mini),
                                             p.constant_normalizer, seq_lengths)
        forwarded = time.perf_counter()
        loss.backward()
        if host.device.type == "cpu":
            trim()  # else each micro-batch fits its activations around the last one's holes: +0.3 GB a step
        stats.forward_seconds += forwarded - started
        stats.backward_seconds += time.perf_counter() - forwarded
        with torch.no_grad():
            if count:
                stats.loss += float(loss) / n_mini
                stats.loss_tokens += mb.n_loss_tokens
                stats.row_tokens += mb.n_tokens
                stats.sequence_tokens += mb.n_sequence_tokens
                stats.padding_tokens += mb.n_padding
                stats.clipped += int(clipped.sum())
                stats.entropy_sum += float(entropy.sum())
            if measure_gap:
                stats.gap_sum += float((lp - mb.old_logprobs).abs().sum())
                stats.gap_tokens += mb.n_loss_tokens
    return False

