"""A transposed copy of the base model's linear weights, for the engine's one-row decode on a CPU.

Decoding one sequence multiplies one row by each weight, a pass bound by how fast the weights stream
from memory. torch's `F.linear` (x·Wᵀ with W stored out x in) streams float32 weights at about 10
GB/s on this project's 2-core machine; the same product as `x @ Wt`, with Wt stored in x out, runs
at about 14 GB/s: SmolLM2-135M's 211 linear layers take 37 ms a token against 50, and a one-client
decode is about 20% faster (measured in the model; oneDNN's inner product on its own copy gained 5%,
and MKL's packed GEMM nothing). At 4 rows and more `F.linear` is the faster again (2 and 3 were not
measured), so only one row takes the copy. The copy costs the weights' size again in memory, so it
is made only where the torch engine decodes in float32 on a CPU. Only the engine's passes take it
(`decoding()`, on the thread that decodes): training's, the reference model's and the scoring
route's passes multiply through `F.linear` as before, so no logprob a training step computes
changes.

A copy of at least `SHARED_BYTES` (the vocabulary projection of a small model: SmolLM2's is 113 MB of
its 538) multiplies on the process's threads even where the decode step runs on one
(server/model/threads.py): waking the second thread under OMP_WAIT_POLICY=PASSIVE costs about 140 µs,
more than a layer's product of 0.4-3.5 MB takes, but SmolLM2's head takes 3.2 ms on two threads against
6.2 ms on one, and Gemma 3 270M's (671 MB) 28 ms against 57, with the same bits (MKL splits a one-row
product by its columns).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from server.model.threads import PROCESS_THREADS, own_threads

SHARED_BYTES = 32 * 2**20
_state = threading.local()


@contextmanager
def decoding() -> Iterator[None]:
    """The engine's passes on this thread multiply one row by the transposed copies."""
    _state.on = True
    try:
        yield
    finally:
        _state.on = False


class DecodeCopyLinear(torch.nn.Linear):
    """An nn.Linear (an adapter wraps it as one) with a transposed copy of its weight for `decoding()`."""

    weight_t: torch.Tensor
    copied_version: int
    threads: int | None

    def copy_weight(self) -> None:
        self.weight_t = self.weight.detach().t().contiguous()
        self.copied_version = self.weight._version
        self.threads = PROCESS_THREADS if self.weight_t.nbytes >= SHARED_BYTES else None  # None: the thread's own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1] or not getattr(_state, "on", False) or torch.is_grad_enabled() \
                or x.dtype != self.weight_t.dtype:
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self.copied_version:  # written in place since copied: never stale
            self.copy_weight()
        with own_threads(self.threads):
            y = x.reshape(1, -1) @ self.weight_t
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


def copy_for_decode(model: torch.nn.Module) -> int:
    """Every float32 nn.Linear of `model` on a CPU becomes a DecodeCopyLinear; the bytes the copies take."""
    added = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu" \
                and module.weight.dtype == torch.float32:
            module.__class__ = DecodeCopyLinear
            module.copy_weight()
            added += module.weight.numel() * module.weight.element_size()
    return added
