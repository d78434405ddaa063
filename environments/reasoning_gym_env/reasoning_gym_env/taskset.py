"""reasoning-gym's procedural tasks as a verifiers (0.4, `verifiers.v1`) taskset.

Single-turn: the model answers once, inside `<answer>` tags; the reward is reasoning-gym's
own `score_answer` for the task's dataset, on the tagged answer (or the whole reply when the
model wrote no tags, so a bare correct answer still counts). Offline: the rows are generated
from (dataset, size, seed), so the same config always yields the same tasks.

verifiers finds it by id: `vf-eval reasoning-gym-env --env.taskset.dataset chain_sum ...`.
Its harness should be `null` (a plain chat loop); verifiers' default for a taskset without
one of its own is `bash`, which hands the model a shell.
"""

from __future__ import annotations

from typing import Any

import reasoning_gym
import verifiers.v1 as vf
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from rewards.reasoning_gym import score_reply

TASKSET_ID = "reasoning-gym-env"


class ReasoningGymData(vf.TaskData):
    answer: str
    """reasoning-gym's reference answer."""
    entry: dict[str, Any]
    """The generated row as reasoning-gym gave it: `score_answer` reads its metadata."""


class ReasoningGymTask(vf.Task[ReasoningGymData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return score_reply(trace.last_reply, self.data.entry)

    @vf.metric
    async def tagged(self, trace: vf.Trace) -> float:
        return float(extract_answer(trace.last_reply or "") is not None)



class ReasoningGymConfig(vf.TasksetConfig):
    dataset: str = "basic_arithmetic"
    """A reasoning-gym dataset name (`reasoning_gym.factory.DATASETS`)."""
    size: int = 1000
    seed: int = 0
    options: dict[str, Any] = {}
    """The dataset's own settings (its difficulty knobs), passed to `create_dataset`."""
    prompt_style: str = "direct"
    """A key of reasoning-gym's SYSTEM_PROMPTS; "direct" asks for the bare answer in tags."""


class ReasoningGymTaskset(vf.Taskset[ReasoningGymTask, ReasoningGymConfig]):
    def load(self) -> list[ReasoningGymTask]:
        cfg = self.config
        rows = reasoning_gym.create_dataset(cfg.dataset, size=cfg.size, seed=cfg.seed, **cfg.options)
        system = SYSTEM_PROMPTS[cfg.prompt_style]
        return [ReasoningGymTask(ReasoningGymData(idx=i, id=f"{cfg.dataset}-{cfg.seed}-{i}", prompt=row["question"],
                                                  system_prompt=system, answer=str(row["answer"]), entry=row),
                                 cfg.task)
                for i, row in enumerate(rows)]


def load_environment(task: str = "basic_arithmetic", size: int = 1000, seed: int = 0,
                     options: dict[str, Any] | None = None, harness: str = "null",
                     runtime: str = "subprocess", **agent: Any) -> vf.Env:
    """The single-agent env over one reasoning-gym dataset, as `vf-eval` would build it:
    verifiers' `null` chat harness in a local subprocess unless told otherwise. `agent` takes
    AgentConfig fields (max_turns, timeout, ...)."""
    config = vf.SingleAgentEnvConfig.model_validate({
        "taskset": {"id": TASKSET_ID, "dataset": task, "size": size, "seed": seed, "options": options or {}},
        "agent": {"harness": {"id": harness}, "runtime": {"type": runtime}, **agent},
    })
    return vf.load_environment(config)
