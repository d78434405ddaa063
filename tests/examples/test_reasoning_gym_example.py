"""The reasoning_gym example on any of reasoning-gym's tasks, and its reward on replies a scorer cannot read."""

import pytest

from examples import reasoning_gym as example
from rewards.reasoning_gym import exact_reply, score_reply

pytestmark = pytest.mark.unit


def test_a_task_without_settings_here_is_asked_at_reasoning_gyms_defaults():
    assert "simple_equations" not in example.SETTINGS
    made = example.make_example("simple_equations")
    [row] = [t.data["row"] for t in made.eval_tasks()[:1]]
    assert row["metadata"]["source_dataset"] == "simple_equations"
    assert score_reply(str(row["answer"]), row) == 1.0
    # its reply budget holds every answer of its shot pool at a token a byte (modulo_grid's are mostly
    # three-byte marks), with room for a sentence beside it; the measured tasks keep theirs
    for task in ("number_sorting", "modulo_grid"):
        room = example.make_example(task).settings.max_tokens - example.SHORT_REPLY_TOKENS
        assert room > 64 and all(len(str(ex["answer"]).encode()) <= room for ex in example._pool(task))
    assert example.make_example("chain_sum").settings.max_tokens == example.SHORT_REPLY_TOKENS


def test_a_task_this_prompt_cannot_pose_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^reasoning-gym task 'boxnet' gives its questions no reference answer"):
        example.make_example("boxnet")  # the shots would show "None" as the solved answers
    with pytest.raises(ValueError, match=r"^reasoning-gym task 'composite' cannot be built at its defaults: "):
        example.make_example("composite")


def test_a_task_reasoning_gym_lacks_is_refused_in_one_line_with_the_names_near_it():
    with pytest.raises(ValueError) as near:
        example.make_example("chain_sums")
    assert str(near.value) == "reasoning-gym has no task 'chain_sums'; did you mean chain_sum, decimal_chain_sum?"
    with pytest.raises(ValueError, match=r"^reasoning-gym has no task 'zzz'; its tasks: ab, acre, .*leg_counting"):
        example.make_example("zzz")


def test_a_reply_the_scorer_cannot_parse_scores_zero_not_an_error():
    row = example.rows("prime_factorization", 1, seed=0)[0]
    assert score_reply("2 and 32", row) == 0.0  # reasoning-gym's own scorer raises ValueError on it
    assert score_reply(row["answer"], row) == exact_reply(row["answer"], row) == 1.0
    assert exact_reply("2 and 32", row) == 0.0
