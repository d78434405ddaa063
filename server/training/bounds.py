"""What one job or one run may cost the server, checked before it starts: a job's optimizer steps
(each run's jobs take turns, so one run's job delays the others by at most its own length), and a
run's adapter with its optimizer state against the memory the server has left."""

from __future__ import annotations

import math

from protocol.jobs import RLJob, SFTJob

JOB_STEPS_FLAG = "art-server --max-job-optimizer-steps"
# Bytes per trainable LoRA parameter: its fp32 value, its gradient and AdamW's two moments, and the
# served snapshots (SERVED_SNAPSHOTS in runs/served_steps.py, 3) of the value, each a copy in the engine.
BYTES_PER_LORA_PARAM = 4 * (1 + 1 + 2 + 3)


class TooLarge(ValueError):
    """A job or a run past one of this server's bounds (a 4xx naming the bound and its flag)."""


def optimizer_steps(epochs: int, minibatches: int) -> int:
    return epochs * minibatches


def requested_steps(request: RLJob | SFTJob) -> int:
    """The optimizer steps a job asks for, counting one sequence per trajectory or conversation
    (assembly can only make more: a trajectory whose template rewrote history splits in two)."""
    cfg = request.config
    if isinstance(request, RLJob):
        trajectories = sum(len(g.trajectories) for g in request.groups)
        return optimizer_steps(cfg.epochs, max(1, min(cfg.num_minibatches, trajectories)))
    return optimizer_steps(cfg.epochs, max(1, math.ceil(len(request.conversations) / cfg.batch_size)))


def check_steps(steps: int, limit: int | None, counted: str) -> None:
    if limit is not None and steps > limit:
        raise TooLarge(f"this job {counted} {steps} optimizer steps (epochs x minibatches); this server allows "
                       f"{limit} per job so that other runs' jobs are not held up: use fewer epochs or minibatches "
                       f"(or a larger batch_size), split the job, or raise {JOB_STEPS_FLAG}")


def lora_params(rank: int, shapes: list[tuple[int, int]]) -> int:
    """Trainable parameters of a LoRA of `rank` on linear layers of these (in, out) shapes: A is
    rank x in, B is out x rank."""
    return sum(rank * (i + o) for i, o in shapes)


def run_bytes(rank: int, shapes: list[tuple[int, int]]) -> int:
    """An upper bound at steady state: the adapter, once it has trained and been served."""
    return lora_params(rank, shapes) * BYTES_PER_LORA_PARAM


def _mib(n: int) -> str:
    return f"{max(n, 0) / 2**20:.0f} MiB"


def check_budget(rank: int, need: int, used: int, budget: int) -> None:
    """Refuse a run past the memory all runs' adapters may take together."""
    if used + need > budget:
        raise TooLarge(f"lora.rank {rank} needs about {_mib(need)} for its adapter, optimizer state and served "
                       f"copies; the runs on this server hold {_mib(used)} of the {_mib(budget)} they may take "
                       f"(art-server --adapter-memory-mb): use a smaller rank or fewer target modules, or delete "
                       f"runs you no longer need")


def check_run_memory(rank: int, need: int, available: int, reserve: int) -> None:
    """Refuse a run whose adapter would leave less than `reserve` of the `available` bytes."""
    if need > available - reserve:
        raise TooLarge(f"lora.rank {rank} needs about {_mib(need)} for its adapter, optimizer state and served "
                       f"copies; this server has {_mib(available)} available and keeps {_mib(reserve)} free for "
                       f"decoding and training (art-server --memory-reserve-mb): use a smaller rank or fewer target "
                       f"modules, or delete runs you no longer need")
