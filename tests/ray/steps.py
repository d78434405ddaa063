"""One training step's inputs for the data-parallel tests, and the comparison they make: the
adapter two training processes train against the one a single process trains from the same
start (tests/ray/test_data_parallel.py on one machine, tests/ray/test_two_nodes.py across two)."""

from __future__ import annotations

import random
from typing import Any

import torch
from peft import LoraConfig

from server.model.host import ModelHost
from server.runs.run import new_optimizer
from server.settings import DEFAULT_MODEL_DIR
from server.training.assemble import TrainSequence
from server.training.data_parallel import TrainingReplica
from server.training.optimize import OptimPlan

ADAPTER = "dp"

# Two minibatches, two epochs (four optimizer steps, each after the ranks' gradients are summed),
# a token budget that cuts each minibatch into several micro-batches, and a KL term, so that the
# reference forward runs on every rank. The two updates differ by float summation order, which
# AdamW's per-element normalisation carries into the weights in proportion to the learning rate:
# one process accumulating the same micro-batches in reverse order differs from itself by as much
# (measured on five such batches: up to 8.8e-6 at lr 1e-3, 4.0e-6 at 5.8e-4, the same as two
# processes). At 1e-4 the order's share is well under the bound.
PLAN = OptimPlan(learning_rate=1e-4, epochs=2,
                 num_minibatches=2, max_tokens_per_microbatch=96, kl_coef=0.05)


def adapter_host() -> ModelHost:
    """The embedded model with a freshly initialised (seeded) trainable LoRA named ADAPTER."""
    host = ModelHost(DEFAULT_MODEL_DIR, device="cpu")
    with host.lock:
        torch.manual_seed(0)
        host.add_adapter(ADAPTER, LoraConfig(r=8, lora_alpha=16, target_modules=host.lora_targets, lora_dropout=0.0))
        for p in host.adapter_params(ADAPTER):
            p.requires_grad_(True)
    return host


def replica(host: ModelHost, state: dict[str, torch.Tensor]) -> TrainingReplica:
    with host.lock:
        host.load_adapter_state(ADAPTER, state)
    params = host.adapter_params(ADAPTER)
    return TrainingReplica(host, ADAPTER, new_optimizer(params), params)


def sequences(vocab: int, n: int = 12, seed: int = 1, shared_prompt: bool = False) -> list[TrainSequence]:
    """Prompt-then-completion sequences of mixed lengths, the completion sampled at T=1 or 0.7
    with made-up sampler logprobs (so that ratios and clipping are not trivial); `shared_prompt`:
    groups of four share a 20-token prompt, as a GRPO group does."""
    rng = random.Random(seed)
    out = []
    prompts = [[rng.randrange(vocab) for _ in range(20)] for _ in range(n // 4 + 1)] if shared_prompt else []
    for i in range(n):
        prompt, completion = rng.randint(8, 30), rng.randint(4, 24)
        s = TrainSequence(advantage=rng.choice([-1.0, -0.5, 0.5, 1.0]), group=i // 4)
        s.extend(prompts[i // 4] if shared_prompt else [rng.randrange(vocab) for _ in range(prompt)], trained=False)
        s.extend([rng.randrange(vocab) for _ in range(completion)], trained=True,
                 logprobs=[-rng.uniform(0.5, 6.0) for _ in range(completion)], temperature=rng.choice([1.0, 0.7]))
        out.append(s)
    return out


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def one_against_two(ray_address: str) -> dict[str, Any]:
    """One PPO step with a KL term, by this process alone and by two training processes on the
    cluster at `ray_address`; how far apart the two adapters are, how far the step moved them, and
    the Ray node each training process ran on. Run as a Ray driver."""
    from server.training.data_parallel import DataParallelTrainer
    from server.training.optimize import optimize, rl_loss
    from client import TrainConfig

    host, loss = adapter_host(), rl_loss(TrainConfig(loss="ppo"))
    batch = sequences(host.vocab_size)
    with host.lock:
        start = host.adapter_state(ADAPTER)
    optimize(replica(host, start), batch, PLAN, loss)
    with host.lock:
        want = host.adapter_state(ADAPTER)
    trainer = DataParallelTrainer(2, ray_address, host.model_dir, host.device, host.dtype)
    try:
        trainer.optimize(replica(host, start), batch, PLAN, loss)
        nodes = [trainer.ray.get(r.address.remote())[0] for r in trainer.ranks]
    finally:
        trainer.shutdown()
    with host.lock:
        got = host.adapter_state(ADAPTER)
    return {"diff": max_difference(got, want), "moved": max_difference(want, start), "rank_nodes": nodes}
