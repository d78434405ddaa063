"""The first GPU run: art-server's torch engine on CUDA in bf16, on random-weight models of Qwen2.5's
shapes (bench/gpu_configs/: the hidden sizes, layers, heads and vocabularies of Qwen2.5-0.5B, -1.5B
and -7B's published config.json), each serving and training a LoRA. For each shape, in one run:

- decode: generated tokens/s through art-server (a subprocess on loopback) at 1, 8 and 64 concurrent
  requests on a run's LoRA (`server_cN`), against transformers' `generate` on one static batch of
  as many rows with the same LoRA, in this process before the server starts (`static_cN`);
- a GRPO step on groups the server sampled itself (8 groups x 8 rollouts x 512 tokens): its trained
  tokens/s (prompt and completion tokens per second of the step) and the memory it took
  (CUDA: device memory in use at the step's peak beyond what was in use before the server started,
  the allocator's cache included, so at least torch.cuda.max_memory_allocated; CPU: the server's
  resident memory);
- the sampler-trainer gap of that step (`logprob_gap`: the mean |sampler - trainer| logprob of a
  trained token on the step's first pass, ~0 on-policy) and what the PPO loss did with it
  (`clip_fraction`: trained tokens whose ratio left the clip range, so their gradient was dropped);
- the same seeded request, sent twice, gives the same token ids;
- after the step, the run's name answers from the new step's adapter.

The weights are random (nothing is downloaded): speed and memory depend on the shapes, not on what
the model says. The tokenizer is the embedded model's, under each shape's full vocabulary; sampled
ids past the tokenizer's have no text, which changes nothing measured here.

    python bench/gpu.py                        # every shape, on CUDA
    python bench/gpu.py --shape qwen2-7b       # one shape (repeat --shape for more)
    python bench/gpu.py --device cpu --tiny    # the same steps on a tiny shape, on CPU (about a minute)

Prints a table, then one JSON line last.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.publish import PeakMemory  # noqa: E402
from bench.serve import PROMPT, _client_load  # noqa: E402
from client.local_server import ROOT, LocalServer  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "gpu_configs"
SHAPES = ["qwen2-0.5b", "qwen2-1.5b", "qwen2-7b"]
TINY_SHAPE = "qwen2-tiny"
TOKENIZER = ROOT / "server" / "embedded" / "model"
LORA = {"rank": 16, "alpha": 32}
SEED = 1234
GIB = 2**30


@dataclass(frozen=True)
class Plan:
    decode_tokens: int  # per decode request
    loads: tuple[tuple[int, int], ...]  # (concurrent requests, requests each)
    groups: int  # the GRPO step's
    group_size: int
    completion_tokens: int  # per rollout


FULL = Plan(decode_tokens=128, loads=((1, 3), (8, 2), (64, 2)), groups=8, group_size=8, completion_tokens=512)
TINY = Plan(decode_tokens=8, loads=((1, 2), (8, 1), (64, 1)), groups=2, group_size=4, completion_tokens=16)


class DeviceMemory(PeakMemory):
    """CUDA memory in use on the device (every process's), less what was in use at `base`: a
    server's own memory, read from outside it."""

    def __init__(self, pid: int, base: int):
        super().__init__(pid)
        self.base = base

    @staticmethod
    def used() -> int:
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free

    def now(self) -> int:
        return self.used() - self.base


def build_model(shape: str, out: Path, device: str, dtype: Any) -> Any:
    """A random-weight model of `shape` with the embedded tokenizer, saved as a model directory
    art-server loads; the model itself is returned, on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    spec = json.loads((CONFIGS / f"{shape}.json").read_text())
    if spec["vocab_size"] < len(tokenizer):
        raise SystemExit(f"{shape}: vocab_size {spec['vocab_size']} is below the tokenizer's {len(tokenizer)} tokens")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, bos_token_id=None, eos_token_id=eos,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 7B on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model


def with_lora(model: Any) -> Any:
    """The LoRA a run gets: the same rank on every linear layer of the decoder blocks."""
    from peft import LoraConfig, get_peft_model

    from server.model.architecture import lora_targets

    config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=lora_targets(model))
    return get_peft_model(model, config).eval()


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def static_batch(model: Any, prompt_ids: list[int], batch: int, max_tokens: int) -> float:
    """Generated tokens/s of transformers' generate on one batch of equal prompts (no padding),
    every row to `max_tokens`."""
    import torch

    ids = torch.tensor([prompt_ids] * batch, device=model.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up at this batch
        _sync(model.device)
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        _sync(model.device)
    return (out.shape[1] - ids.shape[1]) * batch / (time.perf_counter() - started)


async def _seeded(client: Any, name: str, max_tokens: int) -> Any:
    r = await client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=max_tokens, temperature=1.0, seed=SEED,
                                             extra_body={"ignore_eos": True})
    return r.choices[0]


async def _sample_groups(client: Any, name: str, plan: Plan, step: int) -> tuple[list[Any], float]:
    """GRPO groups the server samples on the run's latest step, every completion exactly
    `completion_tokens` long, rewards 0 and 1 alternating in each group; and the sampled tokens/s."""
    from protocol.choices import choice_token_ids
    from protocol.trajectory import Trajectory, TrajectoryGroup

    async def group(i: int) -> TrajectoryGroup:
        messages = [{"role": "user", "content": f"{PROMPT} (task {i})"}]
        r = await client.chat.completions.create(model=name, messages=messages, n=plan.group_size,
                                                 max_tokens=plan.completion_tokens, temperature=1.0,
                                                 seed=step * 1000 + i, extra_body={"ignore_eos": True})
        return TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=[*messages, c], reward=float(j % 2))
                                             for j, c in enumerate(r.choices)])

    started = time.perf_counter()
    groups = await asyncio.gather(*(group(i) for i in range(plan.groups)))
    sampled = sum(len(choice_token_ids(t.messages_and_choices[-1]) or []) for g in groups for t in g.trajectories)
    return groups, sampled / (time.perf_counter() - started)


async def _exercise(server: LocalServer, plan: Plan, memory: PeakMemory) -> dict[str, Any]:
    """Decode loads, the seeded repeat and two GRPO steps (the first warms kernels, the allocator
    and the optimizer up; the second is measured) on one run of the server."""
    from client.model import TrainableModel
    from protocol.choices import choice_sampling, choice_token_ids
    from protocol.config import TrainConfig

    model = await TrainableModel("gpu-bench", lora=LORA).register(server.url)
    out: dict[str, Any] = {}
    for c, n in plan.loads:
        out[f"server_c{c}"] = round(await _client_load(server.url, model.name, c, n, plan.decode_tokens), 1)
    async with model.openai_client(max_retries=0, timeout=1800) as client:
        first, again = [await _seeded(client, model.name, plan.decode_tokens) for _ in range(2)]
        out["seeded_repeat_identical"] = choice_token_ids(first) == choice_token_ids(again)
        groups, _ = await _sample_groups(client, model.name, plan, step=1)
        warm = await model.train(groups, TrainConfig())
        groups, out["grpo_sample_tokens_per_s"] = await _sample_groups(client, model.name, plan, step=2)
        out["memory_before_step_gib"] = round(memory.now() / GIB, 2)
        with memory:
            result = await model.train(groups, TrainConfig())
        served = choice_sampling(await _seeded(client, model.name, plan.decode_tokens))
    m = result.metrics
    out.update(
        memory_peak_gib=round(memory.peak / GIB, 2), train_tokens_per_s=round(m.tokens_per_second or 0.0, 1),
        trainable_tokens=m.trainable_tokens, step_seconds=round(m.step_seconds or 0.0, 2),
        logprob_gap=m.logprob_gap, first_step_logprob_gap=warm.metrics.logprob_gap, clip_fraction=m.clip_fraction,
        lora_update_norm=m.lora_update_norm, warnings=result.warnings, trained_step=result.step,
        served_step=served.step if served else None,
        new_adapter_served=bool(served and result.trained and served.policy == model.name and served.step == result.step))
    out["grpo_sample_tokens_per_s"] = round(out["grpo_sample_tokens_per_s"], 1)
    return out


def measure_shape(shape: str, device: str, plan: Plan, work: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from server.chat.format import ChatFormat

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model_dir = work / "model"
    model = build_model(shape, model_dir, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    prompt_ids = ChatFormat.build(AutoTokenizer.from_pretrained(model_dir)).renderer.render(
        [{"role": "user", "content": PROMPT}]).ids
    model = with_lora(model)
    static = {c: static_batch(model, prompt_ids, c, plan.decode_tokens) for c, _ in plan.loads}
    del model
    gc.collect()
    before_server = 0
    if device == "cuda":
        torch.cuda.empty_cache()
        before_server = DeviceMemory.used()
    out: dict[str, Any] = {"params_m": round(n_params / 1e6, 1), "prompt_tokens": len(prompt_ids),
                           "decode_tokens": plan.decode_tokens, "lora_rank": LORA["rank"],
                           "grpo_batch": [plan.groups, plan.group_size, plan.completion_tokens],
                           "memory_kind": "cuda_device_used" if device == "cuda" else "rss"}
    extra = ["--device", device, "--dtype", str(dtype).removeprefix("torch."), "--served-model-name", "base",
             "--max-batch", str(max(max(c for c, _ in plan.loads), plan.groups * plan.group_size))]
    server = LocalServer(work / "data", model=model_dir, extra=extra).start(timeout=900)
    try:
        assert server.proc is not None
        memory = DeviceMemory(server.proc.pid, before_server) if device == "cuda" else PeakMemory(server.proc.pid)
        out["memory_loaded_gib"] = round(memory.now() / GIB, 2)
        out.update(asyncio.run(_exercise(server, plan, memory)))
    finally:
        server.stop()
    for c, _ in plan.loads:
        out[f"static_c{c}"] = round(static[c], 1)
        out[f"server_vs_static_c{c}"] = round(out[f"server_c{c}"] / static[c], 3)
    return out


def table(shapes: dict[str, dict[str, Any]], plan: Plan) -> str:
    cs = [c for c, _ in plan.loads]
    head = ["shape", "params M", "server tok/s " + "/".join(f"c{c}" for c in cs), "static tok/s", "train tok/s",
            "peak GiB", "logprob gap", "clip", "seeded same", "new adapter"]
    rows = [head] + [[name, f"{r['params_m']:.1f}", " / ".join(f"{r[f'server_c{c}']:.0f}" for c in cs),
                      " / ".join(f"{r[f'static_c{c}']:.0f}" for c in cs), f"{r['train_tokens_per_s']:.0f}",
                      f"{r['memory_peak_gib']:.2f}", f"{r['logprob_gap']:.2e}" if r["logprob_gap"] is not None else "-",
                      f"{r['clip_fraction']:.4f}" if r["clip_fraction"] is not None else "-",
                      str(r["seeded_repeat_identical"]), str(r["new_adapter_served"])]
                     for name, r in shapes.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def main(device: str = typer.Option("cuda", help="cuda or cpu."),
         tiny: bool = typer.Option(False, help=f"The {TINY_SHAPE} shape with a small load: a minute on a CPU."),
         shape: list[str] = typer.Option([], help=f"A shape in bench/gpu_configs ({', '.join(SHAPES)}); repeat "
                                                  f"for more (default: all of them).")) -> None:
    import torch
    import transformers

    if device not in ("cuda", "cpu"):
        raise SystemExit(f"bench/gpu.py: --device {device}: expected cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: CUDA is not available on this machine (--device cpu --tiny runs on a CPU)")
    names = shape or ([TINY_SHAPE] if tiny else SHAPES)
    unknown = [n for n in names if not (CONFIGS / f"{n}.json").exists()]
    if unknown:
        known = sorted(p.stem for p in CONFIGS.glob("*.json"))
        raise SystemExit(f"bench/gpu.py: --shape {', '.join(unknown)}: not in bench/gpu_configs ({', '.join(known)})")
    plan = TINY if tiny else FULL
    results = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="bench-gpu-") as work:
            results[name] = measure_shape(name, device, plan, Path(work))
    print(table(results, plan))
    print(json.dumps({"bench": "gpu", "device": device,
                      "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      "dtype": "bfloat16" if device == "cuda" else "float32", "torch": torch.__version__,
                      "transformers": transformers.__version__, "tiny": tiny, "shapes": results}))


if __name__ == "__main__":
    typer.run(main)
