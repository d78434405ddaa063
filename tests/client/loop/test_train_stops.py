"""`python -m client.train` stops when a run cannot learn, and says why.

A step with nothing to train does not advance the run; before, the loop tried again up to 3 x
--steps times in silence and then "succeeded" at step 0. Now --patience attempts in a row that
trained nothing end the run with exit status 3 and one paragraph naming the cause.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from client.errors import EXIT_CANNOT_LEARN
from client.loop.patience import Patience, diagnose
from client.loop.report import short_float
from protocol.metrics import StepMetrics
from server.training import health
from tests.helpers import train_cli


def _attempt(trained: bool = False, rewards=(0.0,), groups: int = 2, constant: int | None = None,
             largest: int = 4, tokens: int = 0, warnings=(), **extra) -> dict:
    return {"step": 0, "trained": trained, "groups_total": groups,
            "groups_dropped_constant": groups if constant is None else constant, "trajectories_total": groups * largest,
            "trajectories_excluded": 0, "trainable_tokens": tokens, "reward_values": list(rewards),
            "largest_group": largest, "first_exception": None, "warnings": list(warnings), **extra}


@pytest.mark.unit
def test_constant_rewards_name_the_reward_seen():
    cause, text = diagnose([_attempt()] * 3)
    assert cause == "constant_reward"
    assert "Every rollout scored 0.0" in text and "never earns reward" in text and "--model" in text
    _, solved = diagnose([_attempt(rewards=(1.0,))] * 3)
    assert "scored 1.0" in solved and "already solves" in solved
    _, mixed = diagnose([_attempt(rewards=(0.0,)), _attempt(rewards=(0.0, 1.0))])
    assert "rewards seen: 0.0, 1.0" in mixed and "--temperature" in mixed


@pytest.mark.unit
def test_reward_earned_elsewhere_in_the_run_means_too_rare_not_never():
    """A run with sparse reward can draw three all-zero batches in a row; it does earn reward, so
    "never earns reward" would send the user the wrong way."""
    patience = Patience(limit=3)
    for attempt in (_attempt(trained=True, rewards=(0.0, 1.0), constant=1), _attempt(), _attempt(), _attempt()):
        patience.record(attempt)
    assert patience.exhausted and patience.best_reward == 1.0
    text = str(patience.verdict(step=1))
    assert "too rare" in text and "--group-size" in text and "--dynamic-sampling" in text and "never earns" not in text
    resampled = Patience(limit=1)  # a run that already samples other tasks in place of such groups
    resampled.record(_attempt(trained=True, rewards=(0.0, 1.0), constant=1))
    resampled.record({**_attempt(), "groups_set_aside": 8})
    assert "too rare" in (said := str(resampled.verdict(step=1))) and "--dynamic-sampling" not in said
    fresh = Patience(limit=1)
    fresh.record(_attempt())
    assert "too rare" in str(fresh.verdict(step=0, eval_rewards=(0.125,)))  # seen in the held-out evaluation
    assert "never earns" in str(fresh.verdict(step=0, eval_rewards=(0.0,)))


@pytest.mark.unit
def test_a_collapse_the_server_saw_is_passed_on():
    failed = StepMetrics(groups_total=4, groups_dropped_constant=4, groups_constant_failed=4, reward_mean=0.0)
    wide = StepMetrics(groups_total=4, groups_trainable=4, trained=True, reward_mean=0.5)
    said = health.step_warnings(failed, wide)  # the server's own words, so a change to them is caught here
    [collapse] = [w for w in said if "collapse" in w]
    _, text = diagnose([_attempt(warnings=tuple(said))] * 2)
    assert collapse in text
    _, quiet = diagnose([_attempt(warnings=tuple(w for w in said if w != collapse))] * 2)
    assert "The server adds" not in quiet and "The server said" not in quiet


@pytest.mark.unit
def test_attempts_that_fail_alike_after_a_collapse_warning_settle_it():
    """The server's warning leaves it to the next attempts at the same weights; once they fail alike
    too, the stop says the policy broke, not that reward is rare (which would send the user to
    --dynamic-sampling and more patience)."""
    failed = StepMetrics(groups_total=4, groups_dropped_constant=4, groups_constant_failed=4, reward_mean=0.0)
    said = tuple(health.step_warnings(failed, StepMetrics(groups_total=4, groups_trainable=4, trained=True,
                                                          reward_mean=0.5)))
    patience = Patience(limit=3)
    for attempt in (_attempt(trained=True, rewards=(0.0, 1.0), constant=1), _attempt(warnings=said), _attempt(),
                    _attempt()):
        patience.record(attempt)
    verdict = patience.verdict(step=1)
    settled = str(verdict)
    assert verdict.cause == "collapse"
    assert "2 more attempts at the same weights" in settled and "broke the policy" in settled
    assert "too rare" not in settled and "--dynamic-sampling" not in settled and said[-1] in settled
    alone = Patience(limit=1)  # --patience 1: nothing after the warning has settled it
    alone.record(_attempt(trained=True, rewards=(0.0, 1.0), constant=1))
    alone.record(_attempt(warnings=said))
    unsettled = str(alone.verdict(step=1))
    assert "too rare" in unsettled and f"The server adds: {said[-1]}" in unsettled and "broke the policy" not in unsettled


@pytest.mark.unit
def test_groups_of_one_are_named_before_constant_rewards():
    cause, text = diagnose([_attempt(largest=1)] * 3, group_size=1)
    assert cause == "group_size_1" and "--group-size 2" in text
    _, survivors = diagnose([_attempt(largest=1, first_exception="ConnectError: refused")] * 3, group_size=4)
    assert "ConnectError: refused" in survivors


@pytest.mark.unit
def test_failed_rollouts_are_infrastructure_with_the_first_error():
    failed = {"step": 0, "trained": False, "warnings": [],
              "rollouts_failed": "8 of 8 rollouts failed (limit 4); first error: APIConnectionError: Connection error."}
    cause, text = diagnose([failed] * 3)
    assert cause == "rollouts_failed"
    assert "APIConnectionError: Connection error." in text and "infrastructure" in text and "not a reward of 0" in text
    cause, text = diagnose([_attempt(trajectories_total=0, trajectories_excluded=8,
                                     first_exception="ToolBackendDown: 503")] * 3)
    assert cause == "rollouts_failed" and "ToolBackendDown: 503" in text and "8 of 8" in text


@pytest.mark.unit
def test_nothing_trainable_repeats_the_servers_reason():
    said = "No trainable tokens: the trajectories contain no Choice objects. Append the Choice..."
    cause, text = diagnose([_attempt(constant=0, rewards=(0.0, 1.0), warnings=(said,))] * 3)
    assert cause == "no_trainable_choices" and said in text


@pytest.mark.unit
def test_the_most_frequent_cause_wins_and_a_trained_attempt_resets_the_count():
    failed = {"step": 0, "trained": False, "rollouts_failed": "2 of 2 rollouts failed", "warnings": []}
    assert diagnose([failed, _attempt(), _attempt()])[0] == "constant_reward"
    assert diagnose([_attempt(), failed])[0] == "rollouts_failed"  # a tie: the latest
    patience = Patience(limit=2)
    for attempt in (_attempt(), _attempt(trained=True), _attempt()):
        patience.record(attempt)
        assert not patience.exhausted
    patience.record(_attempt())
    assert patience.exhausted
    verdict = patience.verdict(step=1, where="out/summary.json")
    assert str(verdict).startswith("Stopped: 2 training attempts in a row trained nothing, so the run stays at step 1.")
    assert str(verdict).endswith("The attempts are in out/summary.json.") and "\n" not in str(verdict)


@pytest.mark.unit
def test_no_reward_anywhere_at_step_0_stops_after_the_first_attempt():
    """Held-out reward exactly 0 at step 0, and a first batch whose every rollout scored 0: said at
    once, not after --patience full batches of the same."""
    patience = Patience(limit=3)
    patience.record(_attempt())
    assert patience.hopeless(0, [0.0]) and not patience.exhausted
    text = str(patience.verdict(step=0, eval_rewards=(0.0,), early=True))
    assert text.startswith("Stopped after the first training attempt, without waiting for --patience 3: it trained "
                           "nothing and the held-out evaluation scored 0 too, so the run stays at step 0.")
    assert "Every rollout scored 0.0" in text and "never earns reward" in text
    assert not patience.hopeless(0, [0.125])  # held-out reward was seen
    assert not patience.hopeless(0, [])  # no held-out evaluation of step 0
    assert not patience.hopeless(3, [0.0])  # a run that trained before
    for first in (_attempt(rewards=(0.5,)), _attempt(trained=True, rewards=(0.0, 1.0), constant=1),
                  _attempt(largest=1)):  # a reward other than 0, a step that trained, groups of one
        other = Patience(limit=3)
        other.record(first)
        assert not other.hopeless(0, [0.0])
    lost = Patience(limit=3)  # rollouts that failed were never scored: the batch is not all zeros
    lost.record({**_attempt(), "trajectories_excluded": 6})
    assert not lost.hopeless(0, [0.0])
    later = Patience(limit=3)
    later.record(_attempt(rewards=(0.5,)))
    later.record(_attempt())
    assert not later.hopeless(0, [0.0])  # only the first attempt decides


def _train(srv, out, run: str, *args: str) -> subprocess.CompletedProcess:
    return train_cli(srv.url, out, run, "--eval-every", "0", *args)


def test_retail_on_the_embedded_model_stops_naming_constant_rewards(fresh_server_module, tmp_path):
    """The embedded model never solves a retail task: every rollout scores 0.0. The loop used to
    retry for 34 minutes and exit 0 at step 0, then stopped after --patience (3) attempts (7.5
    minutes at the default size); held-out 0 at step 0 and a first batch of nothing but 0 say it
    after one attempt."""
    srv = fresh_server_module()
    out = tmp_path / "retail"
    proc = _train(srv, out, "retail-stops", "--example", "retail", "--steps", "5", "--groups-per-step", "2",
                  "--group-size", "2", "--eval-tasks", "2", "--max-turns", "2", "--max-tokens", "24")
    assert proc.returncode == EXIT_CANNOT_LEARN, proc.stdout[-2000:] + proc.stderr[-2000:]
    # the first line: a new run, on the server's model, at the learning rate the server derives for it
    default_lr = httpx.get(f"{srv.url}/v1/runs/retail-stops", timeout=30).json()["default_learning_rate"]
    assert proc.stdout.splitlines()[0] == (f"run retail-stops: created on artisan-tiny | lr {short_float(default_lr)} | "
                                           f"2 groups x 2 | loss ppo")
    assert "Traceback" not in proc.stderr
    message = proc.stderr.strip()
    assert "Every rollout scored 0.0" in message and "never earns reward" in message and "\n" not in message
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"]["message"] == message and summary["stopped"]["cause"] == "constant_reward"
    assert summary["stopped"]["attempts"] == 1 and len(summary["history"]) == 1
    assert not summary["history"][0]["trained"] and summary["history"][0]["reward_values"] == [0.0]
    assert summary["steps"] == 0 and summary["evals"] == [summary["evals"][0]] and summary["evals"][0]["reward"] == 0
    assert proc.stdout.count("not trained |") == 1 and "without waiting for --patience 3" in message


def test_group_size_one_stops_with_its_own_cause(fresh_server_module, tmp_path):
    srv = fresh_server_module()
    proc = _train(srv, tmp_path, "one-per-group", "--example", "demo", "--steps", "2", "--groups-per-step", "2",
                  "--group-size", "1", "--eval-tasks", "2", "--patience", "2")
    assert proc.returncode == EXIT_CANNOT_LEARN, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--group-size 1" in proc.stderr and "Stopped: 2 training attempts in a row" in proc.stderr
    # between the two attempts, a line says that nothing trained and that another batch is coming
    lines = proc.stdout.splitlines()
    retry = "  nothing trained (1 of 2 attempts in a row, --patience 2): the run stays at step 0; sampling another batch"
    assert lines.count(retry) == 1 and lines.index(retry) < [i for i, x in enumerate(lines) if "not trained |" in x][1]
    assert json.loads((tmp_path / "summary.json").read_text())["stopped"]["cause"] == "group_size_1"
