"""Shared-prefix packs: sequences that begin alike trained in one row, their common prefix once.

A GRPO group's members share their prompt, and the sequences of one multi-turn history (a turn
whose prompt does not extend the last starts a sequence of its own) share their first turns.
Padded rows encode that prefix once per sequence. A pack lays it out once, then each member's own
tokens after it:

    [ prefix | member 0's rest | member 1's rest | ... | padding ]

Each member's tokens attend to the prefix and to their own earlier tokens, at the positions they
have in their own sequence (a tree mask, and position ids that restart after the prefix for each
member), so every logit is the one the member's own row gives and the loss and its gradients are
the same (the prefix's activations take the sum of what each member's row would have given them).

Small pure functions: which sequences form a pack (`packs`), where each token of a member lies in
its pack's row (`Pack.row_position`), the row's mask (`tree_mask`) and position ids (`positions`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.model.architecture import tree_attention

# Sequences sharing fewer tokens than this are not packed, whatever `row_cost` says.
MIN_SHARED = 16
# A pack's row at most: its mask is [row x row] (256 MiB in float32 at 8192), on top of the
# activations the micro-batch's token budget counts. 8192 holds a group of agents whose prompt is
# tau2's policy and tools (5-8k tokens), so that the prompt is encoded once, not once per rollout:
# the compute and activation memory that saves outweigh the mask's.
MAX_ROW = 8192


@dataclass(frozen=True)
class Pack:
    """Sequences `members` (indices) laid out in one row: `prefix` tokens shared, then each
    member's tokens from `prefix` on, in order. A sequence alone is a pack whose prefix is all of it."""

    members: tuple[int, ...]
    prefix: int
    lengths: tuple[int, ...]  # each member's whole length

    @property
    def length(self) -> int:
        return self.prefix + sum(n - self.prefix for n in self.lengths)

    def starts(self) -> list[int]:
        """Where each member's own tokens begin in the row."""
        out, at = [], self.prefix
        for n in self.lengths:
            out.append(at)
            at += n - self.prefix
        return out

    def row_position(self, t: int, start: int) -> int:
        """The row index of a member's token `t`, the member's own tokens beginning at `start`."""
        return t if t < self.prefix else start + t - self.prefix


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def single(index: int, length: int) -> Pack:
    return Pack((index,), length, (length,))


# Attention's multiply-adds run slower than the linear layers' on the 2-core CPU. Replaying the
# demo's step 4 (128 sequences) on the embedded model, packs chosen with this factor at 1 / 4 / 16
# trained in 3.3 / 2.5 / 2.1 s (5.9 s unshared); 2 groups x 8 on SmolLM2 (150-token prompts, 30-120
# sampled), with memory for whole groups in a row, at 1 / 8: 15.0 / 17.3 s (32.4 s unshared). 4 is
# the compromise.
ATTENTION_SLOWDOWN = 4.0


def attention_weight(config: object) -> float:
    """What attending to one more key costs a token, against the rest of its layer (the linear
    layers): 4 x heads x head_dim multiply-adds against 2 x the layer's weights, from the model's
    config (about 3e-4 for SmolLM2-135M, 7e-4 for the embedded model), times ATTENTION_SLOWDOWN."""
    hidden = getattr(config, "hidden_size", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 1
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", 0) or 4 * hidden
    experts = getattr(config, "num_experts_per_tok", None) or 1
    weights = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate * experts
    return ATTENTION_SLOWDOWN * 4 * heads * head_dim / max(2 * weights, 1)


def row_cost(pack: Pack, weight: float) -> float:
    """A row's cost in token-layers: its tokens, plus attention. A sequence's own row is causal (the
    kernel skips the half past the diagonal); a pack's tree mask is computed whole."""
    causal = 0.5 if len(pack.members) == 1 else 1.0
    return pack.length * (1 + weight * pack.length * causal)


def packs(sequences: list[list[int]], max_length: int, weight: float = 0.0,
          min_shared: int = MIN_SHARED) -> list[Pack]:
    """Every sequence in exactly one pack. Sequences are sorted so that those sharing a prefix are
    neighbours; a pack takes the next one while they share at least `min_shared` tokens, the row
    stays within `max_length`, and it costs less than the two apart (`row_cost`, attention weighing
    `weight` a key): a group's members share most of their tokens, while groups that share only a
    system prompt would make long rows whose attention costs more than the prompt saves. A sequence
    longer than `max_length` is a pack of one. A member may lie wholly in the prefix (a sequence
    sampled twice, or one that another continues): its logits are the prefix's."""
    out: list[Pack] = []
    for i in sorted(range(len(sequences)), key=lambda i: sequences[i]):
        seq, alone = sequences[i], single(i, len(sequences[i]))
        if out:
            last = out[-1]
            shared = min(last.prefix, common_prefix(sequences[last.members[0]], seq))
            joined = Pack((*last.members, i), shared, (*last.lengths, len(seq)))
            if shared >= min_shared and joined.length <= max_length and \
                    row_cost(joined, weight) < row_cost(last, weight) + row_cost(alone, weight):
                out[-1] = joined
                continue
        out.append(alone)
    return out


def tree_mask(pack: Pack, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[width, width] additive attention mask of one pack's row: 0 where a query may attend a key
    (the prefix, causally, and its own member's earlier tokens), the dtype's lowest elsewhere
    (padding rows attend nothing useful; their outputs are never read)."""
    owner = torch.full((width,), -2, dtype=torch.long)  # -1: the prefix; -2: padding
    owner[: pack.prefix] = -1
    for m, (start, n) in enumerate(zip(pack.starts(), pack.lengths)):
        owner[start:start + n - pack.prefix] = m
    return tree_attention(owner, dtype)


def positions(pack: Pack, width: int) -> torch.Tensor:
    """[width] position ids: each member's tokens at the positions they have in their own sequence."""
    pos = torch.zeros(width, dtype=torch.long)
    pos[: pack.prefix] = torch.arange(pack.prefix)
    for start, n in zip(pack.starts(), pack.lengths):
        pos[start:start + n - pack.prefix] = torch.arange(pack.prefix, n)
    return pos


def packable_length(config: object) -> int | None:
    """The longest sequence a tree mask gives the model's own attention for, or None when its
    attention does not take one. The tree mask is the same for every layer, so a model with a
    sliding or chunked window (Gemma 3, Mistral, gpt-oss) is packed only while no sequence is
    longer than its window; attention kernels that take no mask (flash-attention) never are."""
    if getattr(config, "_attn_implementation", "eager") not in ("sdpa", "eager"):
        return None
    windows = [w for w in (getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None))
               if isinstance(w, int) and w > 0]
    return min(windows) if windows else 2**62
