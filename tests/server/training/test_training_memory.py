"""The trainer's memory: logprobs a chunk of positions at a time (the same values and gradients as
all at once), micro-batches cut to the server's memory budget, and a step past it refused with
one clear line through the real server."""

from __future__ import annotations

import pytest
import torch

from client import ServerError, TrainableModel
from server.model.memory import GB
from server.training import memory
from server.training.bounds import TooLarge
from server.training.optimize import logit_chunk, token_logprobs
from tests.helpers import demo_groups, with_rewards


class CountingHead(torch.nn.Linear):
    """An output head that records how many positions each call computes logits for."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__(hidden, vocab, bias=False)
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return super().forward(x)


def _reference(head, hidden, targets, temps):
    lp_all = torch.log_softmax(head(hidden).float() / temps[:, None], dim=-1)
    return lp_all.gather(-1, targets[:, None]).squeeze(-1), -(lp_all.exp() * lp_all).sum(-1)


@pytest.mark.unit
@pytest.mark.parametrize("chunk", [1, 5, 37, 100])
def test_chunked_logprobs_and_their_gradients_equal_the_unchunked_ones(chunk):
    torch.manual_seed(0)
    head = CountingHead(24, 3000)
    hidden = torch.randn(37, 24, dtype=torch.float32) * 3
    targets = torch.randint(0, 3000, (37,))
    temps = torch.rand(37) + 0.5  # each token at its own sampling temperature
    weights = torch.randn(37)  # a loss that weighs the tokens unequally

    h_ref = hidden.clone().requires_grad_(True)
    lp_ref, ent_ref = _reference(head, h_ref, targets, temps)
    (weights * lp_ref).sum().backward()

    h = hidden.clone().requires_grad_(True)
    head.rows.clear()
    lp, ent = token_logprobs(head, h, targets, temps, chunk)
    assert max(head.rows) <= chunk  # never the whole [positions x vocab] at once
    (weights * lp).sum().backward()
    assert max(head.rows) <= chunk  # nor when backward recomputes a chunk's logits
    assert torch.allclose(lp, lp_ref, atol=1e-5, rtol=0)
    assert torch.allclose(ent, ent_ref, atol=1e-5, rtol=0) and not ent.requires_grad
    assert torch.allclose(h.grad, h_ref.grad, atol=1e-5, rtol=0)
    assert h.grad.abs().sum() > 0


@pytest.mark.unit
def test_chunked_logprobs_without_gradients_and_of_no_positions():
    head = CountingHead(8, 50)
    hidden, targets, temps = torch.randn(9, 8), torch.randint(0, 50, (9,)), torch.ones(9)
    with torch.no_grad():
        lp, _ = token_logprobs(head, hidden, targets, temps, 4)
    assert head.rows == [4, 4, 1]
    assert torch.allclose(lp, _reference(head, hidden, targets, temps)[0], atol=1e-6)
    lp, ent = token_logprobs(head, hidden[:0], targets[:0], temps[:0], 4)
    assert lp.shape == ent.shape == (0,)


@pytest.mark.unit
def test_a_logit_chunk_is_bounded_whatever_the_vocabulary():
    assert logit_chunk(262_144) * 262_144 <= memory.LOGIT_BYTES // 4
    assert logit_chunk(49_152) == 341 and logit_chunk(10**9) == 1


@pytest.mark.unit
def test_micro_batches_fit_the_room_the_job_and_on_a_cpu_the_working_set():
    mb = 2**20
    assert memory.microbatch_tokens(4096, free=100 * mb, per_token=mb, working_set=None) == 100
    assert memory.microbatch_tokens(64, free=100 * mb, per_token=mb, working_set=None) == 64
    assert memory.microbatch_tokens(4096, free=100 * mb, per_token=mb, working_set=10 * mb) == 10
    assert memory.microbatch_tokens(4096, free=-5, per_token=mb, working_set=None) == 1  # check_longest refuses it


@pytest.mark.unit
def test_without_a_budget_a_cpu_keeps_micro_batches_small_and_a_budget_given_is_used():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert memory.working_set(cpu, None) == memory.CPU_WORKING_SET
    assert memory.working_set(cpu, 3 * GB) is None and memory.working_set(cuda, None) is None


@pytest.mark.unit
def test_a_sequence_past_the_budget_is_refused_with_the_figures_and_what_to_lower():
    room = memory.Room(held=int(1.5 * GB), limit=2 * GB,
                       source="its memory budget of 2.00 GB (art-server --memory-budget)")
    memory.check_longest(100, 10**6, room, checkpointing=False)  # 0.37 GB with the logit chunk: fits
    with pytest.raises(TooLarge) as e:
        memory.check_longest(1000, 10**6, room, checkpointing=False)
    message = str(e.value)
    assert "\n" not in message
    for said in ("1000 tokens", "1.27 GB", "1.50 GB", "2.00 GB", "--memory-budget", "--max-tokens",
                 "--gradient-checkpointing"):
        assert said in message, message
    with pytest.raises(TooLarge) as e:
        memory.check_longest(1000, 10**6, room, checkpointing=True)
    assert "--gradient-checkpointing" not in str(e.value)


@pytest.mark.unit
def test_the_budget_is_the_lesser_of_the_flag_and_the_machine():
    cpu = torch.device("cpu")
    flagged = memory.room(cpu, 10**6)
    assert flagged.limit == 10**6 and "--memory-budget" in flagged.source and flagged.held > 0
    machine = memory.room(cpu, 10**15)  # a petabyte: the machine bounds it
    assert machine.limit < 10**15 and "available" in machine.source
    assert "available" in memory.room(cpu, None).source


def _embedded_replica(seed: int):
    from peft import LoraConfig

    from server.model.host import ModelHost
    from server.settings import DEFAULT_MODEL_DIR
    from server.training.data_parallel import TrainingReplica

    host = ModelHost(DEFAULT_MODEL_DIR, device="cpu")
    torch.manual_seed(seed)
    host.add_adapter("trained", LoraConfig(r=8, lora_alpha=16, target_modules=host.lora_targets, lora_dropout=0.0,
                                     init_lora_weights=False))  # B != 0: the base and the adapter differ
    params = host.adapter_params("trained")
    for p in params:
        p.requires_grad_(True)
    return TrainingReplica(host, "trained", torch.optim.SGD(params, lr=1e-3), params)


def _sequences(n: int, seed: int):
    import random

    from server.training.assemble import TrainSequence

    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = TrainSequence()
        s.extend([rng.randrange(3, 1300) for _ in range(rng.randrange(20, 60))], False)
        k = rng.randrange(1, 12)
        s.extend([rng.randrange(3, 1300) for _ in range(k)], True, [-2.0] * k, temperature=rng.choice([0.7, 1.0]))
        s.advantage = rng.choice([-1.0, 1.0])
        out.append(s)
    return out


@pytest.mark.unit
def test_micro_batches_cut_to_memory_train_the_same_update(monkeypatch):
    """The same step with one micro-batch for everything and with a micro-batch per sequence (a
    working set of a few bytes): the same loss, figures and gradient (compared as it is: AdamW's
    first update is about its sign, which float noise flips where a gradient is ~0)."""
    from protocol.config import TrainConfig
    from server.training import optimize as opt

    cfg = TrainConfig(learning_rate=1e-3, kl_coef=0.01)
    results, make = [], opt.make_microbatch
    for working_set in (10**12, 1):
        monkeypatch.setattr(memory, "CPU_WORKING_SET", working_set)
        run = _embedded_replica(seed=0)
        cuts: list[int] = []
        monkeypatch.setattr(opt, "make_microbatch", lambda seqs, *a, cuts=cuts, **k: (
            cuts.append(len(k["packs"])), make(seqs, *a, **k))[1])  # its rows, a sequence each
        stats = opt.optimize(run, _sequences(12, seed=1), opt.OptimPlan.for_rl(cfg, 1e-3), opt.rl_loss(cfg))
        results.append((cuts, stats, [p.grad.clone() for p in run.params]))  # left after the step
    (big, s1, g1), (small, s2, g2) = results
    assert big == [12] and small == [1] * 12
    assert s1.loss == pytest.approx(s2.loss, rel=1e-5) and s1.entropy_sum == pytest.approx(s2.entropy_sum, rel=1e-5)
    assert s1.grad_norms == pytest.approx(s2.grad_norms, rel=1e-4)
    scale = max(float(g.abs().max()) for g in g1)
    assert scale > 0 and max(float((a - b).abs().max()) for a, b in zip(g1, g2)) < 1e-5 * scale


async def test_a_step_past_the_servers_memory_budget_fails_with_one_clear_line(fresh_server):
    """0.1 GB is less than the server holds with the model loaded: no sequence fits, and the step is
    refused before it trains, naming the budget, its figures and what to lower; the run stays at
    step 0 and the server keeps serving."""
    srv = fresh_server(extra=["--memory-budget", "0.1"])
    model = await TrainableModel("tight").register(srv.url)
    groups = with_rewards(await demo_groups(model, 1, 2), [[0.0, 1.0]])
    with pytest.raises(ServerError) as e:
        await model.train(groups)
    message = str(e.value)
    assert "\n" not in message
    for said in ("longest sequence", "tokens) needs about", "past its memory budget of 0.10 GB",
                 "art-server --memory-budget", "--max-tokens"):
        assert said in message, message
    assert await model.get_step() == 0
    assert len(await demo_groups(model, 1, 1)) == 1  # still serving
