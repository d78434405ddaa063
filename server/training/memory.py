"""How many tokens one training micro-batch may hold, so that a step stays within the server's
memory budget (art-server --memory-budget; by default what the machine has available).

What a step costs. The base weights, adapters and caches are held already; on top, a micro-batch
keeps every layer's activations for backward, in proportion to its padded tokens (rows x the
longest row): 1.2 MB a token for SmolLM2-135M in float32, 1.1 MB for Gemma 3 270M, so the
default 4096-token micro-batch of the README's learning command took 7-9 GB. The output head's
logits are computed a chunk of positions at a time (optimize.token_logprobs), a bounded amount
whatever the micro-batch. The gradient does not depend on how a minibatch is cut into micro-batches
(the loss's normalisers are minibatch-wide, losses.aggregate), so the trainer is free to cut finer.

Design: measure, then size. The bytes a token's activations take are measured once per model
(and gradient-checkpointing setting) by a short forward whose saved-for-backward tensors are
counted, times PEAK_FACTOR for what the allocator holds on top. Before each step the room is the
limit (the budget, or what the process holds plus 90% of what the machine has available now,
whichever is less) less what the process holds; micro-batches get at most as many padded tokens
as fit in it. A sequence is one row, so a step whose longest sequence alone does not fit is
refused before it trains, with one line naming the figures and what to lower.

Without a budget, on a CPU, micro-batches also stop at CPU_WORKING_SET, one ~230-token row of
SmolLM2: its resident memory peaks near 2 GB instead of 8-10. Larger micro-batches buy little
there (SmolLM2 on 2 busy cores, ms a token forward and backward: 13.9 at 1 row of 230 tokens,
14.3 at 2, 12.6 at 4, 11.6 at 8). A budget given is memory to use: micro-batches grow into it,
up to the job's max_tokens_per_microbatch.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from server.model.architecture import decoder
from server.model.memory import GB, available_memory, gb, held
from server.training.bounds import TooLarge

# A micro-batch's peak over its saved activations. On a CPU, glibc's heaps keep what a forward
# frees in holes the next allocations do not fit: 360 tokens of SmolLM2 that keep 0.47 GB for
# backward raised resident memory by 0.87 GB trained in the main thread and by 1.10 GB in another
# thread, as the server trains (its own malloc arena), 2.33x. Every allocation over 256 kB mmapped
# would make it 1.0x, at 35-50% more CPU time. On CUDA, the caching allocator's rounding and
# backward's transients (not measured here: no GPU).
PEAK_FACTOR = {"cpu": 2.4, "cuda": 1.5}
PROBE_WIDTH = 64  # tokens per row of the measuring forward
CPU_WORKING_SET = 1 * GB  # a micro-batch's peak on a CPU when no --memory-budget is given (see above)
MACHINE_SHARE = 0.9  # of what the machine has available: the rest is left to everyone else
# What a micro-batch needs whatever its size: one chunk of output-head logits (optimize.token_logprobs)
# in its few float32 copies.
LOGIT_BYTES = 4 * 4 * 2**24

_measured: "weakref.WeakKeyDictionary[Any, dict[bool, int]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Room:
    """What a step may still allocate: `limit` bytes less the `held` ones; `source` says where the
    limit comes from, for the error that names it."""

    held: int
    limit: int
    source: str

    @property
    def free(self) -> int:
        return self.limit - self.held - LOGIT_BYTES


def room(device: torch.device, budget: int | None) -> Room:
    """The room a step has now: the budget, or the machine's share, whichever is less."""
    now = held(device)
    machine = now + int(MACHINE_SHARE * available_memory(device))
    if budget is not None and budget <= machine:
        return Room(now, budget, f"its memory budget of {gb(budget)} (art-server --memory-budget)")
    return Room(now, machine, f"the {gb(machine)} this machine has for it now (its own use plus "
                              f"{MACHINE_SHARE:.0%} of what the machine has available)")


def working_set(device: torch.device, budget: int | None) -> int | None:
    """The bytes a micro-batch should stop at short of the room: on a CPU without a budget,
    CPU_WORKING_SET; a budget given says how much to use, and micro-batches grow into it."""
    return CPU_WORKING_SET if device.type == "cpu" and budget is None else None


def microbatch_tokens(configured: int, free: int, per_token: int, working_set: int | None) -> int:
    """Padded tokens per micro-batch: the job's own bound, within the free bytes and, where set,
    the working set. A sequence longer than this still trains, alone in its micro-batch, when
    it fits in `free` (`check_longest`)."""
    tokens = min(configured, max(free, 0) // max(per_token, 1))
    if working_set is not None:
        tokens = min(tokens, working_set // max(per_token, 1))
    return max(tokens, 1)


def check_longest(longest: int, per_token: int, r: Room, checkpointing: bool) -> None:
    """Refuse a step whose longest sequence alone would take the server past its limit."""
    need = longest * per_token + LOGIT_BYTES
    if r.held + need <= r.limit:
        return
    lower = "lower the rollouts' max tokens (--max-tokens) or the prompt's length"
    if not checkpointing:
        lower += ", start art-server with --gradient-checkpointing (10-11x less a token on SmolLM2 and Gemma 3)"
    raise TooLarge(f"training this step's longest sequence ({longest} tokens) needs about {gb(need)} on top of the "
                   f"{gb(r.held)} the server holds, past {r.source}: {lower}, or raise art-server --memory-budget")


def token_bytes(host: Any, adapter: str | None) -> int:
    """Peak bytes a padded token of a micro-batch takes to train, measured once per model and
    gradient-checkpointing setting (call with the host's lock held and `adapter` set)."""
    known = _measured.setdefault(host, {})
    key = bool(host.gradient_checkpointing)
    if key not in known:
        full = _saved_per_token(host, checkpointing=False)
        if key:  # checkpointed: each layer's input kept, and one layer's activations while it recomputes
            full = _saved_per_token(host, checkpointing=True) + full // max(host.config.num_hidden_layers, 1)
        known[key] = int(PEAK_FACTOR.get(host.device.type, PEAK_FACTOR["cuda"]) * full)
    return known[key]


def _saved_per_token(host: Any, checkpointing: bool) -> int:
    """Bytes autograd keeps for backward per padded token of a two-row forward (one row padded to
    half, as micro-batches pad), weights not counted."""
    lm = host.model.get_base_model() if host.has_adapters else host.model
    weights = {t.untyped_storage().data_ptr() for t in (*lm.parameters(), *lm.buffers())}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    ids = torch.ones(2, PROBE_WIDTH, dtype=torch.long, device=host.device)
    mask = torch.ones_like(ids)
    mask[1, PROBE_WIDTH // 2:] = 0
    mode = host.training_forward() if checkpointing else contextlib.nullcontext()  # eval mode: no checkpoints
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), mode:
        decoder(lm)(input_ids=ids, attention_mask=mask, use_cache=False)
    return sum(saved.values()) // ids.numel()

