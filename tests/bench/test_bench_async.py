"""bench/async.py's reading of a run: when it reached a reward, what it had at a given time, and its
throughput score."""

from __future__ import annotations

import importlib.util
import math

import pytest

from client.local_server import ROOT

pytestmark = pytest.mark.unit

spec = importlib.util.spec_from_file_location("bench_async", ROOT / "bench" / "async.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

RUN = {"landed": {1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0}, "held_out": {1: 0.2, 2: 0.9, 3: 0.5, 4: 0.95}}


def test_time_to_a_reward_is_the_first_evaluated_step_that_reaches_it():
    assert bench.seconds_to(RUN, 0.9) == 20.0  # step 3's dip does not move it
    assert bench.seconds_to(RUN, 0.95) == 40.0
    assert bench.seconds_to(RUN, 0.96) is None


def test_reward_at_a_time_is_the_newest_step_landed_by_then():
    assert bench.reward_by(RUN, 35.0) == 0.5
    assert bench.reward_by(RUN, 40.0) == 0.95
    assert bench.reward_by(RUN, 5.0) is None


def test_the_throughput_score_is_accepted_tokens_a_second_discounted_for_staleness():
    fresh = bench.throughput_score([(100, 0.0), (300, 0.0)], 4.0)
    assert fresh == {"accepted_tokens_per_second": 100.0, "freshness": 1.0, "score": 100.0}
    stale = bench.throughput_score([(100, 0.0), (300, 2.0)], 4.0)
    freshness = 400 / (100 + 300 * math.exp(2.0 / 8.0))  # a token-weighted mean of exp(age / 8), inverted
    assert stale["freshness"] == round(freshness, 4) and stale["score"] == round(100.0 * freshness, 2)
    assert bench.throughput_score([], 4.0)["score"] is None  # nothing trained
