# examples/quickstart.py: one training step from your own code, against a running art-server.
import asyncio
import os
import sys

from client import TrainableModel, TrainConfig, gather_trajectory_groups
from examples.demo.task import make_example
from rollouts.agent import rollout


async def main(server: str = "http://127.0.0.1:8000") -> None:
    example = make_example()  # the demo task: look a price up with a tool, then answer
    tasks = example.train_tasks(seed=0)[:8]
    model = await TrainableModel("my-run").register(server, api_key=os.environ.get("ARTISAN_API_KEY"))
    async with model.openai_client() as client:  # closed when done
        groups = await gather_trajectory_groups(
            [[rollout(client, model.name, example.make_env(task), task, example.settings) for _ in range(8)]
             for task in tasks])  # 8 rollouts of each task: rewards are compared within a group
    result = await model.train(groups, TrainConfig())
    print(f"step {result.step}: trained {result.trained}, reward {result.metrics.reward_mean:.2f}")
    for warning in result.warnings:
        print("warning:", warning)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
