"""Training throughput with 1 and 2 data-parallel processes on the same batch (embedded model).

One process is the server's own path (`--train-processes 1`: server/training/optimize.py in this
process); two are `--train-processes 2` (server/training/data_parallel.py: two Ray actors, their
gradients summed with gloo). Each process runs one torch thread, pinned to a core of its own where
the OS allows it, so the figure is what a second core buys. Each is timed on a warm step (the
actors started and the model loaded before), best of `repeats`.

    python bench/scale_training.py [--ray-address ADDR]    # prints one JSON line last
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sequences(vocab: int, n: int, seed: int = 0) -> list[Any]:
    """RL-shaped sequences: a prompt of 100-300 tokens, a sampled completion of 30-120 trained ones."""
    from server.training.assemble import TrainSequence

    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = TrainSequence(advantage=rng.choice([-1.0, 1.0]), group=i // 8)
        s.extend([rng.randrange(vocab) for _ in range(rng.randint(100, 300))], trained=False)
        completion = rng.randint(30, 120)
        s.extend([rng.randrange(vocab) for _ in range(completion)], trained=True,
                 logprobs=[-rng.uniform(0.5, 4.0) for _ in range(completion)])
        out.append(s)
    return out


def _pin(tids: list[int], core: int) -> bool:
    """These threads onto one core; False where the OS does not allow it."""
    try:
        for tid in tids:
            os.sched_setaffinity(tid, {core})
        return True
    except (AttributeError, OSError):
        return False


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _timed(step, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
    return best


def measure_training(ray_address: str | None = None, sequences: int = 64, epochs: int = 1,
                     max_tokens_per_microbatch: int = 2048, repeats: int = 2) -> dict[str, Any]:
    """Training tokens/s of one step on `sequences` sequences with 1 process and with 2."""
    import torch
    from peft import LoraConfig

    from protocol.config import TrainConfig
    from server.model.host import ModelHost
    from server.settings import DEFAULT_MODEL_DIR
    from server.training.data_parallel import DataParallelTrainer, TrainingReplica
    from server.training.optimize import OptimPlan, optimize, rl_loss
    from server.runs.run import new_optimizer

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    host = ModelHost(DEFAULT_MODEL_DIR, device="cpu")
    with host.lock:
        torch.manual_seed(0)
        host.add_adapter("bench", LoraConfig(r=8, lora_alpha=16, target_modules=host.lora_targets, lora_dropout=0.0))
        params = host.adapter_params("bench")
        for p in params:
            p.requires_grad_(True)
        start = host.adapter_state("bench")
    batch = _sequences(host.vocab_size, sequences)
    plan = OptimPlan(learning_rate=1e-4, epochs=epochs, max_tokens_per_microbatch=max_tokens_per_microbatch)
    loss = rl_loss(TrainConfig())
    tokens = sum(len(s.ids) for s in batch) * epochs

    def fresh() -> TrainingReplica:
        with host.lock:
            host.load_adapter_state("bench", start)
        return TrainingReplica(host, "bench", new_optimizer(params), params)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pinned = _pin([os.getpid()], cores[0])  # this thread; torch runs its one thread here
    try:
        optimize(fresh(), batch, plan, loss)  # warm-up
        one = _timed(lambda: optimize(fresh(), batch, plan, loss), repeats)
    finally:
        torch.set_num_threads(threads)
        if pinned:
            os.sched_setaffinity(os.getpid(), set(cores))

    trainer = DataParallelTrainer(2, ray_address, DEFAULT_MODEL_DIR, host.device, host.dtype)
    try:
        trainer.start()
        pids = trainer.ray.get([r.__ray_call__.remote(lambda self: os.getpid()) for r in trainer.ranks])
        # Actors on another machine (a remote cluster) cannot be pinned from here.
        local = all(os.path.exists(f"/proc/{pid}") for pid in pids)
        pinned = pinned and local and all(_pin(_threads(pid), cores[(r + 1) % len(cores)])
                                          for r, pid in enumerate(pids))
        trainer.optimize(fresh(), batch, plan, loss)  # warm-up
        two = _timed(lambda: trainer.optimize(fresh(), batch, plan, loss), repeats)
    finally:
        trainer.shutdown()
    return {"bench": "scale_training", "sequences": len(batch), "tokens": tokens, "epochs": epochs,
            "tokens_per_s_1_process": round(tokens / one, 1), "tokens_per_s_2_processes": round(tokens / two, 1),
            "speedup": round(one / two, 3), "seconds_1_process": round(one, 3), "seconds_2_processes": round(two, 3),
            "pinned_one_core_each": pinned, "cores": len(cores)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ray-address", default=None, help="a Ray cluster (default: a local Ray started here)")
    parser.add_argument("--sequences", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(measure_training(args.ray_address, args.sequences)))


if __name__ == "__main__":
    main()
