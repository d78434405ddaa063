"""Data-parallel training (server/training/data_parallel.py) on the local Ray cluster: two training
processes train the adapter one process trains, report the same figures, stop when told, and a
process that dies fails its step alone; through a real art-server with --train-processes 2."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace

import httpx
import pytest
import torch

from client import TrainConfig, TrainableModel
from protocol.jobs import RLJob
from server.model.host import ModelHost
from server.connections.ray_cluster import connect
from server.training.data_parallel import DataParallelTrainer, TrainProcessFailed
from server.training.optimize import Cancelled, OptimPlan, optimize, rl_loss, sft_loss
from tests.conftest import ServerProcess
from tests.helpers import adapter_weights, demo_groups, with_rewards
from tests.ray.steps import PLAN, adapter_host, max_difference, replica as make_replica, sequences as make_sequences

FIGURES = ("loss", "entropy", "clip_fraction", "logprob_gap", "kl_to_base", "grad_norm", "padding_fraction")
COUNTS = ("loss_tokens", "row_tokens", "sequence_tokens", "padding_tokens", "gap_tokens", "kl_tokens", "clipped",
          "optimizer_steps", "skipped_steps")


@pytest.fixture(scope="module")
def host() -> ModelHost:
    return adapter_host()


@pytest.fixture(scope="module")
def ray(ray_cluster):
    """This test process connected to the cluster, as the server connects (and disconnected
    before the cluster is shut down, which refuses to remove a node a driver is connected to)."""
    ray = connect(ray_cluster)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def trainer(ray, ray_cluster, host):
    t = DataParallelTrainer(2, ray_cluster, host.model_dir, host.device, host.dtype)
    yield t
    t.shutdown()




# PPO with a KL term; A*-PO, whose loss reads the reference's logprobs; SFT, which measures no gap.
LOSSES = {"ppo": (rl_loss(TrainConfig(loss="ppo")), PLAN, True),
          "apo": (rl_loss(TrainConfig(loss="apo", baseline="given")), replace(PLAN, kl_coef=0.0, needs_reference=True),
                  True),
          "sft": (sft_loss, replace(PLAN, kl_coef=0.0), False)}


@pytest.mark.parametrize("name,shared", [(name, False) for name in LOSSES] + [("ppo", True)])
def test_two_processes_train_the_adapter_one_process_trains(host, trainer, name, shared, monkeypatch):
    """`shared`: groups share their prompts, and every rank packs a group's members in one row, as
    the one process does (the ranks follow the server's host)."""
    loss, plan, rl = LOSSES[name]
    sequences = make_sequences(host.vocab_size, shared_prompt=shared)
    monkeypatch.setattr(host, "share_prefix", shared)
    with host.lock:
        start = host.adapter_state("dp")

    one = make_replica(host, start)
    t0 = time.perf_counter()
    single = optimize(one, sequences, plan, loss, measure_gap=rl, measure_kl=rl)
    t_single = time.perf_counter() - t0
    with host.lock:
        want = host.adapter_state("dp")
    want_optimizer = one.optimizer.state_dict()

    two = make_replica(host, start)
    t0 = time.perf_counter()
    dp = trainer.optimize(two, sequences, plan, loss, measure_gap=rl, measure_kl=rl)
    t_dp = time.perf_counter() - t0
    with host.lock:
        got = host.adapter_state("dp")

    assert single.optimizer_steps == 4 and (single.kl_tokens > 0) == rl
    assert set(got) == set(want)
    diff = max_difference(got, want)
    moved = max_difference(want, start)
    print(f"{name}: max |2-process - 1-process| over LoRA tensors {diff:.2e} (the step moved them up to {moved:.2e}); "
          f"1 process {t_single:.1f}s, 2 processes {t_dp:.1f}s")
    assert moved > 1e-4  # the comparison is of a step that trained
    assert diff <= 1e-5
    for k in COUNTS:
        assert getattr(dp, k) == getattr(single, k), k
    figures_dp, figures_single = dp.figures(), single.figures()
    for k in FIGURES:
        want_figure = figures_single[k]
        assert figures_dp[k] == (None if want_figure is None else pytest.approx(want_figure, rel=1e-5, abs=1e-7)), k
    assert dp.grad_norms == pytest.approx(single.grad_norms, rel=1e-5)
    # the optimizer state came back too: the next step starts from the same moments
    got_optimizer = two.optimizer.state_dict()
    for i, state in want_optimizer["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(got_optimizer["state"][i][name], state[name], atol=1e-6), (i, name)


def test_a_stopped_step_stops_every_process_and_changes_nothing(host, trainer):
    sequences, loss = make_sequences(host.vocab_size, seed=2), rl_loss(TrainConfig(loss="cispo"))
    with host.lock:
        start = host.adapter_state("dp")
    replica = make_replica(host, start)
    long_plan = OptimPlan(learning_rate=1e-3, epochs=200, num_minibatches=2, max_tokens_per_microbatch=96)
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        trainer.optimize(replica, sequences, long_plan, loss, should_stop=lambda: time.monotonic() - t0 > 1.0)
    assert time.monotonic() - t0 < 30  # 200 epochs would take minutes: it stopped, not finished
    with host.lock:
        after = host.adapter_state("dp")
    assert all(torch.equal(after[k], start[k]) for k in start)
    # the same processes train the next step
    ranks = list(trainer.ranks)
    assert trainer.optimize(replica, sequences, PLAN, loss).optimizer_steps == 4
    assert trainer.ranks == ranks


def test_a_process_that_dies_fails_its_step_and_the_next_step_starts_new_ones(ray, host, trainer):
    sequences, loss = make_sequences(host.vocab_size, seed=3), rl_loss(TrainConfig())
    with host.lock:
        start = host.adapter_state("dp")
    replica = make_replica(host, start)
    trainer.optimize(replica, sequences, PLAN, loss)  # the processes are up
    victim = trainer.ranks[1]
    killer = threading.Timer(1.0, lambda: ray.kill(victim))
    killer.start()
    long_plan = OptimPlan(learning_rate=1e-3, epochs=200, num_minibatches=2, max_tokens_per_microbatch=96)
    with host.lock:
        before = host.adapter_state("dp")
    with pytest.raises(TrainProcessFailed, match=r"data-parallel training process 1 of 2 failed: .*the next step "
                                                 r"starts new processes"):
        trainer.optimize(replica, sequences, long_plan, loss)
    killer.join()
    assert trainer.ranks == []  # the survivor was killed too: it would wait in a collective for the dead
    with host.lock:
        after = host.adapter_state("dp")
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert trainer.optimize(replica, sequences, PLAN, loss).optimizer_steps == 4
    assert len(trainer.ranks) == 2 and victim not in trainer.ranks


# ---- through the real server --------------------------------------------------------------------

async def _train_once(srv: ServerProcess, groups, config: TrainConfig):
    model = await TrainableModel("dp").register(srv.url)
    return await model.train(groups, config)


def _training_processes(ray, srv: ServerProcess, rank: str = "") -> list[str]:
    """The names of this server's training processes (DataParallelTrainer.name_prefix)."""
    mine = f"artisan-train-{socket.gethostname()}-{srv.proc.pid}-"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(mine) and a["name"].endswith(rank)]


async def test_a_server_with_two_training_processes_trains_and_serves_the_step(ray, ray_cluster, tmp_path):
    # At the embedded model's default (2e-3) summation order alone moves the LoRA by up to 1.6e-5
    # (see PLAN above): the bound below holds at 5e-4.
    config = TrainConfig(learning_rate=5e-4, num_minibatches=2, max_tokens_per_microbatch=512)
    with ServerProcess(tmp_path / "sampler") as sampler:
        model = await TrainableModel("dp").register(sampler.url)
        groups = with_rewards(await demo_groups(model, 2, 4, seed=5), [[0.0, 1.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.5]])
        single = await _train_once(sampler, groups, config)  # the same step on one process, for comparison

    with ServerProcess(tmp_path / "dp", extra=["--train-processes", "2", "--ray-address", ray_cluster]) as srv:
        result = await _train_once(srv, groups, config)
        m = result.metrics
        assert len(_training_processes(ray, srv)) == 2  # it trained on them, not in the server process
        assert result.trained and result.step == 1
        assert m.prompt_mismatches == 0 and m.trainable_tokens > 0
        for k in ("trainable_tokens", "optimizer_steps", "choices"):
            assert getattr(m, k) == getattr(single.metrics, k), k
        for k in ("loss", "entropy", "clip_fraction", "logprob_gap", "grad_norm", "lora_update_norm"):
            assert getattr(m, k) == pytest.approx(getattr(single.metrics, k), rel=1e-4, abs=1e-7), k
        want, got = adapter_weights(tmp_path / "sampler", "dp", 1), adapter_weights(tmp_path / "dp", "dp", 1)
        diff = max_difference(got, want)
        print(f"server step: max |2-process - 1-process| over LoRA tensors {diff:.2e}; loss {m.loss:.6f} vs "
              f"{single.metrics.loss:.6f}, grad norm {m.grad_norm:.6f} vs {single.metrics.grad_norm:.6f}")
        assert diff <= 1e-5

        # the run serves the new step at once, under its name
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "dp", "max_tokens": 8, "messages": [{"role": "user", "content": "What is the price of tea?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["sampling"]["step"] == 1


async def test_a_training_process_killed_mid_step_interrupts_that_job_and_the_server_goes_on(ray, ray_cluster,
                                                                                              tmp_path):
    with ServerProcess(tmp_path / "dp", extra=["--train-processes", "2", "--ray-address", ray_cluster]) as srv:
        model = await TrainableModel("dp-kill").register(srv.url)
        groups = with_rewards(await demo_groups(model, 2, 3, seed=7), [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0]])
        assert (await model.train(groups, TrainConfig(learning_rate=1e-3))).step == 1  # processes up
        names = _training_processes(ray, srv, rank="-1")
        assert len(names) == 1, names
        killer = threading.Timer(2.0, lambda: ray.kill(ray.get_actor(names[0], namespace="artisan")))
        killer.start()
        # Over HTTP, to see the job's own end: the client library would resubmit an interrupted job.
        job = RLJob(groups=groups, config=TrainConfig(learning_rate=1e-3, epochs=100, num_minibatches=6),
                    idempotency_key="killed-rank")
        submitted = httpx.post(f"{srv.url}/v1/runs/dp-kill/jobs", json=job.model_dump(mode="json"), timeout=60)
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["job_id"]
        while (state := httpx.get(f"{srv.url}/v1/jobs/{job_id}", timeout=30).json())["status"] in ("queued",
                                                                                                   "running"):
            time.sleep(0.2)
        killer.join()
        print(f"the job's end: {state['status']}: {state['error']}")
        # A lost process is the cluster's failure, not the job's: interrupted, so that the same key runs again.
        assert state["status"] == "interrupted"
        assert "data-parallel training process 1 of 2 failed" in state["error"]
        assert await model.get_step() == 1  # the failed step never landed
        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "dp-kill", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["sampling"]["step"] == 1
        assert (await model.train(groups, TrainConfig(learning_rate=1e-3))).step == 2  # new processes
