"""bench/learn.py's pieces that decide its figures: the task both trainers see, and how two
learning curves are compared. (The benchmark itself is run with `make bench-learn`.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from examples import reasoning_gym as learn_task

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))




def test_the_fewshot_prompt_puts_solved_questions_of_the_same_dataset_before_the_question():
    [row] = learn_task.rows("chain_sum", 1, learn_task.EVAL_SEED)
    msgs = learn_task.messages(row, "fewshot")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[-1]["content"] == row["question"]
    shots = learn_task.rows("chain_sum", learn_task.FEWSHOT_N, learn_task.FEWSHOT_SEED)
    assert [msgs[2]["content"], msgs[4]["content"]] == [str(s["answer"]) for s in shots]
    assert learn_task.messages(row, "fewshot") == msgs  # every prompt of a run is the same


def test_train_and_held_out_rows_are_other_questions():
    train = {r["question"] for r in learn_task.rows("chain_sum", 64, learn_task.TRAIN_SEED)}
    held_out = [r["question"] for r in learn_task.rows("chain_sum", 64, learn_task.EVAL_SEED)]
    assert len(train & set(held_out)) < len(held_out)  # one-digit sums repeat; the sets are not the same draw


def test_the_reward_is_reasoning_gyms_score_of_the_bare_or_tagged_answer():
    [row] = learn_task.rows("chain_sum", 1, 0)
    answer = str(row["answer"])
    assert learn_task.score(answer, row) == 1.0
    assert learn_task.score(f" {answer}\n", row) == 1.0
    assert learn_task.score(f"I think <answer>{answer}</answer>", row) == 1.0
    assert learn_task.score(f"The answer is {answer}.", row) < 1.0
    assert learn_task.score(None, row) == 0.0


def test_time_ratio_compares_seconds_to_reach_trls_final_accuracy():
    learn = _load("learn")
    trl = [[0.0, 0, 0.2], [10.0, 5, 0.3], [20.0, 10, 0.5]]
    artisan = [[0.0, 0, 0.2], [4.0, 5, 0.5], [8.0, 10, 0.6]]
    out = learn.compare(artisan, trl)
    assert out["time_ratio_to_trl_final"] == pytest.approx(0.2)  # 4 s vs 20 s to reach 0.5
    assert out["time_ratio_per_step"] == pytest.approx(0.4)
    assert learn.compare([[0.0, 0, 0.2], [8.0, 10, 0.3]], trl)["time_ratio_to_trl_final"] is None  # never reached
    flat = [[0.0, 0, 0.2], [20.0, 10, 0.2]]
    assert learn.compare(artisan, flat)["time_ratio_to_trl_final"] is None  # TRL learned nothing: nothing to time
