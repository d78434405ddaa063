"""Prefix sharing in training (server/training/packing.py): which sequences share a row, the row's
tree mask, and that a step trained with the prefix encoded once has today's loss and gradients,
on a group that shares its prompt and on a multi-turn history, for each model family's attention."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from protocol.config import TrainConfig
from server.model.host import ModelHost
from server.training.assemble import TrainSequence
from server.training.data_parallel import TrainingReplica
from server.training import optimize
from server.training.optimize import OptimizeStats, OptimPlan, _accumulate, rl_loss
from server.training.packing import (ATTENTION_SLOWDOWN, MIN_SHARED, Pack, packable_length, packs, positions, row_cost,
                                     single, tree_mask)
from tests.families import tiny_model_dir

GRADIENT_TOLERANCE = 1e-5  # float32, the largest difference of any LoRA gradient


# ---- which sequences share a row ---------------------------------------------------------------

@pytest.mark.unit
def test_a_group_that_shares_its_prompt_is_one_pack_with_the_prompt_once():
    prompt = list(range(100, 140))
    group = [prompt + [1, 2, 3], prompt + [4, 5], prompt + [6, 7, 8, 9]]
    (pack,) = packs(group, max_length=4096)
    assert sorted(pack.members) == [0, 1, 2] and pack.prefix == 40
    assert pack.length == 40 + 3 + 2 + 4


@pytest.mark.unit
def test_every_sequence_lies_in_exactly_one_pack():
    rng = random.Random(1)
    prompts = [[rng.randrange(50) for _ in range(rng.choice([5, 20, 40]))] for _ in range(5)]
    seqs = [rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(40)]
    result = packs(seqs, max_length=200)
    assert sorted(m for pk in result for m in pk.members) == list(range(40))
    for pk in result:
        assert pk.length <= max(200, *(len(seqs[m]) for m in pk.members))
        assert all(seqs[m][: pk.prefix] == seqs[pk.members[0]][: pk.prefix] for m in pk.members)
        assert len(pk.members) == 1 or pk.prefix >= MIN_SHARED


@pytest.mark.unit
def test_prompts_that_differ_early_are_not_packed():
    a, b = [1] * 10 + list(range(40)), [2] * 10 + list(range(40))
    assert [pk.members for pk in packs([a, b], 4096)] == [(0,), (1,)]
    short = list(range(MIN_SHARED - 1))
    assert len(packs([short + [1, 2], short + [3, 4]], 4096)) == 2  # too little shared to pay for the longer row


@pytest.mark.unit
def test_a_pack_stops_at_the_row_length_it_may_have():
    prompt = list(range(100, 140))
    group = [prompt + [i] * 20 for i in range(8)]  # 40 + 20 a member
    assert [len(pk.members) for pk in packs(group, max_length=100)] == [3, 3, 2]


@pytest.mark.unit
def test_a_pack_grows_only_while_it_costs_less_than_its_members_apart():
    system = list(range(1000, 1030))
    groups = [[system + [g] * 60 + [g, i] * 10 for i in range(8)] for g in range(2)]  # 90-token prompts, 20 own
    seqs = [s for group in groups for s in group]
    # groups that share only the system prompt stay apart: one row would re-encode each prompt's rest
    assert sorted(sorted(pk.members) for pk in packs(seqs, 4096)) == [list(range(8)), list(range(8, 16))]
    for weight in (7e-4 * ATTENTION_SLOWDOWN, 0.05):  # the embedded model's; attention far dearer
        result = packs(seqs, 4096, weight)
        for pk in result:
            assert row_cost(pk, weight) <= sum(row_cost(single(m, n), weight) for m, n in zip(pk.members, pk.lengths))
    assert max(len(pk.members) for pk in packs(seqs, 4096, 0.05)) < 8  # a whole group's row would cost more


@pytest.mark.unit
def test_a_sequence_sampled_twice_or_continued_by_another_lies_in_the_prefix():
    seq = list(range(30))
    (pack,) = packs([seq, list(seq), seq + [7, 8]], 4096)
    assert pack.prefix == 30 and pack.length == 32


@pytest.mark.unit
def test_tree_mask_and_positions_lay_each_member_after_the_prefix():
    pack = Pack(members=(0, 1), prefix=2, lengths=(4, 3))  # row: p p a a b, then a padding slot
    allowed = tree_mask(pack, 6, torch.float32) == 0
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # member 1 sees the prefix and itself, not member 0
        [1, 1, 0, 0, 0, 0],  # padding reads the prefix only; nothing reads it
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)
    assert positions(pack, 6).tolist() == [0, 1, 2, 3, 2, 0]


@pytest.mark.unit
def test_only_attention_that_takes_the_mask_and_within_its_window_is_packed():
    class Config:
        _attn_implementation = "sdpa"
        sliding_window = 512

    assert packable_length(Config()) == 512
    Config.sliding_window = None
    assert packable_length(Config()) > 10**9
    Config._attn_implementation = "flash_attention_2"
    assert packable_length(Config()) is None


@pytest.mark.unit
def test_an_agents_group_with_a_prompt_of_thousands_of_tokens_is_one_row():
    """tau2's policy and tools open every rollout of a domain with 5-8k tokens: a group of two
    shares them in one row, not two, when the micro-batch's budget holds it."""
    from types import SimpleNamespace

    smollm2 = SimpleNamespace(_attn_implementation="sdpa", hidden_size=576, num_attention_heads=9,
                              num_key_value_heads=3, intermediate_size=1536)
    host = SimpleNamespace(config=smollm2, share_prefix=True, takes_tree_mask=True)
    prompt = list(range(5000))
    group = [TrainSequence(ids=prompt + [7] * 48), TrainSequence(ids=prompt + [8] * 48)]
    (row,) = optimize._rows(host, group, max_tokens=16384)
    assert row.members == (0, 1) and row.prefix == 5000 and row.length == 5096
    assert len(optimize._rows(host, group, max_tokens=4096)) == 2  # the budget still bounds a row


# ---- the same loss and gradients -----------------------------------------------------------------

def _sequence(parts: list[tuple[list[int], bool]], advantage: float) -> TrainSequence:
    seq = TrainSequence(advantage=advantage)
    for ids, trained in parts:
        seq.extend(ids, trained, [-1.5 + 0.01 * i for i in range(len(ids))], 0.7)
    return seq


def _group(rng: random.Random, vocab: int) -> list[TrainSequence]:
    """A GRPO group: one prompt, eight sampled completions (two of them the same, and one that
    another continues)."""
    prompt = [rng.randrange(3, vocab) for _ in range(40)]
    completions = [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
    completions += [list(completions[0]), completions[1] + [rng.randrange(3, vocab) for _ in range(5)]]
    return [_sequence([(prompt, False), (c, True)], rng.uniform(-1, 1)) for c in completions]


def _history(rng: random.Random, vocab: int) -> list[TrainSequence]:
    """A multi-turn history cut into sequences: the turn after a rewritten one starts a sequence of
    its own, sharing the first turns, whose sampled tokens the first sequence trains on."""
    def ids(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    system, turn1, reply1, turn2 = ids(30), ids(10), ids(12), ids(8)
    first = _sequence([(system + turn1, False), (reply1, True), (turn2, False), (ids(9), True)], 0.8)
    rewritten = _sequence([(system + turn1 + reply1[:6], False), (ids(5), False), (turn2, False), (ids(11), True)], 0.8)
    third = _sequence([(system + turn1, False), (reply1, False), (ids(4), False), (ids(7), True)], 0.8)
    other = _sequence([(ids(25), False), (ids(6), True)], -0.4)  # another history: a row of its own
    return [first, rewritten, third, other]


def _host(model_dir: Path) -> ModelHost:
    from peft import LoraConfig

    host = ModelHost(model_dir, device="cpu", dtype="float32")
    with host.lock:
        # random B as well as A, so that every LoRA gradient is non-zero
        host.add_adapter("run", LoraConfig(r=8, lora_alpha=16, target_modules=host.lora_targets, lora_dropout=0.0,
                                           init_lora_weights=False))
        for p in host.adapter_params("run"):
            p.requires_grad_(True)
    return host


def _step(host: ModelHost, sequences: list[TrainSequence], share: bool) -> tuple[list[torch.Tensor], OptimizeStats]:
    """One step's gradients and figures; sharing every prefix it may, whatever attention costs
    (what is tested here is that a pack trains as its rows do, not which packs pay)."""
    host.share_prefix = share
    run = TrainingReplica(host, "run", None, host.adapter_params("run"))
    for p in run.params:
        p.grad = None
    stats = OptimizeStats()
    plan = OptimPlan(learning_rate=1e-3, max_tokens_per_microbatch=4096)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optimize, "attention_weight", lambda config: 0.0)
        _accumulate(run, sequences, plan, rl_loss(TrainConfig(loss="ppo")), stats, True, 1, 1.0, lambda: False,
                    measure_gap=True, measure_kl=True)
    return [p.grad.clone() for p in run.params], stats


def _assert_same_step(host: ModelHost, sequences: list[TrainSequence]) -> None:
    plain, plain_stats = _step(host, sequences, share=False)
    shared, shared_stats = _step(host, sequences, share=True)
    assert shared_stats.row_tokens < plain_stats.row_tokens == shared_stats.sequence_tokens  # the prefix encoded once
    assert shared_stats.figures()["prefix_shared_fraction"] > 0 == plain_stats.figures()["prefix_shared_fraction"]
    assert shared_stats.loss == pytest.approx(plain_stats.loss, rel=1e-5, abs=1e-7)
    # the KL estimator exponentiates the difference of two float32 log-probabilities, so its relative
    # error is their absolute error (a few 1e-6 at a real vocabulary's log-sum-exp), not float32's epsilon:
    # 1.6e-5 was seen on SmolLM2's weights on another machine; a mask that leaks moves it by far more
    assert shared_stats.kl_sum == pytest.approx(plain_stats.kl_sum, rel=1e-4, abs=1e-6)
    assert shared_stats.entropy_sum == pytest.approx(plain_stats.entropy_sum, rel=1e-5)
    assert shared_stats.loss_tokens == plain_stats.loss_tokens
    assert all(g.abs().max() > 0 for g in plain)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, shared)) < GRADIENT_TOLERANCE


def _family_model(family: str, root: Path) -> Path:
    model_dir = tiny_model_dir(family, root)
    if family == "gemma3":  # its tiny stand-in's 16-token window would (rightly) leave these unpacked
        wide = root / "model-gemma3-wide"
        if not wide.exists():
            shutil.copytree(model_dir, wide)
            config = json.loads((wide / "config.json").read_text())
            (wide / "config.json").write_text(json.dumps({**config, "sliding_window": 512}))
        return wide
    return model_dir


@pytest.mark.unit
@pytest.mark.parametrize("family", ["smollm2", "qwen2_5", "qwen3", "mistral_v0_3", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("shape", ["group", "history"])
def test_a_shared_prefix_trains_with_the_same_loss_and_gradients(family, shape, tmp_path_factory):
    host = _host(_family_model(family, tmp_path_factory.getbasetemp() / "families"))
    rng = random.Random(7)
    vocab = host.vocab_size
    sequences = _group(rng, vocab) + _group(rng, vocab) if shape == "group" else _history(rng, vocab)
    _assert_same_step(host, sequences)


@pytest.mark.unit
def test_a_shared_prefix_trains_the_same_under_gradient_checkpointing(tmp_path_factory):
    host = _host(_family_model("smollm2", tmp_path_factory.getbasetemp() / "families"))
    host.enable_gradient_checkpointing()
    rng = random.Random(5)
    _assert_same_step(host, _group(rng, host.vocab_size) + _history(rng, host.vocab_size))


@pytest.mark.unit
def test_a_sequence_longer_than_the_models_window_leaves_the_minibatch_unpacked(tmp_path_factory):
    host = _host(tiny_model_dir("gemma3", tmp_path_factory.getbasetemp() / "families"))  # a 16-token window
    sequences = _group(random.Random(3), host.vocab_size)
    plain, plain_stats = _step(host, sequences, share=False)
    shared, shared_stats = _step(host, sequences, share=True)
    assert shared_stats.row_tokens == plain_stats.row_tokens
    assert all(torch.equal(a, b) for a, b in zip(plain, shared))


def test_real_weights_train_a_shared_prefix_with_the_same_gradients():
    from tests.real_models import converted, smollm2_gguf

    host = _host(converted(smollm2_gguf()))
    rng = random.Random(11)
    _assert_same_step(host, _group(rng, host.vocab_size) + _history(rng, host.vocab_size))
