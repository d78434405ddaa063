"""What test modules share, beside the fixtures and the server they start (conftest.py): rollouts
to train on, a choice as the server samples one, the server's JSON, `client.train` as a user runs
it, a saved step's adapter, the logprobs a full forward gives, a bench script as a module, and an
ASGI app (a stand-in endpoint, or art-server's own app) served in a thread of the test's process.

Imported as `tests.helpers` (tests/art_client cannot: ART's environments install a `tests` package of
their own). Nothing here imports torch until a test reads weights.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import httpx
from openai.types.chat.chat_completion import Choice

from client import TrainableModel, TrajectoryGroup
from client.local_server import ROOT, free_port
from examples.demo import task as demo
from rollouts.agent import rollout

if TYPE_CHECKING:
    import torch


async def demo_groups(model: TrainableModel, n_groups: int, size: int, seed: int = 0) -> list[TrajectoryGroup]:
    """Real multi-turn, tool-calling rollouts of the demo task, sampled from the server. Seeded:
    the warm-started model often skips the tool, and a test that needs tool calls must not ride
    on sampling luck."""
    example = demo.make_example()
    tasks = example.train_tasks(seed)[:n_groups]
    out = []
    async with model.openai_client(max_retries=0) as client:
        for g, t in enumerate(tasks):
            trajs = await asyncio.gather(*(rollout(client, model.name, example.make_env(t), t,
                                                   replace(example.settings, seed=seed * 1000 + g * size + i))
                                           for i in range(size)))
            out.append(TrajectoryGroup(trajectories=list(trajs)))
    return out


def sampled_choice(content: str | None = "x", token_ids: list[int] | None = None, *,
                   tool_calls: list[dict] | None = None, token: str = "t", logprob: float = -0.5,
                   policy: str = "p", step: int = 0, prompt_fingerprint: str = "f", prompt_len: int = 0) -> Choice:
    """A choice as art-server answers one: its message, the ids it sampled with a logprob each, and
    the sampling record (which policy and step, after which prompt) that training checks."""
    return Choice.model_validate({
        "index": 0, "finish_reason": "tool_calls" if tool_calls else "stop",
        "message": {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})},
        **({"token_ids": token_ids, "logprobs": {"content": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []} for _ in token_ids]}}
           if token_ids is not None else {}),
        "sampling": {"temperature": 1.0, "top_p": 1.0, "logprob_temperature": 1.0, "policy": policy, "step": step,
                     "prompt_fingerprint": prompt_fingerprint, "prompt_len": prompt_len, "model_fingerprint": "m"}})


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py loaded as a module: the benches are scripts, not a package."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_rewards(groups: list[TrajectoryGroup], rewards: list[list[float]]) -> list[TrajectoryGroup]:
    """The same groups, their trajectories rewarded as given (what is learnt is not what is tested)."""
    out = []
    for g, rs in zip(groups, rewards):
        trajs = [t.model_copy(update={"reward": r}) for t, r in zip(g.trajectories, rs)]
        out.append(TrajectoryGroup(trajectories=trajs))
    return out


def get_json(url: str, path: str, **params: Any) -> dict:
    """The JSON of a GET that must succeed; the body is the assertion's message if it does not."""
    r = httpx.get(url + path, params=params, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def train_command(server_url: str, out: Path, run: str, *args: str) -> list[str]:
    """`python -m client.train` against a server, as a user types it, without its progress bar."""
    return [sys.executable, "-m", "client.train", "--server", server_url, "--run", run, "--out", str(out),
            "--no-progress", *args]


def train_cli(server_url: str, out: Path, run: str, *args: str, timeout: float = 600,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`client.train` run to its end (`env` on top of this process's); its output is captured for
    the assertions."""
    return subprocess.run(train_command(server_url, out, run, *args), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def train_demo(server_url: str, out: Path, steps: int, *args: str, run: str = "e2e") -> subprocess.CompletedProcess:
    """`client.train` on the demo task at the size its learning tests use; `args` may override any of it."""
    return train_cli(server_url, out, run, "--example", "demo", "--steps", str(steps), "--groups-per-step", "4",
                     "--group-size", "4", "--eval-every", "2", "--eval-tasks", "16", "--learning-rate", "1e-3",
                     *args, timeout=900)


def adapter_weights(data_dir: Path, run: str, step: int) -> dict[str, torch.Tensor]:
    """The LoRA tensors a run saved at `step`, read from the server's data directory."""
    from safetensors.torch import load_file  # torch: only where a test reads weights

    return load_file(str(data_dir / "runs" / run / "checkpoints" / f"step_{step:06d}" / "adapter.safetensors"))


def completion_logprobs(model: Any, prompt: list[int], completion: list[int], temperature: float = 1.0
                        ) -> torch.Tensor:
    """Each completion token's logprob under softmax(logits / T), from one full forward of `model`
    over the prompt and completion: what a sampler's reported logprobs must equal."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


class ServedApp:
    """An ASGI app served by uvicorn in a daemon thread of this process, on a free loopback port:
    for stand-in endpoints, and for tests that reach into a server's own objects while it serves."""

    def __init__(self, app: Any, **config: Any):
        import uvicorn  # the server's extra: only the tests that serve an app need it

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, **{"host": "127.0.0.1", "port": self.port,
                                                            "log_level": "warning", **config}))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> ServedApp:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, f"the app at {self.url} did not start"
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)

    def __enter__(self) -> ServedApp:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
