"""Regenerate the shipped embedded model: a tiny agent that knows the demo task's format but
often answers without looking the price up, so RL has something to fix.

    python -m examples.demo.warmstart [--out server/embedded/model]

1. Build the base model from nothing: tokenizer, seeded random weights, a short pretraining on
   generic synthetic tool-use chats (examples/demo/pretrain.py).
2. Start art-server on it and warm-start a LoRA through the server's own SFT job, on synthetic
   demonstrations where a fixed share skip the lookup and state a made-up price.
3. Merge the LoRA into the base weights and save the result.

`--base` warm-starts a model that was built already: the shipped model is the one this recipe
built with the item repeated in the answer ("The price of {item} is {n}."), warm-started again on
the current answer with `--base <that model> --n 3000 --epochs 1` (about 5 minutes).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import typer

from client import SFTConfig, TrainableModel
from client.local_server import ROOT, LocalServer
from examples.demo import task as demo
from protocol.trajectory import Conversation

SHIPPED = ROOT / "server" / "embedded" / "model"
# The RL learning rate this model trains its LoRAs at by default (artisan.json; see
# server/training/hyperparams.py): measured, because the fit for real models is 5.9e-4 here and
# barely moves a model of 3.3M parameters.
RL_LEARNING_RATE = 2e-3


def demonstrations(n: int, mistake_rate: float, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    tasks = demo.make_example(n_train=n).train_tasks(seed)
    return [Conversation(messages=demo.demonstration(t, rng.random() < mistake_rate, rng), tools=demo.TOOLS)
            for t in tasks]


async def _sft(url: str, convs: list[Conversation], epochs: int, lr: float, rank: int) -> None:
    model = await TrainableModel("warmstart", lora={"rank": rank, "alpha": rank, "seed": 0}).register(url)
    for epoch in range(epochs):
        t0 = time.time()
        result = await model.train_sft(convs, SFTConfig(learning_rate=lr, batch_size=16))
        print(f"epoch {epoch + 1}/{epochs}: loss {result.metrics.loss:.3f} "
              f"({time.time() - t0:.0f}s, {result.metrics.tokens_per_second:.0f} tok/s)", flush=True)


# 6000 demonstrations at a 70% mistake rate leave 1800 lookups, enough for the item to be copied
# into the tool call reliably: its first token came out right 99% of the time at T=0.6, against
# 95% after 900 lookups and 48% after 300; RL then only has to fix the habit. (About 8 minutes.)
def main(out: Path = typer.Option(SHIPPED), base: Path = typer.Option(None, help="A built base model to reuse."),
         pretrain_steps: int = 500, n: int = 6000, epochs: int = 2, lr: float = 2e-3, rank: int = 16,
         mistake_rate: float = 0.7, seed: int = 0) -> None:
    from examples.demo.pretrain import build_model

    work = Path(tempfile.mkdtemp(prefix="warmstart-"))
    if base is None:
        base = build_model(work / "base", seed=seed, pretrain_steps=pretrain_steps)
    with LocalServer(work / "data", model=base, extra=["--device", "cpu"]) as server:
        asyncio.run(_sft(server.url, demonstrations(n, mistake_rate, seed), epochs, lr, rank))
    merge(base, work / "data" / "runs" / "warmstart" / "checkpoints", out)
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}")


def merge(base: Path, checkpoint_root: Path, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from server.model.architecture import lora_targets
    from server.runs import checkpoints
    from server.runs.base_models import read_record

    step = checkpoints.steps(checkpoint_root)[-1]
    spec = read_record(checkpoint_root.parent)  # run.json: the RunSpec and the base model's fingerprint
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=spec.lora.rank, lora_alpha=spec.lora.alpha,
                      target_modules=spec.lora.target_modules or lora_targets(model))
    peft_model = get_peft_model(model, lora)
    set_peft_model_state_dict(peft_model, checkpoints.read_adapter(checkpoint_root, step))
    merged = peft_model.merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    card = {**json.loads((base / "artisan.json").read_text()), "built_by": "examples.demo.warmstart",
            "learning_rate": RL_LEARNING_RATE}
    (tmp / "artisan.json").write_text(json.dumps(card))
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)


if __name__ == "__main__":
    typer.run(main)
