"""A run draws its training tasks in seeded passes: each task once a pass, every pass its own order."""

from __future__ import annotations

import types

import pytest

from client.loop.config import LoopConfig
from client.loop.task_draws import TaskDraws
from client.loop.training_loop import TrainingLoop
from examples import leg_lookup
from rollouts.env import Task

pytestmark = pytest.mark.unit


def tasks(n: int, prefix: str = "t") -> list[Task]:
    return [Task(id=f"{prefix}{i}", data={}) for i in range(n)]


def ids(draws: TaskDraws, n: int) -> list[str]:
    return [draws.next().id for _ in range(n)]


def test_every_task_comes_once_a_pass_and_the_next_pass_is_reshuffled():
    draws = ids(TaskDraws(tasks(50), seed=2), 100)
    first, second = draws[:50], draws[50:]
    assert sorted(first) == sorted(second) == sorted(t.id for t in tasks(50))
    assert first != second and first != sorted(first, key=lambda i: int(i[1:]))


def test_a_seed_repeats_its_order_and_another_seed_draws_another():
    assert ids(TaskDraws(tasks(30), 0), 45) == ids(TaskDraws(tasks(30), 0), 45)
    assert ids(TaskDraws(tasks(30), 0), 45) != ids(TaskDraws(tasks(30), 1), 45)


def test_new_tasks_start_a_new_pass_at_the_next_draw():
    draws = TaskDraws(tasks(10, "easy"), 0)
    ids(draws, 3)
    draws.replace(tasks(4, "hard"))
    assert sorted(ids(draws, 4)) == ["hard0", "hard1", "hard2", "hard3"]
    draws.replace([])  # refused at the first draw, not before: a run may never draw
    with pytest.raises(ValueError, match="no training tasks"):
        draws.next()


def test_a_runs_groups_do_not_repeat_a_question_before_the_pool_is_spent(tmp_path):
    # The tool agent's seed 2 drew 72 distinct questions in its first 80 groups when draws were
    # with replacement; a pass now gives 80 of 80.
    example = leg_lookup.make_example()
    loop = TrainingLoop(LoopConfig(example="leg_lookup", seed=2, out=tmp_path), example,
                        types.SimpleNamespace(step=0, base_model=None), None, types.SimpleNamespace(figures=None))
    drawn = [loop.draw().id for _ in range(80)]
    assert len(set(drawn)) == 80


def test_a_resumed_run_goes_on_with_the_draws_after_those_it_made(tmp_path):
    # A resumed run drew from the seed's start again: the first pass's questions came twice while
    # the rest of the pool waited. summary.json keeps how many it drew, and the resumed loop skips them.
    example, cfg = leg_lookup.make_example(), LoopConfig(example="leg_lookup", seed=2, out=tmp_path)
    first = TrainingLoop(cfg, example, types.SimpleNamespace(step=0, base_model=None), None,
                         types.SimpleNamespace(figures=None))
    drawn = [first.draw().id for _ in range(12)]
    first.summary.history = [{"step": 1}]
    first.summary.evals = [{"step": 0, "reward": 0.0}]
    first.summary.write()  # the run stopped after 12 draws, at step 1
    drawn += [first.draw().id for _ in range(8)]  # what it would have drawn next
    assert first.summary.tasks_drawn == 20
    resumed = TrainingLoop(cfg, example, types.SimpleNamespace(step=1, base_model=None), None,
                           types.SimpleNamespace(figures=None))
    assert [resumed.draw().id for _ in range(8)] == drawn[12:]
    over = TrainingLoop(cfg, example, types.SimpleNamespace(step=0, base_model=None), None,
                        types.SimpleNamespace(figures=None))  # a run started over draws from the start
    assert over.draw().id == drawn[0]
