"""Advantage, loss and batching math: small pure functions, each tried where it could break."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from server.training import losses
from server.training.advantages import (awr_weights, given_value_advantages, group_advantages,
                                        leave_one_out_advantages)
from server.training.assemble import TrainSequence
from server.training.batching import make_microbatch, plan
from protocol.metrics import StepMetrics
from server.training import health
from server.training.hyperparams import default_learning_rate, learning_rate_for
from examples.demo.warmstart import RL_LEARNING_RATE
from tests.conftest import ROOT

pytestmark = pytest.mark.unit


def test_constant_groups_are_dropped_not_trained():
    assert group_advantages([1, 1, 1, 1]).advantages is None
    assert group_advantages([0.1, 0.1, 0.1]).dropped == "constant"
    assert group_advantages([0.5]).advantages is None  # one rollout: nothing to compare with
    assert group_advantages([0.5]).dropped == "single" and group_advantages([]).dropped == "empty"
    assert group_advantages([0.0, 1.0]).dropped is None


def test_float_noise_is_not_signal():
    # ART's bug: [0.1, 0.1 + 1e-11] normalised by its std becomes a full-size +-1 advantage.
    noisy = group_advantages([0.1, 0.1 + 1e-11, 0.1], scale=True)
    assert noisy.advantages is None
    real = group_advantages([0.0, 1.0, 0.0, 1.0], scale=True)
    assert real.advantages == pytest.approx([-1, 1, -1, 1], abs=1e-5)


def test_advantages_are_reward_minus_mean_by_default():
    g = group_advantages([0.0, 0.5, 1.0])
    assert g.advantages == pytest.approx([-0.5, 0.0, 0.5])
    assert sum(g.advantages) == pytest.approx(0.0)


def test_awr_weights_positive_and_ordered():
    w = awr_weights([-1.0, 0.0, 2.0])
    assert all(x > 0 for x in w)
    assert w[0] < w[1] < w[2]
    assert all(0.1 <= x <= 5.0 for x in w)


def _grad(fn, lp0, old, adv):
    lp = torch.tensor(lp0, requires_grad=True)
    loss, clipped = fn(lp, torch.tensor(old), torch.tensor(adv))
    loss.sum().backward()
    return lp.grad, clipped


def test_ppo_on_policy_is_policy_gradient_and_clips_beyond_bounds():
    g, clipped = _grad(lambda lp, o, a: losses.ppo_loss(lp, o, a, 0.2, 0.28), [-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0])
    assert g.tolist() == pytest.approx([-1.0, 1.0])  # ratio 1: gradient of -A * logprob
    assert not clipped.any()
    # ratio e^0.5 = 1.65 > 1.28 with A > 0: clipped, no gradient
    g, clipped = _grad(lambda lp, o, a: losses.ppo_loss(lp, o, a, 0.2, 0.28), [-0.5], [-1.0], [1.0])
    assert clipped.all() and g.abs().sum() == 0
    # the same ratio with A < 0 is not clipped (PPO's pessimistic min)
    g, clipped = _grad(lambda lp, o, a: losses.ppo_loss(lp, o, a, 0.2, 0.28), [-0.5], [-1.0], [-1.0])
    assert not clipped.any() and g.abs().sum() > 0


def test_ppo_bounds_are_separate():
    lp, old, adv = torch.tensor([math.log(1.25)]), torch.tensor([0.0]), torch.tensor([1.0])
    assert not losses.ppo_loss(lp, old, adv, 0.2, 0.28)[1].any()  # 1.25 < 1 + 0.28
    assert losses.ppo_loss(lp, old, adv, 0.2, 0.2)[1].all()


def test_cispo_keeps_gradient_on_clipped_tokens():
    g, clipped = _grad(lambda lp, o, a: losses.cispo_loss(lp, o, a, 0.2, 0.28), [-0.5], [-1.0], [1.0])
    assert clipped.all() and g.item() == pytest.approx(-1.28)


def test_truncated_importance_sampling_caps_the_weight():
    g, capped = _grad(lambda lp, o, a: losses.truncated_is_loss(lp, o, a, 2.0), [0.0], [-3.0], [1.0])
    assert capped.all() and g.item() == pytest.approx(-2.0)


def test_kl_k3_is_zero_at_reference_and_positive_elsewhere():
    lp = torch.tensor([-1.0, -2.0])
    assert losses.kl_k3(lp, lp).abs().max() == 0
    assert (losses.kl_k3(lp, lp + 0.3) > 0).all()


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "constant"])
def test_aggregation_does_not_depend_on_microbatch_cut(mode):
    token_loss = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    seq = torch.tensor([0, 0, 0, 1, 1])
    lengths = torch.tensor([3.0, 2.0])
    whole = losses.aggregate(token_loss, seq, mode, 5, 2, 10, lengths)
    parts = (losses.aggregate(token_loss[:2], seq[:2], mode, 5, 2, 10, lengths)
             + losses.aggregate(token_loss[2:], seq[2:], mode, 5, 2, 10, lengths))
    assert float(whole) == pytest.approx(float(parts))
    expected = {"token_mean": 15 / 5, "seq_mean": (6 / 3 + 9 / 2) / 2, "constant": 15 / 20}[mode]
    assert float(whole) == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "constant"])
def test_dropping_constant_groups_leaves_the_loss_as_plain_grpo_has_it(mode):
    """Two trained sequences (3 and 2 tokens) and a dropped group of two (4 and 1 tokens): the
    scaled loss over the trained ones equals the loss with the dropped ones kept at advantage 0."""
    trained = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    seq = torch.tensor([0, 0, 0, 1, 1])
    kept = torch.cat([trained, torch.zeros(5)])  # a zero advantage gives a zero per-token loss
    kept_seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    plain = losses.aggregate(kept, kept_seq, mode, 10, 4, 10, torch.tensor([3.0, 2.0, 4.0, 1.0]))
    share = losses.signal_share(mode, trained_tokens=5, trained_seqs=2, dropped_tokens=5, dropped_seqs=2)
    scaled = share * losses.aggregate(trained, seq, mode, 5, 2, 10, torch.tensor([3.0, 2.0]))
    assert float(scaled) == pytest.approx(float(plain))
    assert losses.signal_share(mode, 5, 2, 0, 0) == 1.0


def test_plan_respects_budget_and_sorts_by_length():
    lengths = [100, 300, 120, 290, 50]
    batches = plan(lengths, 600)
    assert sorted(i for b in batches for i in b) == list(range(5))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 600 or len(b) == 1
    assert batches[0][:2] == [1, 3]


def test_microbatch_targets_only_masked_tokens():
    s = TrainSequence()
    s.extend([5, 6, 7], trained=False)
    s.extend([8, 9], trained=True, logprobs=[-0.5, -0.25], temperature=0.7)
    s.advantage = 0.3
    short = TrainSequence()
    short.extend([1, 2], trained=False)
    short.extend([3], trained=True, logprobs=[-1.0])
    mb = make_microbatch([s, short], [0, 1], torch.device("cpu"))
    assert mb.targets.tolist() == [8, 9, 3]
    assert mb.logit_positions.tolist() == [2, 3, 1]  # logits at t-1 predict token t
    assert mb.rows.tolist() == [0, 0, 1]
    assert mb.old_logprobs.tolist() == [-0.5, -0.25, -1.0]
    assert mb.temperatures.tolist() == pytest.approx([0.7, 0.7, 1.0])
    assert mb.n_padding == 2 and mb.attention_mask[1].tolist() == [1, 1, 1, 0, 0]


def test_default_learning_rate_scales_with_model_size():
    assert learning_rate_for(2560, "qwen2") == pytest.approx(4.7e-4, rel=0.05)
    assert learning_rate_for(4096, "qwen2") < learning_rate_for(2560, "qwen2") < learning_rate_for(256, "qwen2")
    # tinker-cookbook's Llama fit falls much faster with width: 8B's hidden size 4096 -> ~2.9e-4
    assert learning_rate_for(4096, "llama") == pytest.approx(2.86e-4, rel=0.05)
    assert learning_rate_for(4096, "llama") < learning_rate_for(2048, "llama")


def test_the_steep_llama_fit_is_not_extrapolated_below_the_smallest_model_it_was_fitted_on():
    # SmolLM2-135M (hidden 576) learns at the 1B value and collapsed at the extrapolated 1.3e-3.
    assert learning_rate_for(576, "llama") == learning_rate_for(2048, "llama") == pytest.approx(4.9e-4, rel=0.01)


def test_a_learning_rate_measured_for_the_model_wins_over_the_fit():
    # The embedded model's card carries one: the fit gives it 5.9e-4, at which it barely learns.
    config = SimpleNamespace(hidden_size=256, model_type="qwen2")
    assert default_learning_rate(SimpleNamespace(config=config, measured_learning_rate=2e-3)) == 2e-3
    assert default_learning_rate(SimpleNamespace(config=config, measured_learning_rate=None)) == learning_rate_for(
        256, "qwen2")
    card = json.loads((ROOT / "server" / "embedded" / "model" / "artisan.json").read_text())
    assert card["learning_rate"] == RL_LEARNING_RATE


def step_warnings(figures: dict, previous: dict | None = None) -> list[str]:
    return health.step_warnings(StepMetrics(**figures), None if previous is None else StepMetrics(**previous))


def test_warnings_speak_plainly():
    assert "no signal" in step_warnings({"groups_total": 3, "groups_dropped_constant": 3, "trainable_tokens": 0})[0]
    w = step_warnings({"groups_total": 2, "groups_dropped_constant": 0, "trainable_tokens": 0, "choices": 0})
    assert "Choice" in w[0]
    assert any("did not change" in x for x in step_warnings({"trained": 1, "lora_update_norm": 0.0, "trainable_tokens": 5}))
    assert any("logprobs" in x for x in step_warnings({"logprob_gap": 0.4, "trainable_tokens": 5}))
    assert any("failed" in x for x in step_warnings({"trajectories_total": 1, "trajectories_excluded": 3, "trainable_tokens": 5}))
    assert step_warnings({"groups_total": 2, "groups_dropped_constant": 0, "trainable_tokens": 10, "trained": 1,
                          "lora_update_norm": 0.1, "logprob_gap": 0.0}) == []


def test_a_collapse_is_told_from_a_solved_task():
    no_signal = {"groups_total": 4, "groups_dropped_constant": 4, "trainable_tokens": 0}
    learning = {"groups_trainable": 3, "reward_mean": 0.28}
    assert any("collapse" in w for w in step_warnings({**no_signal, "reward_mean": 0.0}, learning))
    assert not any("collapse" in w for w in step_warnings({**no_signal, "reward_mean": 1.0}, learning))  # solved
    assert not any("collapse" in w for w in step_warnings({**no_signal, "reward_mean": 0.0}, {}))  # first step
    # a step that itself had no signal is no evidence that the policy was working
    assert not any("collapse" in w for w in step_warnings({**no_signal, "reward_mean": 0.0},
                                                          {"groups_trainable": 0, "reward_mean": 0.5}))


def test_a_group_of_one_is_told_apart_from_constant_rewards():
    alone = step_warnings({"groups_total": 2, "groups_dropped_single": 2, "trainable_tokens": 0, "choices": 4})
    assert len(alone) == 1 and health.SINGLE_TRAJECTORY in alone[0] and "Nothing was trained" in alone[0]
    assert not any("same reward" in w or "No trainable tokens" in w for w in alone)
    # with constant groups beside it, each says its own reason, and neither blames the tokens
    mixed = step_warnings({"groups_total": 3, "groups_dropped_single": 1, "groups_dropped_constant": 2,
                           "trainable_tokens": 0, "choices": 4})
    assert [w.split(" ")[:3] for w in mixed] == [["1", "of", "3"], ["The", "other", "2"]]
    assert health.SINGLE_TRAJECTORY in mixed[0] and "same reward" in mixed[1]
    # a single group among trainable ones still gets named; the step trained on the rest
    some = step_warnings({"groups_total": 4, "groups_dropped_single": 1, "groups_trainable": 3, "trainable_tokens": 9,
                          "trained": 1, "lora_update_norm": 0.1})
    assert len(some) == 1 and some[0].startswith("1 of 4 groups had one trajectory")


def test_rollouts_that_all_failed_are_not_called_constant_rewards():
    w = step_warnings({"groups_total": 2, "groups_dropped_failed": 2, "trajectories_total": 0,
                       "trajectories_excluded": 6, "trainable_tokens": 0})
    assert w == ["All 6 rollouts failed with errors and were excluded: nothing was left to train on. "
                 "Check the server, tools or judge."]


def _train_on_a_stale_group(loss_fn, steps: int = 200, lr: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4-way policy trained again and again on one group sampled by an older policy (the
    behaviour policy, whose logprobs the choices carry). Returns the final logits and the ratio
    of current to behaviour probability on each sampled action."""
    behaviour = torch.tensor([0.0, 0.5, 0.0, -0.5])
    theta = (behaviour + torch.tensor([0.3, -0.1, 0.0, -0.2])).requires_grad_()  # the policy moved since
    actions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    rewards = (actions == 0).float()
    adv = rewards - rewards.mean()
    old = torch.log_softmax(behaviour, -1)[actions]
    opt = torch.optim.SGD([theta], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        lp = torch.log_softmax(theta, -1)[actions]
        loss, _ = loss_fn(lp, old, adv)
        loss.mean().backward()
        opt.step()
    with torch.no_grad():
        ratio = torch.exp(torch.log_softmax(theta, -1)[actions] - old)
    return theta.detach(), ratio


def test_a_stale_group_trains_inside_the_trust_region_and_diverges_without_the_correction():
    """Off-policy correction: the ratio is taken against the sampler's logprobs and clipped, so
    however often a stale group is trained on, the policy stops where the ratio leaves
    [1 - eps_low, 1 + eps_high]. Trained as if it were on-policy (REINFORCE on the stale samples),
    the same group pushes the logits apart without end. (The rewarded action's ratio ends past
    1 + eps_high: the other actions' samples, clipped at 1 - eps_low, leave it their mass.)"""
    ppo = lambda lp, old, adv: losses.ppo_loss(lp, old, adv, 0.2, 0.28)  # noqa: E731
    theta, ratio = _train_on_a_stale_group(ppo)
    assert ratio[0] > 1.0  # it trained: the rewarded action gained
    assert ratio[[1, 2, 3]].min() > 0.8 * 0.95 and ratio.max() < 2.0  # and stopped at the clip bounds
    assert (theta[0] - theta[1:]).max() < 2.0
    longer, _ = _train_on_a_stale_group(ppo, steps=400)
    assert torch.allclose(longer, theta, atol=1e-6)  # it has stopped moving

    on_policy = lambda lp, old, adv: (-(adv * lp), None)  # noqa: E731  (the behaviour policy ignored)
    drift, drift_ratio = _train_on_a_stale_group(on_policy)
    drift_longer, _ = _train_on_a_stale_group(on_policy, steps=400)
    gap, gap_longer = (drift[0] - drift[1:]).min(), (drift_longer[0] - drift_longer[1:]).min()
    assert gap > 20 and gap_longer > 1.9 * gap  # the logits move apart linearly: no bound
    assert drift_ratio[[1, 2, 3]].max() < 1e-6  # the unrewarded actions: gone


def test_groups_dropped_for_staleness_are_counted_apart_from_constant_ones():
    some = step_warnings({"groups_total": 4, "groups_dropped_stale": 1, "staleness_bound": 2, "groups_trainable": 3,
                          "trainable_tokens": 9, "trained": 1, "lora_update_norm": 0.1})
    assert len(some) == 1 and some[0].startswith("1 of 4 groups were sampled more than 2 steps before")
    every = step_warnings({"groups_total": 2, "groups_dropped_stale": 2, "staleness_bound": 0, "trainable_tokens": 0})
    assert len(every) == 1 and "nothing was trained" in every[0] and "same reward" not in every[0]
    mixed = step_warnings({"groups_total": 3, "groups_dropped_stale": 1, "groups_dropped_constant": 2,
                           "staleness_bound": 1, "trainable_tokens": 0})
    assert any("other 2 groups had the same reward" in w for w in mixed)


def test_a_logprob_gap_is_a_warning_only_for_groups_the_trained_weights_sampled():
    on_policy = step_warnings({"groups_total": 2, "groups_trainable": 2, "trainable_tokens": 9, "trained": 1,
                               "lora_update_norm": 0.1, "logprob_gap": 0.2, "staleness_max": 0})
    stale = step_warnings({"groups_total": 2, "groups_trainable": 2, "trainable_tokens": 9, "trained": 1,
                           "lora_update_norm": 0.1, "logprob_gap": 0.2, "staleness_max": 2})
    assert any("disagree on token logprobs" in w for w in on_policy) and stale == []


def test_leave_one_out_baselines_each_reward_with_the_others_mean():
    g = leave_one_out_advantages([0.0, 1.0, 1.0, 0.0])
    assert g.advantages == pytest.approx([0 - 2 / 3, 1 - 1 / 3, 1 - 1 / 3, 0 - 2 / 3])
    assert leave_one_out_advantages([1.0]).dropped == "single"
    assert leave_one_out_advantages([0.3, 0.3]).dropped == "constant"


def test_a_given_value_makes_a_group_of_one_trainable():
    g = given_value_advantages([1.0], value=0.25, keep_zero=False)
    assert g.advantages == pytest.approx([0.75]) and g.dropped is None
    assert given_value_advantages([0.0, 0.0], value=0.5, keep_zero=False).advantages == pytest.approx([-0.5, -0.5])
    assert given_value_advantages([], value=0.5, keep_zero=True).dropped == "empty"
    # every reward equal to the value: no policy gradient, dropped, unless the loss regresses on it (A*-PO)
    assert given_value_advantages([0.5], value=0.5, keep_zero=False).dropped == "constant"
    assert given_value_advantages([0.5], value=0.5, keep_zero=True).advantages == [0.0]


def test_apo_loss_is_the_squared_residual_per_sequence():
    """Two sequences (3 and 2 tokens): (beta * sum log pi/pi_ref - (r - V*))^2 each; with seq_mean
    aggregation the step's loss is their mean, and the gradient on each token of a sequence is
    2 * beta * residual (the same on all of them: the sequence's log-ratio is a sum)."""
    lp = torch.tensor([-1.0, -2.0, -0.5, -1.0, -3.0], requires_grad=True)
    ref = torch.tensor([-1.5, -2.0, -0.5, -1.0, -2.0])
    seq = torch.tensor([0, 0, 0, 1, 1])
    adv = torch.tensor([0.8, 0.8, 0.8, -0.3, -0.3])
    beta = 0.1
    tok, clipped = losses.apo_loss(lp, ref, adv, seq, beta)
    r0, r1 = beta * 0.5 - 0.8, beta * -1.0 + 0.3
    assert tok.tolist() == pytest.approx([r0 ** 2] * 3 + [r1 ** 2] * 2)
    assert not clipped.any()
    loss = losses.aggregate(tok, seq, "seq_mean", 5, 2, 1, torch.tensor([3.0, 2.0]))
    assert float(loss.detach()) == pytest.approx((r0 ** 2 + r1 ** 2) / 2)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([2 * beta * r0 / 2] * 3 + [2 * beta * r1 / 2] * 2)
    # at the reference (log-ratio 0) it is REINFORCE with advantage r - V*, scaled by 2 * beta
    lp0 = ref.clone().requires_grad_()
    losses.aggregate(losses.apo_loss(lp0, ref, adv, seq, beta)[0], seq, "seq_mean", 5, 2, 1,
                     torch.tensor([3.0, 2.0])).backward()
    assert lp0.grad.tolist() == pytest.approx([-beta * 0.8] * 3 + [beta * 0.3] * 2)


def test_a_stage_two_config_says_what_it_regresses_on():
    from protocol.config import TrainConfig
    from protocol.jobs import RLJob

    apo = TrainConfig(loss="apo")
    assert apo.baseline == "given" and apo.loss_aggregation == "seq_mean"
    assert TrainConfig().baseline == "group_mean"
    assert TrainConfig.model_validate(apo.model_dump()) == apo  # the wire round trip keeps it
    with pytest.raises(ValueError, match="baseline is 'given'"):
        TrainConfig(loss="apo", baseline="group_mean")
    with pytest.raises(ValueError, match="seq_mean"):
        TrainConfig(loss="apo", loss_aggregation="token_mean")
    with pytest.raises(ValueError, match=r"groups\[1\] has none"):
        RLJob(groups=[{"trajectories": [{}], "value": 0.5}, {"trajectories": [{}]}], config=apo)
    RLJob(groups=[{"trajectories": [{}]}], config=TrainConfig())  # no value needed for a group baseline
