"""A real model learns: GRPO through art-server raises SmolLM2-135M-Instruct's held-out accuracy.

The task is bench/learn.py's (examples/reasoning_gym: leg_counting, the same two solved questions
as earlier turns before every question, reasoning-gym's own score), on a budget small enough for
CI's 2 cores: STEPS steps of PROMPTS x GROUP seeded samples at art-server's default learning rate,
held-out accuracy answered greedily before and after, so the figure is neither sampling luck nor
evaluation noise. Every step must also be token-exact: no prompt mismatch and an on-policy logprob gap below 1e-3.

Run by `make test-learn` (CI calls it); the figures of its runs are in the README.
"""

from __future__ import annotations

import asyncio

import pytest

from client import TrainConfig, TrainableModel, Trajectory, TrajectoryGroup
from examples import reasoning_gym as task
from tests.conftest import ServerProcess
from tests.real_models import CACHE, converted, smollm2_gguf

STEPS, PROMPTS, GROUP = 8, 4, 8
HELD_OUT = 64
MAX_TOKENS = 8
RISE = 0.10  # asserted; the runs measured are in the README
# The prompt RISE was measured with: 0.109 -> 0.312. The example's default, drawn shots, starts lower
# on leg_counting and rose 0.039 -> 0.156 in one run here, too near RISE for a test that must not flake.
PROMPT = "fewshot"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    converted(smollm2_gguf())  # once per machine; the server then loads the dequantised copy
    server = ServerProcess(tmp_path_factory.mktemp("learn"), model=smollm2_gguf(),
                           extra=["--cache-dir", str(CACHE)]).start(timeout=600)
    yield server
    server.stop()


async def _accuracy(client, model: str, rows) -> float:
    async def one(row) -> float:
        r = await client.chat.completions.create(model=model, messages=task.messages(row, PROMPT),
                                                 temperature=0.0, max_tokens=MAX_TOKENS)
        return task.score(r.choices[0].message.content, row)

    return sum(await asyncio.gather(*(one(r) for r in rows))) / len(rows)


async def _group(client, model: str, row, seed: int) -> TrajectoryGroup:
    msgs = task.messages(row, PROMPT)
    r = await client.chat.completions.create(model=model, messages=msgs, n=GROUP, temperature=1.0,
                                             max_tokens=MAX_TOKENS, seed=seed)
    return TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=msgs + [c],
                                                    reward=task.score(c.message.content, row)) for c in r.choices])


async def test_grpo_raises_smollm2s_held_out_accuracy_on_a_reasoning_gym_task(smollm2):
    train = task.rows(task.TASK, STEPS * PROMPTS, task.TRAIN_SEED)
    held_out = task.rows(task.TASK, HELD_OUT, task.EVAL_SEED)

    model = await TrainableModel("smollm2-learns").register(smollm2.url)
    async with model.openai_client(max_retries=0) as client:
        before = await _accuracy(client, model.name, held_out)
        for step in range(STEPS):
            rows = train[step * PROMPTS:(step + 1) * PROMPTS]
            groups = await asyncio.gather(*(_group(client, model.name, row, seed=step * 100 + i)
                                            for i, row in enumerate(rows)))
            result = await model.train(list(groups), TrainConfig())
            m = result.metrics
            assert m.prompt_mismatches == 0
            assert m.logprob_gap is None or m.logprob_gap <= 1e-3
        after = await _accuracy(client, model.name, held_out)
    print(f"SmolLM2 held-out accuracy before {before:.3f}, after {after:.3f}")
    assert after >= before + RISE, f"held-out accuracy did not rise by {RISE}: {before:.3f} -> {after:.3f}"
