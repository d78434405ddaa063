"""What the server process holds in memory, what the device has left, and giving freed memory back
to the machine.

glibc's malloc keeps what torch frees in its heaps for reuse: after a training step whose
activations took gigabytes, the process went on holding them (10.6 GB resident for SmolLM2-135M
until it ended), and a second process on the machine got the kernel's OOM kill instead.
`trim` hands the free pages back; the trainer calls it after each step and the engine when it
goes idle. It costs milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache

import torch

GB = 10**9  # the unit of --memory-budget and of every figure printed


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None  # glibc only


def trim() -> None:
    """Return the free pages of every malloc arena to the OS (glibc; a no-op elsewhere)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def resident() -> int:
    """This process's resident memory in bytes (what the OOM killer weighs)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best figure there is
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if os.uname().sysname == "Darwin" else peak * 1024


def available_memory(device: torch.device) -> int:
    """Bytes the device can still allocate: free GPU memory, or the system's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def held(device: torch.device) -> int:
    """Bytes this process holds where training allocates: resident memory on the CPU, tensors
    on a CUDA device."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return resident()


def gb(n: float) -> str:
    return f"{n / GB:.2f} GB"
