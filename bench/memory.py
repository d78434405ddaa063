"""art-server's memory on the README's commands: peak resident memory of the server, per phase.

For each model (the embedded one, SmolLM2-135M-Instruct and Gemma 3 270M from their GGUFs) it
starts a real art-server (client/local_server.py, on the CPU) and runs the README's command for it
with `python -m client.train` against it, shortened to 2 steps (the same groups x group size and
max tokens). The server process tree's resident memory is sampled every 0.1 s, and the kernel's
own peak (VmHWM, reset at every phase boundary) catches what falls between samples. Phases:

- start: from launching the server until it answers /health (the model loaded)
- evaluation: the client's step-0 evaluation (held-out tasks, greedy)
- sampling: the steps' rollouts (the engine has rows running or waiting)
- training: the rest of each step (the engine idle: assembly, forward/backward, checkpoint)
- final_evaluation: the evaluation after the last step
- idle: once the client has ended (what the server goes on holding)

    python bench/memory.py                        # all three; one JSON line last
    python bench/memory.py --models smollm2 --server-arg=--memory-budget --server-arg=3

Figures are GB (10^9 bytes). Nothing is timed.

`--long-prompts N` measures the engine's K/V budget instead: N concurrent chat requests on
SmolLM2, each a distinct prompt of about 4,400 tokens (a group of long agent turns), against a
server with its default `--kv-cache-mb` and against one whose budget binds nothing; the peak of
each, the budget, and the seconds the requests took.

    python bench/memory.py --long-prompts 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import ROOT, LocalServer  # noqa: E402

GB = 10**9
PHASES = ("start", "evaluation", "sampling", "training", "final_evaluation", "idle")
STEPS = 2
REASONING_GYM = ["--example", "reasoning_gym", "--run", "legs", "--groups-per-step", "4", "--group-size", "8",
                 "--learning-rate", "2e-4"]


def models() -> dict[str, dict[str, Any]]:
    """Each model's server arguments and the README's client command for it (less --steps, --out)."""
    from tests.real_models import TEMPLATES, gemma3_gguf, smollm2_gguf

    return {
        "embedded": {"server": [], "client": ["--example", "demo", "--run", "first-run", "--eval-tasks", "32"]},
        "smollm2": {"server": ["--model", str(smollm2_gguf())], "client": REASONING_GYM},
        "gemma3": {"server": ["--model", str(gemma3_gguf()), "--chat-template", str(TEMPLATES / "gemma3.jinja")],
                   "client": REASONING_GYM},
    }


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def resident(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def kernel_peak(procs: list[psutil.Process], reset: bool) -> int:
    """The sum of each process's peak resident memory since its last reset (an upper bound on the
    tree's; the torch engine's server is one process), then reset it (Linux's clear_refs 5)."""
    total = 0
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
            if reset:
                with open(f"/proc/{p.pid}/clear_refs", "w") as f:
                    f.write("5")
        except (OSError, StopIteration):
            pass
    return total


class Monitor(threading.Thread):
    """Samples the server's memory; `label()` names the phase each sample belongs to."""

    def __init__(self, pid: int, label: Callable[[], str]):
        super().__init__(daemon=True)
        self.pid, self.label = pid, label
        self.peaks: dict[str, int] = {}
        self.phase = "start"
        self._done = threading.Event()

    def run(self) -> None:
        self._note("start", kernel_peak(tree(self.pid), reset=True))
        while not self._done.is_set():
            self.sample()
            time.sleep(0.1)

    def sample(self) -> None:
        procs = tree(self.pid)
        phase = self.label()
        if phase != self.phase:  # the kernel's peak since the last boundary is the phase that just ended
            self._note(self.phase, kernel_peak(procs, reset=True))
            self.phase = phase
        self._note(phase, resident(procs))

    def _note(self, phase: str, n: int) -> None:
        self.peaks[phase] = max(self.peaks.get(phase, 0), n)

    def finish(self) -> dict[str, float]:
        self._done.set()
        self.join()
        self._note(self.phase, kernel_peak(tree(self.pid), reset=False))
        return {p: round(self.peaks[p] / GB, 2) for p in PHASES if p in self.peaks}


class ClientProgress:
    """Where `client.train` is, from its output lines, and whether the server's engine is busy."""

    def __init__(self, url: str):
        self.url, self.state, self.lines = url, "waiting", []
        self._http = httpx.Client(timeout=2)

    def read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip())
            if line.startswith("eval @ step 0"):
                self.state = "steps"
            elif line.startswith(f"step {STEPS:3d}"):
                self.state = "final_evaluation"
        self.state = "ended"

    def label(self) -> str:
        if self.state == "waiting":
            return "start"
        if self.state == "steps":
            return "sampling" if self._engine_busy() else "training"
        if self.state == "ended":
            return "idle"
        return self.state

    def _engine_busy(self) -> bool:
        try:
            load = self._http.get(self.url + "/health").json()
            return bool(load.get("running") or load.get("waiting"))
        except (httpx.HTTPError, ValueError):
            return False


def measure(name: str, spec: dict[str, Any], work: Path, server_args: list[str]) -> dict[str, Any]:
    from tests.real_models import CACHE

    extra = ["--device", "cpu", "--cache-dir", str(CACHE), *spec["server"], *server_args]
    server = LocalServer(work / name / "data", extra=extra)
    progress = ClientProgress(server.url)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    cmd = [sys.executable, "-m", "client.train", "--server", server.url, *spec["client"], "--steps", str(STEPS),
           "--out", str(work / name / "out"), "--no-progress"]
    server.start(timeout=600)
    monitor = Monitor(server.proc.pid, progress.label)
    monitor.start()  # its first reading is the kernel's peak since launch: loading the model
    try:
        progress.state = "evaluation"
        client = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        reader = threading.Thread(target=progress.read, args=(client.stdout,), daemon=True)
        reader.start()
        code = client.wait(timeout=3600)
        reader.join()
        time.sleep(3)  # the idle phase: what the server keeps once the work is done
        peaks = monitor.finish()
    finally:
        server.stop()
    if code != 0:
        raise SystemExit(f"{name}: client.train exited {code}:\n" + "\n".join(progress.lines[-30:]))
    steps = [line for line in progress.lines if line.startswith("step ")]
    return {"peak_gb": peaks, "max_gb": max(peaks.values()), "steps": steps,
            "server": " ".join(["art-server", *extra]), "client": " ".join(["python -m client.train", *cmd[3:]])}


LONG_PROMPT_WORDS = 1500  # about 4,400 tokens under SmolLM2's template
UNBOUNDED_MB = 2**20  # a K/V budget of 1 TiB: rows are bounded by --max-batch alone


def long_prompt(i: int) -> str:
    words = "apple pear river stone cloud seven green table window music paper light ocean forest bread".split()
    return f"{i}: " + " ".join(f"{words[(i * 7 + j * 3 + j // 5) % len(words)]}{(i + j) % 97}"
                               for j in range(LONG_PROMPT_WORDS))


def long_prompts(n: int, work: Path, server_args: list[str]) -> dict[str, Any]:
    """The server's peak while it answers `n` concurrent long prompts (16 new tokens each)."""
    import asyncio

    from openai import AsyncOpenAI

    from tests.real_models import CACHE, smollm2_gguf

    server = LocalServer(work, extra=["--device", "cpu", "--cache-dir", str(CACHE), "--model", str(smollm2_gguf()),
                                      *server_args])

    async def ask(model: str) -> list[int]:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="-", timeout=3600) as client:
            async def one(i: int) -> int:
                reply = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": long_prompt(i)}], max_tokens=16)
                return reply.usage.prompt_tokens
            return await asyncio.gather(*(one(i) for i in range(n)))

    server.start(timeout=600)
    try:
        health = httpx.get(server.url + "/health").json()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        procs = tree(server.proc.pid)
        before = resident(procs)
        kernel_peak(procs, reset=True)
        started = time.perf_counter()
        tokens = asyncio.run(ask(model))
        seconds = time.perf_counter() - started
        peak = kernel_peak(procs, reset=False)
    finally:
        server.stop()
    return {"kv_cache_mb": health["kv_cache"]["budget_mb"], "prompt_tokens": max(tokens),
            "before_gb": round(before / GB, 2), "peak_gb": round(peak / GB, 2), "seconds": round(seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="embedded,smollm2,gemma3", help="comma-separated: embedded, smollm2, gemma3")
    ap.add_argument("--server-arg", action="append", default=[], help="one more art-server argument (repeat)")
    ap.add_argument("--long-prompts", type=int, metavar="N", help="the K/V budget's bench (above), N requests")
    a = ap.parse_args()
    if a.long_prompts:
        result = {"bench": "memory", "long_prompts": a.long_prompts, "unit": "GB, peak resident memory of the server"}
        with tempfile.TemporaryDirectory(prefix="bench-memory-") as scratch:
            for name, extra in (("default_budget", []), ("unbounded", ["--kv-cache-mb", str(UNBOUNDED_MB)])):
                result[name] = long_prompts(a.long_prompts, Path(scratch) / name, [*a.server_arg, *extra])
                print(f"{name}: {json.dumps(result[name])}", file=sys.stderr, flush=True)
        print(json.dumps(result))
        return
    specs = models()
    names = [n for n in a.models.split(",") if n]
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)} (known: {', '.join(specs)})")
    result: dict[str, Any] = {"bench": "memory", "unit": "GB, peak resident memory of the server's process tree",
                              "steps": STEPS, "machine_gb": round(psutil.virtual_memory().total / GB, 1)}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as scratch:  # servers' data, checkpoints, client output
        for name in names:
            result[name] = measure(name, specs[name], Path(scratch), a.server_arg)
            print(f"{name}: {json.dumps(result[name]['peak_gb'])}", file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
