"""bench/async.py's reading of a run: when it reached a reward, what it had at a given time, and its
throughput score."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.helpers import bench_module

pytestmark = pytest.mark.unit

bench = bench_module("async")

REWARDS = {1: 0.2, 2: 0.9, 3: 0.5, 4: 0.95}
LANDED = {1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0}


def held_out(every: int = 1) -> tuple[object, list[int]]:
    """A HeldOut whose evaluation reads REWARDS, and the steps it evaluated."""
    evaluated: list[int] = []

    async def evaluate_step(run, step):
        evaluated.append(step)
        return REWARDS[step]

    return bench.HeldOut(evaluate_step, every), evaluated


def test_time_to_a_reward_is_the_first_evaluated_step_that_reaches_it():
    ho, evaluated = held_out()
    assert asyncio.run(ho.seconds_to({"landed": LANDED}, 0.9)) == 20.0  # step 3's dip does not move it
    assert evaluated == [1, 2]  # the scan stops where it is reached
    assert asyncio.run(ho.seconds_to({"landed": LANDED}, 0.95)) == 40.0
    assert asyncio.run(ho.seconds_to({"landed": LANDED}, 0.96)) is None
    ho, _ = held_out(every=2)
    assert asyncio.run(ho.seconds_to({"landed": LANDED}, 0.5)) == 20.0  # step 1 is not evaluated


def test_reward_at_a_time_is_the_newest_step_landed_by_then_each_step_evaluated_once():
    ho, evaluated = held_out()
    run = {"landed": LANDED}
    assert asyncio.run(ho.reward_by(run, 35.0)) == 0.5
    assert asyncio.run(ho.reward_by(run, 40.0)) == 0.95
    assert asyncio.run(ho.reward_by(run, 5.0)) is None
    assert asyncio.run(ho.seconds_to(run, 0.95)) == 40.0
    assert sorted(evaluated) == [1, 2, 3, 4] and run["held_out"] == REWARDS


def test_the_runs_of_a_seed_are_timed_to_its_synchronous_final_reward():
    ho, _ = held_out()
    sync = {"seed": 0, "S": 0, "landed": LANDED, "train_seconds": 40.0}
    fast = {"seed": 0, "S": 2, "landed": {s: t / 2 for s, t in LANDED.items()}, "train_seconds": 20.0}
    asyncio.run(bench.time_to_reward(ho, [sync, fast], seeds=1))
    assert sync["final_reward"] == 0.95 and sync["target_reward"] == pytest.approx(0.95 - math.sqrt(0.95 * 0.05 / 64))
    assert sync["seconds_to_target"] == 40.0 and fast["seconds_to_target"] == 20.0 and fast["ratio_to_sync"] == 0.5
    assert fast["reward_at_sync_seconds"] == 0.95


def test_the_throughput_score_is_accepted_tokens_a_second_discounted_for_staleness():
    fresh = bench.throughput_score([(100, 0.0), (300, 0.0)], 4.0)
    assert fresh == {"accepted_tokens_per_second": 100.0, "freshness": 1.0, "score": 100.0}
    stale = bench.throughput_score([(100, 0.0), (300, 2.0)], 4.0)
    freshness = 400 / (100 + 300 * math.exp(2.0 / 8.0))  # a token-weighted mean of exp(age / 8), inverted
    assert stale["freshness"] == round(freshness, 4) and stale["score"] == round(100.0 * freshness, 2)
    assert bench.throughput_score([], 4.0)["score"] is None  # nothing trained
