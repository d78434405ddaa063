"""The pure parts of data-parallel training (server/training/data_parallel.py), without Ray: how a
minibatch's micro-batches are dealt to ranks, how the ranks' figures add up to the step's, and
that a step's token loss travels to a training process."""

import os
import pickle
import subprocess
import sys
from typing import get_args

import pytest
import torch

from protocol.config import LossName, TrainConfig
from server.training.batching import Microbatch, deal, make_microbatch
from server.training.assemble import TrainSequence
from server.training.optimize import OptimizeStats, rl_loss, sft_loss
from tests.conftest import ROOT


@pytest.mark.unit
@pytest.mark.parametrize("costs,world", [([5, 1, 3, 3, 8, 2], 2), ([4, 4, 4], 3), ([7], 2), ([], 2), ([1, 2, 3], 1),
                                         ([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 3)])
def test_deal_gives_every_micro_batch_to_exactly_one_rank(costs, world):
    shares = deal(costs, world)
    assert len(shares) == world
    assert sorted(i for s in shares for i in s) == list(range(len(costs)))
    assert all(s == sorted(s) for s in shares)


@pytest.mark.unit
def test_deal_balances_cost_not_count():
    shares = deal([8, 5, 3, 3, 2, 1], 2)
    loads = [sum([8, 5, 3, 3, 2, 1][i] for i in s) for s in shares]
    assert loads == [11, 11]
    # one costly micro-batch and many cheap ones: the cheap ones go to the other ranks
    assert deal([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 3)[0] == [0]


@pytest.mark.unit
def test_deal_with_one_rank_is_every_micro_batch_in_order():
    assert deal([3, 9, 1], 1) == [[0, 1, 2]]


@pytest.mark.unit
def test_deal_with_more_ranks_than_micro_batches_leaves_some_empty():
    assert deal([2, 5], 4) == [[1], [0], [], []]


@pytest.mark.unit
def test_merged_figures_are_the_sums_of_the_ranks():
    a = OptimizeStats(loss=0.5, loss_tokens=10, row_tokens=40, padding_tokens=4, gap_sum=0.1, gap_tokens=10,
                      clipped=2, entropy_sum=20.0, kl_sum=0.3, kl_tokens=10, grad_norms=[1.5, 0.5],
                      skipped_steps=0, optimizer_steps=2)
    b = OptimizeStats(loss=0.25, loss_tokens=30, row_tokens=60, padding_tokens=0, gap_sum=0.2, gap_tokens=30,
                      clipped=1, entropy_sum=40.0, kl_sum=0.0, kl_tokens=0, grad_norms=[1.5, 0.5],
                      skipped_steps=0, optimizer_steps=2)
    m = OptimizeStats.merged([a, b])
    assert (m.loss, m.loss_tokens, m.row_tokens, m.padding_tokens, m.clipped, m.kl_tokens) == (0.75, 40, 100, 4, 3, 10)
    assert m.gap_sum == pytest.approx(0.3) and m.entropy_sum == 60.0 and m.kl_sum == pytest.approx(0.3)
    # taken after the all-reduce, the same on every rank: counted once, not twice
    assert m.grad_norms == [1.5, 0.5] and m.optimizer_steps == 2 and m.skipped_steps == 0
    f = m.figures()
    assert f["clip_fraction"] == pytest.approx(3 / 40) and f["entropy"] == pytest.approx(60 / 40)
    assert f["logprob_gap"] == pytest.approx(0.3 / 40) and f["kl_to_base"] == pytest.approx(0.03)


@pytest.mark.unit
def test_a_merged_phase_took_as_long_as_its_slowest_rank():
    a = OptimizeStats(forward_seconds=2.0, backward_seconds=3.0, optimizer_seconds=0.5)
    b = OptimizeStats(forward_seconds=1.0, backward_seconds=4.0, optimizer_seconds=0.25)
    f = OptimizeStats.merged([a, b]).figures()
    assert (f["forward_seconds"], f["backward_seconds"], f["optimizer_seconds"]) == (2.0, 4.0, 0.5)


@pytest.mark.unit
def test_merged_figures_of_one_rank_are_its_own():
    a = OptimizeStats(loss=0.5, loss_tokens=10, clipped=2, grad_norms=[1.0], optimizer_steps=1)
    assert OptimizeStats.merged([a]) == a


@pytest.mark.unit
@pytest.mark.parametrize("loss", get_args(LossName))
def test_token_losses_pickle_and_compute_the_same(loss):
    seq = TrainSequence(ids=[1, 2, 3, 4], mask=[False, True, True, True], old_logprobs=[0.0, -1.0, -2.0, -0.5],
                        temperatures=[1.0] * 4, advantage=0.5, weight=1.2)
    mb: Microbatch = make_microbatch([seq], [0], torch.device("cpu"))
    mb.ref_logprobs = torch.tensor([-1.1, -1.9, -0.4])
    lp = torch.tensor([-0.9, -2.2, -0.6])
    fn = rl_loss(TrainConfig(loss=loss))
    sent = pickle.loads(pickle.dumps(fn))
    for got, want in zip(sent(lp, mb), fn(lp, mb)):
        assert torch.equal(got, want)
    assert pickle.loads(pickle.dumps(sft_loss)) is sft_loss


@pytest.mark.unit
def test_an_unknown_loss_is_refused_when_the_step_is_planned():
    cfg = TrainConfig().model_copy(update={"loss": "nope"})
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        rl_loss(cfg)


def test_one_training_process_trains_in_the_server_process_without_ray():
    code = ("import sys; from server.app import make_optimizer; from server.settings import Settings; "
            "from server.training.optimize import optimize; "
            "assert make_optimizer(Settings(train_processes=1), None) is optimize; "
            "assert 'ray' not in sys.modules and 'server.training.data_parallel' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.unit
def test_collectives_bind_to_the_interface_of_the_nodes_address(monkeypatch):
    from server.training.data_parallel import bind_collectives_to, interface_of

    assert interface_of("127.0.0.1") == "lo" and interface_of("203.0.113.9") is None
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(variable, raising=False)
    bind_collectives_to("127.0.0.1")
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("lo", "lo")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice stands
    bind_collectives_to("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
