"""The demo's reward: the asked item looked up, its price stated, and no other item named."""

from __future__ import annotations

import random

import pytest

from examples.demo import task as demo

pytestmark = pytest.mark.unit

PENCIL = demo.make_task(random.Random(0), "pencil", 0, "test").model_copy(update={"data": {
    "item": "pencil", "question": "What is the price of pencil?", "price": 36}})


async def _score(answer: str, lookups=({"item": "pencil"},)) -> tuple[float, dict]:
    env = demo.ShopEnv(PENCIL)
    for args in lookups:
        try:
            await env.call_tool("get_price", dict(args))
        except demo.ToolError:
            pass
    score = await env.score(env.initial_messages() + [{"role": "assistant", "content": answer}])
    return score.reward, score.metrics


async def test_the_right_number_about_another_item_earns_nothing():
    reward, metrics = await _score("The price of plum is 36.")
    assert reward == 0.0
    assert metrics["looked_up"] and metrics["right_number"] and metrics["names_other_item"]


async def test_the_looked_up_price_earns_the_reward():
    for answer in ("The price is 36.", "The price of pencil is 36.", "PENCIL: 36 dollars", "A pencil costs $36."):
        reward, metrics = await _score(answer)
        assert reward == 1.0 and not metrics["names_other_item"], answer


async def test_every_part_is_required():
    assert (await _score("The price of pencil is 35."))[0] == 0.0  # not the tool's number
    assert (await _score("The price of pencil is 36.", lookups=()))[0] == 0.0  # no lookup: a guess
    reward, metrics = await _score("The price of pencil is 36.", lookups=({"item": "plum"},))
    assert reward == 0.0 and not metrics["looked_up"]  # looked up the wrong item
    assert (await _score("The price of pencil, not of plum, is 36."))[0] == 0.0  # another item named
    assert (await _score("Pineapples: 36."))[0] == 1.0  # a word match, not a prefix ("apple" is an item)


async def test_the_demonstrations_still_earn_the_reward():
    """The warm start's right answers must score 1 under this reward, its mistakes 0."""
    rng = random.Random(1)
    for task in demo.make_example(n_train=32).train_tasks(3):
        for mistake in (False, True):
            messages = demo.demonstration(task, mistake, rng)
            env = demo.ShopEnv(task)
            if not mistake:
                await env.call_tool("get_price", {"item": task.data["item"]})
            assert (await env.score(messages)).reward == (0.0 if mistake else 1.0)
