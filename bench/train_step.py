"""Training throughput of a real RL step vs a plain peft forward+backward+optimizer step, and
what sharing a group's prefix in training saves.

Samples demo-task rollouts from art-server on the embedded model, submits them as one training
step (PPO loss, health metrics, checkpoint), and reads the step's own figures. The baseline,
measured in the same run, trains the same token sequences in-process with plain peft: padded
batches in submission order, cross-entropy, AdamW, nothing else.

Prefix sharing (art-server --share-prefix, server/training/packing.py): the same sequences trained
in-process by the server's own optimizer, with and without sharing, on the embedded model and, with
`--smollm2`, on SmolLM2-135M's weights (the demo's token ids read as SmolLM2's): the step's seconds
(the faster of two), its peak resident memory above what the process held before it, and the
tokens its forward encoded.

    python bench/train_step.py [--smollm2]       # prints one JSON line last
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import ROOT, LocalServer  # noqa: E402

GROUPS, GROUP_SIZE, BATCH = 8, 8, 8
LORA = {"rank": 8, "alpha": 16}


async def _step(url: str):
    from client import TrainConfig, TrainableModel, TrajectoryGroup
    from examples.demo import task as demo
    from rollouts.agent import rollout

    model = await TrainableModel("bench", lora=LORA).register(url)
    client = model.openai_client(max_retries=0)
    example = demo.make_example()
    groups = []
    for i, t in enumerate(example.train_tasks(0)[:GROUPS]):
        trajs = await asyncio.gather(*(rollout(client, model.name, example.make_env(t), t, example.settings)
                                       for _ in range(GROUP_SIZE)))
        groups.append(TrajectoryGroup(trajectories=[tr.model_copy(update={"reward": float(j % 2)})
                                                    for j, tr in enumerate(trajs)]))
    # warm-up step, then the measured one
    await model.train(groups, TrainConfig(learning_rate=1e-4))
    result = await model.train(groups, TrainConfig(learning_rate=1e-4))
    return groups, result


def _sequences(groups, model_dir: Path):
    """The same token sequences the server trained, rebuilt in-process, with an advantage each."""
    from transformers import AutoTokenizer

    from server.chat.format import ChatFormat
    from server.training.assemble import assemble_history

    chat = ChatFormat.build(AutoTokenizer.from_pretrained(model_dir))
    out = []
    for g in groups:
        for t in g.trajectories:
            seqs, _ = assemble_history(t, chat)
            for s in seqs:
                s.advantage = t.reward - 0.5
            out += seqs
    return out


def _resident_gb(field: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field)) / 1e6


def _sharing(model_dir: Path, sequences) -> dict:
    """The server's optimizer on `sequences`, without and with prefix sharing (alternating, twice
    each): the faster step's seconds, the larger peak above the resident memory, tokens encoded."""
    import torch
    from peft import LoraConfig

    from protocol.config import TrainConfig
    from server.model.host import ModelHost
    from server.training.data_parallel import TrainingReplica
    from server.training.optimize import OptimPlan, optimize, rl_loss

    host = ModelHost(model_dir, device="cpu", dtype="float32")
    with host.lock:
        host.add_adapter("bench", LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"],
                                             target_modules=host.lora_targets, lora_dropout=0.0))
        params = host.adapter_params("bench")
        for p in params:
            p.requires_grad_(True)
    run = TrainingReplica(host, "bench", torch.optim.AdamW(params, lr=1e-5), params)
    cfg = TrainConfig(learning_rate=1e-5)
    figures: dict[bool, dict] = {}
    for share in (False, True, False, True):
        host.share_prefix = share
        before = _resident_gb("VmRSS")
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak resident memory starts again from now
        started = time.perf_counter()
        stats = optimize(run, sequences, OptimPlan.for_rl(cfg, cfg.learning_rate), rl_loss(cfg))
        seconds, peak = time.perf_counter() - started, _resident_gb("VmHWM") - before
        last = figures.get(share, {"seconds": float("inf"), "peak_gb": 0.0})
        figures[share] = {"seconds": round(min(seconds, last["seconds"]), 2),
                          "peak_gb": round(max(peak, last["peak_gb"]), 2),
                          "encoded_tokens": stats.row_tokens + stats.padding_tokens}
    plain, shared = figures[False], figures[True]
    return {"model": host.name, "unshared": plain, "shared": shared,
            "time_ratio": round(shared["seconds"] / plain["seconds"], 3),
            "token_ratio": round(shared["encoded_tokens"] / plain["encoded_tokens"], 3)}


def _raw(model_dir: Path, sequences: list[list[int]]) -> float:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def once() -> float:
        started = time.perf_counter()
        for i in range(0, len(sequences), BATCH):
            batch = sequences[i:i + BATCH]
            width = max(len(s) for s in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            labels = torch.full((len(batch), width), -100)
            for j, s in enumerate(batch):
                ids[j, : len(s)] = torch.tensor(s)
                labels[j, : len(s)] = torch.tensor(s)
            model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        return sum(len(s) for s in sequences) / (time.perf_counter() - started)

    once()
    return max(once() for _ in range(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2", action="store_true", help="measure prefix sharing on SmolLM2-135M as well")
    args = parser.parse_args()
    model_dir = ROOT / "server" / "embedded" / "model"
    models = [model_dir]
    if args.smollm2:
        from tests.real_models import converted, smollm2_gguf

        models.append(converted(smollm2_gguf()))
    with tempfile.TemporaryDirectory(prefix="bench-train-") as work, \
            LocalServer(Path(work) / "data", extra=["--device", "cpu"]) as server:
        groups, result = asyncio.run(_step(server.url))
    sequences = _sequences(groups, model_dir)
    raw = _raw(model_dir, [s.ids for s in sequences])
    sharing = [_sharing(d, sequences) for d in models]
    m = result.metrics
    print(json.dumps({"train_tokens_per_s": round(m.tokens_per_second, 1), "raw_fwd_bwd_tokens_per_s": round(raw, 1),
                      "ratio": round(m.tokens_per_second / raw, 3), "padding_fraction": round(m.padding_fraction, 4),
                      "trajectories": sum(len(g.trajectories) for g in groups), "trainable_tokens": m.trainable_tokens,
                      "step_seconds": round(m.step_seconds, 2), "prefix_sharing": sharing}))


if __name__ == "__main__":
    main()
