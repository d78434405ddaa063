"""How many OpenMP threads the engine's own thread runs with, set for that thread alone.

A decode step of a few rows on a CPU is bound by how fast the weights stream from memory, which one
core nearly saturates, and under OMP_WAIT_POLICY=PASSIVE (art-server's default) every parallel
region in it wakes a sleeping worker for a few microseconds of work (SmolLM2's attention of one row:
136 µs a call on 2 threads, 37 on 1). Spinning workers (`GOMP_SPINCOUNT`) would remove the wake-ups
only while no other thread of the process holds an OpenMP team and no other process wants the core
(bench/omp_wait.py). `torch.set_num_threads` cannot say "this thread only": it also sets the
count every thread started afterwards begins with, so a training thread born during a decode step
would keep one thread for good. OpenMP's own `omp_set_num_threads` sets the calling thread's count
only, and torch's kernels and MKL read that count.
"""

from __future__ import annotations

import ctypes
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator

import torch

try:  # the OpenMP runtime torch loaded (libgomp on Linux); absent, the count is left alone
    _omp_set_num_threads = ctypes.CDLL(None).omp_set_num_threads
except (AttributeError, OSError):
    _omp_set_num_threads = None


# The count this process's threads start with (OMP_NUM_THREADS, else the cores), read once in the thread
# that imports the model code: what a product large enough to share the cores runs on
# (server/model/decode_copy.py), whatever count the thread computing it has set for itself.
PROCESS_THREADS = torch.get_num_threads()


def own_threads(n: int | None) -> AbstractContextManager[None]:
    """Run this thread's torch ops on `n` threads (None: as they are), other threads unchanged. With
    None it is a plain nullcontext: every one-row product of the decode copy enters it, 211 a token."""
    if n is None or _omp_set_num_threads is None:
        return nullcontext()
    return _set_threads(n)


@contextmanager
def _set_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()  # this thread's count
    _omp_set_num_threads(n)
    try:
        yield
    finally:
        _omp_set_num_threads(before)
