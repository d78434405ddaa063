"""bench/tool_agent.py gives TRL the questions client.train trains artisan on, in the order it draws them,
and artisan's training seconds as its budget; it splits held-out success by the kinds of animal in a
question, and keeps each held-out episode and TRL's training episodes."""

from __future__ import annotations

import json
import sqlite3
import types

import pytest

from client.loop.config import LoopConfig
from client.loop.training_loop import TrainingLoop
from examples import leg_lookup
from rollouts.env import Score
from tests.helpers import bench_module

pytestmark = pytest.mark.unit


bench = bench_module("tool_agent")


@pytest.mark.parametrize("seed", [0, 3])
def test_trl_is_given_the_questions_client_train_draws_in_its_order(seed, tmp_path):
    example = leg_lookup.make_example()
    loop = TrainingLoop(LoopConfig(example="leg_lookup", seed=seed, out=tmp_path), example,
                        types.SimpleNamespace(step=0, base_model=None), None, types.SimpleNamespace(figures=None))
    drawn = [loop.draw().data["row"]["question"] for _ in range(40)]
    assert [row["question"] for row in bench.drawn_rows(example, seed, 40)] == drawn
    assert len(set(drawn)) > 20  # questions, not one repeated


def test_trls_budget_is_artisans_training_seconds_and_its_steps_may_pass_artisans():
    saved = [{"step": 4, "train_seconds": 808.0}, {"step": 8, "train_seconds": 1476.5}]
    opts = dict(steps=4, trl_steps=None, trl_seconds=None, only=None)
    assert bench.trl_budget(types.SimpleNamespace(**opts), saved) == (1476.5, 4)  # equal steps, at most its seconds
    assert bench.trl_budget(types.SimpleNamespace(**opts | {"trl_steps": 12}), saved) == (1476.5, 12)
    assert bench.trl_budget(types.SimpleNamespace(**opts), []) == (None, 4)  # artisan trained nothing
    alone = opts | {"only": "trl"}
    assert bench.trl_budget(types.SimpleNamespace(**alone), []) == (None, 4)
    assert bench.trl_budget(types.SimpleNamespace(**alone | {"trl_seconds": 900.0, "trl_steps": 9}), []) == (900.0, 9)


def test_the_servers_database_is_kept_whole_from_its_write_ahead_log(tmp_path):
    db = sqlite3.connect(tmp_path / "artisan.sqlite")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")  # the row stays in the log, not the main file
    db.execute("CREATE TABLE trajectories (step INTEGER, reward REAL)")
    db.execute("INSERT INTO trajectories VALUES (9, 0.5)")
    db.commit()
    bench.keep_database(tmp_path / "artisan.sqlite", tmp_path / "kept.sqlite")
    db.close()
    kept = sqlite3.connect(tmp_path / "kept.sqlite")
    assert kept.execute("SELECT step, reward FROM trajectories").fetchall() == [(9, 0.5)]
    kept.close()


def test_held_out_success_is_split_by_the_kinds_of_animal_in_a_question():
    rows = [t.data["row"] for t in leg_lookup.make_example().eval_tasks()[:16]]
    kinds = [len(r["metadata"]["animals"]) for r in rows]
    assert set(kinds) == {3, 4}  # the held-out questions' settings (leg_lookup.TASK)
    rewards = [1.0 if k == 3 else (0.5 if i % 2 else 0.0) for i, k in enumerate(kinds)]
    four = [r for r, k in zip(rewards, kinds) if k == 4]
    assert bench.success_by_kinds(rows, rewards) == {"3": 1.0, "4": round(sum(four) / len(four), 4)}
    with pytest.raises(ValueError):  # a reward per row, or the split is of other questions
        bench.success_by_kinds(rows, rewards[:-1])


def test_each_held_out_episode_is_kept_with_its_question_reward_and_messages(tmp_path):
    rows = [t.data["row"] for t in leg_lookup.make_example().eval_tasks()[:3]]
    scored = [([{"role": "user", "content": r["question"]}, {"role": "assistant", "content": str(i)}],
               Score(reward=i / 2, metrics={"turns": 1})) for i, r in enumerate(rows)]
    bench.keep_episodes(tmp_path / "step-4.jsonl", rows, scored)
    kept = [json.loads(line) for line in (tmp_path / "step-4.jsonl").read_text().splitlines()]
    assert [k["question"] for k in kept] == [r["question"] for r in rows]
    assert [k["reward"] for k in kept] == [0.0, 0.5, 1.0]
    assert kept[2]["messages"][-1] == {"role": "assistant", "content": "2"} and kept[0]["answer"] == rows[0]["answer"]
    with pytest.raises(ValueError):  # an episode per question, or the lines name other questions
        bench.keep_episodes(tmp_path / "short.jsonl", rows, scored[:-1])


def test_trls_training_episodes_are_appended_with_their_step_question_and_reward(tmp_path):
    tool_agent_trl = bench_module("tool_agent_trl")
    rows = [t.data["row"] for t in leg_lookup.make_example().eval_tasks()[:3]]
    completions = [[{"role": "assistant", "content": str(i)}] for i in range(3)]
    kept = tmp_path / "trl-train.jsonl"
    tool_agent_trl.keep_train_episodes(kept, rows[:2], [1, 1], completions[:2], [0.0, 1.0])
    tool_agent_trl.keep_train_episodes(kept, rows[2:], [2], completions[2:], [0.5])  # the next batch appends
    lines = [json.loads(line) for line in kept.read_text().splitlines()]
    assert [(k["step"], k["question"], k["reward"]) for k in lines] == [
        (1, rows[0]["question"], 0.0), (1, rows[1]["question"], 1.0), (2, rows[2]["question"], 0.5)]
    assert lines[2]["messages"] == completions[2]
    with pytest.raises(ValueError):  # a reward per episode, or the lines mismatch them
        tool_agent_trl.keep_train_episodes(tmp_path / "short.jsonl", rows, [1, 1, 1], completions, [0.0])
    assert not (tmp_path / "short.jsonl").exists()
