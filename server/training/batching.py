"""Packing sequences into micro-batches with no padding.

Each micro-batch is one row of concatenated sequences whose position ids restart at every
sequence boundary; transformers then builds a block-diagonal causal mask, so sequences never
attend to each other. Rows are filled first-fit-decreasing up to the token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.training.assemble import TrainSequence


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of sequences per row, first-fit decreasing. A sequence longer than the budget
    gets a row of its own (it cannot be split without cutting its context)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(budget - lengths[i])
    return rows


@dataclass
class Microbatch:
    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    logit_positions: torch.Tensor  # [K] positions whose logits predict a loss token
    targets: torch.Tensor  # [K]
    old_logprobs: torch.Tensor  # [K]
    temperatures: torch.Tensor  # [K]
    advantages: torch.Tensor  # [K]
    weights: torch.Tensor  # [K]
    seq_index: torch.Tensor  # [K] index of the token's sequence within the minibatch
    n_tokens: int  # tokens in the row

    @property
    def n_loss_tokens(self) -> int:
        return int(self.targets.numel())


def make_microbatch(seqs: list[TrainSequence], seq_ids: list[int], device: torch.device) -> Microbatch:
    ids: list[int] = []
    pos: list[int] = []
    logit_pos: list[int] = []
    targets: list[int] = []
    old, temps, adv, w, sidx = [], [], [], [], []
    for seq, sid in zip(seqs, seq_ids):
        offset = len(ids)
        ids += seq.ids
        pos += range(len(seq.ids))
        for t in range(1, len(seq.ids)):
            if seq.mask[t]:
                logit_pos.append(offset + t - 1)
                targets.append(seq.ids[t])
                old.append(seq.old_logprobs[t])
                temps.append(seq.temperatures[t])
                adv.append(seq.advantage)
                w.append(seq.weight)
                sidx.append(sid)

    def t(x, dtype=torch.float32):
        return torch.tensor(x, dtype=dtype, device=device)

    return Microbatch(
        input_ids=t([ids], torch.long), position_ids=t([pos], torch.long),
        logit_positions=t(logit_pos, torch.long), targets=t(targets, torch.long),
        old_logprobs=t(old), temperatures=t(temps), advantages=t(adv), weights=t(w),
        seq_index=t(sidx, torch.long), n_tokens=len(ids),
    )
