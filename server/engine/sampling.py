"""Next-token sampling for a batch of rows with their own settings.

The logprob reported for a sampled token is log softmax(logits / T) at the row's own
temperature, taken before top-p truncation or a grammar's mask (invariant 2): that is the
distribution the trainer recomputes, so an on-policy step starts with ratio 1. Greedy rows
(T = 0) report T = 1 logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0
    ignore_eos: bool = False
    constraint: Any = None  # server.engine.constraints.Constraint: a grammar the output must follow

    @property
    def logprob_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Sampled:
    tokens: torch.Tensor  # [B]
    logprobs: torch.Tensor  # [B]
    top_ids: torch.Tensor | None  # [B, k]
    top_logprobs: torch.Tensor | None  # [B, k]


def logprobs_at_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T) per row; T <= 0 means greedy and is reported at T = 1."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return torch.log_softmax(logits.float() / t[:, None], dim=-1)


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero out the tail beyond each row's nucleus (the smallest set with mass >= top_p). The most
    likely token always stays: a top_p that rounds to 0 in float32 (5e-324 does) would leave nothing."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    tail = mass_before >= top_p[:, None]
    tail[:, 0] = False
    sorted_p = sorted_p.masked_fill(tail, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    top_k: int = 0,
    allowed: torch.Tensor | None = None,
) -> Sampled:
    """`allowed`: [B, V] booleans, the tokens each row's grammar permits (all True when none)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
    logprobs = logprobs_at_temperature(logits, temperature)
    probs = logprobs.exp()
    if allowed is not None:
        probs = probs * allowed
        probs = probs / probs.sum(-1, keepdim=True)
        logits = logits.masked_fill(~allowed, float("-inf"))  # greedy rows pick among the allowed too
    if bool((top_p < 1).any()):
        probs = top_p_filter(probs, top_p)
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0]
    seeded = [i for i, g in enumerate(generators) if g is not None and params[i].temperature > 0]
    free = [i for i in range(len(params)) if i not in set(greedy) | set(seeded)]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    if free:
        tokens[free] = torch.multinomial(probs[free], 1).squeeze(-1)
    for i in seeded:  # a seed makes a row reproducible whatever else shares its batch
        tokens[i] = torch.multinomial(probs[i], 1, generator=generators[i]).squeeze(-1)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    top_ids = top_lp = None
    if top_k > 0:
        top_lp, top_ids = logprobs.topk(top_k, dim=-1)
    return Sampled(tokens, chosen, top_ids, top_lp)
