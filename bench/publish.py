"""From a trained step to its first token, and the memory a step takes, per engine.

Starts art-server with each engine asked for, trains a run for a few RL steps on groups it sampled
itself, and measures for each step:
- publish: the server's own figure for loading the new adapter into the engine (StepMetrics);
- first token on the new adapter: a streamed request on the run's name sent the moment the
  job's result arrives, to its first token. The baseline, in the same run, is the same request
  sent again at once (the adapter now warm);
- resident memory of art-server and every process it started (vLLM's), sampled every 50 ms:
  before the step and at its peak during the step.

    python bench/publish.py --model DIR --engine torch --engine vllm --vllm-python .venv-vllm/bin/python

Prints one JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import LocalServer  # noqa: E402

STEPS, GROUP_SIZE = 3, 8
MESSAGES = [{"role": "user", "content": "Name a colour and say why you like it."}]


class PeakMemory:
    """Resident memory of a process and its descendants, sampled on a thread."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> int:
        total = 0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.05)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _first_token(client, model: str) -> float:
    started = time.perf_counter()
    stream = await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, stream=True)
    async for chunk in stream:
        if chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids"):
            elapsed = time.perf_counter() - started
            await stream.close()
            return elapsed
    raise RuntimeError("the stream ended without a token")


async def _measure(server: LocalServer) -> dict[str, float]:
    from client import TrainConfig, TrainableModel, Trajectory, TrajectoryGroup

    model = await TrainableModel("publish-bench").register(server.url)
    publish, new, warm, idle, peak = [], [], [], [], []
    async with model.openai_client(max_retries=0, timeout=600) as client:
        for step in range(STEPS):
            resp = await client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=24,
                                                        n=GROUP_SIZE, temperature=1.0, seed=step)
            group = TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=[*MESSAGES, c], reward=float(i))
                                                  for i, c in enumerate(resp.choices)])
            memory = PeakMemory(server.proc.pid)
            idle.append(memory.now())
            with memory:
                result = await model.train([group], TrainConfig(learning_rate=1e-4))
            new.append(await _first_token(client, model.name))
            warm.append(await _first_token(client, model.name))
            publish.append(result.metrics.publish_seconds)
            peak.append(memory.peak)
    return {"publish_s": round(statistics.median(publish), 4),
            "first_token_new_adapter_s": round(statistics.median(new), 4),
            "first_token_warm_adapter_s": round(statistics.median(warm), 4),
            "rss_before_step_gib": round(max(idle) / 2**30, 2), "rss_peak_in_step_gib": round(max(peak) / 2**30, 2)}


def main(model: str = typer.Option(None, help="A model directory or .gguf file (default: the embedded model)."),
         engine: list[str] = typer.Option(["torch"], help="torch and/or vllm (repeat to compare in one run)."),
         vllm_python: str = typer.Option(None, help="The Python with vllm installed (default: this one).")) -> None:
    out: dict = {"model": Path(model).stem if model else "embedded", "steps": STEPS}
    for name in engine:
        extra = ["--device", "cpu", "--engine", name] + (["--vllm-python", vllm_python] if vllm_python else [])
        with tempfile.TemporaryDirectory(prefix="bench-publish-") as work:
            server = LocalServer(Path(work) / "data", model=model, extra=extra).start(timeout=900)
            try:
                out.update({f"{name}_{k}": v for k, v in asyncio.run(_measure(server)).items()})
            finally:
                server.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    typer.run(main)
