"""A run that gets worse, or no better, is named in the line that sees it (client/loop/decline.py):
held-out reward falling from its best by more than two standard errors, or not rising above where
training started, entropy collapsing before the task is learned, held-out tasks all given one
answer; and the best evaluated step, in summary.json and the web UI's run API."""

from __future__ import annotations

import json
import math

import pytest

from client.loop.decline import (NO_GAIN_STEPS, TRAINING_WINDOW, best_eval, entropy_collapse, first_entropy,
                                held_out_decline, keep_best_line, no_held_out_gain, one_answer, stderr_of,
                                training_reward_decline)
from client.loop.evaluation import final_reply
from client.loop.summary import Summary
from protocol.trajectory import Trajectory
from server.api.ui_routes import best_held_out

pytestmark = pytest.mark.unit


def _eval(step: int, reward: float | None, stderr: float | None = 0.03) -> dict:
    return {"step": step, "reward": reward, "stderr": stderr}


def test_the_standard_error_is_the_sample_std_over_root_n():
    assert stderr_of([0.0, 1.0, 0.0, 1.0]) == pytest.approx(math.sqrt(1 / 3) / 2)
    assert stderr_of([0.5] * 10) == 0.0
    assert stderr_of([1.0]) is None and stderr_of([]) is None  # one task says nothing of the noise


def test_the_best_evaluation_is_the_highest_and_the_earliest_on_ties():
    evals = [_eval(0, 0.1), _eval(4, 0.4), _eval(8, 0.4), _eval(12, None), _eval(16, 0.2)]
    assert best_eval(evals) == {"step": 4, "reward": 0.4, "stderr": 0.03}
    assert best_eval([_eval(0, None)]) is None and best_eval([]) is None


def test_a_fall_of_more_than_two_standard_errors_from_the_best_is_named_with_what_to_change():
    evals = [_eval(0, 0.2, 0.03), _eval(8, 0.398, 0.022), _eval(10, 0.30, 0.03), _eval(12, 0.133, 0.021)]
    said = held_out_decline(evals, "legs", 4.9e-4, keep_best=False)
    two_se = 2 * math.hypot(0.022, 0.021)
    assert said == (f"held-out reward fell from 0.398 (step 8) to 0.133 (step 12), more than two standard errors "
                    f"({two_se:.3f}): the policy is getting worse; likely too high a learning rate (--learning-rate, "
                    f"now 4.9e-4) or a collapse onto one answer (see entropy); legs@8 serves it, and --keep-best "
                    f"would make legs serve it at the end")
    assert "--keep-best will serve step 8" in held_out_decline(evals, "legs", 4.9e-4, keep_best=True)


def test_a_fall_within_the_noise_a_rise_or_an_unknown_noise_is_not_a_decline():
    # 0.40 -> 0.30 with SEs of 0.05: 0.1 < 2 * 0.0707
    assert held_out_decline([_eval(0, 0.4, 0.05), _eval(4, 0.3, 0.05)], "r", None, False) is None
    assert held_out_decline([_eval(0, 0.4, 0.05), _eval(4, 0.6, 0.05)], "r", None, False) is None
    assert held_out_decline([_eval(0, 0.9, None), _eval(4, 0.1, 0.05)], "r", None, False) is None
    assert held_out_decline([_eval(0, 0.9, 0.01), _eval(4, None, None)], "r", None, False) is None
    assert held_out_decline([_eval(0, 0.9, 0.01)], "r", None, False) is None  # nothing to compare with
    # compared with the best so far, not the previous evaluation: a slow slide is caught
    slide = [_eval(0, 0.5, 0.02), _eval(2, 0.45, 0.02), _eval(4, 0.40, 0.02)]
    assert "from 0.500 (step 0) to 0.400 (step 4)" in held_out_decline(slide, "r", None, False)
    # two certain evaluations (every task the same reward): any fall is real
    assert "(0.000)" in held_out_decline([_eval(0, 1.0, 0.0), _eval(2, 0.0, 0.0)], "r", None, False)
    # without a learning rate to quote, the flag alone
    assert "(--learning-rate)" in held_out_decline(slide, "r", None, False)


def _steps(n: int, groups: int = 4, constant: int = 0) -> list[dict]:
    return [{"step": i + 1, "trained": True, "groups_total": groups, "groups_dropped_constant": constant}
            for i in range(n)]


def test_a_run_no_better_than_its_start_from_three_quarters_of_its_steps_on_says_so_and_why():
    # bench/learn.py's basic_arithmetic seed 1 (greedy, 64 questions): flat while its other seeds rose by 0.3
    flat = [_eval(0, 0.099, 0.037), _eval(4, 0.094, 0.036), _eval(8, 0.099, 0.037), _eval(12, 0.094, 0.036)]
    said = no_held_out_gain(flat, 0, 16, _steps(12, constant=3), 2e-4)
    assert said == ("held-out reward is no better than at step 0 (0.099) after 12 steps: the best since, 0.099 at "
                    f"step 8, is within two standard errors ({2 * math.hypot(0.037, 0.037):.3f}); only 25% of its "
                    "groups had a reward spread to learn from (in the rest every rollout scored the same): more "
                    "rollouts per task (--group-size), other groups sampled in their place (--dynamic-sampling), or "
                    "tasks it sometimes solves (--warm-start, --curriculum, an easier prompt)")
    assert no_held_out_gain(flat[:3], 0, 16, _steps(8), 2e-4) is None  # step 8 of 16: too soon to say
    # most groups had signal: the steps trained, so the learning rate or the transfer is the suspect
    assert "75% of its groups had a reward spread, so its steps trained: too small a learning rate " \
           "(--learning-rate, now 2e-4)" in no_held_out_gain(flat, 0, 16, _steps(8, constant=1), 2e-4)
    assert "the run is training but not learning" in no_held_out_gain(flat, 0, 16, [], None)
    # --dynamic-sampling kept the groups that scored alike out of its batches: they count as constant
    aside = [{**h, "groups_set_aside": 6} for h in _steps(8)]
    assert "only 40% of its groups had a reward spread" in no_held_out_gain(flat, 0, 16, aside, 2e-4)


def test_a_rise_past_the_noise_at_any_evaluation_since_the_start_is_a_gain():
    rose = [_eval(0, 0.1, 0.03), _eval(4, 0.3, 0.05), _eval(8, 0.12, 0.04)]
    assert no_held_out_gain(rose, 0, 8, _steps(8), 1e-3) is None  # a later fall is held_out_decline's to say
    assert no_held_out_gain([_eval(0, 0.1, 0.03), _eval(8, 0.21, 0.03)], 0, 8, _steps(8), 1e-3) is None  # 0.11 > 0.085
    assert no_held_out_gain([_eval(0, 0.1, 0.03), _eval(8, 0.18, 0.03)], 0, 8, _steps(8), 1e-3) is not None
    assert no_held_out_gain([_eval(0, 0.1, None), _eval(8, 0.1, 0.03)], 0, 8, _steps(8), 1e-3) is None
    assert no_held_out_gain([_eval(0, 0.1, 0.03), _eval(8, None, None)], 0, 8, _steps(8), 1e-3) is None
    assert no_held_out_gain([_eval(0, 0.1, 0.03)], 0, 8, [], 1e-3) is None


def test_a_warm_started_run_is_measured_from_its_warm_start_and_a_long_one_told_by_step_50():
    # SFT's jump (step 1) is not GRPO's gain: GRPO starts from the warm start's evaluation
    warm = [_eval(0, 0.0, 0.0), _eval(1, 0.44, 0.06), _eval(20, 0.45, 0.06), _eval(31, 0.47, 0.06)]
    assert "no better than at step 1 (0.440) after 30 steps" in no_held_out_gain(warm, 1, 40, _steps(30), 2e-4)
    assert no_held_out_gain(warm, 0, 40, _steps(31), 2e-4) is None
    assert no_held_out_gain(warm[:3], 1, 40, _steps(19), 2e-4) is None  # 19 of GRPO's 39 steps
    long = [_eval(0, 0.2, 0.03), _eval(NO_GAIN_STEPS - 1, 0.2, 0.03), _eval(NO_GAIN_STEPS, 0.2, 0.03)]
    assert no_held_out_gain(long[:2], 0, 1000, _steps(NO_GAIN_STEPS - 1), 1e-5) is None
    assert f"after {NO_GAIN_STEPS} steps" in no_held_out_gain(long, 0, 1000, _steps(NO_GAIN_STEPS), 1e-5)


def test_entropy_collapse_is_named_before_the_task_is_learned():
    first = (1, 2.33)
    said = entropy_collapse(first, 9, 0.13, 0.4, groups_solved=1, groups_total=8)
    assert said == ("entropy fell from 2.33 to 0.13 nats per token since step 1 while reward is 0.4: the policy is "
                    "collapsing onto one answer before it has learned the task; lower --learning-rate")
    assert entropy_collapse(first, 9, 0.6, 0.4) is None  # above a quarter of the first step's
    assert entropy_collapse(first, 9, 0.13, 0.9) is None  # mostly solved: confidence is the point
    assert entropy_collapse(first, 9, 0.13, 0.5, groups_solved=4, groups_total=8) is None  # half solved by all
    assert entropy_collapse(first, 1, 0.13, 0.4) is None  # the first step itself
    assert entropy_collapse(None, 9, 0.13, 0.4) is None and entropy_collapse(first, 9, None, 0.4) is None
    assert entropy_collapse((1, 0.0), 9, 0.0, 0.4) is None  # no entropy to fall from


def test_one_answer_to_most_held_out_tasks_scoring_below_its_share_is_named():
    # count_primes in bench/results/learn-sweep.jsonl: one number to every range ("1" in artisan's runs),
    # right on a quarter of them
    replies = ["2"] * 60 + ["3", "5", "1", "4"]
    assert one_answer(replies, 0.25) == (
        "60 of 64 held-out tasks got the same final reply, '2', and held-out reward (0.250) is below that share: "
        "the policy is collapsing onto one answer whatever the question, and its reward is mostly how often that "
        "answer is right, not the task learned; the task may be beyond the model as posed: an easier setting "
        "(--curriculum), demonstrations (--warm-start), or a tool that computes what it cannot")
    assert one_answer(["yes"] * 40 + ["no"] * 24, 0.95) is None  # mostly one answer, and learned: right past its share
    assert one_answer([str(i % 20) for i in range(64)], 0.1) is None  # varied: no answer has half
    assert one_answer(["2"] * 32 + [str(i) for i in range(32)], 0.2) is not None  # exactly half counts
    assert one_answer([""] * 60 + ["2"] * 4, 0.0) is None  # no text (a tool call last) is not an answer
    assert one_answer(["2"] * 7, 0.0) is None and one_answer(["2"] * 64, None) is None  # too few; nothing scored
    long = one_answer(["The answer is " + "very " * 20 + "long"] * 10, 0.0)
    assert "'The answer is very very very very ver...'" in long  # 37 characters and an ellipsis


def test_the_final_reply_is_the_last_assistant_text_with_its_whitespace_collapsed():
    said = Trajectory(messages_and_choices=[{"role": "user", "content": "How many legs?"},
                                            {"role": "assistant", "content": " 12 \n legs "},
                                            {"role": "user", "content": "Sure?"}])
    assert final_reply(said) == "12 legs"
    called = Trajectory(messages_and_choices=[{"role": "user", "content": "Legs of a cat?"}, {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "legs", "arguments": "{}"}}]}])
    assert final_reply(called) == ""
    assert final_reply(Trajectory(messages_and_choices=[{"role": "user", "content": "?"}])) == ""


def test_the_first_entropy_is_the_first_trained_steps_and_survives_a_resume(tmp_path):
    history = [{"step": 0, "trained": False, "entropy": None}, {"step": 1, "trained": True, "entropy": 2.5},
               {"step": 2, "trained": True, "entropy": 1.0}, {"step": 3, "trained": True, "entropy": 0.2}]
    assert first_entropy(history) == (1, 2.5)
    assert first_entropy([{"step": 1, "trained": True}, {"step": 2, "trained": True, "entropy": 1.0}]) == (2, 1.0)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"run": "r", "evals": [_eval(0, 0.1)], "history": history}))
    resumed = Summary(path, "r", resumed_at=2)  # the restarted client reads the run's first step back
    assert first_entropy(resumed.history) == (1, 2.5)
    assert entropy_collapse(first_entropy(resumed.history), 3, 0.2, 0.3) is not None


def test_summary_names_the_best_step_and_each_evaluations_stderr(tmp_path):
    summary = Summary(tmp_path / "summary.json", "r", resumed_at=0)
    summary.evals += [_eval(0, 0.2, 0.05), _eval(4, 0.6, 0.04), _eval(8, 0.6, 0.03), _eval(12, 0.3, 0.05)]
    written = json.loads(json.dumps(summary.write()))
    assert written["best_step"] == {"step": 4, "reward": 0.6, "stderr": 0.04}
    assert [e["stderr"] for e in written["evals"]] == [0.05, 0.04, 0.03, 0.05]
    assert json.loads((tmp_path / "summary.json").read_text())["best_step"]["step"] == 4
    assert "keep_best" not in written


def test_keep_best_says_what_serves_and_what_the_latest_scored():
    line = keep_best_line("legs", {"step": 8, "reward": 0.398}, {"step": 16, "reward": 0.312})
    assert line.startswith("--keep-best: run legs now serves step 8 (held-out 0.398); step 16 scored 0.312")
    assert "legs@16" in line


def test_the_ui_names_the_best_held_out_step_earliest_on_ties():
    points = [{"step": 0, "n": 8, "reward_mean": 0.25}, {"step": 2, "n": 8, "reward_mean": 0.5},
              {"step": 4, "n": 8, "reward_mean": 0.5}, {"step": 6, "n": 8, "reward_mean": None}]
    assert best_held_out(points) == {"step": 2, "reward": 0.5, "n": 8}
    assert best_held_out([]) is None


def test_training_reward_falling_past_the_noise_from_its_best_run_of_batches_is_named():
    # bench/tool_agent.py's seed 2: its batches rose to 0.58 over steps 4-7, then the policy fell apart
    batches = list(enumerate([0.25, 0.438, 0.25, 0.562, 0.625, 0.531, 0.594, 0.125, 0.719, 0.562, 0.5, 0.41,
                              0.125, 0.031], start=1))
    said = training_reward_decline(batches)
    rewards = [r for _, r in batches]
    two_se = 2 * math.sqrt(2) * stderr_of(rewards) * math.sqrt(len(rewards) / TRAINING_WINDOW)
    assert said.startswith(f"training reward fell from 0.578 (steps 4-7) to 0.266 (steps 11-14), more than two "
                           f"standard errors ({two_se:.3f}): the policy is getting worse")
    assert training_reward_decline(batches[:-1]) is None  # 0.356 over steps 10-13: within the noise


def test_batches_that_rise_stay_level_or_are_too_few_are_not_a_decline():
    assert training_reward_decline([(s, 0.1 * s) for s in range(1, 11)]) is None
    assert training_reward_decline([(s, 0.5) for s in range(1, 11)]) is None  # no noise, no fall
    assert training_reward_decline([(1, 0.9), (2, 0.9), (3, 0.9), (4, 0.9), (5, 0.0), (6, 0.0), (7, 0.0)]) is None
    # a window of two batches: the last two against the best two before them
    assert "fell from 0.500 (steps 1-2) to 0.000 (steps 9-10)" in training_reward_decline(
        [*((s, 0.5) for s in range(1, 9)), (9, 0.0), (10, 0.0)], window=2)
