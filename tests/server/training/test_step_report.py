"""What a step says about itself: the client's step line (client/loop/report.py) and the server's
warnings about constant-reward groups (server/training/health.py).

A user saw `| 15.8s` on a step that took 33.9 s (the line showed the training alone), and a batch
solved at 0.9-0.97 warned "most of this batch carries no learning signal" as a failing run does."""

from __future__ import annotations

import pytest

from client.loop.evaluation import eval_line, measure_note
from client.loop.report import (StepTiming, dropped_part, interrupted_line, nothing_to_train_line, retry_line, run_line,
                           short_float, step_line)
from protocol.jobs import TrainResult
from protocol.metrics import StepMetrics
from server.training import health

pytestmark = pytest.mark.unit


def _warnings(**figures) -> list[str]:
    return health.step_warnings(StepMetrics(**figures))


def test_constant_groups_are_told_apart_by_their_reward():
    # rewards in [0, 1]: 1.0 is solved, 0.0 failed, anything else neither
    assert health.constant_split([1.0, 1.0, 0.0, 0.5], [1.0, 0.0, 0.5, 0.25]) == (2, 1)
    # a batch whose best reward is 3 (a task scored out of 3): 3 is solved, and 1.0 is not
    assert health.constant_split([3.0, 1.0], [3.0, 1.0, 2.0]) == (1, 0)
    # negative rewards: the worst one is the failure
    assert health.constant_split([-1.0, 0.0], [-1.0, 0.0, 1.0]) == (0, 1)


def test_a_failed_batch_after_sparse_signal_is_luck_and_after_wide_signal_a_collapse():
    """leg_lookup's step 3: 1 of 4 groups had spread at reward 0.094, then all 4 failed. With those
    odds, four groups without spread is a draw in three, not a broken policy."""
    failed = StepMetrics(groups_total=4, groups_dropped_constant=4, groups_constant_failed=4, reward_mean=0.0)
    sparse = StepMetrics(groups_total=4, groups_trainable=1, trained=True, reward_mean=0.094)
    wide = StepMetrics(groups_total=4, groups_trainable=4, trained=True, reward_mean=0.5)
    assert not any("collapse" in w for w in health.step_warnings(failed, sparse))
    [collapse] = [w for w in health.step_warnings(failed, wide) if "collapse" in w]
    assert collapse.startswith("Reward fell from 0.5")
    # one such batch is not proof (chain_sum's next attempt at the same weights scored 0.32): the
    # warning says what would be, and claims no more
    assert "if it fails alike too" in collapse and "Nothing can train" not in collapse
    # more groups failing alike make the same sparse start unlikely: 0.75 ** 16 is 1 in 100
    many = failed.model_copy(update={"groups_total": 16, "groups_dropped_constant": 16, "groups_constant_failed": 16})
    assert any("collapse" in w for w in health.step_warnings(many, sparse))


def test_a_batch_mostly_solved_is_good_news_and_mostly_failed_a_warning():
    solved = dict(groups_total=16, groups_dropped_constant=13, groups_constant_solved=12, groups_constant_failed=1,
                  groups_trainable=3, trainable_tokens=90, trained=True, lora_update_norm=0.1, reward_mean=0.93)
    assert _warnings(**solved) == []  # nothing is wrong with a task the model has learned
    line = step_line(TrainResult(step=7, trained=True, metrics=StepMetrics(**solved)))
    assert "groups 3/16 trainable, 13 dropped (12 solved, 1 failed)" in line
    assert "\n  12 of 16 groups solved by every rollout: the task is nearly learned; raise the difficulty or stop." \
        in line and "warning" not in line

    failed = {**solved, "groups_constant_solved": 1, "groups_constant_failed": 12, "reward_mean": 0.05}
    [warning] = _warnings(**failed)
    assert warning.startswith("12 of 16 groups failed in every rollout") and "no learning signal" in warning
    assert "solved by every rollout" not in step_line(TrainResult(step=7, trained=True, metrics=StepMetrics(**failed)))

    neither = {**solved, "groups_constant_solved": 2, "groups_constant_failed": 3}
    [warning] = _warnings(**neither)
    assert warning == ("13 of 16 groups had constant reward and were dropped (2 solved, 3 failed, 8 neither): most "
                       "of this batch carries no learning signal.")


def test_a_batch_all_solved_or_all_failed_says_which():
    none = dict(groups_total=4, groups_dropped_constant=4, trainable_tokens=0)
    [all_solved] = _warnings(**none, groups_constant_solved=4)
    assert "same reward for every rollout, the top one: every rollout solved its task" in all_solved
    assert "Raise the difficulty" in all_solved and "no signal" not in all_solved
    [all_failed] = _warnings(**none, groups_constant_failed=4)
    assert "the lowest one: every rollout failed its task" in all_failed and "no signal" in all_failed
    [mixed] = _warnings(**none, groups_constant_solved=1, groups_constant_failed=2)
    assert "same reward for every rollout (1 solved, 2 failed, 1 neither)" in mixed
    # nothing trained: no good-news line, the warning says it
    assert "nearly learned" not in step_line(TrainResult(step=0, trained=False, metrics=StepMetrics(
        **none, groups_constant_solved=4)))


def test_the_step_time_is_its_wall_time_split_by_what_it_waited_on():
    # window 100..133.9; rollouts ended by 112.1, scored by 112.4, submitted at 113.1, a 20.8 s call
    # of which 5.0 s in the server's queue
    t = StepTiming.measure(100.0, 133.9, [(110.0, 110.1), (112.1, 112.4)], 113.1, 20.8, 5.0)
    assert (t.wall, t.sample, t.score, t.queue, t.train) == pytest.approx((33.9, 12.1, 0.3, 5.0, 15.8))
    line = step_line(TrainResult(step=3, trained=True, metrics=StepMetrics(trained=True, step_seconds=15.0)),
                     timing=t)
    assert line.endswith("| 33.9s (sample 12.1, score 0.3, queue 5.0, train 15.8)")
    # a pipelined step whose groups were sampled while the previous step trained waited on none of it
    ahead = StepTiming.measure(100.0, 110.0, [(95.0, 95.0)], 100.5, 9.5, 0.0)
    assert (ahead.sample, ahead.score, ahead.train) == (0.0, 0.0, 9.5)
    # rollouts that failed too often were never submitted: their time is all sampling
    failed = StepTiming.measure(100.0, 108.0, [(107.5, 107.5)], None, None, None)
    assert (failed.sample, failed.queue, failed.train) == (7.5, 0.0, 0.0)
    assert StepTiming.measure(0, 1, [], None, None, None).figures() == {
        "wall_seconds": 1, "sample_seconds": 0, "score_seconds": 0, "queue_seconds": 0, "train_seconds": 0}
    # a library caller without the client's clock: the server's figure, named for what it is
    assert step_line(TrainResult(step=1, trained=True, metrics=StepMetrics(step_seconds=15.8))).endswith(
        "| train 15.8s")


def test_dropped_groups_are_named_by_why():
    m = StepMetrics(groups_dropped_constant=5, groups_constant_solved=2, groups_dropped_single=1,
                    groups_dropped_failed=1, groups_dropped_stale=2)
    assert dropped_part(m) == " (2 solved, 3 same reward, 1 one rollout, 1 errored, 2 too stale)"
    assert dropped_part(StepMetrics()) == ""


def test_the_runs_first_line_and_the_lines_that_say_there_is_nothing_to_do():
    assert run_line("legs", True, 0, 16, "SmolLM2-135M-Instruct", 2e-4, 4, 8, "ppo") == \
        "run legs: created on SmolLM2-135M-Instruct | lr 2e-4 | 4 groups x 8 | loss ppo"
    assert run_line("legs", False, 8, 16, "SmolLM2-135M-Instruct", 4.9e-4, 4, 8, "cispo").startswith(
        "run legs: resumed at step 8 of 16 on SmolLM2-135M-Instruct | lr 4.9e-4 |")
    assert [short_float(x) for x in (1e-3, 5.9e-4, 1.26e-5)] == ["1e-3", "5.9e-4", "1.3e-5"]
    assert nothing_to_train_line("legs", 16, 16) == \
        "run legs is already at step 16 (--steps 16): nothing to train; --steps 24 trains 8 more"
    assert nothing_to_train_line("legs", 3, 3).endswith("--steps 6 trains 3 more")
    assert nothing_to_train_line("legs", 0, 0).endswith("--steps 1 trains 1 more")
    assert interrupted_line(5, False) == "interrupted at step 5; the same command resumes from step 5"
    assert "(or 6, if the batch it had submitted finishes training" in interrupted_line(5, True)
    assert retry_line(1, 3, 0) == ("  nothing trained (1 of 3 attempts in a row, --patience 3): the run stays at "
                                   "step 0; sampling another batch")


def test_the_first_evaluation_line_says_what_held_out_reward_measures():
    # The README and the benches report greedy accuracy; client.train's examples mostly sample.
    note = measure_note(32, 1.0)
    assert note == ("held-out reward: the mean over 32 tasks of one answer sampled at temperature 1, "
                    "each seeded per step when --seed is given")
    assert "the greedy answer" in measure_note(64, 0.0)
    assert eval_line(0, 0.125, {}, None, note) == f"eval @ step 0: reward 0.125\n  {note}"
    assert eval_line(4, 0.5, {}, None) == "eval @ step 4: reward 0.500"
