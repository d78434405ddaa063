"""K/V of recently prefilled long prompts and finished turns, so that a prompt opening with one
prefills only the rest.

An agent re-sends its whole conversation every turn, and the rollouts of a group (and, in tau2,
every task of a domain) open with the same system prompt: tau2's policy and tool list are 5-8k
tokens. Without this, the torch engine pays for that prefix on every request. A finished turn is
kept with its reply (the engine adds it as the row retires), so the next turn, which carries the
reply as the same ids, prefills only the tool result and the new turn's opening.

An entry holds one token sequence's K/V as computed under one adapter. It is dropped when that adapter
is loaded again or unloaded (the engine calls `drop`), so a hit is always the weights the request
decodes with. Logprobs after a cached prefix equal a full prefill's up to float rounding: the
trainer's recomputation (logprob_gap) is the check. Entries are kept least recently used within a
byte budget; prompts shorter than `min_tokens` are not worth the copies and never enter. Where layers
keep a state (a linear attention's), which holds its whole prefix and cannot be cut back to a shorter
one, an entry also holds the states after its last token and after every `checkpoint_every` tokens
of its prefill (art-server --prefix-state-every), and is reused up to the furthest such point within
the shared prefix: the tasks of one tau2 domain share a system prompt of thousands of tokens, then
differ.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

MIN_TOKENS = 256
# One row's state in a layer that keeps one: its convolution's and its recurrence's tensors, by
# transformers' state index (server/engine/kv_cache.py).
RowState = tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]


def shared_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two id tensors have in common."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if len(differ) else n


@dataclass(eq=False)
class Entry:
    adapter: str | None
    ids: torch.Tensor  # [L], on the CPU: compared with each new prompt
    keys: list[torch.Tensor]  # per layer, [heads, L, head_dim]
    values: list[torch.Tensor]
    states: list[RowState] | None = None  # per layer that keeps one, its state after all L tokens
    checkpoints: dict[int, list[RowState]] = field(default_factory=dict)  # the states after fewer tokens

    @property
    def nbytes(self) -> int:
        states = [t for row in (self.states, *self.checkpoints.values()) for conv, recurrent in row or ()
                  for t in (*conv.values(), *recurrent.values())]
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *states))

    def states_within(self, shared: int) -> dict[int, list[RowState]]:
        """The states it holds after at most `shared` of its tokens, by how many tokens they follow."""
        held = {n: st for n, st in self.checkpoints.items() if n <= shared}
        if self.states is not None and shared >= len(self.ids):
            held[len(self.ids)] = self.states
        return held


@dataclass(frozen=True)
class Hit:
    entry: Entry
    length: int  # the prompt's first `length` tokens have their K/V in the entry

    @property
    def states(self) -> list[RowState] | None:
        """Where layers keep states, theirs after those `length` tokens."""
        return self.entry.states_within(self.length).get(self.length)


class PrefixCache:
    """`stateful`: the model keeps states that cannot be cut back to a shorter prefix (Qwen3.5's
    linear attention), so an entry is reused only up to a point where it holds them."""

    def __init__(self, max_bytes: int, min_tokens: int = MIN_TOKENS, stateful: bool = False,
                 checkpoint_every: int = 0):
        self.max_bytes, self.min_tokens, self.stateful = max_bytes, min_tokens, stateful
        self.checkpoint_every = checkpoint_every
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.nbytes = self.hits = self.tokens_reused = 0  # read by /health from another thread

    def wants(self, ids: list[int]) -> bool:
        return self.max_bytes > 0 and len(ids) >= self.min_tokens

    def find(self, adapter: str | None, ids: list[int]) -> Hit | None:
        """The entry of this adapter sharing the longest prefix with `ids`. The prompt's last
        token is always left to compute: its logits sample the first new token."""
        if not self.wants(ids):
            return None
        prompt = torch.tensor(ids)
        best: Hit | None = None
        for entry in self._entries.values():
            if entry.adapter != adapter:
                continue
            shared = shared_length(entry.ids, prompt[:-1])
            if self.stateful:  # only as far as it holds the states
                shared = max(entry.states_within(shared), default=0)
            if shared >= self.min_tokens and (best is None or shared > best.length):
                best = Hit(entry, shared)
        if best is not None:
            self._entries.move_to_end(id(best.entry))
            self.hits += 1
            self.tokens_reused += best.length
        return best

    def checkpoints(self, start: int, end: int) -> list[int]:
        """Where a prefill of tokens start..end stops to keep the states (none where no layer keeps one).
        Each is at most `checkpoint_every` tokens a later prompt computes again, and one more state
        (each such layer's recurrence and convolution window) the entry holds."""
        if not self.stateful or self.max_bytes <= 0 or self.checkpoint_every <= 0:
            return []
        every = self.checkpoint_every
        return list(range((start // every + 1) * every, end, every))

    def add(self, adapter: str | None, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
            states: list[RowState] | None = None, checkpoints: dict[int, list[RowState]] | None = None) -> None:
        """Keep the K/V of `ids` (per layer [heads, len(ids), head_dim], not shared with any batch),
        the states after them, and after fewer of them (`checkpoints`). An entry they extend is
        replaced by them, its states kept with theirs; one that already covers them stays alone."""
        if not self.wants(ids):
            return
        prompt, checkpoints = torch.tensor(ids), dict(checkpoints or {})
        for key, entry in list(self._entries.items()):
            if entry.adapter != adapter:
                continue
            if shared_length(entry.ids, prompt) == min(len(entry.ids), len(prompt)):
                if len(entry.ids) >= len(prompt):
                    self._entries.move_to_end(key)
                    return
                checkpoints = {**entry.states_within(len(entry.ids)), **checkpoints}
                self._remove(key)
        entry = Entry(adapter, prompt, keys, values, states, checkpoints)
        if entry.nbytes > self.max_bytes:
            return
        self._entries[id(entry)] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))

    def drop(self, adapter: str | None) -> None:
        """Forget every entry computed under `adapter` (its weights are about to change or go)."""
        for key in [k for k, e in self._entries.items() if e.adapter == adapter]:
            self._remove(key)

    def _remove(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def figures(self) -> dict[str, int | float]:
        return {"entries": len(self), "mib": round(self.nbytes / 2**20, 1), "hits": self.hits,
                "tokens_reused": self.tokens_reused}
