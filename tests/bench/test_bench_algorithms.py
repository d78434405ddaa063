"""bench/algorithms.py's pieces that decide its figures: its arguments, the budget each algorithm
gets, which options each algorithm is, and the held-out set. (The bench itself is `make
bench-algorithms`.)"""

from __future__ import annotations

import pytest

from tests.bench.test_bench_learn import _load

pytestmark = pytest.mark.unit


def test_quick_is_a_reduced_run_and_bad_arguments_are_refused(capsys):
    bench = _load("algorithms")
    a = bench.parse(["--quick"])
    assert (a.steps, a.prompts_per_step, a.group_size, a.value_samples, a.curriculum_every) == (2, 2, 8, 4, 1)
    assert a.algorithms == ["grpo", "reinforce", "apo"] and a.curriculum == "both"
    assert bench.parse(["--algorithms", "apo, grpo"]).algorithms == ["apo", "grpo"]
    for argv, needle in ((["--algorithms", "ppo2"], "ppo2"), (["--steps", "0"], "--steps"),
                         (["--group-size", "1"], "--group-size"), (["--curriculum-threshold", "1.5"], "threshold"),
                         (["--curriculum", "sometimes"], "--curriculum")):
        with pytest.raises(SystemExit) as exc:
            bench.parse(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err


def test_every_algorithm_gets_the_same_sample_budget():
    bench = _load("algorithms")
    a = bench.parse(["--steps", "16", "--prompts-per-step", "4", "--group-size", "8", "--value-samples", "8"])
    grpo, reinforce, apo = (bench.shape(x, a) for x in ("grpo", "reinforce", "apo"))
    assert grpo == reinforce and grpo["budget"] == 16 * 4 * 8
    assert apo["group_size"] == 1  # one sample per prompt in stage 2
    stage2 = a.steps * apo["prompts_per_step"] * apo["group_size"]
    stage1 = apo["pool"] * apo["value_samples"]  # at most: each prompt of the pool estimated once
    assert stage1 + stage2 == grpo["budget"]


def test_each_algorithm_is_the_options_it_names():
    bench = _load("algorithms")
    grpo, reinforce, apo = (bench.train_config(x, 2e-4, 1e-3) for x in ("grpo", "reinforce", "apo"))
    assert (grpo.loss, grpo.baseline) == ("ppo", "group_mean")
    assert (reinforce.loss, reinforce.baseline) == ("importance_sampling", "leave_one_out")
    assert (apo.loss, apo.baseline, apo.loss_aggregation, apo.apo_beta) == ("apo", "given", "seq_mean", 1e-3)
    with pytest.raises(ValueError):
        bench.train_config("dpo", 2e-4, 1e-3)


def test_the_held_out_set_has_every_level_in_equal_numbers():
    bench = _load("algorithms")
    rows = bench.eval_rows("leg_counting", 8, 4)
    assert [lvl for lvl, _ in rows] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len({r["question"] for _, r in rows}) == 8
