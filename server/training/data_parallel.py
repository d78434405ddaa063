"""Data-parallel training (`art-server --train-processes N`): one step's micro-batches dealt to N
training processes (Ray actors), their gradients summed with torch.distributed (gloo on CPU,
NCCL on GPU), one update, the same as the one-process update up to float summation order.

Every rank is an actor; the server process is none of them. Serving is untouched while a step
trains (no rank takes the server's model lock), and a rank that dies breaks only the actors'
process group: the server, in no group, fails that job with a clear error, keeps serving, and
starts new processes for the next job. The cost is one more copy of the base weights (the
server's, which serves).

A step. The server puts the run's adapter weights, its LoRA config and its AdamW state, the
sequences, the plan and the token loss in Ray's object store once; every rank loads them into its
own copy of the adapter and runs server/training/optimize.py's `optimize` with a `Shard`: the
same minibatches, cut into the same micro-batches, of which it computes those `batching.deal`
gives it (forward, reference forward where the loss or KL needs it, backward). After each
minibatch one all-reduce sums the flat gradients and a stop flag; every rank then clips and steps
an identical AdamW on identical gradients, so the copies stay equal without a broadcast. Rank 0
returns the new adapter and optimizer state, which the server loads into the run; every rank
returns its figures, whose sums are the one-process step's (`OptimizeStats.merged`). The loss's
normalisers are minibatch-wide (losses.aggregate), so the sum of the ranks' micro-batch
gradients is the one-process gradient.

Stop and failure. The job's stop (cancel, time limit) reaches the ranks through a second actor
thread; a rank that sees it computes no more micro-batches, and the flag in the next all-reduce
stops every rank at the same point, so none waits in a collective for one that left. A rank that
dies (or fails to start within START_TIMEOUT) fails the step with TrainProcessFailed; the
others are killed, the run keeps its last checkpoint (the caller rolls back), the job is
interrupted rather than failed (its resubmission under the same key runs again), and the next
attempt starts a new group. There is no fall-back to one process: a step silently trained elsewhere
would hide a broken cluster.

FSDP2, for a base model that does not fit one device: each rank would wrap every decoder block
and then the model with torch.distributed.fsdp.fully_shard, so the base weights and the LoRA
parameters are sharded (DTensor) across the ranks instead of replicated; each block's forward
(and backward) all-gathers its full weights just in time and frees them after, and backward
reduce-scatters the gradients, so each rank holds and steps the optimizer state of its own
shards only. What changes here: the ranks load the base model sharded (meta device, then each
rank its shards) rather than whole; the adapter state goes in and comes out with
get_/set_model_state_dict (torch.distributed.checkpoint.state_dict), gathered on rank 0 for the
server; the explicit all-reduce of `Shard.reduce` goes (FSDP reduces gradients in backward),
with the stop flag as a collective of its own; and the grad-norm clip works on DTensors (the
norm all-reduced across shards). The server would then no longer hold the base weights it
serves with, so serving would move to engine replicas. Built here: the replicated (DDP-shaped)
trainer only; nothing of FSDP.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist

from server.model.host import ModelHost
from server.runs.run import new_optimizer
from server.training.assemble import Interrupted, TrainSequence
from server.training.optimize import Cancelled, OptimizeStats, OptimPlan, Shard, TokenLoss, optimize

log = logging.getLogger("artisan.data_parallel")
START_TIMEOUT = 300.0  # seconds for the training processes to be placed and load the model
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a rank stuck in a collective this long fails it


class TrainProcessFailed(Interrupted):
    """A data-parallel training process died or could not start: the step is not applied."""


@dataclass
class TrainingReplica:
    """What `optimize` trains: a model host, the adapter being trained in it, its parameters and
    optimizer. A run is one; a training process builds its own over its copy of the adapter."""

    host: ModelHost
    adapter: str
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]


@dataclass
class RankResult:
    stats: OptimizeStats | None  # None: the step was stopped
    adapter_state: dict[str, torch.Tensor] | None = None  # rank 0's, after the step
    optimizer_state: dict[str, Any] | None = None


def sum_gradients(params: list[torch.nn.Parameter], stopped: bool) -> bool:
    """Every rank's gradients summed into each rank's, in one all-reduce of a flat buffer that
    also carries the stop flag. Returns whether any rank stopped (then the gradients are left)."""
    ref = params[0]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                     + [torch.tensor([float(stopped)], dtype=ref.dtype, device=ref.device)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    if float(flat[-1]) > 0:
        return True
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return False


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds `address`."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


def bind_collectives_to(node_address: str) -> None:
    """Gloo and NCCL pick their interface from what the hostname resolves to, which is 127.0.0.1 on
    many machines: each rank would then announce loopback, and a rank on another node dial itself.
    The interface that holds the Ray node's address is the one the other nodes reach (unless the
    user chose one)."""
    interface = interface_of(node_address)
    if interface is not None:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, interface)


class TrainProcess:
    """One rank (a Ray actor): the base model, a copy of each trained adapter, its share of a step."""

    def __init__(self, rank: int, world: int, model_dir: str, device: str, dtype: str, gradient_checkpointing: bool):
        if device == "cpu":
            torch.set_num_threads(1)  # a rank is placed on one CPU; more threads would fight the others
        self.rank, self.world = rank, world
        self.host = ModelHost(Path(model_dir), device=device, dtype=dtype)
        if gradient_checkpointing:
            self.host.enable_gradient_checkpointing()
        self.replicas: dict[str, TrainingReplica] = {}
        self._stopped = 0  # the id of the last step told to stop
        self._lock = threading.Lock()

    def address(self) -> tuple[str, int]:
        """Where the process group meets (asked of rank 0): this node's address and a free port."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, address: str, port: int) -> None:
        import ray

        bind_collectives_to(ray.util.get_node_ip_address())
        backend = "nccl" if self.host.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world, timeout=COLLECTIVE_TIMEOUT)

    def stop(self, step_id: int) -> None:
        with self._lock:
            self._stopped = max(self._stopped, step_id)

    def step(self, step_id: int, adapter: str, lora_config: Any, adapter_state: dict[str, torch.Tensor],
             optimizer_state: dict[str, Any], sequences: list[TrainSequence], plan: OptimPlan, token_loss: TokenLoss,
             measure_gap: bool, measure_kl: bool, loss_scale: float, share_prefix: bool) -> RankResult:
        self.host.share_prefix = share_prefix  # as the server's host has it, so every rank cuts the same rows
        replica = self._replica(adapter, lora_config)
        with self.host.lock:
            self.host.load_adapter_state(adapter, adapter_state)
        replica.optimizer = new_optimizer(replica.params)
        replica.optimizer.load_state_dict(optimizer_state)
        try:
            stats = optimize(replica, sequences, plan, token_loss, measure_gap, measure_kl, loss_scale,
                             should_stop=lambda: self._stopped >= step_id,
                             shard=Shard(self.rank, self.world, sum_gradients))
        except Cancelled:
            return RankResult(None)
        if self.rank != 0:
            return RankResult(stats)
        with self.host.lock:
            state = self.host.adapter_state(adapter)
        return RankResult(stats, state, replica.optimizer.state_dict())

    def _replica(self, adapter: str, lora_config: Any) -> TrainingReplica:
        if adapter not in self.replicas:
            with self.host.lock:
                self.host.add_adapter(adapter, lora_config)
                params = self.host.adapter_params(adapter)
                for p in params:
                    p.requires_grad_(True)
            self.replicas[adapter] = TrainingReplica(self.host, adapter, new_optimizer(params), params)
        return self.replicas[adapter]


class DataParallelTrainer:
    """`optimize` for the server, on `processes` training processes of the Ray cluster at `address`;
    the same arguments and result as server/training/optimize.py's."""

    def __init__(self, processes: int, address: str | None, model_dir: Path, device: torch.device, dtype: torch.dtype,
                 gradient_checkpointing: bool = False, start_timeout: float = START_TIMEOUT):
        from server.connections.ray_cluster import connect

        self.ray = connect(address)
        self.world, self.address = processes, address
        self.model_dir, self.device = str(model_dir), "cuda" if device.type == "cuda" else "cpu"
        self.dtype = str(dtype).removeprefix("torch.")
        self.gradient_checkpointing, self.start_timeout = gradient_checkpointing, start_timeout
        self.ranks: list[Any] = []
        self._step_id = 0
        self._starts = 0

    def start(self) -> None:
        """The training processes, placed and joined in one process group (at the first step, and
        again after a failure)."""
        ray = self.ray
        actor = ray.remote(num_cpus=1, num_gpus=1 if self.device == "cuda" else 0,
                           max_concurrency=2)(TrainProcess)  # one thread steps, the other takes stop()
        self._starts += 1
        # SPREAD: a node's accelerators and memory to each rank, as a multi-node job places them.
        self.ranks = [actor.options(name=f"{self.name_prefix}{self._starts}-{r}", scheduling_strategy="SPREAD").remote(
            r, self.world, self.model_dir, self.device, self.dtype, self.gradient_checkpointing)
            for r in range(self.world)]
        try:
            address, port = ray.get(self.ranks[0].address.remote(), timeout=self.start_timeout)
            ray.get([r.join.remote(address, port) for r in self.ranks], timeout=self.start_timeout)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise TrainProcessFailed(
                f"{self.world} training processes did not start within {self.start_timeout:.0f}s on the Ray cluster "
                f"at {self.address or 'local'}: it needs {self.world} free CPUs"
                f"{' and GPUs' if self.device == 'cuda' else ''} for --train-processes {self.world}") from None
        except ray.exceptions.RayError as exc:
            self.shutdown()
            raise TrainProcessFailed(f"the training processes could not start: {_reason(exc)}") from None
        log.info("%d data-parallel training processes started", self.world)

    @property
    def name_prefix(self) -> str:
        """The Ray actor names of this server's training processes begin so (then start number and rank)."""
        return f"artisan-train-{socket.gethostname()}-{os.getpid()}-"

    def shutdown(self) -> None:
        for r in self.ranks:
            self.ray.kill(r)
        self.ranks = []

    def optimize(self, run: Any, sequences: list[TrainSequence], p: OptimPlan, token_loss: TokenLoss,
                 measure_gap: bool = True, measure_kl: bool = True, loss_scale: float = 1.0,
                 should_stop: Callable[[], bool] = lambda: False) -> OptimizeStats:
        if not self.ranks:
            self.start()
        ray, host = self.ray, run.host
        with host.lock:
            state = host.adapter_state(run.adapter)
            lora_config = host.model.peft_config[run.adapter]
        self._step_id += 1
        args = [ray.put(x) for x in (state, run.optimizer.state_dict(), sequences)]
        refs = [r.step.remote(self._step_id, run.adapter, lora_config, *args, p, token_loss, measure_gap, measure_kl,
                              loss_scale, host.share_prefix) for r in self.ranks]
        results = self._gather(refs, should_stop)
        if any(r.stats is None for r in results):
            raise Cancelled()
        with host.lock:
            host.load_adapter_state(run.adapter, results[0].adapter_state)
        run.optimizer.load_state_dict(results[0].optimizer_state)
        return OptimizeStats.merged([r.stats for r in results])

    def _gather(self, refs: list[Any], should_stop: Callable[[], bool]) -> list[RankResult]:
        """Every rank's result; the job's stop passed on to the ranks while they run. A rank that
        fails ends the step: the others are killed (they would wait in a collective for it)."""
        ray, pending, stop_sent = self.ray, list(refs), False
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=0.2)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    rank = refs.index(ref)
                    self.shutdown()
                    raise TrainProcessFailed(
                        f"data-parallel training process {rank} of {self.world} failed: {_reason(exc)}; the step was "
                        f"not applied (the run keeps its last checkpoint), and the next step starts new processes"
                    ) from None
            if not stop_sent and should_stop():
                for r in self.ranks:
                    r.stop.remote(self._step_id)
                stop_sent = True
        return ray.get(refs)


def _reason(exc: BaseException) -> str:
    """Why a rank failed, in one line: the exception it raised, or the first line of Ray's account
    of its death (not the whole traceback)."""
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the rank's own exception
    if isinstance(cause, BaseException) and not isinstance(cause, type(exc)):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
