"""`make demo`'s last line: held-out reward before and after, and the step the run serves when
--keep-best pinned an earlier, better one."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.demo.run_demo import DEMO_ARGS, result_line

pytestmark = pytest.mark.unit

SUMMARY = {"eval_reward_before": 0.188, "eval_reward_after": 0.859, "steps": 16}


def test_the_demo_keeps_its_best_step_served():
    assert "--keep-best" in DEMO_ARGS


def test_the_last_line_names_the_served_step_when_an_earlier_one_was_best():
    pinned = SUMMARY | {"keep_best": {"serving_step": 12, "reward": 0.891, "latest_step": 16, "latest_reward": 0.859}}
    assert result_line(pinned, 120.4, Path("out/demo/reward.png")) == (
        "held-out reward 0.188 -> 0.859 (the run serves step 12, its best: 0.891) in 16 steps, 120s including "
        "server start; plot: out/demo/reward.png")
    assert result_line(SUMMARY, 110.8, Path("p.png")) == (
        "held-out reward 0.188 -> 0.859 in 16 steps, 111s including server start; plot: p.png")
