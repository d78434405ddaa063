"""Which replica samples a prompt: cache-aware routing in the manner of SGLang's router.

Only prompt token ids reach an engine, so a conversation is recognised by its ids: its next turn's
prompt starts with the previous turn's prompt and answer. Each replica remembers the sequences it
served lately; a prompt goes to the replica holding its longest prefix when that prefix is long
enough and the replica is not overloaded (its prefix and KV reuse are worth more than balance only
within limits), else to the least loaded replica.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Sequence

MIN_MATCH = 0.5  # of the prompt: a shared chat header alone must not pull every prompt to one replica
MAX_IMBALANCE = 4  # sequences a prefix's replica may have in flight beyond the least loaded one


@dataclass(frozen=True)
class Candidate:
    load: int  # sequences in flight on the replica
    match: int  # tokens of the prompt that the replica served lately (its longest common prefix)


def route(prompt_len: int, candidates: Sequence[Candidate], min_match: float = MIN_MATCH,
          max_imbalance: int = MAX_IMBALANCE) -> int:
    """The index of the candidate to send the prompt to (candidates: the healthy replicas, at
    least one). Ties go to the lowest index."""
    least = min(range(len(candidates)), key=lambda i: candidates[i].load)
    best = max(range(len(candidates)), key=lambda i: (candidates[i].match, -candidates[i].load))
    c = candidates[best]
    if c.match > 0 and c.match >= min_match * prompt_len and c.load <= candidates[least].load + max_imbalance:
        return best
    return least


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([a, b]))  # type: ignore[type-var]  # it compares any sequences


class PrefixMemory:
    """The last `size` token sequences (prompt and answer) a replica served."""

    def __init__(self, size: int = 256):
        self._seqs: deque[tuple[int, ...]] = deque(maxlen=size)

    def add(self, ids: Sequence[int]) -> None:
        self._seqs.append(tuple(ids))

    def match(self, prompt: Sequence[int]) -> int:
        prompt = tuple(prompt)
        return max((common_prefix(prompt, s) for s in self._seqs), default=0)

    def clear(self) -> None:
        self._seqs.clear()
