"""The logprobs a served model gives to tokens it is shown rather than samples: what a teacher
says of a student's exact tokens (on-policy distillation). Temperature 1, the same forward pass
as training's, with each token's top-k alternatives and the log of the probability left outside
them, so a client can form a full or a top-k KL."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.model.host import ModelHost

# The floor a remaining mass's log is reported at where the top k hold all of it (JSON has no -inf).
LOG_FLOOR = -1e4


@dataclass
class Scored:
    logprobs: list[float]  # of token_ids[start:], each given every token before it
    top: list[list[tuple[int, float]]] | None = None  # per scored position, the k likeliest (id, logprob)
    rest: list[float] | None = None  # per scored position, log of the probability outside the top k


def adapter_here(host: ModelHost, adapter: str | None) -> bool:
    """Whether this process's model holds `adapter` (None: the base model, always). With --replicas
    or vLLM, the adapters of served steps live in the engine's processes instead."""
    return adapter is None or (host.has_adapters and adapter in host.model.peft_config)


def elsewhere(name: str) -> str:
    """Why the served `name` cannot be scored here (adapter_here is False)."""
    return (f"{name!r} is served by engine processes outside this one (--replicas or vLLM): scoring its tokens "
            f"needs its adapter in the server's own model")


def batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Sequence indices in padded batches of at most `max_tokens` (rows x longest), shortest first."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if out and (len(out[-1]) + 1) * lengths[i] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def score(host: ModelHost, adapter: str | None, sequences: list[tuple[list[int], int]], top_k: int = 0,
          max_tokens: int = 8192, temperatures: list[list[float]] | None = None) -> list[Scored]:
    """For each (token ids, start): the logprob of every token from `start` (at least 1) on, under
    `adapter` (None: the base model); with `temperatures`, each sequence's scored tokens at their own
    temperature (one per token from `start`), else at 1."""
    out: list[Scored | None] = [None] * len(sequences)
    for batch in batches([len(ids) for ids, _ in sequences], max_tokens):
        width = max(len(sequences[i][0]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(sequences[i][0])] = torch.tensor(sequences[i][0])
            mask[row, : len(sequences[i][0])] = 1
        with host.lock, torch.no_grad():
            logits = host.forward(ids.to(host.device), [adapter] * len(batch),
                                  attention_mask=mask.to(host.device)).logits
        for row, i in enumerate(batch):
            tokens, start = sequences[i]
            scaled = logits[row, start - 1: len(tokens) - 1].float()  # predicts tokens[start:]
            if temperatures is not None:
                scaled = scaled / torch.tensor(temperatures[i], device=scaled.device)[:, None]
            lp = torch.log_softmax(scaled, dim=-1)
            given = torch.tensor(tokens[start:], device=lp.device).unsqueeze(1)
            scored = Scored(lp.gather(1, given).squeeze(1).tolist())
            if top_k:
                values, indices = lp.topk(top_k, dim=-1)
                rest = torch.logsumexp(lp.scatter(1, indices, float("-inf")), dim=-1).clamp(min=LOG_FLOOR)
                scored.top = [list(zip(ix, v)) for ix, v in zip(indices.tolist(), values.tolist())]
                scored.rest = rest.tolist()
            out[i] = scored
    return out  # type: ignore[return-value]
