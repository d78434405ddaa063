"""Regenerate the shipped embedded model: a tiny agent that knows the demo task's format but
often picks the wrong tool, so RL has something to fix.

    python -m examples.demo.warmstart [--out server/embedded/model]

1. Build the base model from nothing (tokenizer + seeded random weights).
2. Start art-server on it and warm-start a LoRA through the server's own SFT job, on synthetic
   demonstrations where a fixed share call the other tool and report its number.
3. Merge the LoRA into the base weights and save the result.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import typer

from client import SFTConfig, TrainableModel
from client.types import Conversation
from examples.demo import task as demo

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "server" / "embedded" / "model"


def demonstrations(n: int, mistake_rate: float, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    tasks = demo.make_example(n_train=n).train_tasks(seed)
    return [Conversation(messages=demo.demonstration(t, rng.random() < mistake_rate, rng), tools=demo.TOOLS)
            for t in tasks]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _sft(url: str, convs: list[Conversation], epochs: int, lr: float, rank: int) -> None:
    model = await TrainableModel("warmstart", lora={"rank": rank, "alpha": rank, "seed": 0}).register(url)
    for epoch in range(epochs):
        t0 = time.time()
        result = await model.train_sft(convs, SFTConfig(learning_rate=lr, batch_size=16))
        print(f"epoch {epoch + 1}/{epochs}: loss {result.metrics['loss']:.3f} "
              f"({time.time() - t0:.0f}s, {result.metrics['tokens_per_second']:.0f} tok/s)", flush=True)


def main(out: Path = typer.Option(SHIPPED), n: int = 2000, epochs: int = 4, lr: float = 2e-3, rank: int = 64,
         mistake_rate: float = 0.6, seed: int = 0) -> None:
    from server.embedded.build import build_model

    work = Path(tempfile.mkdtemp(prefix="warmstart-"))
    base = build_model(work / "base", seed=seed)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "--model", str(base), "--port", str(port),
                               "--data-dir", str(work / "data"), "--device", "cpu", "--log-level", "warning"], cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        asyncio.run(_sft(url, demonstrations(n, mistake_rate, seed), epochs, lr, rank))
    finally:
        server.terminate()
        server.wait()
    merge(base, work / "data" / "runs" / "warmstart" / "checkpoints", out)
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}")


def merge(base: Path, checkpoint_root: Path, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from server.training import checkpoints
    from server.training.runs import RunSpec

    step = checkpoints.steps(checkpoint_root)[-1]
    spec = RunSpec.model_validate_json((checkpoint_root.parent / "run.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=spec.lora.rank, lora_alpha=spec.lora.alpha, target_modules=spec.lora.target_modules)
    peft_model = get_peft_model(model, lora)
    set_peft_model_state_dict(peft_model, checkpoints.read_adapter(checkpoint_root, step))
    merged = peft_model.merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    shutil.copy(base / "artisan.json", tmp / "artisan.json")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)


if __name__ == "__main__":
    typer.run(main)
